//! One loaded plugin ([`Plugin`]): its spec, label and metrics, the code it serves
//! and its idle instances (typed by its world, see [`crate::world`]): taking an
//! instance within the host's slots, arming its deadline, naming its failures, and
//! keeping it for the next call. The calls themselves are in [`crate::calls`] and
//! [`crate::session`]; loading in [`crate::engine`].

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ResourceTable};
use wasmtime::{PoolConcurrencyLimitError, Store, StoreLimitsBuilder, Trap, UpdateDeadline};
use wasmtime_wasi::WasiCtx;

use crate::compiler::{Compiler, Tier};
use crate::error::{LoadError, LoadErrorReason, PluginError, PluginErrorKind, first_line};
use crate::grants::Grants;
use crate::metrics::{self, PluginMetrics};
use crate::pool::{self, Idle, Member, Slot};
use crate::state::{Limiter, PluginState};
use crate::stdio::LogStream;
use crate::world::{PluginKind, World};

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

/// One instance of a plugin of world `W`, with its store.
pub(crate) struct Instance<W: World> {
    pub(crate) store: Store<PluginState>,
    pub(crate) exports: W::Exports,
    /// The thread that last ran it: its memory is likely still in that core's cache.
    thread: std::thread::ThreadId,
    /// The code it runs: an instance of baseline code is not kept once the plugin
    /// has moved to optimized code.
    pub(crate) tier: Tier,
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
    pub(crate) tier: Tier,
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
pub(crate) struct Runner<W: World> {
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
    /// Shared with the versions before and after this one (see
    /// [`crate::PluginHost::reload`]).
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

impl Plugin {
    /// A plugin of world `W` serving `code` (of the module `digest` names), before its
    /// configuration is checked; it counts into metrics of its own until the caller
    /// gives it the ones it shares.
    pub(crate) fn new<W: World>(
        spec: PluginSpec,
        code: Code<W>,
        digest: &str,
        grants: Grants,
        pool: Member,
    ) -> Self {
        let short = digest
            .get(..("sha256:".len() + 12))
            .unwrap_or(digest)
            .to_owned();
        let label = format!("plugin {} ({}, v {short})", spec.name, spec.kind);
        Self {
            digest: digest.to_owned(),
            label,
            tier: tokio::sync::watch::Sender::new(code.tier),
            served: Box::new(Runner::<W> {
                code: RwLock::new(Arc::new(code)),
                idle: Mutex::new(Vec::new()),
            }),
            pool,
            grants,
            // The load's own failures are not the serving version's: they count
            // nowhere, and shared counters are taken only once the version is ready.
            metrics: Arc::default(),
            spec,
        }
    }

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

    /// The compiled module serving now, and its tier.
    pub(crate) fn component(&self) -> (Arc<Component>, Tier) {
        self.served.component()
    }

    /// The host imports its instances are served by.
    pub(crate) fn grants(&self) -> &Grants {
        &self.grants
    }

    /// The runner of world `W`, if the plugin is of that world.
    pub(crate) fn runner<W: World>(&self) -> Option<&Runner<W>> {
        self.served.as_any().downcast_ref()
    }

    /// A call into world `W` of a plugin of another world (a caller's mistake).
    pub(crate) fn not_of<W: World>(&self) -> PluginError {
        self.error(PluginErrorKind::BadAnswer(format!(
            "nothing: a {} plugin does not serve the {} world",
            self.spec.kind,
            W::NAME
        )))
    }

    /// Starts an instance and has it check the plugin's configuration: the load's
    /// last step, on the call threads.
    pub(crate) async fn check_configuration<W: World>(&self) -> Result<(), LoadError> {
        let start_error = |e: PluginError| LoadError {
            reason: LoadErrorReason::InstantiateFailed,
            message: e.to_string(),
        };
        let Some(runner) = self.runner::<W>() else {
            return Err(start_error(self.not_of::<W>()));
        };
        let wait = self.spec.timeout.max(LOAD_SLOT_WAIT);
        let mut instance = match tokio::time::timeout(wait, runner.take(self)).await {
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
    pub(crate) async fn bounded<R>(
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

    pub(crate) fn failure(&self, e: wasmtime::Error, store: &Store<PluginState>) -> PluginError {
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

impl Idle for Plugin {
    /// How many idle instances hold slots of the host's pool.
    fn pooled_idle(&self) -> usize {
        self.served.pooled_idle()
    }

    /// Drops the oldest idle instance that holds a slot of the host's pool, for a call
    /// of another plugin that needs the slot; `false` if there was none (another call
    /// may have taken it meanwhile).
    fn release_idle(&self) -> bool {
        self.served.release_idle()
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
    pub(crate) async fn take(&self, plugin: &Plugin) -> Result<Instance<W>, PluginError> {
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
            match self.instantiate(plugin).await {
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
    pub(crate) fn finish<R>(
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
    async fn instantiate(&self, plugin: &Plugin) -> Result<Instance<W>, NotMade> {
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
        // The engine of the code's tier, which compiled it.
        let mut store = Store::new(code.component.engine(), state);
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
    pub(crate) fn arm(&mut self, deadline: Instant) {
        self.store.data_mut().deadline = deadline;
        self.store.data_mut().limits.denied = false;
        self.store.set_epoch_deadline(1);
    }
}

/// Appends the metrics of `plugins` to a Prometheus text exposition.
pub fn render_metrics(out: &mut String, plugins: &[Arc<Plugin>]) {
    let series: Vec<metrics::Series<'_>> = plugins
        .iter()
        .map(|p| metrics::Series {
            plugin: p.name(),
            kind: p.kind().as_str(),
            metrics: &p.metrics,
        })
        .collect();
    metrics::render(out, &series);
}
