//! Container probes as the kubelet runs them: startup, liveness and readiness, each
//! `exec`, `httpGet`, `tcpSocket` or `grpc`, with Kubernetes' fields and defaults
//! (`initialDelaySeconds` 0, `periodSeconds` 10, `timeoutSeconds` 1,
//! `successThreshold` 1, `failureThreshold` 3).
//!
//! The worker asks [`Prober::check`] at each sync for each running container; the
//! prober runs the probes that are due, keeps their counts per container run (a
//! restarted container starts over), and says whether the container has started, is
//! ready, must be killed, and when the next probe is due.
//!
//! An `httpGet` probe with `scheme: HTTPS` speaks TLS without checking the container's
//! certificate, as the kubelet's prober does (`InsecureSkipVerify`): a probe asks
//! whether the container answers, not who it is.

use std::collections::HashMap;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::time::Instant;

use crate::Context;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Startup,
    Liveness,
    Readiness,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Startup => "Startup",
            Self::Liveness => "Liveness",
            Self::Readiness => "Readiness",
        }
    }
}

#[derive(Debug, Default)]
struct State {
    successes: i32,
    failures: i32,
    /// The last verdict once a threshold was reached.
    passed: Option<bool>,
    next: Option<Instant>,
}

/// What the probes say of one running container.
#[derive(Debug, Default)]
pub struct Outcome {
    pub started: bool,
    pub ready: bool,
    /// Kill the container: the probe that failed and why (the `Killing` event's text).
    pub kill: Option<String>,
    /// `Unhealthy` events to record.
    pub unhealthy: Vec<String>,
    /// When a probe is next due.
    pub next: Option<Instant>,
}

/// The probes' counts of one pod's containers, by container run.
#[derive(Debug, Default)]
pub struct Prober {
    states: HashMap<(String, Kind), State>,
}

impl Prober {
    /// Runs the due probes of a running container (`id`, started at `started_at`, in
    /// ns since the epoch) and says what follows.
    pub async fn check(
        &mut self,
        ctx: &Context,
        pod: &Pod,
        container: &Container,
        id: &str,
        started_at: i64,
    ) -> Outcome {
        let now = Instant::now();
        let since_start = Duration::from_nanos(
            (jiff::Timestamp::now().as_nanosecond() - started_at as i128).max(0) as u64,
        );
        let started_instant = now.checked_sub(since_start).unwrap_or(now);
        let mut out = Outcome {
            started: true,
            ready: true,
            ..Default::default()
        };
        // Startup first: liveness and readiness wait until it has passed.
        if let Some(probe) = &container.startup_probe {
            let passed = self
                .run_if_due(
                    ctx,
                    pod,
                    container,
                    id,
                    Kind::Startup,
                    probe,
                    started_instant,
                    &mut out,
                )
                .await;
            if passed != Some(true) {
                out.started = false;
                out.ready = false;
                if passed == Some(false) {
                    out.kill = Some(format!(
                        "Container {} failed startup probe, will be restarted",
                        container.name
                    ));
                }
                return out;
            }
            // Once started, a startup probe is not run again for this run.
            if let Some(state) = self.states.get_mut(&(id.to_owned(), Kind::Startup)) {
                state.next = None;
            }
        }
        if let Some(probe) = &container.liveness_probe {
            let passed = self
                .run_if_due(
                    ctx,
                    pod,
                    container,
                    id,
                    Kind::Liveness,
                    probe,
                    started_instant,
                    &mut out,
                )
                .await;
            if passed == Some(false) {
                out.kill = Some(format!(
                    "Container {} failed liveness probe, will be restarted",
                    container.name
                ));
            }
        }
        if let Some(probe) = &container.readiness_probe {
            let passed = self
                .run_if_due(
                    ctx,
                    pod,
                    container,
                    id,
                    Kind::Readiness,
                    probe,
                    started_instant,
                    &mut out,
                )
                .await;
            // Not ready until a probe passed.
            out.ready = passed == Some(true);
        }
        out
    }

    /// Forgets the runs that are not `keep` (their containers are gone).
    pub fn retain(&mut self, keep: &[String]) {
        self.states.retain(|(run, _), _| keep.contains(run));
    }

    /// Runs the probe when due; the verdict once a threshold was reached. `out.next`
    /// takes the probe's next due time.
    #[allow(clippy::too_many_arguments)]
    async fn run_if_due(
        &mut self,
        ctx: &Context,
        pod: &Pod,
        container: &Container,
        id: &str,
        kind: Kind,
        probe: &Probe,
        started: Instant,
        out: &mut Outcome,
    ) -> Option<bool> {
        let passed = self
            .run_once(ctx, pod, container, id, kind, probe, started, out)
            .await;
        if let Some(at) = self.states.get(&(id.to_owned(), kind)).and_then(|s| s.next) {
            out.next = Some(out.next.map_or(at, |n| n.min(at)));
        }
        passed
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_once(
        &mut self,
        ctx: &Context,
        pod: &Pod,
        container: &Container,
        id: &str,
        kind: Kind,
        probe: &Probe,
        started: Instant,
        out: &mut Outcome,
    ) -> Option<bool> {
        let now = Instant::now();
        let period = Duration::from_secs(probe.period_seconds.unwrap_or(10).max(1) as u64);
        let initial = Duration::from_secs(probe.initial_delay_seconds.unwrap_or(0).max(0) as u64);
        let state = self.states.entry((id.to_owned(), kind)).or_default();
        let due = state.next.unwrap_or(started + initial);
        if now < due {
            state.next = Some(due);
            return state.passed;
        }
        let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1) as u64);
        let result =
            match tokio::time::timeout(timeout, run(ctx, pod, container, id, probe, timeout)).await
            {
                Ok(r) => r,
                Err(_) => Err(format!(
                    "timeout: probe did not answer within {}s",
                    timeout.as_secs()
                )),
            };
        let state = self.states.entry((id.to_owned(), kind)).or_default();
        state.next = Some(Instant::now() + period);
        match result {
            Ok(()) => {
                state.failures = 0;
                state.successes += 1;
                // Liveness and startup need one success; readiness its threshold.
                let threshold = match kind {
                    Kind::Readiness => probe.success_threshold.unwrap_or(1).max(1),
                    _ => 1,
                };
                if state.successes >= threshold {
                    state.passed = Some(true);
                }
            }
            Err(why) => {
                state.successes = 0;
                state.failures += 1;
                out.unhealthy
                    .push(format!("{} probe failed: {why}", kind.name()));
                if state.failures >= probe.failure_threshold.unwrap_or(3).max(1) {
                    state.passed = Some(false);
                    // A killed container's next run starts over; readiness keeps
                    // probing this one.
                    if kind != Kind::Readiness {
                        state.failures = 0;
                    }
                }
            }
        }
        state.passed
    }
}

/// One probe: `Ok` when it passed, else why not.
async fn run(
    ctx: &Context,
    pod: &Pod,
    container: &Container,
    id: &str,
    probe: &Probe,
    timeout: Duration,
) -> Result<(), String> {
    // The pod's IP, as the kubelet probes (the node's for a hostNetwork pod).
    let host_default = crate::spec::pod_ips(ctx, pod).swap_remove(0);
    if let Some(exec) = &probe.exec {
        let mut runtime = ctx.cri.runtime.clone();
        let answer = runtime
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.to_owned(),
                cmd: exec.command.clone().unwrap_or_default(),
                timeout: timeout.as_secs() as i64,
            })
            .await
            .map_err(|e| e.message().to_owned())?
            .into_inner();
        if answer.exit_code == 0 {
            return Ok(());
        }
        let output = String::from_utf8_lossy(&answer.stdout).trim().to_owned();
        return Err(if output.is_empty() {
            format!("command exited with {}", answer.exit_code)
        } else {
            output
        });
    }
    if let Some(http) = &probe.http_get {
        let port = port_of(container, &http.port)?;
        let host = http
            .host
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or(host_default);
        let path = http
            .path
            .clone()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".into());
        let tls = match http.scheme.as_deref().unwrap_or("HTTP") {
            s if s.eq_ignore_ascii_case("https") => true,
            s if s.eq_ignore_ascii_case("http") => false,
            other => return Err(format!("unsupported scheme {other:?}")),
        };
        let headers: Vec<(String, String)> = http
            .http_headers
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect();
        let status = http_get(&host, port, &path, &headers, tls).await?;
        return if (200..400).contains(&status) {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {status}"))
        };
    }
    if let Some(tcp) = &probe.tcp_socket {
        let port = port_of(container, &tcp.port)?;
        let host = tcp
            .host
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or(host_default);
        return tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map(drop)
            .map_err(|e| format!("dial tcp {host}:{port}: {e}"));
    }
    if let Some(grpc) = &probe.grpc {
        let port = u16::try_from(grpc.port).map_err(|_| format!("invalid port {}", grpc.port))?;
        let endpoint = format!("http://{host_default}:{port}");
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| format!("connect to {endpoint}: {e}"))?;
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
        let answer = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: grpc.service.clone().unwrap_or_default(),
            })
            .await
            .map_err(|e| format!("rpc error: code = {:?} desc = {}", e.code(), e.message()))?
            .into_inner();
        return if answer.status
            == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        {
            Ok(())
        } else {
            Err(format!(
                "service unhealthy (responded with {:?})",
                answer.status()
            ))
        };
    }
    let _ = pod;
    Err("the probe names no handler (exec, httpGet, tcpSocket or grpc)".into())
}

/// A probe's port: a number, or the name of one of the container's ports.
fn port_of(container: &Container, port: &IntOrString) -> Result<u16, String> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("invalid port {n}")),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .ok_or_else(|| format!("no port named {name:?} in container {:?}", container.name)),
    }
}

/// The status code of `GET http://host:port/path`, or `https://` when `tls`.
async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
    tls: bool,
) -> Result<u16, String> {
    let scheme = if tls { "https" } else { "http" };
    // An IPv6 address is bracketed in a URL and a Host header, as Go's JoinHostPort.
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let url = format!("{scheme}://{authority}{path}");
    let tcp = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("Get \"{url}\": dial tcp {authority}: {e}"))?;
    // The headers the kubelet sends unless the probe sets its own (a `Host` of the
    // probe's replaces the address).
    let mut request = format!("GET {path} HTTP/1.1\r\n");
    let has = |name: &str| headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    for (name, value) in [
        ("Host", authority.clone()),
        ("User-Agent", "kube-probe/1.33".to_owned()),
        ("Accept", "*/*".to_owned()),
    ] {
        if !has(name) {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("Connection: close\r\n\r\n");
    let failed = |e: String| format!("Get \"{url}\": {e}");
    if !tls {
        return status_of(tcp, &request).await.map_err(failed);
    }
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("Get \"{url}\": {e}"))?;
    let stream = tokio_rustls::TlsConnector::from(insecure_tls()?)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("Get \"{url}\": {e}"))?;
    status_of(stream, &request).await.map_err(failed)
}

/// Sends `request` and reads the status code of the answer.
async fn status_of(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    request: &str,
) -> Result<u16, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("write the request: {e}"))?;
    // The status line is all a probe reads.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") {
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|e| format!("read the answer: {e}"))?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > 8192 {
            break;
        }
    }
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            format!(
                "not an HTTP answer: {:?}",
                line.lines().next().unwrap_or("")
            )
        })
}
/// A TLS client that takes any certificate the container presents (signatures over
/// the handshake are still checked), made once.
fn insecure_tls() -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    static CONFIG: std::sync::OnceLock<Result<std::sync::Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
            let algorithms = provider.signature_verification_algorithms;
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("TLS for probes: {e}"))?
                .dangerous()
                .with_custom_certificate_verifier(std::sync::Arc::new(
                    trellis_pki::AcceptAnyServerCert(algorithms),
                ))
                .with_no_client_auth();
            Ok(std::sync::Arc::new(config))
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A server on loopback with a self-signed certificate that answers `status` once
    /// and hands back the request it read.
    async fn https_server(status: &str) -> (u16, tokio::task::JoinHandle<String>) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n");
        let served = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            // A client that does not speak TLS is only refused.
            let Ok(mut tls) = tokio_rustls::TlsAcceptor::from(Arc::new(config))
                .accept(tcp)
                .await
            else {
                return String::new();
            };
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let n = tls.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early");
                request.extend_from_slice(&buf[..n]);
            }
            tls.write_all(answer.as_bytes()).await.unwrap();
            tls.shutdown().await.unwrap();
            String::from_utf8(request).unwrap()
        });
        (port, served)
    }

    #[tokio::test]
    async fn an_https_probe_takes_any_certificate_and_reads_the_status() {
        let (port, served) = https_server("204 No Content").await;
        let headers = [("host".to_owned(), "probe.example".to_owned())];
        let status = http_get("127.0.0.1", port, "/ready", &headers, true)
            .await
            .unwrap();
        assert_eq!(status, 204);
        let request = served.await.unwrap();
        assert!(request.starts_with("GET /ready HTTP/1.1\r\n"), "{request}");
        // The probe's own Host replaces the address, and is sent once.
        assert_eq!(
            request.to_lowercase().matches("host:").count(),
            1,
            "{request}"
        );
        assert!(request.contains("host: probe.example\r\n"), "{request}");
        assert!(request.contains("User-Agent: kube-probe/"), "{request}");

        // Plain HTTP to a TLS server is no answer.
        let (port, _served) = https_server("200 OK").await;
        assert!(http_get("127.0.0.1", port, "/", &[], false).await.is_err());
    }
}
