//! The engine every plugin shares, its linker, the compiled-component cache and the
//! epoch ticker.

use std::hash::{Hash as _, Hasher as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::bindings;
use crate::plugin::{LoadError, LoadErrorReason, PluginState};

#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Where compiled components are kept, named by content digest; `None` compiles
    /// every load.
    pub cache_dir: Option<PathBuf>,
    /// How often the epoch advances: the granularity of deadlines.
    pub epoch_tick: Duration,
    /// Instances that may exist at once, over all plugins (pooling allocator slots).
    pub max_instances: u32,
    /// The largest linear memory any plugin may be given, in bytes (each plugin's
    /// own limit is enforced below it).
    pub max_memory: usize,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            cache_dir: None,
            epoch_tick: Duration::from_millis(10),
            max_instances: 1_000,
            max_memory: 1 << 30,
        }
    }
}

/// One engine and linker for all plugins.
pub struct PluginHost {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<PluginState>,
    pub(crate) config: HostConfig,
    ticker: Option<Ticker>,
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PluginHost {
    pub fn new(config: HostConfig) -> anyhow::Result<Arc<Self>> {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(config.max_instances)
            // Components from other languages bring several core modules, memories
            // and tables (a Python component has a dozen core instances).
            .total_core_instances(config.max_instances.saturating_mul(4))
            .total_memories(config.max_instances.saturating_mul(2))
            .total_tables(config.max_instances.saturating_mul(2))
            .total_stacks(config.max_instances)
            .max_core_instances_per_component(64)
            .max_memories_per_component(8)
            .max_tables_per_component(16)
            .max_component_instance_size(1 << 20)
            .max_core_instance_size(1 << 20)
            .table_elements(200_000)
            .max_memory_size(config.max_memory);
        let mut wasm = Config::new();
        wasm.epoch_interruption(true)
            .wasm_component_model(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&wasm).map_err(|e| anyhow::anyhow!("wasm engine: {e}"))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("linking WASI: {e}"))?;
        bindings::admission::Admission::add_to_linker::<PluginState, HasSelf<PluginState>>(
            &mut linker,
            |state| state,
        )
        .map_err(|e| anyhow::anyhow!("linking the plugin imports: {e}"))?;
        if let Some(dir) = &config.cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("plugin cache {}: {e}", dir.display()))?;
        }
        let ticker = Ticker::start(engine.clone(), config.epoch_tick)?;
        Ok(Arc::new(Self {
            engine,
            linker,
            config,
            ticker: Some(ticker),
        }))
    }

    /// Compiles `wasm` (or loads it from the cache). Blocking: tens of milliseconds
    /// for a small Rust component, seconds for a large Python one.
    pub fn compile(&self, wasm: &[u8]) -> Result<Component, LoadError> {
        let digest = digest_of(wasm);
        let Some(dir) = &self.config.cache_dir else {
            return Component::new(&self.engine, wasm).map_err(compile_error);
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.engine
            .precompile_compatibility_hash()
            .hash(&mut hasher);
        let hex = digest.trim_start_matches("sha256:");
        let path = dir.join(format!("{hex}-{:016x}.cwasm", hasher.finish()));
        if path.exists() {
            match deserialize_cached(&self.engine, &path) {
                Ok(component) => return Ok(component),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "recompiling a bad cached plugin");
                }
            }
        }
        let compiled = self
            .engine
            .precompile_component(wasm)
            .map_err(compile_error)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::write(&tmp, &compiled).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            // The cache only saves time: a full or read-only disk must not stop a load.
            tracing::warn!(path = %path.display(), error = %e, "cannot cache a compiled plugin");
            let _ = std::fs::remove_file(&tmp);
            return Component::new(&self.engine, wasm).map_err(compile_error);
        }
        deserialize_cached(&self.engine, &path).map_err(compile_error)
    }
}

impl Drop for PluginHost {
    fn drop(&mut self) {
        if let Some(ticker) = self.ticker.take() {
            ticker.stop();
        }
    }
}

fn compile_error(e: wasmtime::Error) -> LoadError {
    LoadError {
        reason: LoadErrorReason::CompileFailed,
        message: format!("not a valid component: {}", first_line(&format!("{e:#}"))),
    }
}

pub(crate) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

#[allow(unsafe_code)]
fn deserialize_cached(engine: &Engine, path: &std::path::Path) -> wasmtime::Result<Component> {
    // SAFETY: `deserialize_file` trusts the file to be wasmtime's own output for this
    // engine. The cache directory lies inside the server's data directory, which only
    // the server writes; files are written whole under a temporary name and renamed,
    // and their names carry the engine's compatibility hash, so a file from another
    // wasmtime build or configuration is never opened.
    unsafe { Component::deserialize_file(engine, path) }
}

/// `sha256:<hex>` of a module's bytes: how a plugin version is named.
pub fn digest_of(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest.as_ref() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Advances the engine's epoch from an OS thread, so a spinning guest on the async
/// runtime cannot starve the clock that stops it.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Ticker {
    fn start(engine: Engine, tick: Duration) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    engine.increment_epoch();
                }
            })?;
        Ok(Self { stop, thread })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}
