//! Container probes as the kubelet runs them: startup, liveness and readiness, each
//! `exec`, `httpGet`, `tcpSocket` or `grpc`, with Kubernetes' fields and defaults
//! (`initialDelaySeconds` 0, `periodSeconds` 10, `timeoutSeconds` 1,
//! `successThreshold` 1, `failureThreshold` 3).
//!
//! The worker asks [`Prober::check`] at each sync for each running container; the
//! prober runs the probes that are due, keeps their counts per container run (a
//! restarted container starts over), and says whether the container has started, is
//! ready, must be killed, and when the next probe is due.

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
    let host_default = ctx.config.node_ip.to_string();
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
        if http
            .scheme
            .as_deref()
            .is_some_and(|s| s.eq_ignore_ascii_case("https"))
        {
            return Err("HTTPS probes are not supported by this node yet".into());
        }
        let headers: Vec<(String, String)> = http
            .http_headers
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect();
        let status = http_get(&host, port, &path, &headers).await?;
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

/// The status code of `GET http://host:port/path`.
async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> Result<u16, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("Get \"http://{host}:{port}{path}\": dial tcp {host}:{port}: {e}"))?;
    let mut request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.33\r\nAccept: */*\r\nConnection: close\r\n"
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
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
