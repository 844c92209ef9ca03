//! The `wasmtime` handler's HTTP servers: a container whose component exports
//! `wasi:http/incoming-handler` (the `wasi:http/proxy` world) is served over HTTP/1.1 on
//! the node's IP at the container's first TCP port, a fresh instance per request, as
//! `wasmtime serve` does.
//!
//! The port comes from the container annotation `io.kubernetes.container.ports`, which
//! a kubelet (and Trellis' node agent) writes: a JSON list of the container's ports,
//! `[{"name":"http","containerPort":8080,"protocol":"TCP"}]`.
//!
//! A server runs on an OS thread of its own with a single-threaded executor, as a
//! program does, so guest code never runs on the runtime's gRPC threads. Each request
//! gets a WASI context made as a program's (arguments, environment, mounts, output into
//! the container's log) and the container's memory limit for its instance alone: an
//! instance that traps or exceeds it answers 500, the reason goes to the container's
//! stderr log, and the server goes on. A stop closes the listener at once and gives
//! requests in flight the stop's grace (at most [`MAX_GRACE`]); those still running
//! then are cancelled and the container exits 137, otherwise 0.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::server::conn::http1;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use serde::Deserialize;
use tokio::sync::{Semaphore, oneshot, watch};
use tonic::Status;
use wasmtime::Engine;
use wasmtime_wasi_http::WasiHttpView as _;
use wasmtime_wasi_http::p2::bindings::ProxyPre;
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;

use super::pod::PodNetwork;
use super::usage::{Limit, Registry, Usage};
use super::workload::{WasiConfig, Workload, memory_limit, new_store, trap_message};
use crate::log::{Lines, LogFile, Stream};
use crate::record::ContainerRecord;
use crate::state::{Cancel, Exit, Live, State, Stopper};

/// The container annotation the kubelet writes the container's ports into.
pub(crate) const PORTS_ANNOTATION: &str = "io.kubernetes.container.ports";
/// The longest a stop lets requests in flight finish, whatever its own grace: a
/// handler answers requests, it does not run shutdown work.
pub(crate) const MAX_GRACE: Duration = Duration::from_secs(5);
/// Connections served at once; more are closed as they arrive.
const MAX_CONNECTIONS: usize = 1024;
/// How long to wait before accepting again after `accept` failed (out of file
/// descriptors, say), so the failure does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// One entry of the ports annotation, as the kubelet writes it (`v1.ContainerPort`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerPort {
    container_port: u16,
    #[serde(default)]
    protocol: String,
}

/// The container's first TCP port, from its ports annotation.
fn container_port(record: &ContainerRecord) -> Result<u16, Status> {
    let none = || {
        Status::failed_precondition(format!(
            "container {}: a wasi:http component needs a containerPort (a TCP port in the container annotation {PORTS_ANNOTATION})",
            record.id
        ))
    };
    let Some(json) = record.config.annotations.get(PORTS_ANNOTATION) else {
        return Err(none());
    };
    let ports: Vec<ContainerPort> = serde_json::from_str(json).map_err(|e| {
        Status::invalid_argument(format!(
            "container {}: the annotation {PORTS_ANNOTATION} is not a list of ports: {e}",
            record.id
        ))
    })?;
    ports
        .iter()
        // Kubernetes' default protocol is TCP.
        .find(|p| p.protocol.is_empty() || p.protocol.eq_ignore_ascii_case("TCP"))
        .map(|p| p.container_port)
        .filter(|&p| p != 0)
        .ok_or_else(none)
}

/// What serving a container's requests needs: its component pre-instantiated, and what
/// each instance is given.
pub(crate) struct Handler {
    id: String,
    engine: Engine,
    pre: ProxyPre<Workload>,
    wasi: WasiConfig,
    log: Option<Arc<LogFile>>,
    limit: Option<usize>,
    /// Memory of the instances alive, together, and the server thread's CPU time.
    usage: Arc<Usage>,
    /// Set when the stop's grace is over: instances still running are cancelled.
    kill: Arc<Cancel>,
    port: u16,
}

impl Handler {
    /// Checks the container's port and WASI context (its mounts open) before the
    /// start; its usage is found in `usages`.
    pub(crate) fn new(
        engine: &Engine,
        usages: &Registry,
        record: &ContainerRecord,
        pre: ProxyPre<Workload>,
        log: Option<Arc<LogFile>>,
    ) -> Result<Self, Status> {
        let port = container_port(record)?;
        let wasi = WasiConfig::of(record);
        wasi.context(None)?;
        let usage = Usage::new(Limit::of(record));
        usages.add(&usage);
        Ok(Self {
            id: record.id.clone(),
            engine: engine.clone(),
            pre,
            wasi,
            log,
            limit: memory_limit(record),
            usage,
            kill: Arc::new(Cancel::default()),
            port,
        })
    }

    /// Answers one request with a fresh instance; a failure is a 500 and a line in the
    /// container's stderr log.
    async fn handle(
        self: Arc<Self>,
        request: Request<hyper::body::Incoming>,
    ) -> Response<HyperOutgoingBody> {
        let what = format!("{} {}", request.method(), request.uri().path());
        // A request is charged to the CPU limit before its instance runs: one shorter
        // than an epoch tick never reaches a deadline.
        if let Some(wait) = self.usage.account() {
            tokio::time::sleep(wait).await;
        }
        let wasi = match self.wasi.context(self.log.clone()) {
            Ok(wasi) => wasi,
            Err(e) => {
                self.log_failure(&what, e.message());
                return plain(StatusCode::INTERNAL_SERVER_ERROR, "internal server error\n");
            }
        };
        let mut store = new_store(
            &self.engine,
            wasi,
            self.limit,
            self.usage.clone(),
            self.kill.clone(),
        );
        let (sender, receiver) = oneshot::channel();
        let resources = store
            .data_mut()
            .http()
            .new_incoming_request(Scheme::Http, request)
            .and_then(|request| {
                let out = store.data_mut().http().new_response_outparam(sender)?;
                Ok((request, out))
            });
        let (request, out) = match resources {
            Ok(resources) => resources,
            // A request the host cannot hand over (no Host header, say).
            Err(e) => return plain(StatusCode::BAD_REQUEST, &format!("bad request: {e}\n")),
        };
        // The instance runs in a task of its own: it may go on streaming the body (or
        // working) after it has set the response.
        let handler = self.clone();
        let instance_what = what.clone();
        tokio::spawn(async move {
            let result = async {
                let proxy = handler.pre.instantiate_async(&mut store).await?;
                proxy
                    .wasi_http_incoming_handler()
                    .call_handle(&mut store, request, out)
                    .await
            }
            .await;
            // Read now so the stats count the request's work.
            handler.usage.account();
            if let Err(e) = result {
                let limits = &store.data().limits;
                let why = if handler.kill.flag.load(std::sync::atomic::Ordering::Relaxed) {
                    "cancelled: the container was stopped".to_string()
                } else if limits.hit {
                    format!(
                        "its instance would exceed the container's memory limit of {} bytes",
                        limits.limit.unwrap_or_default()
                    )
                } else {
                    trap_message(&e)
                };
                handler.log_failure(&instance_what, &why);
            }
        });
        match receiver.await {
            Ok(Ok(response)) => response,
            Ok(Err(code)) => {
                self.log_failure(&what, &format!("the component answered {code:?}"));
                plain(StatusCode::INTERNAL_SERVER_ERROR, "internal server error\n")
            }
            // The store was dropped without a response: the instance failed (and its
            // task says why) or returned without setting one.
            Err(_) => plain(StatusCode::INTERNAL_SERVER_ERROR, "internal server error\n"),
        }
    }

    fn log_failure(&self, what: &str, why: &str) {
        tracing::warn!(container = %self.id, request = %what, error = %why, "a wasi:http request failed");
        let mut lines = Lines::new(Stream::Stderr, self.log.clone());
        lines.push(format!("request {what} failed: {why}\n").as_bytes());
    }
}

fn plain(status: StatusCode, body: &str) -> Response<HyperOutgoingBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(body.to_owned()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response
}

/// Listens on `node_ip` at the handler's port and serves on a thread of its own until
/// stopped. A port that cannot be bound fails the start.
///
/// In a pod with a network of its own (`network`), the thread enters the pod's network
/// first and listens on every address of the pod's namespace: the requests a handler
/// sends (`wasi:http/outgoing-handler`) and their name lookups are the pod's too.
pub(crate) fn start(
    handler: Handler,
    state: &Arc<State>,
    node_ip: IpAddr,
    network: Option<PodNetwork>,
) -> Result<Live, Status> {
    let address = match network {
        None => SocketAddr::new(node_ip, handler.port),
        Some(_) => SocketAddr::from(([0, 0, 0, 0], handler.port)),
    };
    // The thread says whether it listens before it serves, so a port that cannot be
    // bound (or a network that cannot be entered) fails the start.
    let (bound, listening) = std::sync::mpsc::sync_channel(1);
    let listen = move || {
        if let Some(network) = &network {
            network
                .enter()
                .map_err(|e| format!("cannot enter its pod's network: {e}"))?;
        }
        std::net::TcpListener::bind(address)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| format!("cannot listen on {address}: {e}"))
    };
    let stop = Arc::new(Cancel::default());
    let (exited, _) = watch::channel(false);
    let live = Live {
        exited,
        stop: Stopper::Wasm(stop.clone()),
        log: handler.log.clone(),
        tasks: Vec::new(),
        memory: Some(handler.usage.memory.clone()),
    };
    let id = handler.id.clone();
    let state = state.clone();
    let thread_id = id.clone();
    std::thread::Builder::new()
        .name(format!("http-{}", id.get(..12).unwrap_or(&id)))
        .spawn(move || {
            let listener = match listen() {
                Ok(listener) => {
                    let _ = bound.send(Ok(()));
                    listener
                }
                Err(e) => {
                    let _ = bound.send(Err(e));
                    return;
                }
            };
            let id = thread_id;
            let exit = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                // Dropping the executor afterwards drops what is left: instances past
                // the grace, and their output is flushed before the exit is recorded.
                Ok(executor) => executor.block_on(serve(listener, Arc::new(handler), &stop)),
                Err(e) => Exit {
                    code: 1,
                    reason: "Error",
                    message: format!("cannot start an executor: {e}"),
                },
            };
            state.finish(&id, exit);
        })
        .map_err(|e| Status::internal(format!("cannot start a thread: {e}")))?;
    match listening.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(Status::failed_precondition(format!("container {id}: {e}")));
        }
        Err(_) => {
            return Err(Status::internal(format!(
                "container {id}: its thread ended before it listened"
            )));
        }
    }
    tracing::info!(container = %id, %address, "serving wasi:http");
    Ok(live)
}

/// Accepts connections until `stop`, then lets requests in flight finish within the
/// stop's grace.
async fn serve(listener: std::net::TcpListener, handler: Arc<Handler>, stop: &Cancel) -> Exit {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            return Exit {
                code: 1,
                reason: "Error",
                message: format!("cannot listen: {e}"),
            };
        }
    };
    let graceful = GracefulShutdown::new();
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        // A stop that came before this loop waited is in the flag (and a permit).
        if stop.flag.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let accepted = tokio::select! {
            () = stop.notify.notified() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(container = %handler.id, error = %e, "cannot accept a connection");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::warn!(container = %handler.id, %peer, "too many connections: closing a new one");
            continue;
        };
        let service_handler = handler.clone();
        let connection = http1::Builder::new().keep_alive(true).serve_connection(
            TokioIo::new(tcp),
            hyper::service::service_fn(move |request| {
                let handler = service_handler.clone();
                async move { Ok::<_, Infallible>(handler.handle(request).await) }
            }),
        );
        let connection = graceful.watch(connection);
        let id = handler.id.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(container = %id, %peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    // No new connection from here on.
    drop(listener);
    let grace = stop.grace().min(MAX_GRACE);
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => Exit::code(0),
        Err(_) => {
            handler.kill.cancel();
            Exit {
                code: 137,
                reason: "Error",
                message: format!(
                    "stopped: requests still in flight after {grace:?} were cancelled"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(annotation: Option<&str>) -> ContainerRecord {
        let mut config = k8s_cri::v1::ContainerConfig::default();
        if let Some(json) = annotation {
            config
                .annotations
                .insert(PORTS_ANNOTATION.into(), json.into());
        }
        ContainerRecord {
            id: "c1".into(),
            sandbox_id: "s1".into(),
            config,
            image_id: String::new(),
            kind: crate::record::ImageKind::Wasm,
            handler: crate::WASMTIME.into(),
            program: Default::default(),
            log_path: None,
            state: 0,
            created_at: 0,
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            pid: None,
            pid_start: None,
            netns: None,
        }
    }

    #[test]
    fn the_first_tcp_port_of_the_annotation_is_served() {
        let port = |json| container_port(&record(Some(json)));
        assert_eq!(
            port(r#"[{"name":"http","containerPort":8080,"protocol":"TCP"}]"#).unwrap(),
            8080
        );
        assert_eq!(
            port(r#"[{"containerPort":53,"protocol":"UDP"},{"containerPort":9000}]"#).unwrap(),
            9000
        );
        let err = port(r#"[{"containerPort":53,"protocol":"UDP"}]"#).unwrap_err();
        assert!(
            err.message()
                .contains("a wasi:http component needs a containerPort"),
            "{err:?}"
        );
        assert_eq!(port("{").unwrap_err().code(), tonic::Code::InvalidArgument);
        let err = container_port(&record(None)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    }
}
