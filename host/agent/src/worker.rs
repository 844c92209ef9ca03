//! One pod's worker: the pod's lifecycle as a state machine the worker steps through
//! at each sync — sandbox, init containers in order, containers, restarts with
//! back-off, termination — and the status it then reports.
//!
//! A sync reads the pod (the latest version the informer has) and the runtime's
//! containers of its sandbox, asks [`crate::plan`] what the pod needs now, carries
//! that out (the kubelet's `SyncPod`), and writes the status when it changed. It runs again when the pod changes, when the relist
//! sees one of its containers change, or when a back-off it waits for ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, warn};
use trellis_client::events::EventType;

use crate::Context;
use crate::container;
use crate::images;
use crate::plan::{self, Start};
use crate::probes::Prober;
use crate::sandbox;
use crate::spec::{self, Sources};
use crate::status::{self, Observed, Slot, State, human};

/// The grace period of a pod that sets none.
const DEFAULT_GRACE: i64 = 30;

/// How soon a pod status write that failed is tried again (the server's in-flight limit
/// answers 429 under a burst; kube-rs, unlike client-go, does not retry by itself): this
/// to twice this, so that the pods a burst throttled do not all come back at once.
const STATUS_RETRY: Duration = Duration::from_millis(200);

/// When a pod status write that failed now is tried again.
fn status_retry() -> Instant {
    Instant::now() + STATUS_RETRY.mul_f64(1.0 + rand::random::<f64>())
}

/// What a sync leaves the worker to do.
enum Step {
    /// Wait for the pod or its containers to change, or until this instant.
    Wait(Option<Instant>),
    /// The pod is gone and so is everything it ran.
    Done,
}

struct Backoff {
    delay: Duration,
    until: Instant,
    /// Whether this window's `BackOff` event was recorded: one per window, not one per
    /// wake-up.
    announced: bool,
}

/// Runs one pod until it is deleted and its containers are gone, or until the agent
/// stops (`pod`'s sender dropped), which leaves the containers running.
pub async fn run(
    ctx: Arc<Context>,
    uid: String,
    mut pod: watch::Receiver<Option<Arc<Pod>>>,
    poke: Arc<Notify>,
) {
    let mut worker = Worker {
        ctx,
        uid,
        backoff: HashMap::new(),
        reported: None,
        finished: None,
        start_time: None,
        prober: Prober::default(),
        network: None,
    };
    let mut last: Option<Arc<Pod>> = None;
    // The eviction manager asks through the context; every request wakes the
    // workers, each looks whether it is for its pod.
    let mut evictions = worker.ctx.eviction.subscribe();
    loop {
        let current = pod.borrow_and_update().clone();
        let step = match &current {
            Some(p) => {
                last = Some(p.clone());
                worker.sync(p).await
            }
            None => {
                // Gone from the API without a graceful termination here (a forced
                // delete, a finished pod, or one deleted while the node was down):
                // stop what it ran within its own grace period, then remove its
                // sandboxes, files and logs, as the kubelet does with a pod it no
                // longer has.
                let grace = last.as_deref().map(spec_grace).unwrap_or(DEFAULT_GRACE);
                worker.terminate(last.as_deref(), grace).await;
                sandbox::kill_pod(&worker.ctx, &worker.uid, last.as_deref(), 0, true).await;
                Step::Done
            }
        };
        let wake = match step {
            Step::Done => return,
            Step::Wait(wake) => wake,
        };
        let sleep = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = pod.changed() => if changed.is_err() { return },
            _ = poke.notified() => {}
            Ok(()) = evictions.changed() => {}
            _ = sleep => {}
        }
    }
}

fn spec_grace(pod: &Pod) -> i64 {
    pod.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(DEFAULT_GRACE)
}

struct Worker {
    ctx: Arc<Context>,
    uid: String,
    /// Restart back-off by container name (and `pull:NAME` for image pulls).
    backoff: HashMap<String, Backoff>,
    /// The status last written, so an unchanged one is not written again.
    reported: Option<Value>,
    /// The terminal status this worker found the pod in: from then on nothing of the
    /// pod runs again, whatever copy of the pod comes next.
    finished: Option<Value>,
    start_time: Option<Time>,
    prober: Prober,
    /// The pod's sandbox on its own network and the IPs the runtime gave it: asked of
    /// the runtime once per sandbox.
    network: Option<(String, Vec<String>)>,
}

fn pod_label(pod: &Pod) -> String {
    format!(
        "{}_{}({})",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.uid.as_deref().unwrap_or_default()
    )
}

impl Worker {
    fn event(&self, pod: &Pod, kind: EventType, reason: &str, message: &str) {
        self.ctx.events.record(pod, kind, reason, message);
    }

    async fn sync(&mut self, pod: &Pod) -> Step {
        if pod.metadata.deletion_timestamp.is_some() {
            let grace = pod
                .metadata
                .deletion_grace_period_seconds
                .unwrap_or_else(|| spec_grace(pod));
            self.terminate(Some(pod), grace).await;
            self.finish(pod).await;
            return Step::Done;
        }
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .unwrap_or("");
        if let Some(eviction) = self.ctx.eviction.requested(&self.uid) {
            let written = if self.finished.is_none() && !matches!(phase, "Succeeded" | "Failed") {
                self.evict(pod, &eviction).await
            } else {
                true
            };
            self.ctx.eviction.done(&self.uid);
            return Step::Wait((!written).then(status_retry));
        }
        if matches!(phase, "Succeeded" | "Failed") {
            // Nothing of a finished pod runs again; its sandbox is released.
            sandbox::kill_pod(&self.ctx, &self.uid, Some(pod), 0, false).await;
            return Step::Wait(None);
        }
        if let Some(status) = self.finished.clone() {
            // The pod ended here, but this copy says it runs: one the watch brought
            // before the terminal status came back (or a status someone wrote). Its
            // containers must not start again, as the kubelet never restarts a
            // finished pod; the terminal status is written again, as the kubelet's
            // status manager puts back what it knows.
            self.reported = None;
            if !self.write_status(pod, status).await {
                return Step::Wait(Some(status_retry()));
            }
            return Step::Wait(None);
        }
        match self.sync_running(pod).await {
            Ok(wake) => Step::Wait(wake),
            Err(e) => {
                warn!(pod = %pod_label(pod), error = %e, "sync pod");
                Step::Wait(Some(
                    Instant::now() + self.ctx.config.backoff_base.min(Duration::from_secs(5)),
                ))
            }
        }
    }

    /// The handler a pod runs with: its RuntimeClass's, or the node's default.
    async fn handler(&self, pod: &Pod) -> Result<String, String> {
        let Some(class) = pod
            .spec
            .as_ref()
            .and_then(|s| s.runtime_class_name.as_deref())
            .filter(|c| !c.is_empty())
        else {
            return Ok(self.ctx.config.default_handler.clone());
        };
        // From the shared informer (a sync must not cost a request); a class created
        // a moment ago may not have reached it yet, so a miss asks the server.
        let informer = self.ctx.informers.informer::<RuntimeClass>(
            Api::all(self.ctx.client.clone()),
            kube::runtime::watcher::Config::default(),
        );
        informer.wait_synced().await;
        if let Some(rc) = informer.get(class) {
            return Ok(rc.handler.clone());
        }
        let api: Api<RuntimeClass> = Api::all(self.ctx.client.clone());
        match api.get_opt(class).await {
            Ok(Some(rc)) => Ok(rc.handler),
            Ok(None) => Err(format!("RuntimeClass \"{class}\" not found")),
            Err(e) => Err(format!("read RuntimeClass \"{class}\": {e}")),
        }
    }

    async fn sync_running(&mut self, pod: &Pod) -> anyhow::Result<Option<Instant>> {
        let spec = pod.spec.clone().unwrap_or_default();
        let handler = match self.handler(pod).await {
            Ok(h) => h,
            Err(message) => {
                self.event(pod, EventType::Warning, "FailedCreatePodSandBox", &message);
                let written = self
                    .write_failed(pod, "RuntimeClassNotFound", &message)
                    .await;
                return Ok((!written).then(status_retry));
            }
        };
        if !self.ctx.config.handlers.contains(&handler) {
            let message = format!(
                "the node has no runtime handler \"{handler}\" (it has: {})",
                self.ctx.config.handlers.join(", ")
            );
            self.event(pod, EventType::Warning, "FailedCreatePodSandBox", &message);
            let written = self
                .write_failed(pod, "UnsupportedRuntimeHandler", &message)
                .await;
            return Ok((!written).then(status_retry));
        }
        if self.start_time.is_none()
            && pod.status.as_ref().is_none_or(|s| s.start_time.is_none())
            && let Err(message) = self.ctx.eviction.admit(pod)
        {
            // The kubelet's eviction admit handler: a new pod the node under
            // pressure cannot take fails here, before anything of it runs.
            self.event(pod, EventType::Warning, crate::eviction::REASON, &message);
            let written = self
                .write_failed(pod, crate::eviction::REASON, &message)
                .await;
            return Ok((!written).then(status_retry));
        }
        if self.start_time.is_none() {
            self.start_time = pod
                .status
                .as_ref()
                .and_then(|s| s.start_time.clone())
                .or_else(|| Some(Time(jiff::Timestamp::now())));
        }
        let own_network = spec::own_network(self.ctx.config.pod_network, pod);
        let sandbox_config = sandbox::sandbox_config_of(&self.ctx, pod, &self.uid, own_network);
        let ready = match sandbox::ready_sandbox(&self.ctx, &self.uid).await {
            Ok(ready) => ready,
            Err(message) => return Ok(Some(self.failed_sandbox(pod, &message))),
        };
        // On its own network the pod is seen with the IPs of its sandbox from here on:
        // its containers' downward API and its probes use them.
        let mut with_ips = None;
        if own_network && let Some(id) = &ready {
            with_ips = Some(self.with_ips(pod, id).await?);
        }
        let pod = with_ips.as_ref().unwrap_or(pod);
        let mut observed = match &ready {
            Some(id) => container::observe(&self.ctx, id).await?,
            None => HashMap::new(),
        };
        let restart_policy = spec
            .restart_policy
            .clone()
            .unwrap_or_else(|| "Always".into());
        let init_specs: &[Container] = spec.init_containers.as_deref().unwrap_or_default();
        let mut init: Vec<Slot> = init_specs.iter().map(|c| slot(c, &mut observed)).collect();
        let mut main: Vec<Slot> = spec
            .containers
            .iter()
            .map(|c| slot(c, &mut observed))
            .collect();
        let mut wake: Option<Instant> = None;
        let mut soonest = |at: Instant| {
            wake = Some(wake.map_or(at, |w: Instant| w.min(at)));
        };

        // The probes of the running containers, whose liveness the plan reads (the
        // kubelet's probe results).
        let mut unhealthy = HashMap::new();
        if plan::initialized(&init) {
            let runs: Vec<String> = main
                .iter()
                .filter_map(|s| s.current.as_ref().map(|c| c.id.clone()))
                .collect();
            self.prober.retain(&runs);
            for (container, s) in spec.containers.iter().zip(main.iter_mut()) {
                let Some(current) = s.current.as_ref().filter(|c| c.state == State::Running) else {
                    continue;
                };
                let (id, started_at) = (current.id.clone(), current.started_at);
                let outcome = self
                    .prober
                    .check(&self.ctx, pod, container, &id, started_at)
                    .await;
                for message in &outcome.unhealthy {
                    self.event(pod, EventType::Warning, "Unhealthy", message);
                }
                if let Some(at) = outcome.next {
                    soonest(at);
                }
                s.ready = outcome.ready;
                s.started = outcome.started;
                if let Some(message) = outcome.kill {
                    unhealthy.insert(container.name.clone(), message);
                }
            }
        }

        let actions =
            plan::compute_pod_actions(&restart_policy, ready.is_some(), &init, &main, &unhealthy);
        let sandbox = match ready {
            Some(id) if !actions.create_sandbox => id,
            _ if own_network && !*self.ctx.network_ready.borrow() => {
                // As the kubelet's "network is not ready: container runtime network not
                // ready": until the runtime has a network for pods (the default one on
                // the node's pod CIDR, or an operator's). Woken when it has
                // (`pods::run`).
                debug!(pod = %pod_label(pod), "waiting for the runtime's network");
                return Ok(None);
            }
            _ => {
                // As the kubelet, which tells them each time it makes a sandbox.
                sandbox::record_dns_warnings(&self.ctx, pod);
                match sandbox::run_sandbox(&self.ctx, &sandbox_config, &handler).await {
                    Ok(id) => id,
                    Err(message) => return Ok(Some(self.failed_sandbox(pod, &message))),
                }
            }
        };
        let mut with_new_ips = None;
        if own_network && self.network.as_ref().is_none_or(|(id, _)| *id != sandbox) {
            with_new_ips = Some(self.with_ips(pod, &sandbox).await?);
        }
        let pod = with_new_ips.as_ref().unwrap_or(pod);
        for kill in &actions.kill {
            self.event(pod, EventType::Normal, "Killing", &kill.reason);
            let mut runtime = self.ctx.cri.runtime.clone();
            let _ = runtime
                .stop_container(cri::StopContainerRequest {
                    container_id: kill.container_id.clone(),
                    timeout: spec_grace(pod),
                })
                .await;
            if let Some(s) = main.iter_mut().find(|s| s.name == kill.name) {
                s.ready = false;
            }
            // The next sync sees it exited and restarts it by the policy.
            soonest(Instant::now());
        }
        let mut sources = Sources::default();
        let mut volumes = None;
        if let Some(start) = &actions.start_init {
            let (container, s) = (&init_specs[start.index], &mut init[start.index]);
            if let Some(until) = self
                .start(
                    pod,
                    container,
                    start,
                    &sandbox,
                    &sandbox_config,
                    &mut volumes,
                    &mut sources,
                    s,
                )
                .await
            {
                soonest(until);
            }
        }
        for start in &actions.start {
            let (container, s) = (&spec.containers[start.index], &mut main[start.index]);
            if let Some(until) = self
                .start(
                    pod,
                    container,
                    start,
                    &sandbox,
                    &sandbox_config,
                    &mut volumes,
                    &mut sources,
                    s,
                )
                .await
            {
                soonest(until);
            }
            if s.running() {
                // Probed from the next sync on; until then ready only without
                // probes that must pass first.
                s.ready = container.readiness_probe.is_none() && container.startup_probe.is_none();
                s.started = container.startup_probe.is_none();
                if !s.ready || !s.started {
                    soonest(Instant::now() + Duration::from_millis(10));
                }
            }
        }
        let (initialized, init_failed) = (actions.initialized, actions.init_failed);

        let phase = status::phase(&init, &main, &restart_policy, init_failed);
        let terminal = matches!(phase, "Succeeded" | "Failed");
        let old_conditions = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let containers_ready = initialized && main.iter().all(|s| s.ready);
        let (pod_ip, pod_ips) = if own_network {
            let ips = self.network.as_ref().map(|(_, ips)| ips.as_slice());
            let ips = ips.unwrap_or_default();
            (
                json!(ips.first()),
                json!(ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()),
            )
        } else {
            let ip = self.ctx.config.node_ip.to_string();
            (json!(ip), json!([{"ip": ip}]))
        };
        let status = json!({
            "phase": phase,
            "conditions": status::conditions(&old_conditions, initialized, containers_ready, terminal),
            "hostIP": self.ctx.config.node_ip.to_string(),
            "hostIPs": [{"ip": self.ctx.config.node_ip.to_string()}],
            "podIP": pod_ip,
            "podIPs": pod_ips,
            "startTime": self.start_time,
            "qosClass": status::qos_class(pod),
            "initContainerStatuses": (!init.is_empty()).then(|| status::container_statuses(&init, &self.ctx.runtime_name)),
            "containerStatuses": status::container_statuses(&main, &self.ctx.runtime_name),
        });
        if terminal {
            self.finished = Some(status.clone());
        }
        if !self.write_status(pod, status).await {
            soonest(status_retry());
        }
        if terminal {
            sandbox::kill_pod(&self.ctx, &self.uid, Some(pod), 0, false).await;
        }
        Ok(wake)
    }

    /// `pod` with the IPs of its sandbox `id` in its status (asked of the runtime the
    /// first time this sandbox is seen).
    async fn with_ips(&mut self, pod: &Pod, id: &str) -> anyhow::Result<Pod> {
        if self.network.as_ref().is_none_or(|(known, _)| known != id) {
            let ips = sandbox::sandbox_ips(&self.ctx, id)
                .await
                .map_err(|e| anyhow::anyhow!("read the IPs of sandbox {id}: {e}"))?;
            self.network = Some((id.to_owned(), ips));
        }
        let ips = self.network.as_ref().map(|(_, ips)| ips.clone());
        let ips = ips.unwrap_or_default();
        let mut pod = pod.clone();
        let status = pod.status.get_or_insert_default();
        status.pod_ip = ips.first().cloned();
        status.pod_ips = Some(
            ips.into_iter()
                .map(|ip| k8s_openapi::api::core::v1::PodIP { ip })
                .collect(),
        );
        Ok(pod)
    }

    /// Tells that the pod's sandbox could not be found or made (`message`, the
    /// runtime's), and returns when to try again.
    fn failed_sandbox(&self, pod: &Pod, message: &str) -> Instant {
        self.event(
            pod,
            EventType::Warning,
            "FailedCreatePodSandBox",
            &format!("Failed to create pod sandbox: {message}"),
        );
        Instant::now() + self.ctx.config.backoff_base
    }

    /// Whether the container may restart now (`Err`: not before then), and the
    /// back-off that follows: the first restart at once, then `backoff_base` doubling up
    /// to `backoff_max`; a container that ran twice the cap starts over.
    fn may_restart(&mut self, name: &str, ran: Duration) -> Result<(), Instant> {
        let (base, max) = (self.ctx.config.backoff_base, self.ctx.config.backoff_max);
        let now = Instant::now();
        if ran >= max * 2 {
            self.backoff.remove(name);
        }
        match self.backoff.get_mut(name) {
            None => {
                self.backoff.insert(
                    name.to_owned(),
                    Backoff {
                        delay: base,
                        until: now + base,
                        announced: false,
                    },
                );
                Ok(())
            }
            Some(b) if now >= b.until => {
                b.delay = (b.delay * 2).min(max);
                b.until = now + b.delay;
                b.announced = false;
                Ok(())
            }
            Some(b) => Err(b.until),
        }
    }

    /// The waiting state of a container in back-off. The first time in a back-off
    /// window it is also told as a `BackOff` event, as the kubelet does.
    fn backing_off(&mut self, pod: &Pod, name: &str) -> (String, String) {
        let first = self
            .backoff
            .get_mut(name)
            .is_some_and(|b| !std::mem::replace(&mut b.announced, true));
        if first {
            let message = format!(
                "Back-off restarting failed container {name} in pod {}",
                pod_label(pod)
            );
            self.event(pod, EventType::Warning, "BackOff", &message);
        }
        ("CrashLoopBackOff".into(), self.backoff_message(pod, name))
    }

    fn backoff_message(&self, pod: &Pod, name: &str) -> String {
        let delay = self
            .backoff
            .get(name)
            .map(|b| b.delay)
            .unwrap_or(self.ctx.config.backoff_base);
        format!(
            "back-off {} restarting failed container={name} pod={}",
            human(delay),
            pod_label(pod)
        )
    }

    /// Starts the container as `planned`: once its back-off allows, pulls the image if
    /// the policy asks, creates and starts it; on failure sets the slot's waiting reason
    /// and returns when to try again.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        &mut self,
        pod: &Pod,
        container: &Container,
        planned: &Start,
        sandbox: &str,
        sandbox_config: &cri::PodSandboxConfig,
        volumes: &mut Option<HashMap<String, std::path::PathBuf>>,
        sources: &mut Sources,
        slot: &mut Slot,
    ) -> Option<Instant> {
        if let Some(ran) = planned.after_exit
            && let Err(until) = self.may_restart(&container.name, ran)
        {
            slot.waiting = Some(self.backing_off(pod, &container.name));
            return Some(until);
        }
        debug!(pod = %pod_label(pod), container = %container.name, attempt = planned.attempt, reason = planned.reason, "start container");
        let attempt = planned.attempt;
        let pull_key = format!("pull:{}", container.name);
        if let Some(b) = self.backoff.get(&pull_key)
            && Instant::now() < b.until
        {
            slot.waiting = Some((
                "ImagePullBackOff".into(),
                format!("Back-off pulling image \"{}\"", slot.image),
            ));
            return Some(b.until);
        }
        if let Err(message) = images::pull(&self.ctx, pod, container, sandbox_config).await {
            self.event(pod, EventType::Warning, "Failed", &message);
            self.event(pod, EventType::Warning, "Failed", "Error: ErrImagePull");
            let _ = self.may_restart(&pull_key, Duration::ZERO);
            let until = self.backoff.get(&pull_key).map(|b| b.until);
            slot.waiting = Some(("ErrImagePull".into(), message));
            return until;
        }
        self.backoff.remove(&pull_key);
        let config = match container::container_config(
            &self.ctx, &self.uid, pod, container, attempt, volumes, sources,
        )
        .await
        {
            Ok(c) => c,
            Err(e) => {
                self.event(pod, EventType::Warning, "Failed", &format!("Error: {e}"));
                slot.waiting = Some(("CreateContainerConfigError".into(), e.to_string()));
                return Some(Instant::now() + self.ctx.config.backoff_base);
            }
        };
        let mut runtime = self.ctx.cri.runtime.clone();
        let created = runtime
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: sandbox.to_owned(),
                config: Some(config),
                sandbox_config: Some(sandbox_config.clone()),
            })
            .await;
        let id = match created {
            Ok(r) => r.into_inner().container_id,
            Err(e) => {
                let message = e.message().to_owned();
                self.event(
                    pod,
                    EventType::Warning,
                    "Failed",
                    &format!("Error: {message}"),
                );
                slot.waiting = Some(("CreateContainerError".into(), message));
                return Some(Instant::now() + self.ctx.config.backoff_base);
            }
        };
        self.event(
            pod,
            EventType::Normal,
            "Created",
            &format!("Created container {}", container.name),
        );
        if let Err(e) = runtime
            .start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await
        {
            let message = e.message().to_owned();
            self.event(
                pod,
                EventType::Warning,
                "Failed",
                &format!(
                    "Error: failed to start container \"{}\": {message}",
                    container.name
                ),
            );
            slot.waiting = Some(("RunContainerError".into(), message));
            return Some(Instant::now() + self.ctx.config.backoff_base);
        }
        self.event(
            pod,
            EventType::Normal,
            "Started",
            &format!("Started container {}", container.name),
        );
        let status = runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: id.clone(),
                verbose: false,
            })
            .await
            .ok()
            .and_then(|r| r.into_inner().status)
            .unwrap_or_default();
        slot.previous = slot.current.take();
        slot.waiting = None;
        slot.current = Some(container::observed(id, attempt, status));
        None
    }
    /// Evicts the pod as the eviction manager asked: its containers stopped with the
    /// eviction's grace period, then `Failed` with reason `Evicted`, the
    /// `DisruptionTarget` condition and the containers' final states, for good (the
    /// kubelet's `killPodNow` with the eviction's status). `false` when the status
    /// write failed (it is written again at the next sync).
    async fn evict(&mut self, pod: &Pod, eviction: &crate::eviction::Eviction) -> bool {
        sandbox::kill_pod(&self.ctx, &self.uid, Some(pod), eviction.grace, false).await;
        let spec = pod.spec.clone().unwrap_or_default();
        let mut observed = match self.last_sandbox().await {
            Some(id) => container::observe(&self.ctx, &id).await.unwrap_or_default(),
            None => HashMap::new(),
        };
        let init: Vec<Slot> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| slot(c, &mut observed))
            .collect();
        let main: Vec<Slot> = spec
            .containers
            .iter()
            .map(|c| slot(c, &mut observed))
            .collect();
        let old_conditions = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let initialized = old_conditions
            .iter()
            .any(|c| c.type_ == "Initialized" && c.status == "True");
        let mut conditions = status::conditions(&old_conditions, initialized, false, true);
        conditions.retain(|c| c.type_ != "DisruptionTarget");
        conditions.push(k8s_openapi::api::core::v1::PodCondition {
            type_: "DisruptionTarget".into(),
            status: "True".into(),
            reason: Some("TerminationByKubelet".into()),
            message: Some(eviction.message.clone()),
            last_transition_time: Some(Time(jiff::Timestamp::now())),
            ..Default::default()
        });
        let status = json!({
            "phase": "Failed",
            "reason": crate::eviction::REASON,
            "message": eviction.message,
            "conditions": conditions,
            "hostIP": self.ctx.config.node_ip.to_string(),
            "startTime": self.start_time.clone().or_else(|| pod.status.as_ref().and_then(|s| s.start_time.clone())),
            "qosClass": status::qos_class(pod),
            "initContainerStatuses": (!init.is_empty()).then(|| status::container_statuses(&init, &self.ctx.runtime_name)),
            "containerStatuses": status::container_statuses(&main, &self.ctx.runtime_name),
        });
        self.finished = Some(status.clone());
        self.write_status(pod, status).await
    }

    /// The ID of the pod's newest sandbox, ready or not.
    async fn last_sandbox(&self) -> Option<String> {
        let mut runtime = self.ctx.cri.runtime.clone();
        let listed = runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest {
                filter: Some(cri::PodSandboxFilter {
                    label_selector: [(crate::labels::POD_UID.to_owned(), self.uid.clone())].into(),
                    ..Default::default()
                }),
            })
            .await
            .ok()?
            .into_inner();
        listed
            .items
            .into_iter()
            .max_by_key(|s| s.created_at)
            .map(|s| s.id)
    }

    async fn terminate(&mut self, pod: Option<&Pod>, grace: i64) {
        sandbox::kill_pod(&self.ctx, &self.uid, pod, grace.max(0), false).await;
    }

    /// After a graceful termination: the final status, everything removed, then the
    /// pod object deleted for good (grace 0, for this very pod).
    async fn finish(&mut self, pod: &Pod) {
        sandbox::kill_pod(&self.ctx, &self.uid, Some(pod), 0, true).await;
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => debug!(pod = %pod_label(pod), "pod deleted after termination"),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => warn!(pod = %pod_label(pod), error = %e, "delete a terminated pod"),
        }
    }

    /// Reports the pod Failed; `false` when the write failed (see `write_status`).
    async fn write_failed(&mut self, pod: &Pod, reason: &str, message: &str) -> bool {
        let status = json!({
            "phase": "Failed",
            "reason": reason,
            "message": message,
            "hostIP": self.ctx.config.node_ip.to_string(),
            "startTime": pod.status.as_ref().and_then(|s| s.start_time.clone()).unwrap_or(Time(jiff::Timestamp::now())),
            "qosClass": status::qos_class(pod),
        });
        // Failed for good: a copy of the pod from before must not start it.
        self.finished = Some(status.clone());
        self.write_status(pod, status).await
    }

    /// Writes the pod's status unless it is the one last written; `false` when the
    /// write failed and should be tried again.
    async fn write_status(&mut self, pod: &Pod, status: Value) -> bool {
        if self.reported.as_ref() == Some(&status) {
            return true;
        }
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), ns);
        let patch = json!({"status": status});
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => self.reported = Some(status),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            // The server is busy (its in-flight limit): client-go retries these itself.
            Err(kube::Error::Api(e)) if e.code == 429 => {
                debug!(pod = %pod_label(pod), "pod status write throttled; retrying");
                return false;
            }
            Err(e) => {
                warn!(pod = %pod_label(pod), error = %e, "write pod status");
                return false;
            }
        }
        true
    }
}

/// The slot of a spec container, with its runtime containers taken from `observed`.
fn slot(container: &Container, observed: &mut HashMap<String, Vec<Observed>>) -> Slot {
    let mut runs = observed
        .remove(&container.name)
        .unwrap_or_default()
        .into_iter();
    Slot {
        name: container.name.clone(),
        image: container.image.clone().unwrap_or_default(),
        current: runs.next(),
        previous: runs.next(),
        waiting: None,
        ready: false,
        started: true,
    }
}
