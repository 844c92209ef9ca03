//! What a workload's store is made of, for programs and HTTP handlers alike: the
//! container's WASI context, its memory limit and CPU account, its output into the
//! log, and how a trap reads in its status.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;
use tonic::Status;
use wasmtime::component::ResourceTable;
use wasmtime::{Engine, ResourceLimiter, Store, UpdateDeadline};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use super::usage::Usage;
use crate::log::{Lines, LogFile, Stream};
use crate::record::ContainerRecord;
use crate::state::Cancel;

/// Frames of a trap's WASM backtrace kept in the container's status message.
const TRAP_FRAMES: usize = 6;
/// What a table element costs: a pointer (a function reference or an
/// `externref`), as the engine lays tables out.
const TABLE_ELEMENT_BYTES: usize = std::mem::size_of::<usize>();

/// What a container's WASI context is made of: kept so an HTTP handler can make one
/// per request.
#[derive(Clone, Debug)]
pub(crate) struct WasiConfig {
    id: String,
    argv: Vec<String>,
    envs: Vec<(String, String)>,
    /// Host path, guest path, read-only.
    mounts: Vec<(String, String, bool)>,
    working_dir: Option<String>,
    /// Whether it may open sockets and look names up: only inside a network of its
    /// pod's own, where they cannot reach what listens on the node's loopback.
    sockets: bool,
}

impl WasiConfig {
    pub(crate) fn of(record: &ContainerRecord) -> Self {
        let config = &record.config;
        let name = config
            .metadata
            .as_ref()
            .map(|m| m.name.clone())
            .unwrap_or_default();
        let argv: Vec<String> = if config.command.is_empty() {
            std::iter::once(name)
                .chain(config.args.iter().cloned())
                .collect()
        } else {
            config.command.iter().chain(&config.args).cloned().collect()
        };
        Self {
            id: record.id.clone(),
            argv,
            envs: config
                .envs
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect(),
            mounts: config
                .mounts
                .iter()
                .map(|m| (m.host_path.clone(), m.container_path.clone(), m.readonly))
                .collect(),
            working_dir: Some(config.working_dir.clone()).filter(|d| !d.is_empty()),
            sockets: false,
        }
    }

    /// Grants `wasi:sockets` (TCP, UDP, name lookup, any address): for a program whose
    /// thread is in its pod's network.
    pub(crate) fn grant_sockets(&mut self) {
        self.sockets = true;
    }

    /// A WASI context granting the container's arguments, environment and mounts, its
    /// output into `log`, and sockets if granted.
    pub(crate) fn context(&self, log: Option<Arc<LogFile>>) -> Result<WasiCtx, Status> {
        let mut wasi = WasiCtxBuilder::new();
        wasi.args(&self.argv)
            .envs(&self.envs)
            .stdout(LogStream::new(Stream::Stdout, log.clone()))
            .stderr(LogStream::new(Stream::Stderr, log))
            .allow_tcp(self.sockets)
            .allow_udp(self.sockets)
            .allow_ip_name_lookup(self.sockets);
        if self.sockets {
            wasi.inherit_network();
        }
        for (host_path, container_path, readonly) in &self.mounts {
            let perms = if *readonly {
                FsPerms::ReadOnly
            } else {
                FsPerms::ReadWrite
            };
            wasi.preopened_dir(host_path, container_path, perms)
                .map_err(|e| {
                    Status::failed_precondition(format!(
                        "container {}: cannot mount {host_path} at {container_path}: {e}",
                        self.id
                    ))
                })?;
        }
        if let Some(dir) = &self.working_dir {
            wasi.initial_cwd(dir);
        }
        Ok(wasi.build())
    }
}

/// The container's memory limit, if it has one.
pub(crate) fn memory_limit(record: &ContainerRecord) -> Option<usize> {
    record
        .config
        .linux
        .as_ref()
        .and_then(|l| l.resources.as_ref())
        .map(|r| r.memory_limit_in_bytes)
        .filter(|&l| l > 0)
        .and_then(|l| usize::try_from(l).ok())
}

/// A store for one instance: its memory held to `limit` and counted into `usage`
/// (the container's, over all of its instances) with its CPU time, its guest code
/// held to the container's CPU limit and stopped once `cancel`'s flag is set.
///
/// The store must run on the container's own thread: its CPU time is that thread's.
pub(crate) fn new_store(
    engine: &Engine,
    wasi: WasiCtx,
    limit: Option<usize>,
    usage: Arc<Usage>,
    cancel: Arc<Cancel>,
) -> Store<Workload> {
    let memory = usage.memory.clone();
    let mut store = Store::new(
        engine,
        Workload {
            wasi,
            http: WasiHttpCtx::new(),
            table: ResourceTable::new(),
            limits: MemoryLimits {
                limit,
                own: 0,
                total: memory,
                hit: false,
            },
            cancel,
            usage,
        },
    );
    store.limiter(|w| &mut w.limits);
    store.set_epoch_deadline(1);
    // At every epoch tick of running guest code: a stop ends it, and its CPU time is
    // read and charged, an overrun of its quota waited off.
    store.epoch_deadline_callback(|ctx| {
        if ctx.data().cancel.flag.load(Ordering::Relaxed) {
            wasmtime::bail!("stopped");
        }
        Ok(match ctx.data().usage.account() {
            None => UpdateDeadline::Yield(1),
            Some(wait) => UpdateDeadline::YieldCustom(1, Box::pin(throttle(wait))),
        })
    });
    store
}

/// Waits an overrun off. The executor is the container's own (see `usage`): its
/// other instances wait too, or are held at their own next deadline.
async fn throttle(wait: Duration) {
    tokio::time::sleep(wait).await;
}

/// A trap, briefly: what happened and the innermost frames of the WASM backtrace.
pub(crate) fn trap_message(e: &wasmtime::Error) -> String {
    let what = match e.downcast_ref::<wasmtime::Trap>() {
        Some(trap) => trap.to_string(),
        None => first_line(&e.root_cause().to_string()).to_string(),
    };
    let Some(backtrace) = e.downcast_ref::<wasmtime::WasmBacktrace>() else {
        return what;
    };
    let frames: Vec<String> = backtrace
        .frames()
        .iter()
        .take(TRAP_FRAMES)
        .map(|f| match f.func_name() {
            Some(name) => name.to_string(),
            None => format!("wasm function {}", f.func_index()),
        })
        .collect();
    if frames.is_empty() {
        return what;
    }
    let more = if backtrace.frames().len() > TRAP_FRAMES {
        " …"
    } else {
        ""
    };
    format!("{what} (backtrace: {}{more})", frames.join(" < "))
}

pub(crate) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// What a workload's store holds.
pub(crate) struct Workload {
    wasi: WasiCtx,
    /// Unused by programs, whose linker has no `wasi:http`.
    http: WasiHttpCtx,
    table: ResourceTable,
    pub(crate) limits: MemoryLimits,
    cancel: Arc<Cancel>,
    usage: Arc<Usage>,
}

impl WasiView for Workload {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for Workload {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: Default::default(),
        }
    }
}

/// An instance's memory limit over all of its linear memories and tables together.
pub(crate) struct MemoryLimits {
    pub(crate) limit: Option<usize>,
    /// Bytes this store's memories and tables hold.
    own: usize,
    /// Bytes the container's stores hold together: what `ContainerStats` reports.
    total: Arc<AtomicU64>,
    /// Whether a growth was refused: the trap that follows is an OOM kill.
    pub(crate) hit: bool,
}

impl ResourceLimiter for MemoryLimits {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(current, desired)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(
            current.saturating_mul(TABLE_ELEMENT_BYTES),
            desired.saturating_mul(TABLE_ELEMENT_BYTES),
        )
    }
}

impl MemoryLimits {
    /// A memory or table growing from `current` to `desired` bytes.
    fn grow(&mut self, current: usize, desired: usize) -> wasmtime::Result<bool> {
        let own = self.own.saturating_sub(current).saturating_add(desired);
        if let Some(limit) = self.limit
            && own > limit
        {
            self.hit = true;
            wasmtime::bail!("memory limit of {limit} bytes reached (growing to {own} bytes)");
        }
        self.total
            .fetch_add(own.saturating_sub(self.own) as u64, Ordering::Relaxed);
        self.own = own;
        Ok(true)
    }
}

impl Drop for MemoryLimits {
    fn drop(&mut self) {
        // The store's memories go with it.
        self.total.fetch_sub(self.own as u64, Ordering::Relaxed);
    }
}

/// A guest's stdout or stderr, into the container's log.
struct LogStream {
    stream: Stream,
    log: Option<Arc<LogFile>>,
}

impl LogStream {
    fn new(stream: Stream, log: Option<Arc<LogFile>>) -> Self {
        Self { stream, log }
    }
}

impl IsTerminal for LogStream {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogStream {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(LineWriter(Lines::new(self.stream, self.log.clone())))
    }

    /// Written at once, so stdout and stderr lines land in the order the guest wrote
    /// them: the default adapter writes from a task of its own, and a stderr line
    /// could land before the stdout line written first.
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(LogOutput(Lines::new(self.stream, self.log.clone())))
    }
}

/// A WASI output stream into the log, always ready.
struct LogOutput(Lines);

#[async_trait::async_trait]
impl Pollable for LogOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for LogOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.0.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // WASI's usual permit: what a guest may hand over in one write.
        Ok(64 * 1024)
    }
}

/// Writes go to the file at once (a log write is short): never pending.
struct LineWriter(Lines);

impl AsyncWrite for LineWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.0.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.0.finish();
        Poll::Ready(Ok(()))
    }
}
