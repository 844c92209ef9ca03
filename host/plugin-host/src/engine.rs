//! [`PluginHost`]: the engines every plugin shares, loading a plugin (compile, link,
//! start an instance that checks its configuration), the compiled modules plugins
//! share, and the background compiler that moves plugins to optimized code.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak, mpsc};
use std::time::{Duration, Instant};

use wasmtime::component::Component;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Strategy};

use trellis_oci::digest_of;

use crate::call_threads::CallThreads;
use crate::compiler::{Compiler, Tier, cache_file, cached, cached_or_compiled, compile_error};
use crate::epoch::Ticker;
use crate::error::{LoadError, LoadErrorReason, first_line};
use crate::grants::{ClusterReader, ControllerHost, Grants};
use crate::metrics::PluginMetrics;
use crate::plugin::{Code, Plugin, PluginSpec};
use crate::pool::Pool;
use crate::world::admission::Admission;
use crate::world::controller::Controller;
use crate::world::initializer::Initializer;
use crate::world::scheduler::Scheduler;
use crate::world::{PluginKind, World};

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
/// A plugin serving baseline code, waiting for its optimized code.
struct TierUp {
    plugin: Weak<Plugin>,
    digest: String,
    wasm: Arc<Vec<u8>>,
}

/// The engines and linkers for all plugins.
pub struct PluginHost {
    /// Cranelift, pooled instances, the disk cache.
    optimized: Compiler,
    /// Winch, instances allocated on demand (they live until the optimized code is
    /// ready); `None` unless [`Compilers::Tiered`] or [`Compilers::Baseline`].
    baseline: Option<Compiler>,
    config: HostConfig,
    /// The pooling allocator's slots, as the plugins share them.
    pool: Arc<Pool>,
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
    fn compile(
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
        if let Some(component) = path
            .as_deref()
            .and_then(|p| cached(&self.optimized.engine, p))
        {
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
    fn compiler(&self, tier: Tier) -> &Compiler {
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
        cached_or_compiled(engine, wasm, &cache_file(engine, dir, digest))
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
            Some(path) => cached_or_compiled(engine, wasm, path).map_err(compile_error)?,
        };
        Ok(self.share(Tier::Optimized, digest, component))
    }

    /// Compiles (or takes from the cache) and links `wasm` for `spec`, starts one
    /// instance and has it check its configuration. Blocking work runs off the async
    /// runtime, guest code on the host's call threads.
    pub async fn load(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        cluster: Option<Arc<dyn ClusterReader>>,
    ) -> Result<Arc<Plugin>, LoadError> {
        self.load_counting(spec, wasm, Grants::cluster(cluster), None, None)
            .await
    }

    /// Loads a controller plugin (kind [`PluginKind::Controller`]), its imports served
    /// by `controller`: its cache reads (and `trellis:core/cluster` reads), its writes
    /// and its events. `previous`, when given, is the version it replaces, whose
    /// metrics it goes on counting into.
    pub async fn load_controller(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        controller: Arc<dyn ControllerHost>,
        previous: Option<&Plugin>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let metrics = previous
            .filter(|p| p.kind() == spec.kind)
            .map(|p| p.metrics.clone());
        let grants = Grants {
            cluster: Some(controller.clone()),
            controller: Some(controller),
        };
        self.load_counting(spec, wasm, grants, metrics, previous)
            .await
    }

    /// Loads a new version of `previous`, as [`PluginHost::load`] does. The new
    /// version counts into the same metrics as the old one (when both are of the same
    /// kind): calls still in flight on the old version after the swap, and everything
    /// before it, stay in the plugin's counters instead of vanishing with the version.
    pub async fn reload(
        self: &Arc<Self>,
        previous: &Plugin,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        cluster: Option<Arc<dyn ClusterReader>>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let metrics = (previous.kind() == spec.kind).then(|| previous.metrics.clone());
        let grants = Grants {
            cluster,
            controller: previous.grants().controller.clone(),
        };
        self.load_counting(spec, wasm, grants, metrics, Some(previous))
            .await
    }

    /// Picks the world of `spec.kind`, then loads as [`PluginHost::load_world`] does.
    async fn load_counting(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        grants: Grants,
        metrics: Option<Arc<PluginMetrics>>,
        previous: Option<&Plugin>,
    ) -> Result<Arc<Plugin>, LoadError> {
        match spec.kind {
            PluginKind::Mutating | PluginKind::Validating => {
                self.load_world::<Admission>(spec, wasm, grants, metrics, previous)
                    .await
            }
            PluginKind::Initializer => {
                self.load_world::<Initializer>(spec, wasm, grants, metrics, previous)
                    .await
            }
            PluginKind::Controller => {
                self.load_world::<Controller>(spec, wasm, grants, metrics, previous)
                    .await
            }
            PluginKind::Scheduler => {
                self.load_world::<Scheduler>(spec, wasm, grants, metrics, previous)
                    .await
            }
        }
    }

    /// Compiles off the async runtime (or takes `previous`'s compiled module when it
    /// is the same), links it as a plugin of world `W`, then loads; counts into
    /// `metrics` when given.
    async fn load_world<W: World>(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        grants: Grants,
        metrics: Option<Arc<PluginMetrics>>,
        previous: Option<&Plugin>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let digest = digest_of(&wasm);
        let current = previous
            .filter(|p| p.digest() == digest)
            .map(|p| p.component());
        let host = self.clone();
        let bytes = wasm.clone();
        let for_compile = digest.clone();
        let code = tokio::task::spawn_blocking(move || {
            let (component, compiler) = host.compile(&bytes, &for_compile, current)?;
            Code::<W>::link(compiler, &component)
        })
        .await
        .map_err(|e| LoadError {
            reason: LoadErrorReason::CompileFailed,
            message: format!("compiling stopped: {e}"),
        })??;
        let tier = code.tier;
        let plugin = self.load_code(spec, code, &digest, grants, metrics).await?;
        if tier == Tier::Baseline {
            self.queue_tier_up(&plugin, wasm);
        }
        Ok(plugin)
    }

    async fn load_code<W: World>(
        self: &Arc<Self>,
        spec: PluginSpec,
        code: Code<W>,
        digest: &str,
        grants: Grants,
        metrics: Option<Arc<PluginMetrics>>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let plugin = Plugin::new(spec, code, digest, grants, self.pool.join());
        // The plugin's first instance starts and checks its configuration on the call
        // threads, as every call does; the plugin comes back with the answer.
        let checking = self.calls.run(async move {
            let checked = plugin.check_configuration::<W>().await;
            (plugin, checked)
        });
        let (mut plugin, checked) = checking.await.map_err(|e| LoadError {
            reason: LoadErrorReason::InstantiateFailed,
            message: format!("starting the plugin stopped: {e}"),
        })?;
        checked?;
        // Counting starts with the version serving (or goes on from the one before).
        plugin.metrics = metrics.unwrap_or_default();
        let plugin = Arc::new(plugin);
        self.pool.register(&plugin);
        Ok(plugin)
    }

    /// Has the background thread compile `plugin`'s module with Cranelift and move the
    /// plugin to that code (unless the plugin is gone by then).
    fn queue_tier_up(&self, plugin: &Arc<Plugin>, wasm: Arc<Vec<u8>>) {
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
