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
//! clocks and randomness; no sockets, no name lookup, no stdin. An HTTP handler may also
//! send requests (`wasi:http/outgoing-handler`); a program may not. A WASM program has
//! no signal handler: a stop cancels it at once, whatever the grace period.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::AsyncWrite;
use tokio::sync::watch;
use tonic::Status;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, ResourceLimiter, Store, Strategy, UpdateDeadline};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::ProxyPre;
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use crate::handler::{self, Handler};
use crate::images::ImageKind;
use crate::log::{Lines, LogFile, Stream};
use crate::state::{Cancel, ContainerRecord, Exit, Live, State, Stopper};

/// How often the epoch advances: how long guest code runs before it checks whether
/// it was stopped (and yields its thread's executor to host work).
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Frames of a trap's WASM backtrace kept in the container's status message.
const TRAP_FRAMES: usize = 6;

/// Export names (before the `@version`) that tell a component's kind.
const RUN_EXPORT: &str = "wasi:cli/run@";
const HANDLER_EXPORT: &str = "wasi:http/incoming-handler@";

pub(crate) struct WasmHost {
    engine: Engine,
    /// WASI alone: what a program may import.
    linker: Linker<Workload>,
    /// WASI and `wasi:http`: what an HTTP handler may import.
    http_linker: Linker<Workload>,
    cache_dir: PathBuf,
    /// Components ready to instantiate, by image digest.
    prepared: Mutex<HashMap<String, Prepared>>,
    ticker: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

/// A component linked and checked, of the kind its exports say.
#[derive(Clone)]
pub(crate) enum Prepared {
    /// Exports `wasi:cli/run`: runs once, as a program.
    Program(CommandPre<Workload>),
    /// Exports `wasi:http/incoming-handler`: serves HTTP, an instance per request.
    Handler(ProxyPre<Workload>),
}

impl std::fmt::Debug for WasmHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmHost")
            .field("cache_dir", &self.cache_dir)
            .finish_non_exhaustive()
    }
}

impl WasmHost {
    pub(crate) fn new(cache_dir: PathBuf) -> anyhow::Result<Self> {
        let mut config = Config::new();
        config
            .strategy(Strategy::Cranelift)
            .epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| anyhow::anyhow!("wasm engine: {e}"))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("link WASI: {e}"))?;
        let mut http_linker = linker.clone();
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut http_linker)
            .map_err(|e| anyhow::anyhow!("link wasi:http: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = {
            let engine = engine.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("runtime-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_TICK);
                        engine.increment_epoch();
                    }
                })?
        };
        Ok(Self {
            engine,
            linker,
            http_linker,
            cache_dir,
            prepared: Mutex::default(),
            ticker: Some((stop, ticker)),
        })
    }

    /// The component at `path` whose digest is `digest`, compiled (or loaded from the
    /// cache) and linked as its exports say. Blocking (up to a compilation).
    pub(crate) fn prepare(&self, digest: &str, path: &Path) -> Result<Prepared, Status> {
        if let Some(prepared) = self.lock_prepared().get(digest) {
            return Ok(prepared.clone());
        }
        let wasm = std::fs::read(path).map_err(|e| {
            Status::not_found(format!(
                "image {digest}: cannot read {}: {e}",
                path.display()
            ))
        })?;
        if let Err(e) = std::fs::create_dir_all(&self.cache_dir) {
            tracing::warn!(dir = %self.cache_dir.display(), error = %e, "cannot create the compiled-component cache");
        }
        let component: Component = trellis_plugin_host::PluginHost::compile_cached(
            &self.engine,
            &wasm,
            digest,
            &self.cache_dir,
        )
        .map_err(|e| {
            Status::invalid_argument(format!(
                "image {digest} is not a valid component: {}",
                first_line(&format!("{e:#}"))
            ))
        })?;
        let exports: Vec<String> = component
            .component_type()
            .exports(&self.engine)
            .map(|(name, _)| name.to_string())
            .collect();
        let exports_one = |prefix: &str| exports.iter().any(|e| e.starts_with(prefix));
        let prepared = if exports_one(RUN_EXPORT) {
            self.linker
                .instantiate_pre(&component)
                .and_then(CommandPre::new)
                .map(Prepared::Program)
                .map_err(|e| {
                    Status::failed_precondition(format!(
                        "image {digest} cannot run as a program (a component exporting wasi:cli/run and importing only WASI): {}",
                        first_line(&format!("{e:#}"))
                    ))
                })?
        } else if exports_one(HANDLER_EXPORT) {
            self.http_linker
                .instantiate_pre(&component)
                .and_then(ProxyPre::new)
                .map(Prepared::Handler)
                .map_err(|e| {
                    Status::failed_precondition(format!(
                        "image {digest} cannot serve HTTP (a component exporting wasi:http/incoming-handler and importing only WASI and wasi:http): {}",
                        first_line(&format!("{e:#}"))
                    ))
                })?
        } else {
            return Err(Status::failed_precondition(format!(
                "image {digest} exports neither wasi:cli/run (a program) nor wasi:http/incoming-handler (an HTTP handler); its exports: {}",
                if exports.is_empty() {
                    "none".to_string()
                } else {
                    exports.join(", ")
                }
            )));
        };
        self.lock_prepared()
            .insert(digest.to_string(), prepared.clone());
        Ok(prepared)
    }

    fn lock_prepared(&self) -> std::sync::MutexGuard<'_, HashMap<String, Prepared>> {
        self.prepared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `record`'s component: a program on a thread of its own, an HTTP handler
    /// listening on `node_ip`. Called with the tables locked, so the thread cannot
    /// record its end before the start is recorded.
    pub(crate) fn start(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        prepared: Prepared,
        log: Option<Arc<LogFile>>,
        node_ip: IpAddr,
    ) -> Result<Live, Status> {
        match prepared {
            Prepared::Program(program) => self.start_program(state, record, program, log),
            Prepared::Handler(pre) => crate::proxy::start(
                crate::proxy::Handler::new(&self.engine, record, pre, log)?,
                state,
                node_ip,
            ),
        }
    }

    fn start_program(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        program: CommandPre<Workload>,
        log: Option<Arc<LogFile>>,
    ) -> Result<Live, Status> {
        let wasi = WasiConfig::of(record).context(log.clone())?;
        let memory = Arc::new(AtomicU64::new(0));
        let cancel = Arc::new(Cancel::default());
        let store = new_store(
            &self.engine,
            wasi,
            memory_limit(record),
            memory.clone(),
            cancel.clone(),
        );
        let (exited, _) = watch::channel(false);
        let id = record.id.clone();
        let state = state.clone();
        let thread_cancel = cancel.clone();
        std::thread::Builder::new()
            .name(format!("wasm-{}", id.get(..12).unwrap_or(&id)))
            .spawn(move || {
                let exit = run(store, program, &thread_cancel);
                state.finish(&id, exit);
            })
            .map_err(|e| Status::internal(format!("cannot start a thread: {e}")))?;
        Ok(Live {
            exited,
            stop: Stopper::Wasm(cancel),
            log,
            tasks: Vec::new(),
            memory: Some(memory),
        })
    }
}

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
        }
    }

    /// A WASI context granting the container's arguments, environment and mounts, its
    /// output into `log`, and no sockets.
    pub(crate) fn context(&self, log: Option<Arc<LogFile>>) -> Result<WasiCtx, Status> {
        let mut wasi = WasiCtxBuilder::new();
        wasi.args(&self.argv)
            .envs(&self.envs)
            .stdout(LogStream::new(Stream::Stdout, log.clone()))
            .stderr(LogStream::new(Stream::Stderr, log))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
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

/// A store for one instance: its memory held to `limit` and counted into `memory`
/// (the container's, over all of its instances), its guest code stopped once
/// `cancel`'s flag is set.
pub(crate) fn new_store(
    engine: &Engine,
    wasi: WasiCtx,
    limit: Option<usize>,
    memory: Arc<AtomicU64>,
    cancel: Arc<Cancel>,
) -> Store<Workload> {
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
        },
    );
    store.limiter(|w| &mut w.limits);
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(|ctx| {
        if ctx.data().cancel.flag.load(Ordering::Relaxed) {
            wasmtime::bail!("stopped");
        }
        Ok(UpdateDeadline::Yield(1))
    });
    store
}

impl Drop for WasmHost {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.ticker.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
    }
}

/// Runs the program to its end on this thread and says how it ended.
fn run(mut store: Store<Workload>, program: CommandPre<Workload>, cancel: &Cancel) -> Exit {
    // WASI's host side is async (Tokio): a small executor of this thread's own keeps
    // a guest's work off the runtime's gRPC threads.
    let executor = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(executor) => executor,
        Err(e) => {
            return Exit {
                code: 1,
                reason: "Error",
                message: format!("cannot start an executor: {e}"),
            };
        }
    };
    let outcome = executor.block_on(async {
        tokio::select! {
            // A guest waiting in a host call (a sleep) never reaches an epoch check.
            () = cancel.notify.notified() => None,
            result = async {
                let command = program.instantiate_async(&mut store).await?;
                command.wasi_cli_run().call_run(&mut store).await
            } => Some(result),
        }
    });
    let oom = store.data().limits.hit;
    let limit = store.data().limits.limit;
    // The output streams' tasks end with the executor: lines still buffered (a last
    // line without a newline) are written before the exit is recorded.
    drop(store);
    drop(executor);
    let stopped = || Exit {
        code: 137,
        reason: "Error",
        message: "stopped (a WebAssembly program has no signal handler: it is cancelled at once)"
            .into(),
    };
    match outcome {
        None => stopped(),
        Some(Ok(Ok(()))) => Exit::code(0),
        Some(Ok(Err(()))) => Exit::code(1),
        Some(Err(e)) => {
            if let Some(exit) = e.downcast_ref::<I32Exit>() {
                Exit::code(exit.0)
            } else if cancel.flag.load(Ordering::Relaxed) {
                stopped()
            } else if oom {
                Exit {
                    code: 137,
                    reason: "OOMKilled",
                    message: format!(
                        "linear memory would exceed the container's limit of {} bytes",
                        limit.unwrap_or_default()
                    ),
                }
            } else {
                Exit {
                    code: 1,
                    reason: "Error",
                    message: trap_message(&e),
                }
            }
        }
    }
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

/// An instance's memory limit over all of its linear memories together.
pub(crate) struct MemoryLimits {
    pub(crate) limit: Option<usize>,
    /// Bytes this store's memories hold.
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

    fn table_growing(
        &mut self,
        _current: usize,
        _desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
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
            component: Some(component),
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
            .component
            .ok_or_else(|| Status::internal("the component was not compiled"))?;
        let live = self
            .host
            .start(state, record, component, prepared.log, self.node_ip)?;
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

    fn usage(&self, live: &Live) -> (Option<u64>, Option<u64>) {
        let memory = live
            .memory
            .as_ref()
            .map_or(0, |m| m.load(Ordering::Relaxed));
        (None, Some(memory))
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
