//! The `wasmtime` handler: a container is a WebAssembly component exporting
//! `wasi:cli/run`, run as a program on an OS thread of its own.
//!
//! Workloads have their own engine (Cranelift, epoch interruption, no pooling): they
//! must not take the plugin host's instance slots. Compiled code is cached on disk by
//! content digest through the plugin host's cache (whose file names carry the engine's
//! compatibility hash), and in memory per digest, so a second container of an image
//! neither recompiles nor reloads it.
//!
//! WASI grants exactly the container's arguments and environment, a preopened
//! directory per mount (read-only when the mount is), stdout and stderr into the log,
//! clocks and randomness; no sockets, no name lookup, no stdin. A WASM program has no
//! signal handler: a stop cancels it at once, whatever the grace period.

use std::collections::HashMap;
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
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::log::{Lines, LogFile, Stream};
use crate::state::{Cancel, ContainerRecord, Exit, Live, State, Stopper};

/// How often the epoch advances: how long guest code runs before it checks whether
/// it was stopped (and yields its thread's executor to host work).
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Frames of a trap's WASM backtrace kept in the container's status message.
const TRAP_FRAMES: usize = 6;

pub(crate) struct WasmHost {
    engine: Engine,
    linker: Linker<Workload>,
    cache_dir: PathBuf,
    /// Programs ready to instantiate, by image digest.
    programs: Mutex<HashMap<String, CommandPre<Workload>>>,
    ticker: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
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
            cache_dir,
            programs: Mutex::default(),
            ticker: Some((stop, ticker)),
        })
    }

    /// The program of the component at `path` whose digest is `digest`: compiled or
    /// loaded from the cache. Blocking (up to a compilation).
    pub(crate) fn program(
        &self,
        digest: &str,
        path: &Path,
    ) -> Result<CommandPre<Workload>, Status> {
        if let Some(pre) = self.lock_programs().get(digest) {
            return Ok(pre.clone());
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
        let pre = self
            .linker
            .instantiate_pre(&component)
            .and_then(CommandPre::new)
            .map_err(|e| {
                Status::failed_precondition(format!(
                    "image {digest} cannot run as a program (a component exporting wasi:cli/run and importing only WASI): {}",
                    first_line(&format!("{e:#}"))
                ))
            })?;
        self.lock_programs().insert(digest.to_string(), pre.clone());
        Ok(pre)
    }

    fn lock_programs(&self) -> std::sync::MutexGuard<'_, HashMap<String, CommandPre<Workload>>> {
        self.programs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `record`'s program on a thread of its own. Called with the tables
    /// locked, so the thread cannot record its end before the start is recorded.
    pub(crate) fn start(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        program: CommandPre<Workload>,
        log: Option<Arc<LogFile>>,
    ) -> Result<Live, Status> {
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
        let envs: Vec<(&str, &str)> = config
            .envs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_str()))
            .collect();
        let mut wasi = WasiCtxBuilder::new();
        wasi.args(&argv)
            .envs(&envs)
            .stdout(LogStream::new(Stream::Stdout, log.clone()))
            .stderr(LogStream::new(Stream::Stderr, log.clone()))
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        for mount in &config.mounts {
            let perms = if mount.readonly {
                FsPerms::ReadOnly
            } else {
                FsPerms::ReadWrite
            };
            wasi.preopened_dir(&mount.host_path, &mount.container_path, perms)
                .map_err(|e| {
                    Status::failed_precondition(format!(
                        "container {}: cannot mount {} at {}: {e}",
                        record.id, mount.host_path, mount.container_path
                    ))
                })?;
        }
        if !config.working_dir.is_empty() {
            wasi.initial_cwd(&config.working_dir);
        }
        let limit = config
            .linux
            .as_ref()
            .and_then(|l| l.resources.as_ref())
            .map(|r| r.memory_limit_in_bytes)
            .filter(|&l| l > 0)
            .and_then(|l| usize::try_from(l).ok());
        let memory = Arc::new(AtomicU64::new(0));
        let cancel = Arc::new(Cancel::default());
        let mut store = Store::new(
            &self.engine,
            Workload {
                wasi: wasi.build(),
                table: ResourceTable::new(),
                limits: MemoryLimits {
                    limit,
                    used: memory.clone(),
                    hit: false,
                },
                cancel: cancel.clone(),
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
fn trap_message(e: &wasmtime::Error) -> String {
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

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// What a workload's store holds.
pub(crate) struct Workload {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: MemoryLimits,
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

/// The container's memory limit over all of its linear memories together.
struct MemoryLimits {
    limit: Option<usize>,
    used: Arc<AtomicU64>,
    /// Whether a growth was refused: the trap that follows is an OOM kill.
    hit: bool,
}

impl ResourceLimiter for MemoryLimits {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let used = self.used.load(Ordering::Relaxed) as usize;
        let total = used.saturating_sub(current).saturating_add(desired);
        if let Some(limit) = self.limit
            && total > limit
        {
            self.hit = true;
            wasmtime::bail!("memory limit of {limit} bytes reached (growing to {total} bytes)");
        }
        self.used.store(total as u64, Ordering::Relaxed);
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
