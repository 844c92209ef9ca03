//! The engines every plugin shares, their linkers, the compiled-component cache, the
//! background compiler that moves plugins to optimized code, and the epoch ticker.

use std::any::TypeId;
use std::collections::HashMap;
use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Strategy};

use trellis_oci::write_whole;

use crate::calls::CallThreads;
use crate::plugin::{LoadError, LoadErrorReason, Plugin};
use crate::pool::Pool;
use crate::state::PluginState;
use crate::world::World;

#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Where compiled components are kept, named by content digest; `None` compiles
    /// every load.
    pub cache_dir: Option<PathBuf>,
    /// How often the epoch advances: the granularity of deadlines.
    pub epoch_tick: Duration,
    /// Instances of optimized code that may exist at once, over all plugins (pooling
    /// allocator slots). Each plugin keeps at most its share of them idle; a call that
    /// finds none free takes back another plugin's idle instance or waits for one
    /// within its deadline.
    pub max_instances: u32,
    /// The largest linear memory any plugin may be given, in bytes (each plugin's
    /// own limit is enforced below it).
    pub max_memory: usize,
    /// Which compilers turn a module into machine code.
    pub compilers: Compilers,
    /// Threads that run guest code (instantiations and calls), apart from the
    /// callers' async runtime: a guest computing until its deadline holds one of
    /// these, never a thread serving HTTP or watches. Defaults to one per core.
    pub call_threads: usize,
}

/// Which compilers a host uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compilers {
    /// A module not in the cache is compiled by Winch, a single-pass compiler (a
    /// fraction of a second where Cranelift may take seconds), and serves at once;
    /// Cranelift compiles it again on a background thread, one module at a time, and
    /// the plugin moves to the optimized code when it is ready. A cached module is
    /// optimized from the start.
    Tiered,
    /// Cranelift only: the first load waits for the optimized code.
    Optimized,
    /// Winch only, never moved to optimized code (for tests of the baseline tier).
    Baseline,
}

/// The compiler that produced the code a plugin runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Winch's code: compiled fast, runs slower.
    Baseline,
    /// Cranelift's code, as cached on disk.
    Optimized,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Optimized => "optimized",
        }
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            cache_dir: None,
            epoch_tick: Duration::from_millis(10),
            max_instances: 1_000,
            max_memory: 1 << 30,
            compilers: Compilers::Tiered,
            call_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// An engine and the linkers that bind components compiled by it.
pub(crate) struct Compiler {
    pub(crate) engine: Engine,
    /// One linker per world, made on its first load: WASI with nothing granted, the
    /// shared imports, and the world's own, so a plugin can link only its world's.
    linkers: Mutex<HashMap<TypeId, Arc<Linker<PluginState>>>>,
    pub(crate) tier: Tier,
}

impl Compiler {
    fn new(wasm: &Config, tier: Tier) -> anyhow::Result<Self> {
        let engine = Engine::new(wasm).map_err(|e| anyhow::anyhow!("wasm engine: {e}"))?;
        Ok(Self {
            engine,
            linkers: Mutex::default(),
            tier,
        })
    }

    /// The linker of world `W`.
    pub(crate) fn linker<W: World>(&self) -> wasmtime::Result<Arc<Linker<PluginState>>> {
        let mut linkers = self.linkers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(linker) = linkers.get(&TypeId::of::<W>()) {
            return Ok(linker.clone());
        }
        let mut linker = Linker::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        crate::imports::add_to_linker(&mut linker)?;
        W::add_to_linker(&mut linker)?;
        let linker = Arc::new(linker);
        linkers.insert(TypeId::of::<W>(), linker.clone());
        Ok(linker)
    }
}

/// A plugin serving baseline code, waiting for its optimized code.
struct TierUp {
    plugin: Weak<Plugin>,
    digest: String,
    wasm: Arc<Vec<u8>>,
}

/// The engines and linkers for all plugins.
pub struct PluginHost {
    /// Cranelift, pooled instances, the disk cache.
    pub(crate) optimized: Compiler,
    /// Winch, instances allocated on demand (they live until the optimized code is
    /// ready); `None` unless [`Compilers::Tiered`] or [`Compilers::Baseline`].
    baseline: Option<Compiler>,
    pub(crate) config: HostConfig,
    /// The pooling allocator's slots, as the plugins share them.
    pub(crate) pool: Arc<Pool>,
    /// Where guest code runs.
    pub(crate) calls: CallThreads,
    /// Hands plugins serving baseline code to the background compiler thread.
    tier_up: Mutex<Option<mpsc::Sender<TierUp>>>,
    ticker: Option<Ticker>,
    /// The compiled modules plugins run, by tier and digest: plugins of the same
    /// module (say one policy configured twice) share one copy of its machine code
    /// instead of each mapping its own, which keeps the code's footprint in the CPU's
    /// caches, TLBs and branch predictors that of one module.
    loaded: Mutex<HashMap<(Tier, String), Weak<Component>>>,
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
            .strategy(Strategy::Cranelift)
            // With a baseline tier, Cranelift works in the background: one thread, so
            // that the plugins serving meanwhile keep a core and their deadlines.
            .parallel_compilation(config.compilers == Compilers::Optimized)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let optimized = Compiler::new(&wasm, Tier::Optimized)?;
        let baseline = match config.compilers {
            Compilers::Optimized => None,
            Compilers::Tiered | Compilers::Baseline => {
                let mut wasm = Config::new();
                wasm.epoch_interruption(true)
                    .wasm_component_model(true)
                    .strategy(Strategy::Winch);
                Some(Compiler::new(&wasm, Tier::Baseline)?)
            }
        };
        if let Some(dir) = &config.cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("plugin cache {}: {e}", dir.display()))?;
        }
        let mut engines = vec![optimized.engine.clone()];
        engines.extend(baseline.as_ref().map(|b| b.engine.clone()));
        let ticker = Ticker::start(engines, config.epoch_tick)?;
        let calls = CallThreads::start(config.call_threads)
            .map_err(|e| anyhow::anyhow!("plugin call threads: {e}"))?;
        let (tx, rx) = mpsc::channel();
        let host = Arc::new_cyclic(|host: &Weak<Self>| {
            if config.compilers == Compilers::Tiered {
                TierUpThread::start(host.clone(), rx);
            }
            Self {
                optimized,
                baseline,
                pool: Pool::new(config.max_instances),
                calls,
                config,
                tier_up: Mutex::new(Some(tx)),
                ticker: Some(ticker),
                loaded: Mutex::default(),
            }
        });
        Ok(host)
    }

    /// The code to serve `wasm` with now: `current` (the running version's compiled
    /// module, when it is the same module) unless it is baseline code and the optimized
    /// code is loaded or cached by now; else optimized code another plugin runs or from
    /// the cache, else the baseline tier's (when there is one and it compiles the
    /// module), else optimized. Blocking: milliseconds from the cache or Winch, up to
    /// seconds from Cranelift.
    pub(crate) fn compile(
        &self,
        wasm: &[u8],
        digest: &str,
        current: Option<(Arc<Component>, Tier)>,
    ) -> Result<(Arc<Component>, &Compiler), LoadError> {
        if let Some((component, Tier::Optimized)) = current {
            return Ok((component, &self.optimized));
        }
        if let Some(component) = self.in_use(Tier::Optimized, digest) {
            return Ok((component, &self.optimized));
        }
        let path = self.cache_path(digest);
        if let Some(component) = path.as_deref().and_then(|p| self.cached_at(p)) {
            return Ok((
                self.share(Tier::Optimized, digest, component),
                &self.optimized,
            ));
        }
        if let Some((component, tier)) = current {
            return Ok((component, self.compiler(tier)));
        }
        if let Some(baseline) = &self.baseline {
            if let Some(component) = self.in_use(Tier::Baseline, digest) {
                return Ok((component, baseline));
            }
            match Component::new(&baseline.engine, wasm) {
                Ok(component) => {
                    return Ok((self.share(Tier::Baseline, digest, component), baseline));
                }
                // Winch lacks a few proposals (tail calls, exceptions, GC);
                // Cranelift gets the last word on whether the module is valid.
                Err(e) if self.config.compilers == Compilers::Tiered => {
                    tracing::debug!(error = %first_line(&format!("{e:#}")), "baseline compiler declined a module");
                }
                Err(e) => return Err(compile_error(e)),
            }
        }
        Ok((
            self.compile_optimized(wasm, digest, path.as_deref())?,
            &self.optimized,
        ))
    }

    /// How many compiled modules the loaded plugins run between them (a module
    /// counts once however many plugins run it, and once per tier while it moves).
    pub fn modules_loaded(&self) -> usize {
        let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.values().filter(|c| c.strong_count() > 0).count()
    }

    /// The compiled module of `digest` at `tier`, if a plugin runs it.
    fn in_use(&self, tier: Tier, digest: &str) -> Option<Arc<Component>> {
        let loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.get(&(tier, digest.to_owned()))?.upgrade()
    }

    /// Records `component` as the module of `digest` at `tier`, for the next plugin
    /// of the same module. Two loads compiling the same module at once each keep
    /// their own copy; the later one is shared from then on.
    fn share(&self, tier: Tier, digest: &str, component: Component) -> Arc<Component> {
        let component = Arc::new(component);
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|_, c| c.strong_count() > 0);
        loaded.insert((tier, digest.to_owned()), Arc::downgrade(&component));
        component
    }

    /// The compiler (engine and linker) of code of `tier`.
    pub(crate) fn compiler(&self, tier: Tier) -> &Compiler {
        match (tier, &self.baseline) {
            (Tier::Baseline, Some(baseline)) => baseline,
            _ => &self.optimized,
        }
    }

    /// Where the optimized code of the module `digest` names is cached, if there is
    /// a cache.
    fn cache_path(&self, digest: &str) -> Option<PathBuf> {
        let dir = self.config.cache_dir.as_ref()?;
        Some(cache_file(&self.optimized.engine, dir, digest))
    }

    /// `engine`'s code for the component `wasm` (whose digest is `digest`): from the
    /// cache in `dir` when there, else compiled and cached there. For hosts of other
    /// components that keep an engine of their own (the container runtime's workloads
    /// must not take plugin slots) but share the cache: a file's name carries its
    /// engine's compatibility hash, so engines configured differently never read each
    /// other's code.
    pub fn compile_cached(
        engine: &Engine,
        wasm: &[u8],
        digest: &str,
        dir: &Path,
    ) -> wasmtime::Result<Component> {
        let path = cache_file(engine, dir, digest);
        if path.exists() {
            match deserialize_cached(engine, &path) {
                Ok(component) => return Ok(component),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "recompiling a bad cached component");
                }
            }
        }
        let compiled = engine.precompile_component(wasm)?;
        match write_whole(&path, &compiled) {
            Ok(()) => deserialize_cached(engine, &path),
            Err(e) => {
                // The cache only saves time: a full or read-only disk must not stop a load.
                tracing::warn!(path = %path.display(), error = %e, "cannot cache a compiled component");
                Component::new(engine, wasm)
            }
        }
    }

    fn cached_at(&self, path: &Path) -> Option<Component> {
        if !path.exists() {
            return None;
        }
        match deserialize_cached(&self.optimized.engine, path) {
            Ok(component) => Some(component),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "recompiling a bad cached plugin");
                None
            }
        }
    }

    /// Cranelift's code for `wasm`: another plugin's, from the cache at `path`, or
    /// compiled (and then cached there).
    fn compile_optimized(
        &self,
        wasm: &[u8],
        digest: &str,
        path: Option<&Path>,
    ) -> Result<Arc<Component>, LoadError> {
        if let Some(component) = self.in_use(Tier::Optimized, digest) {
            return Ok(component);
        }
        let engine = &self.optimized.engine;
        let component = match path {
            None => Component::new(engine, wasm).map_err(compile_error)?,
            // Another load of the same module may have compiled it meanwhile.
            Some(path) => match self.cached_at(path) {
                Some(component) => component,
                None => {
                    let compiled = engine.precompile_component(wasm).map_err(compile_error)?;
                    match write_whole(path, &compiled) {
                        Ok(()) => deserialize_cached(engine, path).map_err(compile_error)?,
                        Err(e) => {
                            // The cache only saves time: a full or read-only disk must
                            // not stop a load.
                            tracing::warn!(path = %path.display(), error = %e, "cannot cache a compiled plugin");
                            Component::new(engine, wasm).map_err(compile_error)?
                        }
                    }
                }
            },
        };
        Ok(self.share(Tier::Optimized, digest, component))
    }

    /// Has the background thread compile `plugin`'s module with Cranelift and move the
    /// plugin to that code (unless the plugin is gone by then).
    pub(crate) fn queue_tier_up(&self, plugin: &Arc<Plugin>, wasm: Arc<Vec<u8>>) {
        let job = TierUp {
            plugin: Arc::downgrade(plugin),
            digest: plugin.digest().to_owned(),
            wasm,
        };
        if let Ok(tx) = self.tier_up.lock()
            && let Some(tx) = tx.as_ref()
        {
            let _ = tx.send(job);
        }
    }

    /// One job of the background thread.
    fn tier_up(&self, job: TierUp) {
        if job.plugin.strong_count() == 0 {
            // Replaced or removed before its turn came.
            return;
        }
        let started = Instant::now();
        let path = self.cache_path(&job.digest);
        let component = match self.compile_optimized(&job.wasm, &job.digest, path.as_deref()) {
            Ok(component) => component,
            Err(e) => {
                tracing::warn!(digest = %job.digest, error = %e.message, "optimizing a plugin failed; it keeps its baseline code");
                return;
            }
        };
        let Some(plugin) = job.plugin.upgrade() else {
            return;
        };
        match plugin.promote(&self.optimized, &component) {
            Ok(()) => tracing::info!(
                plugin = %plugin.name(),
                digest = %plugin.digest(),
                compile_ms = started.elapsed().as_millis() as u64,
                "plugin moved to optimized code"
            ),
            Err(e) => tracing::warn!(
                plugin = %plugin.name(),
                error = %e.message,
                "optimized code of a plugin did not link; it keeps its baseline code"
            ),
        }
    }
}

/// The background compiler: optimizes one plugin at a time, until the host is gone.
struct TierUpThread;

impl TierUpThread {
    fn start(host: Weak<PluginHost>, jobs: mpsc::Receiver<TierUp>) {
        let spawned = std::thread::Builder::new()
            .name("plugin-optimize".into())
            .spawn(move || {
                // Not joined: a host dropped mid-compile lets the thread finish its
                // job and end, instead of making the drop wait seconds.
                while let Ok(job) = jobs.recv() {
                    let Some(host) = host.upgrade() else {
                        return;
                    };
                    host.tier_up(job);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no background compiler thread: plugins keep their baseline code");
        }
    }
}

impl Drop for PluginHost {
    fn drop(&mut self) {
        // Ends the background compiler after its current job.
        if let Ok(mut tx) = self.tier_up.lock() {
            tx.take();
        }
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

/// Where `engine`'s code of the module `digest` names is cached in `dir`.
fn cache_file(engine: &Engine, dir: &Path, digest: &str) -> PathBuf {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let hex = digest.trim_start_matches("sha256:");
    dir.join(format!("{hex}-{:016x}.cwasm", hasher.finish()))
}

/// Advances the engines' epochs from an OS thread, so a spinning guest on the async
/// runtime cannot starve the clock that stops it.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Ticker {
    fn start(engines: Vec<Engine>, tick: Duration) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    for engine in &engines {
                        engine.increment_epoch();
                    }
                }
            })?;
        Ok(Self { stop, thread })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}
