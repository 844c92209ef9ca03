//! The `wasmtime` handler's engine: Cranelift with epoch interruption, a linker per
//! kind of component, and components compiled once per image digest (cached on disk
//! through the plugin host's cache, and in memory linked and ready to instantiate).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tonic::Status;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Strategy};
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi_http::p2::bindings::ProxyPre;

use super::usage::Registry;
use super::workload::{Workload, first_line};

/// How often the epoch advances: how long guest code runs before it checks whether
/// it was stopped, charges its CPU time to its limit (and yields its thread's
/// executor to host work). A CPU limit's period may overrun by up to a tick, paid
/// back in the next ones; a check costs a read of the thread's CPU clock.
const EPOCH_TICK: Duration = Duration::from_millis(10);
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
    /// The running containers' usage.
    usages: Registry,
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
            usages: Registry::default(),
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

    /// The running containers' usage, by their memory counter.
    pub(crate) fn usages(&self) -> &Registry {
        &self.usages
    }

    /// The engine every workload's store is made in.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
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
