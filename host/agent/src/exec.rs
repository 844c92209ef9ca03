//! `kubectl exec` on the node: the kubelet's `/exec/{namespace}/{pod}/{container}`,
//! which the API server's `pods/exec` relays to. Start with [`handle`].
//!
//! # Protocol
//! A WebSocket (`v5.channel.k8s.io`, or `v4.channel.k8s.io`), as Kubernetes'
//! remotecommand speaks it: every message is binary and starts with its channel — 0
//! stdin, 1 stdout, 2 stderr, 3 the outcome (a JSON `Status`), 4 terminal resizes —
//! and v5 adds 255, a stream's close (`[255, 0]`: no more stdin). Once the command
//! ended and its output was sent, the outcome follows on channel 3 and the agent closes
//! the WebSocket normally (1000), which is how the client knows its streams ended.
//!
//! # What runs the command
//! Trellis' runtime implements CRI's `ExecSync` only, not the streaming `Exec`, so the
//! agent runs the command itself for the `process` handler, whose containers are host
//! processes in their pod's namespaces: the command enters the namespaces of the
//! container's process (its pid from the runtime's verbose `ContainerStatus`: mount,
//! UTS, IPC and network), so it sees the container's hostname, /etc files, mounts and
//! interfaces; it has the container's environment (built from the pod as for the container, by
//! [`crate::spec::environment`]; ConfigMap and Secret values are today's, not those
//! the container started with) and working directory, in a process group of its own.
//! No terminal is allocated: with `tty=true` the command's stdout and stderr both go
//! to stdout, and resizes are ignored. A client that goes away kills the command's
//! process group.
//!
//! A `wasmtime` container is a WebAssembly component, which has no shell or programs
//! to run: the answer is an error saying so. Containers of other runtimes (containerd)
//! would need CRI's streaming `Exec`, which the agent does not speak yet.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut as _, Bytes, BytesMut};
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::header::{
    CONNECTION, HeaderValue, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_PROTOCOL, UPGRADE,
};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tracing::{debug, warn};

use crate::Context;
use crate::http::{Body, parse_bool, text, valid_name};
use crate::labels::{CONTAINER_NAME, POD_NAME, POD_NAMESPACE, POD_UID};

/// The subprotocols served, best first.
pub const PROTOCOLS: &[&str] = &[V5, V4];
const V5: &str = "v5.channel.k8s.io";
const V4: &str = "v4.channel.k8s.io";

/// Channels: the first byte of every message.
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const RESIZE: u8 = 4;
/// v5: the stream named by the next byte is closed.
const CLOSE: u8 = 255;

/// How long the runtime may take to answer.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(5);
/// How long output still in the pipes is sent after the command ended (a child it
/// left behind may hold them open).
const DRAIN: Duration = Duration::from_millis(500);
/// How long the client may take to answer the close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// Bytes read from the command's output at a time.
const CHUNK: usize = 32 * 1024;
/// Messages waiting for a slow client (or stdin chunks for a slow command).
const BUFFERED: usize = 16;

/// `PodExecOptions`, as the query carries them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOptions {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl ExecOptions {
    /// Parses the query string, with Kubernetes' validation; the error is the message
    /// for the client.
    pub fn parse(query: &str) -> Result<ExecOptions, String> {
        let mut options = ExecOptions::default();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "command" => options.command.push(value.into_owned()),
                "stdin" | "input" => options.stdin = parse_bool(&key, &value)?,
                "stdout" | "output" => options.stdout = parse_bool(&key, &value)?,
                "stderr" | "error" => options.stderr = parse_bool(&key, &value)?,
                "tty" => options.tty = parse_bool(&key, &value)?,
                _ => {}
            }
        }
        if options.command.is_empty() {
            return Err("you must specify at least one command for the container".into());
        }
        if !(options.stdin || options.stdout || options.stderr) {
            return Err("you must specify at least 1 of stdin, stdout, stderr".into());
        }
        Ok(options)
    }
}

/// The subprotocol chosen from a client's `Sec-WebSocket-Protocol` headers: the first
/// of the client's list this agent serves.
pub fn choose_protocol<'a>(offered: impl IntoIterator<Item = &'a str>) -> Option<&'static str> {
    offered
        .into_iter()
        .flat_map(|h| h.split(','))
        .map(str::trim)
        .find_map(|p| PROTOCOLS.iter().copied().find(|s| *s == p))
}

/// Serves `/exec/{target}`: checks the request and the container, answers 101 and runs
/// the session on the upgraded connection. The client was authorized already.
pub async fn handle(
    ctx: Arc<Context>,
    target: &str,
    mut request: Request<Incoming>,
) -> Response<Body> {
    let parts: Vec<&str> = target.split('/').collect();
    let [namespace, pod, container] = parts[..] else {
        return text(
            StatusCode::NOT_FOUND,
            "expected /exec/{namespace}/{pod}/{container}",
        );
    };
    if let Some(bad) = [namespace, pod, container]
        .into_iter()
        .find(|n| !valid_name(n))
    {
        return text(StatusCode::BAD_REQUEST, format!("invalid name {bad:?}"));
    }
    let options = match ExecOptions::parse(request.uri().query().unwrap_or("")) {
        Ok(o) => o,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    let headers = request.headers();
    let wants_websocket = headers
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let key = headers.get("sec-websocket-key").map(HeaderValue::as_bytes);
    let (true, Some(key)) = (wants_websocket, key) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "Upgrade request required: exec is served over a WebSocket ({})",
                PROTOCOLS.join(", ")
            ),
        );
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key);
    let offered = headers
        .get_all(SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok());
    let Some(protocol) = choose_protocol(offered) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "none of the offered subprotocols is served: exec speaks {}",
                PROTOCOLS.join(", ")
            ),
        );
    };
    let plan = match plan(&ctx, namespace, pod, container).await {
        Ok(plan) => plan,
        Err((status, message)) => return text(status, message),
    };
    let upgrade = hyper::upgrade::on(&mut request);
    let (namespace, pod, container) = (namespace.to_owned(), pod.to_owned(), container.to_owned());
    tokio::spawn(async move {
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                debug!(%namespace, %pod, %container, error = %e, "exec: the upgrade failed");
                return;
            }
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        session(&ctx, ws, plan, options, &namespace, &pod, &container).await;
    });
    let mut response = Response::new(Full::new(Bytes::new()).boxed_unsync());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(protocol));
    if let Ok(accept) = HeaderValue::from_str(&accept) {
        headers.insert(SEC_WEBSOCKET_ACCEPT, accept);
    }
    response
}

/// What an exec into a container does.
#[derive(Debug)]
enum Plan {
    /// Run the command in the namespaces of the container's process, `pid` (whose
    /// /proc start time is `start`).
    Process {
        pod_uid: String,
        pid: i32,
        start: Option<u64>,
    },
    /// Answer this error on channel 3.
    Refuse(String),
}

/// Finds the running container and what can exec into it; the error is an HTTP
/// status and message, before the upgrade.
async fn plan(
    ctx: &Context,
    namespace: &str,
    pod: &str,
    container: &str,
) -> Result<Plan, (StatusCode, String)> {
    let mut runtime = ctx.cri.runtime.clone();
    let labels: HashMap<String, String> = [
        (POD_NAMESPACE, namespace),
        (POD_NAME, pod),
        (CONTAINER_NAME, container),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let request = cri::ListContainersRequest {
        filter: Some(cri::ContainerFilter {
            state: Some(cri::ContainerStateValue {
                state: cri::ContainerState::ContainerRunning as i32,
            }),
            label_selector: labels,
            ..Default::default()
        }),
    };
    let runtime_error = |e: String| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("ask the container runtime for container {container:?} in pod {pod:?}: {e}"),
        )
    };
    let listed = tokio::time::timeout(RUNTIME_TIMEOUT, runtime.list_containers(request))
        .await
        .map_err(|_| runtime_error("timed out".into()))?
        .map_err(|e| runtime_error(e.message().to_owned()))?
        .into_inner();
    let Some(found) = listed
        .containers
        .into_iter()
        .max_by_key(|c| (c.metadata.as_ref().map(|m| m.attempt), c.created_at))
    else {
        return Err((
            StatusCode::NOT_FOUND,
            format!("container {container:?} in pod {pod:?} is not running"),
        ));
    };
    if ctx.runtime_name != "trellis" {
        return Ok(Plan::Refuse(format!(
            "exec into containers of this runtime ({}) is not supported yet",
            ctx.runtime_name
        )));
    }
    let sandbox = tokio::time::timeout(
        RUNTIME_TIMEOUT,
        runtime.pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: found.pod_sandbox_id.clone(),
            verbose: false,
        }),
    )
    .await
    .map_err(|_| runtime_error("timed out".into()))?
    .map_err(|e| runtime_error(e.message().to_owned()))?
    .into_inner();
    let handler = sandbox
        .status
        .map(|s| s.runtime_handler)
        .unwrap_or_default();
    let pod_uid = found.labels.get(POD_UID).cloned().unwrap_or_default();
    Ok(match handler.as_str() {
        "process" => {
            let (pid, start) = process_of(ctx, &found.id)
                .await
                .map_err(runtime_error)?
                .ok_or_else(|| {
                    (
                        StatusCode::NOT_FOUND,
                        format!("container {container:?} in pod {pod:?} is not running"),
                    )
                })?;
            Plan::Process {
                pod_uid,
                pid,
                start,
            }
        }
        "wasmtime" => Plan::Refuse(format!(
            "container {container} runs a WebAssembly component: it has no shell to exec into"
        )),
        other => Plan::Refuse(format!(
            "exec into containers of runtime handler {other:?} is not supported yet"
        )),
    })
}

/// The pid of container `id`'s process and its /proc start time, from the runtime's
/// verbose status (as containerd gives it: `info` holds a JSON object with `pid`);
/// none when it has no process.
async fn process_of(ctx: &Context, id: &str) -> Result<Option<(i32, Option<u64>)>, String> {
    let mut runtime = ctx.cri.runtime.clone();
    let status = tokio::time::timeout(
        RUNTIME_TIMEOUT,
        runtime.container_status(cri::ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: true,
        }),
    )
    .await
    .map_err(|_| "timed out".to_owned())?
    .map_err(|e| e.message().to_owned())?
    .into_inner();
    let Some(info) = status.info.get("info") else {
        return Ok(None);
    };
    let info: serde_json::Value = serde_json::from_str(info).map_err(|e| e.to_string())?;
    let pid = info["pid"].as_i64().and_then(|p| i32::try_from(p).ok());
    Ok(pid.map(|pid| (pid, info["pidStart"].as_u64())))
}

type Ws = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

async fn session(
    ctx: &Context,
    ws: Ws,
    plan: Plan,
    options: ExecOptions,
    namespace: &str,
    pod: &str,
    container: &str,
) {
    let (sink, mut incoming) = ws.split();
    let (out, outgoing) = mpsc::channel::<Message>(BUFFERED);
    let writer = tokio::spawn(write(sink, outgoing));
    let outcome = match plan {
        Plan::Refuse(message) => Outcome::Error(message),
        Plan::Process {
            pod_uid,
            pid,
            start,
        } => match environment(ctx, namespace, pod, &pod_uid, container).await {
            Ok((env, dir)) => run(&mut incoming, &out, &options, env, dir, (pid, start)).await,
            Err(message) => Outcome::Error(message),
        },
    };
    debug!(%namespace, %pod, %container, ?outcome, "exec ended");
    if !matches!(outcome, Outcome::ClientGone) {
        let mut message = vec![ERROR];
        message.extend_from_slice(outcome.status().to_string().as_bytes());
        let _ = out.send(Message::Binary(message.into())).await;
        let _ = out
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Normal,
                reason: "".into(),
            })))
            .await;
    }
    drop(out);
    let _ = writer.await;
    // The client answers the close; what else it sends now is dropped.
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
        while let Some(Ok(m)) = incoming.next().await {
            if matches!(m, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
}

/// Sends what the session queues until the queue ends or a close went out.
async fn write(
    mut sink: futures::stream::SplitSink<Ws, Message>,
    mut outgoing: mpsc::Receiver<Message>,
) {
    while let Some(message) = outgoing.recv().await {
        let close = matches!(message, Message::Close(_));
        if let Err(e) = sink.send(message).await {
            debug!(error = %e, "exec: writing to the client failed");
            return;
        }
        if close {
            return;
        }
    }
}

/// How an exec ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Exited(i32),
    /// The command could not run: the message for the client.
    Error(String),
    /// The client closed the WebSocket first: nothing more to tell.
    ClientGone,
}

impl Outcome {
    /// The `Status` sent on channel 3, as the kubelet words it.
    fn status(&self) -> serde_json::Value {
        match self {
            Outcome::Exited(0) | Outcome::ClientGone => {
                json!({"metadata": {}, "status": "Success"})
            }
            Outcome::Exited(code) => json!({
                "metadata": {},
                "status": "Failure",
                "message": format!("command terminated with non-zero exit code: exit status {code}"),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
            }),
            Outcome::Error(message) => {
                let message = format!("error executing command in container: {message}");
                json!({
                    "metadata": {},
                    "status": "Failure",
                    "message": format!("Internal error occurred: {message}"),
                    "reason": "InternalError",
                    "details": {"causes": [{"message": message}]},
                    "code": 500,
                })
            }
        }
    }
}

/// The container's environment and working directory, from its pod as the node sees
/// it (the pod the running container belongs to: same UID).
async fn environment(
    ctx: &Context,
    namespace: &str,
    pod: &str,
    pod_uid: &str,
    container: &str,
) -> Result<(crate::spec::Environment, String), String> {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let selector = format!("spec.nodeName={}", ctx.config.node_name);
    let informer = ctx
        .informers
        .informer(api, watcher::Config::default().fields(&selector));
    let found = informer
        .get(&format!("{namespace}/{pod}"))
        .filter(|p| p.metadata.uid.as_deref() == Some(pod_uid))
        .ok_or_else(|| format!("pod {pod:?} is not known to this node"))?;
    let spec = found
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == container))
        .ok_or_else(|| format!("pod {pod:?} has no container {container:?}"))?;
    let env = crate::spec::environment(ctx, &found, spec, &mut crate::spec::Sources::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok((env, spec.working_dir.clone().unwrap_or_default()))
}

/// Runs the command, its streams over the WebSocket, until it ended and its output
/// was sent, or the client went away.
async fn run(
    incoming: &mut futures::stream::SplitStream<Ws>,
    out: &mpsc::Sender<Message>,
    options: &ExecOptions,
    env: crate::spec::Environment,
    dir: String,
    (pid, start): (i32, Option<u64>),
) -> Outcome {
    let Some((program, args)) = options.command.split_first() else {
        return Outcome::Error("no command".into());
    };
    let piped = |wanted: bool| {
        if wanted {
            Stdio::piped()
        } else {
            Stdio::null()
        }
    };
    // In the container's namespaces, as its user: what the command sees and may do
    // is what the container sees and may do.
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    let dir = if dir.is_empty() { "/" } else { dir.as_str() };
    let mut command = match trellis_runtime::namespaces::container_command(
        pid,
        start,
        program.as_ref(),
        &args,
        dir.as_ref(),
    ) {
        Ok(command) => command,
        Err(e) => return Outcome::Error(format!("cannot run {program:?}: {e}")),
    };
    command
        .env_clear()
        .envs(env.into_iter().map(|(k, v)| (k, OsString::from_vec(v))))
        .stdin(piped(options.stdin))
        .stdout(piped(options.stdout || options.tty))
        .stderr(piped(options.stderr || options.tty))
        .process_group(0)
        .kill_on_drop(true);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => return Outcome::Error(format!("cannot run {program:?}: {e}")),
    };
    // Without a terminal, a tty's output is stdout's alone.
    let stderr_channel = if options.tty { STDOUT } else { STDERR };
    let mut copies = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        copies.push(tokio::spawn(copy_output(stdout, STDOUT, out.clone())));
    }
    if let Some(stderr) = child.stderr.take() {
        copies.push(tokio::spawn(copy_output(
            stderr,
            stderr_channel,
            out.clone(),
        )));
    }
    let mut stdin = child.stdin.take().map(|mut pipe| {
        let (tx, mut rx) = mpsc::channel::<Bytes>(BUFFERED);
        tokio::spawn(async move {
            while let Some(chunk) = rx.recv().await {
                if pipe.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            // Dropping the pipe is the command's end of input.
        });
        tx
    });
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            message = incoming.next() => match message {
                Some(Ok(Message::Binary(data))) => match data.first() {
                    Some(&STDIN) => {
                        if let Some(tx) = &stdin
                            && tx.send(data.slice(1..)).await.is_err()
                        {
                            stdin = None;
                        }
                    }
                    Some(&CLOSE) if data.get(1) == Some(&STDIN) => stdin = None,
                    // No terminal to resize.
                    Some(&RESIZE) => {}
                    // Other channels are not the client's to write.
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => {
                    // The whole group: a shell's children too (the command leads it).
                    if let Some(pid) = child.id().and_then(|id| rustix::process::Pid::from_raw(id as i32)) {
                        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
                    }
                    let _ = child.start_kill();
                    return Outcome::ClientGone;
                }
                Some(Ok(_)) => {}
            },
        }
    };
    drop(stdin);
    for copy in copies {
        let _ = tokio::time::timeout(DRAIN, copy).await;
    }
    match status {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt as _;
            Outcome::Exited(match (status.code(), status.signal()) {
                (Some(code), _) => code,
                (None, Some(signal)) => 128 + signal,
                (None, None) => 1,
            })
        }
        Err(e) => {
            warn!(error = %e, "exec: waiting for the command failed");
            Outcome::Error(format!("wait for {program:?}: {e}"))
        }
    }
}

/// Sends what `reader` gives on `channel` until it ends.
async fn copy_output(mut reader: impl AsyncRead + Unpin, channel: u8, out: mpsc::Sender<Message>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut message = BytesMut::with_capacity(n + 1);
                message.put_u8(channel);
                message.put_slice(&buf[..n]);
                if out.send(Message::Binary(message.freeze())).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_options_kubectl_sends() {
        let o = ExecOptions::parse(
            "command=sh&command=-c&command=echo+out%3B+exit+3&container=c&stdin=true&stdout=true&stderr=true&tty=false",
        )
        .unwrap();
        assert_eq!(o.command, ["sh", "-c", "echo out; exit 3"]);
        assert!(o.stdin && o.stdout && o.stderr && !o.tty);
        assert!(ExecOptions::parse("stdout=true").is_err());
        assert!(ExecOptions::parse("command=ls").is_err());
    }

    #[test]
    fn chooses_the_clients_first_served_protocol() {
        assert_eq!(choose_protocol(["v5.channel.k8s.io"]), Some(V5));
        assert_eq!(
            choose_protocol(["v4.channel.k8s.io, v5.channel.k8s.io"]),
            Some(V4)
        );
        assert_eq!(
            choose_protocol(["channel.k8s.io", "base64.channel.k8s.io"]),
            None
        );
    }

    #[test]
    fn the_outcome_reads_as_the_kubelets_status() {
        let s = Outcome::Exited(3).status();
        assert_eq!(s["reason"], "NonZeroExitCode");
        assert_eq!(s["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(s["details"]["causes"][0]["message"], "3");
        assert_eq!(Outcome::Exited(0).status()["status"], "Success");
        assert_eq!(
            Outcome::Error("x".into()).status()["reason"],
            "InternalError"
        );
    }
}
