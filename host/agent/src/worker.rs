//! One pod's worker: the pod's lifecycle as a state machine the worker steps through
//! at each sync — sandbox, init containers in order, containers, restarts with
//! back-off, termination — and the status it then reports.
//!
//! A sync reads the pod (the latest version the informer has) and the runtime's
//! containers of its sandbox, does the next thing each container needs, and writes
//! the status when it changed. It runs again when the pod changes, when the relist
//! sees one of its containers change, or when a back-off it waits for ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
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
use trellis_runtime::ENV_BYTES;

use crate::Context;
use crate::logs;
use crate::probes::Prober;
use crate::spec::{self, Sources};
use crate::status::{self, Observed, Slot, State};

/// Labels the agent puts on sandboxes and containers (the kubelet's), by which it
/// finds a pod's again after a restart.
pub const POD_UID: &str = "io.kubernetes.pod.uid";
pub const POD_NAME: &str = "io.kubernetes.pod.name";
pub const POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const CONTAINER_NAME: &str = "io.kubernetes.container.name";

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
    };
    let mut last: Option<Arc<Pod>> = None;
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
                worker.stop_sandboxes(last.as_deref(), 0, true).await;
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
        if matches!(phase, "Succeeded" | "Failed") {
            // Nothing of a finished pod runs again; its sandbox is released.
            self.stop_sandboxes(Some(pod), 0, false).await;
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
        if self.start_time.is_none() {
            self.start_time = pod
                .status
                .as_ref()
                .and_then(|s| s.start_time.clone())
                .or_else(|| Some(Time(jiff::Timestamp::now())));
        }
        let (sandbox, sandbox_config) = match self.ensure_sandbox(pod, &handler).await {
            Ok(s) => s,
            Err(message) => {
                self.event(
                    pod,
                    EventType::Warning,
                    "FailedCreatePodSandBox",
                    &format!("Failed to create pod sandbox: {message}"),
                );
                return Ok(Some(Instant::now() + self.ctx.config.backoff_base));
            }
        };
        let mut observed = self.observe(&sandbox).await?;
        let restart_policy = spec
            .restart_policy
            .clone()
            .unwrap_or_else(|| "Always".into());
        let mut init: Vec<Slot> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| slot(c, &mut observed))
            .collect();
        let mut main: Vec<Slot> = spec
            .containers
            .iter()
            .map(|c| slot(c, &mut observed))
            .collect();
        let mut wake: Option<Instant> = None;
        let mut soonest = |at: Instant| {
            wake = Some(wake.map_or(at, |w: Instant| w.min(at)));
        };
        let mut sources = Sources::default();
        let mut volumes = None;
        let mut init_failed = false;

        // Init containers, one at a time, in order.
        let mut initialized = true;
        for (i, container) in spec.init_containers.iter().flatten().enumerate() {
            let s = &mut init[i];
            if s.succeeded() {
                continue;
            }
            initialized = false;
            if s.running() {
                break;
            }
            if let Some(exited) = s.exited() {
                if restart_policy == "Never" {
                    init_failed = true;
                    break;
                }
                let ran = ran_for(exited);
                if let Err(until) = self.may_restart(&container.name, ran) {
                    s.waiting = Some(self.backing_off(pod, &container.name));
                    soonest(until);
                    break;
                }
            }
            let attempt = s.current.as_ref().map(|c| c.attempt + 1).unwrap_or(0);
            if let Some(until) = self
                .start(
                    pod,
                    container,
                    attempt,
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
            break;
        }

        if initialized {
            let runs: Vec<String> = main
                .iter()
                .filter_map(|s| s.current.as_ref().map(|c| c.id.clone()))
                .collect();
            self.prober.retain(&runs);
            for (i, container) in spec.containers.iter().enumerate() {
                let s = &mut main[i];
                if let Some(current) = s.current.as_ref().filter(|c| c.state == State::Running) {
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
                        self.event(pod, EventType::Normal, "Killing", &message);
                        let grace = spec_grace(pod);
                        let mut runtime = self.ctx.cri.runtime.clone();
                        let _ = runtime
                            .stop_container(cri::StopContainerRequest {
                                container_id: id,
                                timeout: grace,
                            })
                            .await;
                        s.ready = false;
                        // The next sync sees it exited and restarts it by the policy.
                        soonest(Instant::now());
                    }
                    continue;
                }
                let attempt = match s.exited() {
                    None => s.current.as_ref().map(|c| c.attempt + 1).unwrap_or(0),
                    Some(exited) => {
                        let restart = match restart_policy.as_str() {
                            "Always" => true,
                            "OnFailure" => exited.exit_code != 0,
                            _ => false,
                        };
                        if !restart {
                            continue;
                        }
                        if let Err(until) = self.may_restart(&container.name, ran_for(exited)) {
                            s.waiting = Some(self.backing_off(pod, &container.name));
                            soonest(until);
                            continue;
                        }
                        exited.attempt + 1
                    }
                };
                if let Some(until) = self
                    .start(
                        pod,
                        container,
                        attempt,
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
                    s.ready =
                        container.readiness_probe.is_none() && container.startup_probe.is_none();
                    s.started = container.startup_probe.is_none();
                    if !s.ready || !s.started {
                        soonest(Instant::now() + Duration::from_millis(10));
                    }
                }
            }
        }

        let phase = status::phase(&init, &main, &restart_policy, init_failed);
        let terminal = matches!(phase, "Succeeded" | "Failed");
        let old_conditions = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let containers_ready = initialized && main.iter().all(|s| s.ready);
        let status = json!({
            "phase": phase,
            "conditions": status::conditions(&old_conditions, initialized, containers_ready, terminal),
            "hostIP": self.ctx.config.node_ip.to_string(),
            "hostIPs": [{"ip": self.ctx.config.node_ip.to_string()}],
            "podIP": self.ctx.config.node_ip.to_string(),
            "podIPs": [{"ip": self.ctx.config.node_ip.to_string()}],
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
            self.stop_sandboxes(Some(pod), 0, false).await;
        }
        Ok(wake)
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

    /// The pod's ready sandbox, made if there is none.
    async fn ensure_sandbox(
        &mut self,
        pod: &Pod,
        handler: &str,
    ) -> Result<(String, cri::PodSandboxConfig), String> {
        let config = self.sandbox_config(pod);
        let mut runtime = self.ctx.cri.runtime.clone();
        let listed = runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest {
                filter: Some(cri::PodSandboxFilter {
                    label_selector: [(POD_UID.to_owned(), self.uid.clone())].into(),
                    ..Default::default()
                }),
            })
            .await
            .map_err(|e| e.message().to_owned())?
            .into_inner();
        if let Some(ready) = listed
            .items
            .iter()
            .find(|s| s.state == cri::PodSandboxState::SandboxReady as i32)
        {
            return Ok((ready.id.clone(), config));
        }
        let id = runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.to_owned(),
            })
            .await
            .map_err(|e| e.message().to_owned())?
            .into_inner()
            .pod_sandbox_id;
        Ok((id, config))
    }

    fn sandbox_config(&self, pod: &Pod) -> cri::PodSandboxConfig {
        let meta = &pod.metadata;
        let name = meta.name.clone().unwrap_or_default();
        let namespace = meta.namespace.clone().unwrap_or_default();
        let mut labels: HashMap<String, String> = meta
            .labels
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        labels.insert(POD_UID.into(), self.uid.clone());
        labels.insert(POD_NAME.into(), name.clone());
        labels.insert(POD_NAMESPACE.into(), namespace.clone());
        let log_directory = logs::pod_logs_dir(
            &self.ctx.config.root.join("logs"),
            &namespace,
            &name,
            &self.uid,
        );
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name,
                uid: self.uid.clone(),
                namespace,
                attempt: 0,
            }),
            log_directory: log_directory.to_string_lossy().into_owned(),
            labels,
            annotations: meta
                .annotations
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: cri::NamespaceMode::Container as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The sandbox's containers, by container name, newest first.
    async fn observe(&self, sandbox: &str) -> anyhow::Result<HashMap<String, Vec<Observed>>> {
        let mut runtime = self.ctx.cri.runtime.clone();
        let listed = runtime
            .list_containers(cri::ListContainersRequest {
                filter: Some(cri::ContainerFilter {
                    pod_sandbox_id: sandbox.to_owned(),
                    ..Default::default()
                }),
            })
            .await
            .map_err(|e| anyhow::anyhow!("list containers: {}", e.message()))?
            .into_inner();
        let mut by_name: HashMap<String, Vec<cri::Container>> = HashMap::new();
        for c in listed.containers {
            let name = c
                .metadata
                .as_ref()
                .map(|m| m.name.clone())
                .unwrap_or_default();
            by_name.entry(name).or_default().push(c);
        }
        let mut out = HashMap::new();
        for (name, mut list) in by_name {
            list.sort_by_key(|c| {
                std::cmp::Reverse((
                    c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
                    c.created_at,
                ))
            });
            let mut seen = Vec::new();
            for (i, c) in list.iter().enumerate() {
                if i >= 2 {
                    // Older runs than the previous one: their logs are no longer asked for.
                    let _ = runtime
                        .remove_container(cri::RemoveContainerRequest {
                            container_id: c.id.clone(),
                        })
                        .await;
                    continue;
                }
                let status = runtime
                    .container_status(cri::ContainerStatusRequest {
                        container_id: c.id.clone(),
                        verbose: false,
                    })
                    .await
                    .map_err(|e| anyhow::anyhow!("container status: {}", e.message()))?
                    .into_inner()
                    .status
                    .unwrap_or_default();
                seen.push(Observed {
                    id: c.id.clone(),
                    attempt: c.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
                    state: State::from_cri(status.state),
                    exit_code: status.exit_code,
                    reason: status.reason,
                    message: status.message,
                    created_at: status.created_at,
                    started_at: status.started_at,
                    finished_at: status.finished_at,
                    image_ref: status.image_ref,
                });
            }
            out.insert(name, seen);
        }
        Ok(out)
    }

    /// Pulls the image if the policy asks, creates and starts a container of attempt
    /// `attempt`; on failure sets the slot's waiting reason and returns when to try
    /// again.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        &mut self,
        pod: &Pod,
        container: &Container,
        attempt: u32,
        sandbox: &str,
        sandbox_config: &cri::PodSandboxConfig,
        volumes: &mut Option<HashMap<String, std::path::PathBuf>>,
        sources: &mut Sources,
        slot: &mut Slot,
    ) -> Option<Instant> {
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
        if let Err(message) = self.pull(pod, container, sandbox_config).await {
            self.event(pod, EventType::Warning, "Failed", &message);
            self.event(pod, EventType::Warning, "Failed", "Error: ErrImagePull");
            let _ = self.may_restart(&pull_key, Duration::ZERO);
            let until = self.backoff.get(&pull_key).map(|b| b.until);
            slot.waiting = Some(("ErrImagePull".into(), message));
            return until;
        }
        self.backoff.remove(&pull_key);
        let config = match self
            .container_config(pod, container, attempt, volumes, sources)
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
        slot.current = Some(Observed {
            id,
            attempt,
            state: State::from_cri(status.state),
            exit_code: status.exit_code,
            reason: status.reason,
            message: status.message,
            created_at: status.created_at,
            started_at: status.started_at,
            finished_at: status.finished_at,
            image_ref: status.image_ref,
        });
        None
    }

    /// The image, pulled as `imagePullPolicy` says.
    async fn pull(
        &self,
        pod: &Pod,
        container: &Container,
        sandbox_config: &cri::PodSandboxConfig,
    ) -> Result<(), String> {
        let image = container.image.clone().unwrap_or_default();
        let spec = cri::ImageSpec {
            image: image.clone(),
            ..Default::default()
        };
        let policy = container.image_pull_policy.clone().unwrap_or_else(|| {
            if image.ends_with(":latest") || (!image.contains(':') && !image.contains('@')) {
                "Always".into()
            } else {
                "IfNotPresent".into()
            }
        });
        let mut images = self.ctx.cri.images.clone();
        if policy != "Always" {
            let present = images
                .image_status(cri::ImageStatusRequest {
                    image: Some(spec.clone()),
                    verbose: false,
                })
                .await
                .map(|r| r.into_inner().image.is_some())
                .unwrap_or(false);
            if present {
                self.event(
                    pod,
                    EventType::Normal,
                    "Pulled",
                    &format!("Container image \"{image}\" already present on machine"),
                );
                return Ok(());
            }
            if policy == "Never" {
                return Err(format!(
                    "Container image \"{image}\" is not present with pull policy of Never"
                ));
            }
        }
        self.event(
            pod,
            EventType::Normal,
            "Pulling",
            &format!("Pulling image \"{image}\""),
        );
        let started = std::time::Instant::now();
        images
            .pull_image(cri::PullImageRequest {
                image: Some(spec),
                auth: self.pull_credentials(pod, &image).await,
                sandbox_config: Some(sandbox_config.clone()),
            })
            .await
            .map_err(|e| format!("Failed to pull image \"{image}\": {}", e.message()))?;
        self.event(
            pod,
            EventType::Normal,
            "Pulled",
            &format!(
                "Successfully pulled image \"{image}\" in {}",
                human(started.elapsed())
            ),
        );
        Ok(())
    }

    /// Credentials for the image's registry from the pod's `imagePullSecrets`
    /// (`kubernetes.io/dockerconfigjson` or `kubernetes.io/dockercfg`), the first that
    /// names the registry, as the kubelet passes them to the runtime.
    async fn pull_credentials(&self, pod: &Pod, image: &str) -> Option<cri::AuthConfig> {
        let secrets = pod.spec.as_ref()?.image_pull_secrets.as_ref()?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        let registry = registry_of(image);
        let api: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(self.ctx.client.clone(), ns);
        for reference in secrets {
            let Ok(Some(secret)) = api.get_opt(&reference.name).await else {
                continue;
            };
            let data = secret.data.unwrap_or_default();
            let config: Value = match (data.get(".dockerconfigjson"), data.get(".dockercfg")) {
                (Some(json), _) => serde_json::from_slice::<Value>(&json.0)
                    .ok()
                    .and_then(|v| v.get("auths").cloned())
                    .unwrap_or_default(),
                (None, Some(cfg)) => serde_json::from_slice(&cfg.0).unwrap_or_default(),
                _ => continue,
            };
            let Some(entries) = config.as_object() else {
                continue;
            };
            for (server, entry) in entries {
                if registry_of_key(server) != registry {
                    continue;
                }
                let field = |k: &str| {
                    entry
                        .get(k)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned()
                };
                return Some(cri::AuthConfig {
                    username: field("username"),
                    password: field("password"),
                    auth: field("auth"),
                    server_address: server.clone(),
                    identity_token: field("identitytoken"),
                    registry_token: field("registrytoken"),
                });
            }
        }
        None
    }

    async fn container_config(
        &self,
        pod: &Pod,
        container: &Container,
        attempt: u32,
        volumes: &mut Option<HashMap<String, std::path::PathBuf>>,
        sources: &mut Sources,
    ) -> Result<cri::ContainerConfig, spec::ConfigError> {
        if volumes.is_none() {
            *volumes = Some(spec::volumes(&self.ctx, pod, sources).await?);
        }
        let mounts = spec::mounts(container, volumes.as_ref().unwrap_or(&HashMap::new()))?;
        let env = spec::environment(&self.ctx, pod, container, sources).await?;
        // CRI's arguments are strings: a reference to a value that is not UTF-8 is
        // passed as its closest string.
        let expand = |list: &Option<Vec<String>>| -> Vec<String> {
            list.iter()
                .flatten()
                .map(|s| String::from_utf8_lossy(&spec::expand(s, &env)).into_owned())
                .collect()
        };
        let (command, args) = (expand(&container.command), expand(&container.args));
        let mut annotations = annotations(container, attempt);
        let envs = self.cri_environment(container, env, &mut annotations)?;
        let memory_limit = container
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .and_then(|q| q.0.parse::<trellis_quantity::Quantity>().ok())
            .map(|q| q.value())
            .unwrap_or(0);
        let meta = &pod.metadata;
        let labels: HashMap<String, String> = [
            (POD_UID, self.uid.clone()),
            (POD_NAME, meta.name.clone().unwrap_or_default()),
            (POD_NAMESPACE, meta.namespace.clone().unwrap_or_default()),
            (CONTAINER_NAME, container.name.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Ok(cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: container.name.clone(),
                attempt,
            }),
            image: Some(cri::ImageSpec {
                image: container.image.clone().unwrap_or_default(),
                ..Default::default()
            }),
            command,
            args,
            working_dir: container.working_dir.clone().unwrap_or_default(),
            envs,
            mounts,
            labels,
            annotations,
            log_path: format!("{}/{attempt}.log", container.name),
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: memory_limit,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    /// The environment as CRI carries it. Its values are protobuf strings, which this
    /// client can only send as UTF-8: a value that is not (a Secret's bytes) goes to
    /// Trellis' runtime in [`ENV_BYTES`] instead, as the kubelet's bytes reach
    /// containerd; another runtime cannot be given it unchanged, so the container
    /// fails with the reason rather than get a different value.
    fn cri_environment(
        &self,
        container: &Container,
        env: spec::Environment,
        annotations: &mut HashMap<String, String>,
    ) -> Result<Vec<cri::KeyValue>, spec::ConfigError> {
        let mut raw = serde_json::Map::new();
        let mut envs = Vec::with_capacity(env.len());
        for (key, value) in env {
            let value = match String::from_utf8(value) {
                Ok(value) => value,
                Err(e) if self.ctx.runtime_name == "trellis" => {
                    raw.insert(key.clone(), BASE64.encode(e.as_bytes()).into());
                    String::new()
                }
                Err(_) => {
                    return Err(spec::ConfigError(format!(
                        "environment variable {key} of container {:?} is not valid UTF-8, which the {} runtime cannot be given over CRI",
                        container.name, self.ctx.runtime_name
                    )));
                }
            };
            envs.push(cri::KeyValue { key, value });
        }
        if !raw.is_empty() {
            annotations.insert(ENV_BYTES.to_owned(), Value::Object(raw).to_string());
        }
        Ok(envs)
    }

    /// Stops the pod's containers (SIGTERM, `grace` seconds, then SIGKILL) and its
    /// sandboxes; with `remove`, removes them and the pod's files too.
    async fn stop_sandboxes(&self, pod: Option<&Pod>, grace: i64, remove: bool) {
        let mut runtime = self.ctx.cri.runtime.clone();
        let Ok(listed) = runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest {
                filter: Some(cri::PodSandboxFilter {
                    label_selector: [(POD_UID.to_owned(), self.uid.clone())].into(),
                    ..Default::default()
                }),
            })
            .await
        else {
            return;
        };
        for sandbox in listed.into_inner().items {
            if let Ok(containers) = runtime
                .list_containers(cri::ListContainersRequest {
                    filter: Some(cri::ContainerFilter {
                        pod_sandbox_id: sandbox.id.clone(),
                        state: Some(cri::ContainerStateValue {
                            state: cri::ContainerState::ContainerRunning as i32,
                        }),
                        ..Default::default()
                    }),
                })
                .await
            {
                let stops = containers.into_inner().containers.into_iter().map(|c| {
                    let mut runtime = runtime.clone();
                    let name = c
                        .metadata
                        .as_ref()
                        .map(|m| m.name.clone())
                        .unwrap_or_default();
                    if let Some(pod) = pod {
                        self.event(
                            pod,
                            EventType::Normal,
                            "Killing",
                            &format!("Stopping container {name}"),
                        );
                    }
                    async move {
                        let _ = runtime
                            .stop_container(cri::StopContainerRequest {
                                container_id: c.id,
                                timeout: grace,
                            })
                            .await;
                    }
                });
                futures::future::join_all(stops).await;
            }
            if sandbox.state == cri::PodSandboxState::SandboxReady as i32 {
                let _ = runtime
                    .stop_pod_sandbox(cri::StopPodSandboxRequest {
                        pod_sandbox_id: sandbox.id.clone(),
                    })
                    .await;
            }
            if remove {
                let _ = runtime
                    .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                        pod_sandbox_id: sandbox.id.clone(),
                    })
                    .await;
            }
        }
        if remove {
            let dir = spec::pod_dir(&self.ctx, &self.uid);
            if let Err(e) = std::fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                warn!(dir = %dir.display(), error = %e, "remove the pod's files");
            }
            if let Some(pod) = pod {
                let meta = &pod.metadata;
                let dir = logs::pod_logs_dir(
                    &self.ctx.config.root.join("logs"),
                    meta.namespace.as_deref().unwrap_or_default(),
                    meta.name.as_deref().unwrap_or_default(),
                    &self.uid,
                );
                if let Err(e) = std::fs::remove_dir_all(&dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!(dir = %dir.display(), error = %e, "remove the pod's logs");
                }
            }
        }
    }

    async fn terminate(&mut self, pod: Option<&Pod>, grace: i64) {
        self.stop_sandboxes(pod, grace.max(0), false).await;
    }

    /// After a graceful termination: the final status, everything removed, then the
    /// pod object deleted for good (grace 0, for this very pod).
    async fn finish(&mut self, pod: &Pod) {
        self.stop_sandboxes(Some(pod), 0, true).await;
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

/// A container's annotations, as the kubelet writes them: its restart count and its
/// ports (a `wasi:http` component is served on the first).
fn annotations(container: &Container, attempt: u32) -> HashMap<String, String> {
    let mut out = HashMap::from([(
        "io.kubernetes.container.restartCount".to_owned(),
        attempt.to_string(),
    )]);
    if let Some(ports) = container.ports.as_ref().filter(|p| !p.is_empty()) {
        let list: Vec<Value> = ports
            .iter()
            .map(|p| {
                json!({"name": p.name, "containerPort": p.container_port,
                       "protocol": p.protocol.as_deref().unwrap_or("TCP")})
            })
            .collect();
        out.insert(
            "io.kubernetes.container.ports".into(),
            Value::Array(list).to_string(),
        );
    }
    out
}

/// The registry host of an image reference, as Docker names them: the first path
/// part when it looks like a host (a dot, a port, or `localhost`), else Docker Hub.
fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((host, _)) if host.contains('.') || host.contains(':') || host == "localhost" => {
            host.to_owned()
        }
        _ => "docker.io".to_owned(),
    }
}

/// The registry host a docker config key names (`https://host/v1/`, `host:5000`).
fn registry_of_key(key: &str) -> String {
    let host = key
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    match host {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_owned(),
        other => other.to_owned(),
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

/// How long a run lasted; zero for one that never started (a `StartError`: its start
/// time is unset), which the back-off must count as a crash, not as a long run.
fn ran_for(o: &Observed) -> Duration {
    if o.started_at <= 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos((o.finished_at - o.started_at).max(0) as u64)
}

/// A duration as Go prints one (`10s`, `1m20s`, `250ms`).
fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, 0) => format!("{m}m0s"),
        (m, s) => format!("{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_are_named_as_docker_names_them() {
        assert_eq!(registry_of("127.0.0.1:5000/wasm/app:v1"), "127.0.0.1:5000");
        assert_eq!(registry_of("ghcr.io/org/app"), "ghcr.io");
        assert_eq!(registry_of("nginx"), "docker.io");
        assert_eq!(registry_of("library/nginx:1"), "docker.io");
        assert_eq!(registry_of_key("https://index.docker.io/v1/"), "docker.io");
        assert_eq!(registry_of_key("127.0.0.1:5000"), "127.0.0.1:5000");
    }
}
