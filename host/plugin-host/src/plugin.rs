//! One loaded plugin: its spec, label and metrics, the code it serves and its idle
//! instances (typed by its world, see [`crate::world`]), and the calls into it, which
//! run on the host's call threads ([`crate::calls`]).

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ResourceTable};
use wasmtime::{PoolConcurrencyLimitError, Store, StoreLimitsBuilder, Trap, UpdateDeadline};
use wasmtime_wasi::WasiCtx;

use crate::digest_of;
use crate::host::{Compiler, PluginHost, Tier, first_line};
use crate::imports::{ClusterReader, ControllerHost};
use crate::metrics::PluginMetrics;
use crate::pool::{self, Member, Slot};
use crate::state::{Limiter, PluginState};
use crate::stdio::LogStream;
use crate::world::admission::{Admission, Admit};
use crate::world::controller::{Controller, Reconcile};
use crate::world::initializer::{Initialize, Initializer};
use crate::world::scheduler::Scheduler;
use crate::world::{Call, PluginKind, World};
use crate::{Action, AdmissionRequest, AdmissionResponse, InitializeRequest, ObjectKey};

/// How long a load waits for a free instance slot to check its configuration in: no
/// client waits on it as on a call, and a busy server frees slots within a few calls'
/// deadlines.
const LOAD_SLOT_WAIT: Duration = Duration::from_secs(10);

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

/// One instance of a plugin of world `W`, with its store.
struct Instance<W: World> {
    store: Store<PluginState>,
    exports: W::Exports,
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
pub(crate) struct Code<W: World> {
    pre: W::Pre,
    tier: Tier,
    /// Kept so that a new version of the plugin with the same module (a configuration
    /// change) links it again instead of compiling.
    component: Arc<Component>,
}

impl<W: World> Code<W> {
    pub(crate) fn link(compiler: &Compiler, component: &Arc<Component>) -> Result<Self, LoadError> {
        let wrong_world = |what: String| LoadError {
            reason: LoadErrorReason::WrongWorld,
            message: format!("not a trellis {} plugin: {what}", W::NAME),
        };
        let linker = compiler
            .linker::<W>()
            .map_err(|e| wrong_world(format!("linking its imports: {e:#}")))?;
        let instance_pre = linker
            .instantiate_pre(component)
            .map_err(|e| wrong_world(first_line(&format!("{e:#}")).to_owned()))?;
        let pre = W::pre(instance_pre).map_err(|e| {
            wrong_world(format!(
                "it exports none of {} ({})",
                W::EXPORTS.join(", "),
                first_line(&format!("{e:#}"))
            ))
        })?;
        Ok(Self {
            pre,
            tier: compiler.tier,
            component: component.clone(),
        })
    }
}

/// A plugin's code and idle instances, typed by its world: the one instance pool per
/// plugin, never holding more than the plugin's share of the host's slots (see
/// [`crate::pool`]).
struct Runner<W: World> {
    /// Swapped once, from baseline to optimized code, by the background compiler.
    code: RwLock<Arc<Code<W>>>,
    idle: Mutex<Vec<Instance<W>>>,
}

/// What a [`Plugin`] asks of its runner whatever the world.
trait Serving: Send + Sync + 'static {
    /// The compiled module serving now, and its tier.
    fn component(&self) -> (Arc<Component>, Tier);
    /// Links `component` (optimized code of the same module) and serves it from now
    /// on; returns its tier.
    fn promote(&self, compiler: &Compiler, component: &Arc<Component>) -> Result<Tier, LoadError>;
    fn pooled_idle(&self) -> usize;
    fn release_idle(&self) -> bool;
    fn as_any(&self) -> &dyn Any;
}

impl<W: World> Serving for Runner<W> {
    fn component(&self) -> (Arc<Component>, Tier) {
        let code = self.code.read().unwrap_or_else(|e| e.into_inner());
        (code.component.clone(), code.tier)
    }

    fn promote(&self, compiler: &Compiler, component: &Arc<Component>) -> Result<Tier, LoadError> {
        let code = Arc::new(Code::<W>::link(compiler, component)?);
        let tier = code.tier;
        *self.code.write().unwrap_or_else(|e| e.into_inner()) = code;
        if let Ok(mut idle) = self.idle.lock() {
            idle.retain(|instance| instance.tier == tier);
        }
        Ok(tier)
    }

    fn pooled_idle(&self) -> usize {
        self.idle.lock().map_or(0, |idle| {
            idle.iter().filter(|i| i.tier == Tier::Optimized).count()
        })
    }

    fn release_idle(&self) -> bool {
        let taken = self.idle.lock().ok().and_then(|mut idle| {
            let at = idle.iter().position(|i| i.tier == Tier::Optimized)?;
            Some(idle.remove(at))
        });
        // Dropped here, after the lock: dropping a store unmaps its memory.
        taken.is_some()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A loaded plugin, ready to call from any number of tasks at once.
pub struct Plugin {
    spec: PluginSpec,
    digest: String,
    label: String,
    /// Tells waiters when the optimized code serves.
    tier: tokio::sync::watch::Sender<Tier>,
    /// Its world's code and idle instances: a `Runner<W>`.
    served: Box<dyn Serving>,
    /// Counts the plugin among those sharing the slots while it lives.
    pool: Member,
    grants: Grants,
    /// Shared with the versions before and after this one (see [`PluginHost::reload`]).
    pub metrics: Arc<PluginMetrics>,
}

/// The host imports a plugin's instances are served by.
#[derive(Clone, Default)]
struct Grants {
    /// Cluster reads (`trellis:core/cluster`), for plugins granted them.
    cluster: Option<Arc<dyn ClusterReader>>,
    /// A controller's caches, writes and events.
    controller: Option<Arc<dyn ControllerHost>>,
}

impl Grants {
    fn cluster(cluster: Option<Arc<dyn ClusterReader>>) -> Self {
        Self {
            cluster,
            controller: None,
        }
    }
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
            .filter(|p| p.spec.kind == spec.kind)
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
        let metrics = (previous.spec.kind == spec.kind).then(|| previous.metrics.clone());
        let grants = Grants {
            cluster,
            controller: previous.grants.controller.clone(),
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
            .filter(|p| p.digest == digest)
            .map(|p| p.served.component());
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
        let short = digest
            .get(..("sha256:".len() + 12))
            .unwrap_or(digest)
            .to_owned();
        let label = format!("plugin {} ({}, v {short})", spec.name, spec.kind);
        let plugin = Plugin {
            digest: digest.to_owned(),
            label,
            tier: tokio::sync::watch::Sender::new(code.tier),
            served: Box::new(Runner::<W> {
                code: RwLock::new(Arc::new(code)),
                idle: Mutex::new(Vec::new()),
            }),
            pool: self.pool.join(),
            grants,
            // The load's own failures are not the serving version's: they count
            // nowhere, and shared counters are taken only once the version is ready.
            metrics: Arc::default(),
            spec,
        };
        // The plugin's first instance starts and checks its configuration on the call
        // threads, as every call does; the plugin comes back with the answer.
        let host = self.clone();
        let checking = self.calls.run(async move {
            let checked = plugin.check_configuration::<W>(&host).await;
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
        let tier = self.served.promote(compiler, component)?;
        self.tier.send_replace(tier);
        Ok(())
    }

    /// Calls `admit`. A validating plugin's patch is refused here; the caller checks
    /// and applies a mutating plugin's patch.
    pub async fn admit(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        request: &AdmissionRequest,
    ) -> Result<AdmissionResponse, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        // The call runs on the host's call threads, so it owns its request.
        let result = self.call(host, Admit(request.clone())).await;
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
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        request: &InitializeRequest,
    ) -> Result<Result<String, String>, PluginError> {
        self.call_counted(host, Initialize(request.clone())).await
    }

    /// Calls `reconcile` for `key`: `Ok(Ok(action))`, `Ok(Err(reason))` when the
    /// plugin reports a failure, `Err` when it fails (trap, deadline, memory).
    pub async fn reconcile(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        key: &ObjectKey,
    ) -> Result<Result<Action, String>, PluginError> {
        let call = Reconcile {
            key: key.clone(),
            configuration: self.spec.configuration.clone(),
        };
        self.call_counted(host, call).await
    }

    /// Makes a call whose answer is `Ok(value)` or the plugin's own `Err(reason)`,
    /// counting it: a reason as a denial, a failure as an error.
    async fn call_counted<W: World, T, C: Call<W, Output = Result<T, String>>>(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        call: C,
    ) -> Result<Result<T, String>, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let result = self.call(host, call).await;
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

    /// The runner of world `W`, if the plugin is of that world.
    fn runner<W: World>(&self) -> Option<&Runner<W>> {
        self.served.as_any().downcast_ref()
    }

    /// A call into world `W` of a plugin of another world (a caller's mistake).
    fn not_of<W: World>(&self) -> PluginError {
        self.error(PluginErrorKind::BadAnswer(format!(
            "nothing: a {} plugin does not serve the {} world",
            self.spec.kind,
            W::NAME
        )))
    }

    /// Runs `call` in an instance of the plugin, on the host's call threads, within
    /// the plugin's deadline; the caller only awaits the answer.
    async fn call<W: World, C: Call<W>>(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        call: C,
    ) -> Result<C::Output, PluginError> {
        if self.runner::<W>().is_none() {
            return Err(self.not_of::<W>());
        }
        let plugin = self.clone();
        let on = host.clone();
        let running = host.calls.run(async move {
            let Some(runner) = plugin.runner::<W>() else {
                return Err(plugin.not_of::<W>());
            };
            plugin
                .bounded(async {
                    let started = Instant::now();
                    let mut instance = runner.take(&plugin, &on).await?;
                    let _running = Running::new(&plugin.metrics.in_flight);
                    // What waiting for an instance took counts against the deadline.
                    instance.arm(started + plugin.spec.timeout);
                    let answer = call.call(&instance.exports, &mut instance.store).await;
                    runner.finish(&plugin, instance, answer, started)
                })
                .await
        });
        match running.await {
            Ok(answer) => answer,
            Err(e) => Err(self.error(PluginErrorKind::Trapped(format!("the call stopped: {e}")))),
        }
    }

    /// Starts an instance and has it check the plugin's configuration: the load's
    /// last step, on the call threads.
    async fn check_configuration<W: World>(&self, host: &Arc<PluginHost>) -> Result<(), LoadError> {
        let start_error = |e: PluginError| LoadError {
            reason: LoadErrorReason::InstantiateFailed,
            message: e.to_string(),
        };
        let Some(runner) = self.runner::<W>() else {
            return Err(start_error(self.not_of::<W>()));
        };
        let wait = self.spec.timeout.max(LOAD_SLOT_WAIT);
        let mut instance = match tokio::time::timeout(wait, runner.take(self, host)).await {
            Ok(taken) => taken.map_err(start_error)?,
            Err(_) => {
                return Err(LoadError {
                    reason: LoadErrorReason::InstantiateFailed,
                    message: format!(
                        "{} found no free instance slot within {}s: the host's are all in use",
                        self.label,
                        wait.as_secs()
                    ),
                });
            }
        };
        instance.arm(Instant::now() + self.spec.timeout);
        let checked = W::validate_configuration(
            &instance.exports,
            &mut instance.store,
            &self.spec.configuration,
        )
        .await;
        match checked {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                return Err(LoadError {
                    reason: LoadErrorReason::ConfigurationRejected,
                    message: format!("{} rejected its configuration: {why}", self.label),
                });
            }
            Err(e) => return Err(start_error(self.failure(e, &instance.store))),
        }
        runner.give_back(self, instance);
        Ok(())
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

    /// How many idle instances hold slots of the host's pool.
    pub(crate) fn pooled_idle(&self) -> usize {
        self.served.pooled_idle()
    }

    /// Drops the oldest idle instance that holds a slot of the host's pool, for a call
    /// of another plugin that needs the slot; `false` if there was none (another call
    /// may have taken it meanwhile).
    pub(crate) fn release_idle(&self) -> bool {
        self.served.release_idle()
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
}

impl<W: World> Runner<W> {
    /// An idle instance, the one this thread ran last if there is one, or a new one.
    /// Keeping instances with threads keeps a call's guest memory, stack and store in
    /// the cache of the core that touched them last, rather than moving them between
    /// cores call after call.
    ///
    /// When the host's pool has no free slot, takes back another plugin's idle
    /// instance, or waits for an instance to be dropped: the caller bounds the wait
    /// with the call's deadline.
    async fn take(
        &self,
        plugin: &Plugin,
        host: &Arc<PluginHost>,
    ) -> Result<Instance<W>, PluginError> {
        if let Some(instance) = self.pop_idle() {
            return Ok(instance);
        }
        let pool = plugin.pool.pool();
        let mut waiting = None;
        loop {
            let freed = pool.freed();
            let mut freed = std::pin::pin!(freed);
            // Registered before trying, so that a slot freed in between wakes us.
            freed.as_mut().enable();
            match self.instantiate(plugin, host).await {
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
                plugin.metrics.slot_waits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(plugin = %plugin.spec.name, "every instance slot is in use; waiting for one");
                waiting = Some(pool.wait());
            }
            let _ = tokio::time::timeout(pool::RECHECK, freed).await;
        }
    }

    /// The idle instance this thread ran last, else the newest.
    fn pop_idle(&self) -> Option<Instance<W>> {
        let here = std::thread::current().id();
        let mut idle = self.idle.lock().ok()?;
        match idle.iter().rposition(|i| i.thread == here) {
            Some(at) => Some(idle.remove(at)),
            None => idle.pop(),
        }
    }

    /// Keeps `instance` idle for the next call, unless it runs code the plugin no
    /// longer serves, calls wait for its slot, or the plugin keeps its share already.
    fn give_back(&self, plugin: &Plugin, mut instance: Instance<W>) {
        let pool = plugin.pool.pool();
        if instance.tier != plugin.tier() || (instance.tier == Tier::Optimized && pool.contended())
        {
            return;
        }
        instance.thread = std::thread::current().id();
        let share = pool.idle_share();
        // Dropped after the lock is released: dropping a store unmaps its memory.
        let surplus: Vec<Instance<W>> = match self.idle.lock() {
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
        plugin: &Plugin,
        instance: Instance<W>,
        answer: wasmtime::Result<R>,
        started: Instant,
    ) -> Result<R, PluginError> {
        let peak = instance.store.data().limits.peak;
        plugin.metrics.memory(peak);
        match answer {
            // An answer after the deadline is not used, as a webhook's late answer
            // is not: the guest may have been resumed past its deadline between two
            // epoch ticks.
            Ok(_) if started.elapsed() > plugin.spec.timeout => {
                self.give_back(plugin, instance);
                plugin.metrics.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(plugin.error(PluginErrorKind::Timeout(plugin.spec.timeout)))
            }
            Ok(value) => {
                plugin.metrics.observe(started.elapsed());
                self.give_back(plugin, instance);
                Ok(value)
            }
            Err(e) => Err(plugin.failure(e, &instance.store)),
        }
    }

    /// A new instance of the code serving now, in a slot of the host's pool (when the
    /// code is optimized).
    async fn instantiate(
        &self,
        plugin: &Plugin,
        host: &Arc<PluginHost>,
    ) -> Result<Instance<W>, NotMade> {
        let spec = &plugin.spec;
        let name: Arc<str> = Arc::from(spec.name.as_str());
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
                    .memory_size(spec.memory_limit)
                    .build(),
                peak: 0,
                denied: false,
            },
            plugin: name,
            cluster: plugin.grants.cluster.clone(),
            controller: plugin.grants.controller.clone(),
            deadline: Instant::now() + spec.timeout,
        };
        let code = self.code.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut store = Store::new(&host.compiler(code.tier).engine, state);
        store.limiter(|state| &mut state.limits);
        store.epoch_deadline_callback(|ctx| {
            if Instant::now() >= ctx.data().deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                // Let other calls run between ticks of a long call.
                Ok(UpdateDeadline::Yield(1))
            }
        });
        store.set_epoch_deadline(1);
        match W::instantiate(&code.pre, &mut store).await {
            Ok(exports) => Ok(Instance {
                store,
                exports,
                thread: std::thread::current().id(),
                tier: code.tier,
                _slot: Slot::new(plugin.pool.pool()),
            }),
            // Not the plugin's failure: it says nothing about the plugin, and a slot
            // may be free in a moment.
            Err(e) if e.is::<PoolConcurrencyLimitError>() => Err(NotMade::PoolFull),
            Err(e) => Err(NotMade::Failed(plugin.failure(e, &store))),
        }
    }
}

impl<W: World> Instance<W> {
    /// Starts one call, which must end by `deadline`.
    fn arm(&mut self, deadline: Instant) {
        self.store.data_mut().deadline = deadline;
        self.store.data_mut().limits.denied = false;
        self.store.set_epoch_deadline(1);
    }
}

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

/// One instance of a scheduler plugin, held by one scheduler for as long as it
/// schedules with the plugin: the instance keeps its view of the cluster and the pod
/// of the cycle between calls, which therefore run one at a time, in the caller's
/// task (no hop to the call threads: a scheduling cycle makes several calls).
///
/// Each call has the plugin's deadline and memory cap. A call that fails (trap,
/// deadline, memory) ends the session: the instance cannot be entered again, and its
/// view is gone, so the scheduler starts a new session and sends the whole cluster.
pub struct SchedulerSession {
    plugin: Arc<Plugin>,
    instance: Option<Instance<Scheduler>>,
}

impl std::fmt::Debug for SchedulerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerSession")
            .field("plugin", &self.plugin.spec.name)
            .field("alive", &self.instance.is_some())
            .finish()
    }
}

impl Plugin {
    /// A new instance of a scheduler plugin for one scheduler's own use.
    pub async fn scheduler_session(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
    ) -> Result<SchedulerSession, PluginError> {
        let Some(runner) = self.runner::<Scheduler>() else {
            return Err(self.not_of::<Scheduler>());
        };
        let instance = self.bounded(runner.take(self, host)).await?;
        Ok(SchedulerSession {
            plugin: self.clone(),
            instance: Some(instance),
        })
    }
}

impl SchedulerSession {
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Whether the session can still be called: false after a failed call.
    pub fn is_alive(&self) -> bool {
        self.instance.is_some()
    }

    /// Whether the plugin now serves other code than the instance runs (it moved to
    /// optimized code): a new session would be faster.
    pub fn outdated(&self) -> bool {
        self.instance
            .as_ref()
            .is_some_and(|i| i.tier != self.plugin.tier())
    }

    /// Runs one call on the session's instance.
    pub(crate) async fn call<T>(
        &mut self,
        f: impl AsyncFnOnce(
            &crate::bindings::scheduler::exports::trellis::scheduler::handler::Guest,
            &mut Store<PluginState>,
        ) -> wasmtime::Result<T>,
    ) -> Result<T, PluginError> {
        let plugin = self.plugin.clone();
        let Some(instance) = self.instance.as_mut() else {
            return Err(plugin.error(PluginErrorKind::Trapped(
                "the session ended with an earlier failure".into(),
            )));
        };
        plugin.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        instance.arm(started + plugin.spec.timeout);
        let answer = plugin
            .bounded(async {
                let Instance { exports, store, .. } = &mut *instance;
                Ok(f(exports.handler(), store).await)
            })
            .await;
        let answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                plugin.metrics.errors.fetch_add(1, Ordering::Relaxed);
                self.instance = None;
                return Err(e);
            }
        };
        plugin.metrics.memory(instance.store.data().limits.peak);
        match answer {
            Ok(value) => {
                plugin.metrics.observe(started.elapsed());
                Ok(value)
            }
            Err(e) => {
                let e = plugin.failure(e, &instance.store);
                plugin.metrics.errors.fetch_add(1, Ordering::Relaxed);
                self.instance = None;
                Err(e)
            }
        }
    }
}
