//! The `wasmtime` handler: a container is a WebAssembly component, of one of two kinds
//! told by its exports. One exporting `wasi:cli/run` is a program, run once on an OS
//! thread of its own; one exporting `wasi:http/incoming-handler` (the `wasi:http/proxy`
//! world) is an HTTP server, an instance per request (see `proxy`).
//!
//! Workloads have their own engine (Cranelift, epoch interruption, no pooling): they
//! must not take the plugin host's instance slots. Compiled code is cached on disk by
//! content digest through the plugin host's cache (whose file names carry the engine's
//! compatibility hash), and in memory per digest, pre-instantiated, so a second
//! container of an image (or a handler's next request) neither recompiles nor relinks.
//!
//! WASI grants exactly the container's arguments and environment, a preopened
//! directory per mount (read-only when the mount is), stdout and stderr into the log,
//! clocks and randomness; no stdin. A program in a pod with a network of its own also
//! gets `wasi:sockets` and name lookups, inside the pod's network namespace and with
//! the pod's `resolv.conf` (`pod`); elsewhere (the node's network) no sockets and no
//! name lookup. An HTTP handler may also send requests
//! (`wasi:http/outgoing-handler`); a program may not. In a pod with a network of its
//! own, a handler's thread is in the pod's network too: it listens there, and its
//! requests and their name lookups are the pod's. A WASM program has
//! no signal handler: a stop cancels it at once, whatever the grace period.
//!
//! # Layout
//! - `engine`: the engine, its linkers and the compiled-component cache.
//! - `workload`: what an instance's store holds: the WASI context, the memory limit,
//!   output into the log; and how a trap reads.
//! - `usage`: a container's memory and CPU time, and its CPU limit, kept by the
//!   engine (a component runs on a thread of the runtime's own process).
//! - `program`: a `wasi:cli/run` component's run on a thread of its own.
//! - `pod`: how that thread enters its pod's network and DNS settings.
//! - `proxy`: a `wasi:http/incoming-handler` component's HTTP server.

mod engine;
mod pod;
mod program;
mod proxy;
mod usage;
mod workload;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic::Status;

use engine::Prepared;
pub(crate) use engine::WasmHost;

use crate::handler::{self, Handler};
use crate::record::{ContainerRecord, ImageKind};
use crate::state::{Live, State, Stopper};

/// How long a stopped WASM container may take to end before a stop gives up: a
/// program notices at once, an HTTP handler's requests have up to
/// `proxy::MAX_GRACE`.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// The `wasmtime` handler: components on `host`, HTTP servers on `node_ip`.
pub(crate) struct Wasmtime {
    pub host: Arc<WasmHost>,
    pub node_ip: IpAddr,
}

#[tonic::async_trait]
impl Handler for Wasmtime {
    fn runs(&self, kind: ImageKind) -> bool {
        kind == ImageKind::Wasm
    }

    async fn prepare(&self, record: &ContainerRecord) -> Result<handler::Prepared, Status> {
        let host = self.host.clone();
        let (digest, path) = (record.image_id.clone(), record.program.clone());
        let component = tokio::task::spawn_blocking(move || host.prepare(&digest, &path))
            .await
            .map_err(|e| Status::internal(format!("compiling the component failed: {e}")))??;
        Ok(handler::Prepared {
            readied: Some(Box::new(component)),
            log: handler::open_log(record)?,
        })
    }

    fn start(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        prepared: handler::Prepared,
    ) -> Result<handler::Started, Status> {
        let component = prepared
            .readied
            .and_then(|readied| readied.downcast::<Prepared>().ok())
            .ok_or_else(|| Status::internal("the component was not compiled"))?;
        // A program on a thread of its own, an HTTP handler listening on the node's IP
        // (the pod's, in a pod with a network of its own);
        // called with the tables locked, so neither can record its end before its start.
        let engine = self.host.engine();
        let live = match *component {
            Prepared::Program(program) => program::start(
                engine,
                self.host.usages(),
                state,
                record,
                program,
                prepared.log,
            )?,
            Prepared::Handler(pre) => proxy::start(
                proxy::Handler::new(engine, self.host.usages(), record, pre, prepared.log)?,
                state,
                self.node_ip,
                record
                    .netns
                    .as_deref()
                    .map(|netns| pod::PodNetwork::of(netns, &record.sandbox_id)),
            )?,
        };
        Ok(handler::Started {
            live,
            pid: None,
            pid_start: None,
        })
    }

    async fn stop(
        &self,
        _: &Arc<State>,
        id: &str,
        how: Stopper,
        timeout: Duration,
        mut exited: watch::Receiver<bool>,
    ) -> Result<(), Status> {
        let Stopper::Wasm(cancel) = how else {
            return Ok(());
        };
        // A program ends at once; an HTTP handler's requests get the grace.
        cancel.stop(timeout);
        match tokio::time::timeout(CANCEL_WAIT, exited.wait_for(|e| *e)).await {
            Ok(_) => Ok(()),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "container {id} has not ended {CANCEL_WAIT:?} after it was cancelled"
            ))),
        }
    }

    /// The CPU time of the container's thread as of its last epoch deadline (or
    /// request), and the bytes its instances' memories and tables hold.
    fn usage(&self, live: &Live) -> (Option<u64>, Option<u64>) {
        let Some(memory) = live.memory.as_ref() else {
            return (None, None);
        };
        match self.host.usages().get(memory) {
            Some(usage) => (Some(usage.cpu_ns()), Some(usage.memory_bytes())),
            // Its thread has ended: the container is ending.
            None => (
                None,
                Some(memory.load(std::sync::atomic::Ordering::Relaxed)),
            ),
        }
    }

    async fn exec_sync(
        &self,
        record: &ContainerRecord,
        _: &[String],
        _: Duration,
    ) -> Result<k8s_cri::v1::ExecSyncResponse, Status> {
        Err(Status::failed_precondition(format!(
            "container {} runs a WebAssembly component: it has no shell to exec into",
            record.id
        )))
    }
}
