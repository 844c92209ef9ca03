//! A runtime handler: how a container runs. The CRI service (`service`) keeps the
//! records and answers every request the same way whatever runs the containers; it
//! asks the container's handler only to start, stop, measure and exec into one. A
//! handler is named by the sandbox (`RunPodSandboxRequest.runtime_handler`, from the
//! pod's RuntimeClass), as containerd's are.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1::ExecSyncResponse;
use tokio::sync::watch;
use tonic::Status;

use crate::log::LogFile;
use crate::record::{ContainerRecord, ImageKind};
use crate::state::{Live, State, Stopper};

/// What a handler readied, outside the tables' lock, for a start.
#[derive(Default)]
pub(crate) struct Prepared {
    /// What the handler readied for itself (`wasmtime`: a component compiled and
    /// linked), handed back unopened to its own `start`.
    pub readied: Option<Box<dyn Any + Send>>,
    /// Where the container's output goes; none drops it.
    pub log: Option<Arc<LogFile>>,
}

/// A started container: its live part, and a process's pid and /proc start time.
pub(crate) struct Started {
    pub live: Live,
    pub pid: Option<i32>,
    pub pid_start: Option<u64>,
}

#[tonic::async_trait]
pub(crate) trait Handler: Send + Sync {
    /// Whether it runs images of `kind`.
    fn runs(&self, kind: ImageKind) -> bool;

    /// Readies `record` to start: the slow part (compiling, opening the log), done
    /// before the tables are locked.
    async fn prepare(&self, record: &ContainerRecord) -> Result<Prepared, Status>;

    /// Starts `record`. Called with the tables locked, so what watches the container
    /// cannot record its end before its start is recorded.
    fn start(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        prepared: Prepared,
    ) -> Result<Started, Status>;

    /// Stops the running container `id` that `stop` says how to end, giving it up to
    /// `timeout`; returns once `exited` says it ended.
    async fn stop(
        &self,
        state: &Arc<State>,
        id: &str,
        stop: Stopper,
        timeout: Duration,
        exited: watch::Receiver<bool>,
    ) -> Result<(), Status>;

    /// A running container's CPU time (ns) and memory (bytes), where known.
    fn usage(&self, live: &Live) -> (Option<u64>, Option<u64>);

    /// Runs `cmd` in container `record` (`ExecSync`).
    async fn exec_sync(
        &self,
        record: &ContainerRecord,
        cmd: &[String],
        timeout: Duration,
    ) -> Result<ExecSyncResponse, Status>;
}

/// Opens `record`'s log, if it names one.
pub(crate) fn open_log(record: &ContainerRecord) -> Result<Option<Arc<LogFile>>, Status> {
    record
        .log_path
        .as_ref()
        .map(|path| {
            LogFile::open(path).map_err(|e| {
                Status::internal(format!("cannot open the log {}: {e}", path.display()))
            })
        })
        .transpose()
}
