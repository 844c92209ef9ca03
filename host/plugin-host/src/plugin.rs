//! One loaded plugin: its pre-instantiated component, a pool of idle instances, its
//! limits, and the calls into it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ResourceTable};
use wasmtime::{
    PoolConcurrencyLimitError, ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::{self, admission, cluster, initializer, log, types};
use crate::host::{Compiler, PluginHost, Tier, digest_of, first_line};
use crate::metrics::PluginMetrics;
use crate::pool::{self, Member, Slot};
use crate::stdio::LogStream;
use crate::{AdmissionRequest, AdmissionResponse, InitializeRequest};

/// How long a load waits for a free instance slot to check its configuration in: no
/// client waits on it as on a call, and a busy server frees slots within a few calls'
/// deadlines.
const LOAD_SLOT_WAIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    Mutating,
    Validating,
    Initializer,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mutating => "mutating",
            Self::Validating => "validating",
            Self::Initializer => "initializer",
        }
    }

    /// The world a component of this kind must implement.
    pub fn world(self) -> &'static str {
        match self {
            Self::Mutating | Self::Validating => "admission",
            Self::Initializer => "initializer",
        }
    }
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a plugin is run.
#[derive(Clone, Debug)]
pub struct PluginSpec {
    pub name: String,
    pub kind: PluginKind,
    /// Handed to the plugin as JSON, checked by it at load.
    pub configuration: String,
    pub timeout: Duration,
    /// Cap on each of the instance's linear memories, in bytes.
    pub memory_limit: usize,
}

impl PluginSpec {
    pub fn new(name: impl Into<String>, kind: PluginKind) -> Self {
        Self {
            name: name.into(),
            kind,
            configuration: "{}".into(),
            timeout: Duration::from_millis(100),
            memory_limit: 64 << 20,
        }
    }
}

/// Read access to cluster state for plugins granted it.
#[async_trait::async_trait]
pub trait ClusterReader: Send + Sync + std::fmt::Debug {
    async fn get(
        &self,
        resource: &types::GroupVersionResource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Option<String>, String>;

    async fn list(
        &self,
        resource: &types::GroupVersionResource,
        namespace: Option<&str>,
        label_selector: &str,
    ) -> Result<Vec<String>, String>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadErrorReason {
    /// Not a component, or not one wasmtime can compile.
    CompileFailed,
    /// Imports something the host does not provide, or lacks the world's exports.
    WrongWorld,
    /// Trapped or timed out while starting.
    InstantiateFailed,
    /// `validate-configuration` refused the configuration.
    ConfigurationRejected,
}

impl LoadErrorReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CompileFailed => "CompileFailed",
            Self::WrongWorld => "WrongWorld",
            Self::InstantiateFailed => "InstantiateFailed",
            Self::ConfigurationRejected => "ConfigurationRejected",
        }
    }
}

/// Why a plugin could not be loaded; the last good version (if any) keeps serving.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct LoadError {
    pub reason: LoadErrorReason,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginErrorKind {
    Timeout(Duration),
    Trapped(String),
    /// The instance hit its memory cap (bytes).
    OutOfMemory(usize),
    /// The plugin answered something the host cannot use.
    BadAnswer(String),
}

/// A failed call, named: `plugin NAME (validating, v sha256:…) timed out after 100ms`.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{label} {}", describe(.kind))]
pub struct PluginError {
    pub label: String,
    pub kind: PluginErrorKind,
}

fn describe(kind: &PluginErrorKind) -> String {
    match kind {
        PluginErrorKind::Timeout(t) => format!("timed out after {}ms", t.as_millis()),
        PluginErrorKind::Trapped(why) => format!("trapped: {why}"),
        PluginErrorKind::OutOfMemory(limit) => {
            format!("exceeded its {} MiB memory limit", limit >> 20)
        }
        PluginErrorKind::BadAnswer(what) => format!("returned {what}"),
    }
}

/// What each instance's store holds.
pub struct PluginState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: Limiter,
    plugin: Arc<str>,
    cluster: Option<Arc<dyn ClusterReader>>,
    /// When the current call must stop.
    deadline: Instant,
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for PluginState {}

impl log::Host for PluginState {
    fn log(&mut self, level: log::Level, message: String, fields: Vec<(String, String)>) {
        let mut kv = String::new();
        for (k, v) in &fields {
            if !kv.is_empty() {
                kv.push(' ');
            }
            kv.push_str(k);
            kv.push('=');
            kv.push_str(v);
        }
        let plugin = &*self.plugin;
        match level {
            log::Level::Trace => tracing::trace!(plugin, fields = %kv, "{message}"),
            log::Level::Debug => tracing::debug!(plugin, fields = %kv, "{message}"),
            log::Level::Info => tracing::info!(plugin, fields = %kv, "{message}"),
            log::Level::Warn => tracing::warn!(plugin, fields = %kv, "{message}"),
            log::Level::Error => tracing::error!(plugin, fields = %kv, "{message}"),
        }
    }
}

impl cluster::Host for PluginState {
    async fn get(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<String>, String> {
        match &self.cluster {
            Some(reader) => reader.get(&resource, namespace.as_deref(), &name).await,
            None => Err(self.not_granted()),
        }
    }

    async fn list(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        label_selector: String,
    ) -> Result<Vec<String>, String> {
        match &self.cluster {
            Some(reader) => {
                reader
                    .list(&resource, namespace.as_deref(), &label_selector)
                    .await
            }
            None => Err(self.not_granted()),
        }
    }
}

impl PluginState {
    fn not_granted(&self) -> String {
        format!(
            "plugin {} is not granted cluster reads (spec.capabilities.clusterRead)",
            self.plugin
        )
    }
}

/// The plugin's memory cap, remembering whether it was hit and how far memory grew.
struct Limiter {
    inner: StoreLimits,
    peak: usize,
    denied: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.inner.memory_growing(current, desired, maximum)?;
        if allowed {
            self.peak = self.peak.max(desired);
        } else {
            self.denied = true;
        }
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

enum Pre {
    Admission(admission::AdmissionPre<PluginState>),
    Initializer(initializer::InitializerPre<PluginState>),
}

enum Bindings {
    Admission(admission::Admission),
    Initializer(initializer::Initializer),
}

struct Instance {
    store: Store<PluginState>,
    bindings: Bindings,
    /// The thread that last ran it: its memory is likely still in that core's cache.
    thread: std::thread::ThreadId,
    /// The code it runs: an instance of baseline code is not kept once the plugin
    /// has moved to optimized code.
    tier: Tier,
    /// Last, so that it is dropped after the store has given its slots back: then it
    /// wakes the calls waiting for one.
    _slot: Slot,
}

/// Why no new instance was made.
enum NotMade {
    /// The pooling allocator has no free slot (component or core instance, memory,
    /// table or stack): the caller may free one or wait.
    PoolFull,
    Failed(PluginError),
}

/// The code a plugin runs: linked, ready to instantiate in stores of its tier's
/// engine.
struct Code {
    pre: Pre,
    tier: Tier,
    /// Kept so that a new version of the plugin with the same module (a configuration
    /// change) links it again instead of compiling.
    component: Arc<Component>,
}

impl Code {
    fn link(
        compiler: &Compiler,
        kind: PluginKind,
        component: &Arc<Component>,
    ) -> Result<Self, LoadError> {
        let wrong_world = |e: wasmtime::Error| LoadError {
            reason: LoadErrorReason::WrongWorld,
            message: format!(
                "not a trellis:plugin/{} component: {}",
                kind.world(),
                first_line(&format!("{e:#}"))
            ),
        };
        let instance_pre = compiler
            .linker
            .instantiate_pre(component)
            .map_err(wrong_world)?;
        let pre = match kind {
            PluginKind::Mutating | PluginKind::Validating => {
                Pre::Admission(admission::AdmissionPre::new(instance_pre).map_err(wrong_world)?)
            }
            PluginKind::Initializer => Pre::Initializer(
                initializer::InitializerPre::new(instance_pre).map_err(wrong_world)?,
            ),
        };
        Ok(Self {
            pre,
            tier: compiler.tier,
            component: component.clone(),
        })
    }
}

/// A loaded plugin, ready to call from any number of tasks at once.
pub struct Plugin {
    spec: PluginSpec,
    digest: String,
    label: String,
    /// Swapped once, from baseline to optimized code, by the background compiler.
    code: RwLock<Arc<Code>>,
    /// Tells waiters when the optimized code serves.
    tier: tokio::sync::watch::Sender<Tier>,
    /// Never more than the plugin's share of the host's slots (see [`crate::pool`]).
    idle: Mutex<Vec<Instance>>,
    /// Counts the plugin among those sharing the slots while it lives.
    pool: Member,
    cluster: Option<Arc<dyn ClusterReader>>,
    /// Shared with the versions before and after this one (see [`PluginHost::reload`]).
    pub metrics: Arc<PluginMetrics>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("spec", &self.spec)
            .field("digest", &self.digest)
            .finish_non_exhaustive()
    }
}

impl PluginHost {
    /// Compiles (or takes from the cache) and links `wasm` for `spec`, starts one
    /// instance and has it check its configuration. Blocking work runs off the async
    /// runtime.
    pub async fn load(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        cluster: Option<Arc<dyn ClusterReader>>,
    ) -> Result<Arc<Plugin>, LoadError> {
        self.load_counting(spec, wasm, cluster, None, None).await
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
        let metrics = (previous.spec.kind == spec.kind).then(|| previous.metrics.clone());
        self.load_counting(spec, wasm, cluster, metrics, Some(previous))
            .await
    }

    /// Compiles off the async runtime (or takes `previous`'s compiled module when it
    /// is the same), then loads; counts into `metrics` when given.
    async fn load_counting(
        self: &Arc<Self>,
        spec: PluginSpec,
        wasm: Arc<Vec<u8>>,
        cluster: Option<Arc<dyn ClusterReader>>,
        metrics: Option<Arc<PluginMetrics>>,
        previous: Option<&Plugin>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let digest = digest_of(&wasm);
        let current = previous.filter(|p| p.digest == digest).map(|p| {
            let code = p.code.read().unwrap_or_else(|e| e.into_inner());
            (code.component.clone(), code.tier)
        });
        let host = self.clone();
        let bytes = wasm.clone();
        let kind = spec.kind;
        let for_compile = digest.clone();
        let code = tokio::task::spawn_blocking(move || {
            let (component, compiler) = host.compile(&bytes, &for_compile, current)?;
            Code::link(compiler, kind, &component)
        })
        .await
        .map_err(|e| LoadError {
            reason: LoadErrorReason::CompileFailed,
            message: format!("compiling stopped: {e}"),
        })??;
        let tier = code.tier;
        let plugin = self
            .load_code(spec, code, &digest, cluster, metrics)
            .await?;
        if tier == Tier::Baseline {
            self.queue_tier_up(&plugin, wasm);
        }
        Ok(plugin)
    }

    async fn load_code(
        self: &Arc<Self>,
        spec: PluginSpec,
        code: Code,
        digest: &str,
        cluster: Option<Arc<dyn ClusterReader>>,
        metrics: Option<Arc<PluginMetrics>>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let short = digest
            .get(..("sha256:".len() + 12))
            .unwrap_or(digest)
            .to_owned();
        let label = format!("plugin {} ({}, v {short})", spec.name, spec.kind);
        let mut plugin = Plugin {
            digest: digest.to_owned(),
            label,
            tier: tokio::sync::watch::Sender::new(code.tier),
            code: RwLock::new(Arc::new(code)),
            idle: Mutex::new(Vec::new()),
            pool: self.pool.join(),
            cluster,
            // The load's own failures are not the serving version's: they count
            // nowhere, and shared counters are taken only once the version is ready.
            metrics: Arc::default(),
            spec,
        };
        let start_error = |e: PluginError| LoadError {
            reason: LoadErrorReason::InstantiateFailed,
            message: e.to_string(),
        };
        let wait = plugin.spec.timeout.max(LOAD_SLOT_WAIT);
        let mut instance = match tokio::time::timeout(wait, plugin.take(self)).await {
            Ok(taken) => taken.map_err(start_error)?,
            Err(_) => {
                return Err(LoadError {
                    reason: LoadErrorReason::InstantiateFailed,
                    message: format!(
                        "{} found no free instance slot within {}s: the host's are all in use",
                        plugin.label,
                        wait.as_secs()
                    ),
                });
            }
        };
        let config = plugin.spec.configuration.clone();
        instance.arm(Instant::now() + plugin.spec.timeout);
        let checked = match &instance.bindings {
            Bindings::Admission(b) => {
                b.trellis_plugin_admission_handler()
                    .call_validate_configuration(&mut instance.store, &config)
                    .await
            }
            Bindings::Initializer(b) => {
                b.trellis_plugin_initializer_handler()
                    .call_validate_configuration(&mut instance.store, &config)
                    .await
            }
        };
        match checked {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                return Err(LoadError {
                    reason: LoadErrorReason::ConfigurationRejected,
                    message: format!("{} rejected its configuration: {why}", plugin.label),
                });
            }
            Err(e) => return Err(start_error(plugin.failure(e, &instance.store))),
        }
        plugin.give_back(instance);
        // Counting starts with the version serving (or goes on from the one before).
        plugin.metrics = metrics.unwrap_or_default();
        let plugin = Arc::new(plugin);
        self.pool.register(&plugin);
        Ok(plugin)
    }
}

impl Plugin {
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    pub fn kind(&self) -> PluginKind {
        self.spec.kind
    }

    pub fn spec(&self) -> &PluginSpec {
        &self.spec
    }

    /// `sha256:<hex>` of the module serving.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// `plugin NAME (KIND, v sha256:…)`, how errors name the plugin.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The compiler whose code serves now.
    pub fn tier(&self) -> Tier {
        *self.tier.borrow()
    }

    /// Waits until the optimized code serves (at once if it does already). Never
    /// returns for a plugin that stays on baseline code: bound it with a timeout.
    pub async fn optimized(&self) {
        let mut rx = self.tier.subscribe();
        let _ = rx.wait_for(|tier| *tier == Tier::Optimized).await;
    }

    /// Serves `component` (optimized code of the same module) from now on: new calls
    /// instantiate it, calls in flight finish on the code they started with.
    pub(crate) fn promote(
        &self,
        compiler: &Compiler,
        component: &Arc<Component>,
    ) -> Result<(), LoadError> {
        let code = Arc::new(Code::link(compiler, self.spec.kind, component)?);
        let tier = code.tier;
        *self.code.write().unwrap_or_else(|e| e.into_inner()) = code;
        if let Ok(mut idle) = self.idle.lock() {
            idle.retain(|instance| instance.tier == tier);
        }
        self.tier.send_replace(tier);
        Ok(())
    }

    /// Calls `admit`. A validating plugin's patch is refused here; the caller checks
    /// and applies a mutating plugin's patch.
    pub async fn admit(
        &self,
        host: &Arc<PluginHost>,
        request: &AdmissionRequest,
    ) -> Result<AdmissionResponse, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let result = self
            .bounded(async {
                let started = Instant::now();
                let mut instance = self.take(host).await?;
                let _running = Running::new(&self.metrics.in_flight);
                // What waiting for an instance took counts against the deadline.
                instance.arm(started + self.spec.timeout);
                let answer = match &instance.bindings {
                    Bindings::Admission(b) => {
                        b.trellis_plugin_admission_handler()
                            .call_admit(&mut instance.store, request)
                            .await
                    }
                    Bindings::Initializer(_) => {
                        return Err(self.error(PluginErrorKind::BadAnswer(
                            "nothing: an initializer cannot admit".into(),
                        )));
                    }
                };
                self.finish(instance, answer, started)
            })
            .await;
        match &result {
            Ok(response)
                if self.spec.kind == PluginKind::Validating && response.patch.is_some() =>
            {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
                return Err(self.error(PluginErrorKind::BadAnswer(
                    "a patch, but validating plugins may not change objects".into(),
                )));
            }
            Ok(response) if !response.allowed => {
                self.metrics.denials.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
            Err(_) => {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// Calls `initialize`: `Ok(Ok(object))`, `Ok(Err(reason))` when the plugin
    /// refuses, `Err` when it fails.
    pub async fn initialize(
        &self,
        host: &Arc<PluginHost>,
        request: &InitializeRequest,
    ) -> Result<Result<String, String>, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let result = self
            .bounded(async {
                let started = Instant::now();
                let mut instance = self.take(host).await?;
                let _running = Running::new(&self.metrics.in_flight);
                // What waiting for an instance took counts against the deadline.
                instance.arm(started + self.spec.timeout);
                let answer = match &instance.bindings {
                    Bindings::Initializer(b) => {
                        b.trellis_plugin_initializer_handler()
                            .call_initialize(&mut instance.store, request)
                            .await
                    }
                    Bindings::Admission(_) => {
                        return Err(self.error(PluginErrorKind::BadAnswer(
                            "nothing: an admission plugin cannot initialize".into(),
                        )));
                    }
                };
                self.finish(instance, answer, started)
            })
            .await;
        match &result {
            Ok(Err(_)) => {
                self.metrics.denials.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Ok(_)) => {}
            Err(_) => {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// The epoch deadline stops a guest that computes; this also stops one waiting
    /// on a host call (a cluster read), whose instance is then dropped.
    async fn bounded<R>(
        &self,
        call: impl Future<Output = Result<R, PluginError>>,
    ) -> Result<R, PluginError> {
        let deadline = tokio::time::Instant::now() + self.spec.timeout + Duration::from_millis(50);
        let mut call = std::pin::pin!(call);
        // Most calls compute and return within their first poll: those need no timer
        // (registering and cancelling one is a lock on the runtime's timer wheel).
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        if let Poll::Ready(result) = first {
            return result;
        }
        match tokio::time::timeout_at(deadline, call).await {
            Ok(result) => result,
            Err(_) => {
                self.metrics.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(self.error(PluginErrorKind::Timeout(self.spec.timeout)))
            }
        }
    }

    /// Names a failure of this plugin.
    pub fn error(&self, kind: PluginErrorKind) -> PluginError {
        PluginError {
            label: self.label.clone(),
            kind,
        }
    }

    /// An idle instance, the one this thread ran last if there is one, or a new one.
    /// Keeping instances with threads keeps a call's guest memory, stack and store in
    /// the cache of the core that touched them last, rather than moving them between
    /// cores call after call.
    ///
    /// When the host's pool has no free slot, takes back another plugin's idle
    /// instance, or waits for an instance to be dropped: the caller bounds the wait
    /// with the call's deadline.
    async fn take(&self, host: &Arc<PluginHost>) -> Result<Instance, PluginError> {
        if let Some(instance) = self.pop_idle() {
            return Ok(instance);
        }
        let pool = self.pool.pool();
        let mut waiting = None;
        loop {
            let freed = pool.freed();
            let mut freed = std::pin::pin!(freed);
            // Registered before trying, so that a slot freed in between wakes us.
            freed.as_mut().enable();
            match self.instantiate(host).await {
                Ok(instance) => return Ok(instance),
                Err(NotMade::Failed(e)) => return Err(e),
                Err(NotMade::PoolFull) => {}
            }
            // One of ours, returned meanwhile, or a slot freed from another plugin's
            // idle instances; else the next instance dropped anywhere.
            if let Some(instance) = self.pop_idle() {
                return Ok(instance);
            }
            if pool.reclaim() {
                continue;
            }
            if waiting.is_none() {
                self.metrics.slot_waits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(plugin = %self.spec.name, "every instance slot is in use; waiting for one");
                waiting = Some(pool.wait());
            }
            let _ = tokio::time::timeout(pool::RECHECK, freed).await;
        }
    }

    /// The idle instance this thread ran last, else the newest.
    fn pop_idle(&self) -> Option<Instance> {
        let here = std::thread::current().id();
        let mut idle = self.idle.lock().ok()?;
        match idle.iter().rposition(|i| i.thread == here) {
            Some(at) => Some(idle.remove(at)),
            None => idle.pop(),
        }
    }

    /// How many idle instances hold slots of the host's pool.
    pub(crate) fn pooled_idle(&self) -> usize {
        self.idle.lock().map_or(0, |idle| {
            idle.iter().filter(|i| i.tier == Tier::Optimized).count()
        })
    }

    /// Drops the oldest idle instance that holds a slot of the host's pool, for a call
    /// of another plugin that needs the slot; `false` if there was none (another call
    /// may have taken it meanwhile).
    pub(crate) fn release_idle(&self) -> bool {
        let taken = self.idle.lock().ok().and_then(|mut idle| {
            let at = idle.iter().position(|i| i.tier == Tier::Optimized)?;
            Some(idle.remove(at))
        });
        // Dropped here, after the lock: dropping a store unmaps its memory.
        taken.is_some()
    }

    /// Keeps `instance` idle for the next call, unless it runs code the plugin no
    /// longer serves, calls wait for its slot, or the plugin keeps its share already.
    fn give_back(&self, mut instance: Instance) {
        let pool = self.pool.pool();
        if instance.tier != self.tier() || (instance.tier == Tier::Optimized && pool.contended()) {
            return;
        }
        instance.thread = std::thread::current().id();
        let share = pool.idle_share();
        // Dropped after the lock is released: dropping a store unmaps its memory.
        let surplus: Vec<Instance> = match self.idle.lock() {
            Ok(mut idle) if idle.len() < share => {
                idle.push(instance);
                Vec::new()
            }
            // Full (or over a share that shrank as plugins were loaded): this one is
            // the warmest, the oldest go.
            Ok(mut idle) => {
                let excess = idle.len() + 1 - share;
                let surplus = idle.drain(..excess).collect();
                idle.push(instance);
                surplus
            }
            Err(_) => vec![instance],
        };
        drop(surplus);
    }

    /// Keeps a healthy instance for the next call; a failed one is dropped (a trapped
    /// instance cannot be entered again).
    fn finish<R>(
        &self,
        instance: Instance,
        answer: wasmtime::Result<R>,
        started: Instant,
    ) -> Result<R, PluginError> {
        let peak = instance.store.data().limits.peak;
        self.metrics.memory(peak);
        match answer {
            // An answer after the deadline is not used, as a webhook's late answer
            // is not: the guest may have been resumed past its deadline between two
            // epoch ticks.
            Ok(_) if started.elapsed() > self.spec.timeout => {
                self.give_back(instance);
                self.metrics.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(self.error(PluginErrorKind::Timeout(self.spec.timeout)))
            }
            Ok(value) => {
                self.metrics.observe(started.elapsed());
                self.give_back(instance);
                Ok(value)
            }
            Err(e) => Err(self.failure(e, &instance.store)),
        }
    }

    fn failure(&self, e: wasmtime::Error, store: &Store<PluginState>) -> PluginError {
        if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            self.metrics.timeouts.fetch_add(1, Ordering::Relaxed);
            return self.error(PluginErrorKind::Timeout(self.spec.timeout));
        }
        if store.data().limits.denied {
            return self.error(PluginErrorKind::OutOfMemory(self.spec.memory_limit));
        }
        let why = match e.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => first_line(&format!("{e:#}")).to_owned(),
        };
        self.error(PluginErrorKind::Trapped(why))
    }

    /// A new instance of the code serving now, in a slot of the host's pool (when the
    /// code is optimized).
    async fn instantiate(&self, host: &Arc<PluginHost>) -> Result<Instance, NotMade> {
        let name: Arc<str> = Arc::from(self.spec.name.as_str());
        let mut wasi = WasiCtx::builder();
        // Nothing granted: no files, environment, arguments or network; output goes
        // to the host's log.
        wasi.stdout(LogStream {
            plugin: name.clone(),
            stream: "stdout",
        })
        .stderr(LogStream {
            plugin: name.clone(),
            stream: "stderr",
        })
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
        let state = PluginState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limits: Limiter {
                inner: StoreLimitsBuilder::new()
                    .memory_size(self.spec.memory_limit)
                    .build(),
                peak: 0,
                denied: false,
            },
            plugin: name,
            cluster: self.cluster.clone(),
            deadline: Instant::now() + self.spec.timeout,
        };
        let code = self.code.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut store = Store::new(&host.compiler(code.tier).engine, state);
        store.limiter(|state| &mut state.limits);
        store.epoch_deadline_callback(|ctx| {
            if Instant::now() >= ctx.data().deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                // Let other requests run between ticks of a long call.
                Ok(UpdateDeadline::Yield(1))
            }
        });
        store.set_epoch_deadline(1);
        let bindings = match &code.pre {
            Pre::Admission(pre) => pre
                .instantiate_async(&mut store)
                .await
                .map(Bindings::Admission),
            Pre::Initializer(pre) => pre
                .instantiate_async(&mut store)
                .await
                .map(Bindings::Initializer),
        };
        match bindings {
            Ok(bindings) => Ok(Instance {
                store,
                bindings,
                thread: std::thread::current().id(),
                tier: code.tier,
                _slot: Slot::new(self.pool.pool()),
            }),
            // Not the plugin's failure: it says nothing about the plugin, and a slot
            // may be free in a moment.
            Err(e) if e.is::<PoolConcurrencyLimitError>() => Err(NotMade::PoolFull),
            Err(e) => Err(NotMade::Failed(self.failure(e, &store))),
        }
    }
}

impl Instance {
    /// Starts one call, which must end by `deadline`.
    fn arm(&mut self, deadline: Instant) {
        self.store.data_mut().deadline = deadline;
        self.store.data_mut().limits.denied = false;
        self.store.set_epoch_deadline(1);
    }
}

// The initializer world's generated module is used through `Pre`/`Bindings` only.
#[allow(unused_imports)]
use bindings::initializer as _;

/// A call that holds an instance, counted in [`PluginMetrics::in_flight`] until it is
/// dropped (the call returned, failed or was stopped).
struct Running<'a>(&'a std::sync::atomic::AtomicU64);

impl<'a> Running<'a> {
    fn new(count: &'a std::sync::atomic::AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
