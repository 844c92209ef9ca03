//! A pod's status as the kubelet reports it, from what the runtime says of its
//! containers: phase, conditions, container statuses, QoS class.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, Pod, PodCondition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// One container of the runtime, as the agent reads it.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub id: String,
    /// The restart count it was started as.
    pub attempt: u32,
    pub state: State,
    pub exit_code: i32,
    pub reason: String,
    pub message: String,
    pub created_at: i64,
    pub started_at: i64,
    pub finished_at: i64,
    pub image_ref: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum State {
    #[default]
    Created,
    Running,
    Exited,
    Unknown,
}

impl State {
    pub fn from_cri(state: i32) -> Self {
        match k8s_cri::v1::ContainerState::try_from(state) {
            Ok(k8s_cri::v1::ContainerState::ContainerCreated) => Self::Created,
            Ok(k8s_cri::v1::ContainerState::ContainerRunning) => Self::Running,
            Ok(k8s_cri::v1::ContainerState::ContainerExited) => Self::Exited,
            _ => Self::Unknown,
        }
    }
}

/// What the agent knows of one container of the pod spec.
#[derive(Clone, Debug, Default)]
pub struct Slot {
    pub name: String,
    pub image: String,
    /// The latest container, and the one before it (`lastState`).
    pub current: Option<Observed>,
    pub previous: Option<Observed>,
    /// Why it is not running, when the agent knows better than the runtime
    /// (`ContainerCreating`, `CrashLoopBackOff`, `ErrImagePull`, …).
    pub waiting: Option<(String, String)>,
    pub ready: bool,
    /// Its startup probe passed (or it has none).
    pub started: bool,
}

impl Slot {
    pub fn restart_count(&self) -> u32 {
        self.current.as_ref().map(|c| c.attempt).unwrap_or(0)
    }

    pub fn running(&self) -> bool {
        self.current
            .as_ref()
            .is_some_and(|c| c.state == State::Running)
    }

    pub fn exited(&self) -> Option<&Observed> {
        self.current.as_ref().filter(|c| c.state == State::Exited)
    }

    pub fn succeeded(&self) -> bool {
        self.exited().is_some_and(|c| c.exit_code == 0)
    }
}

fn time(ns: i64) -> Option<Time> {
    (ns > 0).then(|| Time(jiff::Timestamp::from_nanosecond(ns as i128).unwrap_or_default()))
}

fn state_of(o: &Observed, container_id: &str) -> ContainerState {
    match o.state {
        State::Running => ContainerState {
            running: Some(ContainerStateRunning {
                started_at: time(o.started_at),
            }),
            ..Default::default()
        },
        State::Exited | State::Unknown => ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: o.exit_code,
                reason: Some(if o.reason.is_empty() {
                    if o.exit_code == 0 {
                        "Completed"
                    } else {
                        "Error"
                    }
                    .to_owned()
                } else {
                    o.reason.clone()
                }),
                message: (!o.message.is_empty()).then(|| o.message.clone()),
                started_at: time(o.started_at),
                finished_at: time(o.finished_at),
                container_id: Some(container_id.to_owned()),
                signal: None,
            }),
            ..Default::default()
        },
        State::Created => ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("ContainerCreating".into()),
                message: None,
            }),
            ..Default::default()
        },
    }
}

/// The container statuses of `slots`; `runtime` prefixes container IDs
/// (`trellis://ID`).
pub fn container_statuses(slots: &[Slot], runtime: &str) -> Vec<ContainerStatus> {
    slots
        .iter()
        .map(|slot| {
            let id = slot
                .current
                .as_ref()
                .map(|c| format!("{runtime}://{}", c.id));
            let state = match (&slot.waiting, &slot.current) {
                (Some((reason, message)), current)
                    if current.as_ref().is_none_or(|c| c.state != State::Running) =>
                {
                    ContainerState {
                        waiting: Some(ContainerStateWaiting {
                            reason: Some(reason.clone()),
                            message: (!message.is_empty()).then(|| message.clone()),
                        }),
                        ..Default::default()
                    }
                }
                (_, Some(c)) => state_of(c, id.as_deref().unwrap_or_default()),
                (_, None) => ContainerState {
                    waiting: Some(ContainerStateWaiting {
                        reason: Some("ContainerCreating".into()),
                        message: None,
                    }),
                    ..Default::default()
                },
            };
            // A container waiting to restart reports the run that ended as lastState.
            let last = if state.waiting.is_some()
                && slot
                    .current
                    .as_ref()
                    .is_some_and(|c| c.state == State::Exited)
            {
                slot.current.as_ref()
            } else {
                slot.previous.as_ref()
            };
            ContainerStatus {
                name: slot.name.clone(),
                image: slot.image.clone(),
                image_id: slot
                    .current
                    .as_ref()
                    .map(|c| c.image_ref.clone())
                    .unwrap_or_default(),
                container_id: id,
                ready: slot.ready,
                started: Some(slot.running() && slot.started),
                restart_count: slot.restart_count() as i32,
                last_state: last.map(|o| state_of(o, &format!("{runtime}://{}", o.id))),
                state: Some(state),
                ..Default::default()
            }
        })
        .collect()
}

/// The pod's phase, as the kubelet's `getPhase`.
pub fn phase(
    init: &[Slot],
    containers: &[Slot],
    restart_policy: &str,
    init_failed: bool,
) -> &'static str {
    if init_failed {
        return "Failed";
    }
    if !init.iter().all(Slot::succeeded) {
        return "Pending";
    }
    let (mut waiting, mut running, mut succeeded, mut failed) = (0, 0, 0, 0);
    for slot in containers {
        match (&slot.current, slot.running()) {
            (_, true) => running += 1,
            (Some(c), false) if c.state == State::Exited => {
                if c.exit_code == 0 {
                    succeeded += 1
                } else {
                    failed += 1
                }
            }
            _ => waiting += 1,
        }
    }
    if waiting > 0 && running == 0 && succeeded == 0 && failed == 0 {
        return "Pending";
    }
    if waiting > 0 || running > 0 {
        return "Running";
    }
    match restart_policy {
        "Always" => "Running",
        "OnFailure" if failed > 0 => "Running",
        _ if failed > 0 => "Failed",
        _ => "Succeeded",
    }
}

/// `Initialized`, `ContainersReady` and `Ready`, with their transition times kept
/// when unchanged; other conditions (`PodScheduled`, …) as they were.
pub fn conditions(
    old: &[PodCondition],
    initialized: bool,
    containers_ready: bool,
    terminal: bool,
) -> Vec<PodCondition> {
    let now = Time(jiff::Timestamp::now());
    // Ready follows ContainersReady (no readiness gates here), with the same reason.
    let not_ready = match (containers_ready, terminal) {
        (true, _) => None,
        (false, true) => Some("PodCompleted"),
        (false, false) => Some("ContainersNotReady"),
    };
    let mine = [
        (
            "Initialized",
            initialized,
            (!initialized).then_some("ContainersNotInitialized"),
        ),
        ("ContainersReady", containers_ready, not_ready),
        ("Ready", containers_ready, not_ready),
    ];
    let mut out: Vec<PodCondition> = old
        .iter()
        .filter(|c| !mine.iter().any(|(t, _, _)| *t == c.type_))
        .cloned()
        .collect();
    for (kind, ok, reason) in mine {
        let status = if ok { "True" } else { "False" };
        let before = old.iter().find(|c| c.type_ == kind);
        let transition = match before {
            Some(c) if c.status == status => c.last_transition_time.clone(),
            _ => Some(now.clone()),
        };
        out.push(PodCondition {
            type_: kind.into(),
            status: status.into(),
            reason: reason.map(str::to_owned),
            last_transition_time: transition,
            ..Default::default()
        });
    }
    out
}

/// Kubernetes' QoS class of a pod (`GetPodQOS`), from the CPU and memory of its
/// containers and init containers: none asked (or all zero) is BestEffort; a limit of
/// both in every container, the pod's requests (a missing one is its limit) summed
/// equal to its limits summed, is Guaranteed; anything else Burstable. The class a
/// status already reports stays (it cannot change for a pod).
pub fn qos_class(pod: &Pod) -> &'static str {
    match pod.status.as_ref().and_then(|s| s.qos_class.as_deref()) {
        Some("Guaranteed") => return "Guaranteed",
        Some("Burstable") => return "Burstable",
        Some("BestEffort") => return "BestEffort",
        _ => {}
    }
    let Some(spec) = &pod.spec else {
        return "BestEffort";
    };
    let parse = |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| {
        q.0.parse::<trellis_quantity::Quantity>()
            .ok()
            .filter(|q| !q.is_zero())
    };
    let mut requests: BTreeMap<&str, trellis_quantity::Quantity> = BTreeMap::new();
    let mut limits: BTreeMap<&str, trellis_quantity::Quantity> = BTreeMap::new();
    let mut guaranteed = true;
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        let r = c.resources.as_ref();
        for (list, into) in [
            (r.and_then(|r| r.requests.as_ref()), &mut requests),
            (r.and_then(|r| r.limits.as_ref()), &mut limits),
        ] {
            for res in ["cpu", "memory"] {
                if let Some(q) = list.and_then(|l| l.get(res)).and_then(parse) {
                    let sum = into
                        .entry(res)
                        .or_insert_with(|| trellis_quantity::Quantity::from_units(0));
                    *sum = sum.saturating_add(q);
                }
            }
        }
        let limited = |res: &str| {
            r.and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get(res))
                .and_then(parse)
                .is_some()
        };
        if !limited("cpu") || !limited("memory") {
            guaranteed = false;
        }
        // A request left out is its limit (the API server's default).
        for res in ["cpu", "memory"] {
            let requested = r
                .and_then(|r| r.requests.as_ref())
                .and_then(|l| l.get(res))
                .is_some();
            if !requested
                && let Some(q) = r
                    .and_then(|r| r.limits.as_ref())
                    .and_then(|l| l.get(res))
                    .and_then(parse)
            {
                let sum = requests
                    .entry(res)
                    .or_insert_with(|| trellis_quantity::Quantity::from_units(0));
                *sum = sum.saturating_add(q);
            }
        }
    }
    if requests.is_empty() && limits.is_empty() {
        return "BestEffort";
    }
    if guaranteed
        && requests.iter().all(|(res, req)| {
            limits
                .get(res)
                .is_some_and(|lim| lim.milli_value() == req.milli_value())
        })
    {
        return "Guaranteed";
    }
    "Burstable"
}

/// A duration as Go prints one (`10s`, `1m20s`, `250ms`).
pub fn human(d: Duration) -> String {
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

    fn slot(state: Option<(State, i32)>) -> Slot {
        Slot {
            name: "c".into(),
            current: state.map(|(state, exit_code)| Observed {
                state,
                exit_code,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn phase_as_the_kubelet() {
        let done = slot(Some((State::Exited, 0)));
        let crashed = slot(Some((State::Exited, 2)));
        let running = slot(Some((State::Running, 0)));
        let none = slot(None);
        assert_eq!(
            phase(&[], std::slice::from_ref(&none), "Always", false),
            "Pending"
        );
        assert_eq!(
            phase(&[], &[running.clone(), none.clone()], "Always", false),
            "Running"
        );
        assert_eq!(
            phase(&[], std::slice::from_ref(&done), "Never", false),
            "Succeeded"
        );
        assert_eq!(
            phase(&[], &[done.clone(), crashed.clone()], "Never", false),
            "Failed"
        );
        assert_eq!(
            phase(&[], std::slice::from_ref(&crashed), "OnFailure", false),
            "Running"
        );
        assert_eq!(
            phase(&[], std::slice::from_ref(&done), "Always", false),
            "Running"
        );
        assert_eq!(
            phase(
                std::slice::from_ref(&running),
                std::slice::from_ref(&none),
                "Always",
                false
            ),
            "Pending"
        );
        assert_eq!(phase(&[crashed], &[none], "Never", true), "Failed");
    }

    #[test]
    fn qos_classes() {
        let pod = |resources: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "c", "resources": resources}]}
            }))
            .unwrap_or_default()
        };
        assert_eq!(qos_class(&pod(serde_json::json!({}))), "BestEffort");
        assert_eq!(
            qos_class(&pod(
                serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}})
            )),
            "Guaranteed"
        );
        assert_eq!(
            qos_class(&pod(serde_json::json!({"requests": {"cpu": "1"}}))),
            "Burstable"
        );
        // Quantities, not strings: 1 CPU is 1000m.
        assert_eq!(
            qos_class(&pod(serde_json::json!({
                "requests": {"cpu": "1000m", "memory": "1024Mi"},
                "limits": {"cpu": "1", "memory": "1Gi"}}))),
            "Guaranteed"
        );
        assert_eq!(
            qos_class(&pod(serde_json::json!({
                "requests": {"cpu": "500m"}, "limits": {"cpu": "1", "memory": "1Gi"}}))),
            "Burstable"
        );
        // Zero asks nothing.
        assert_eq!(
            qos_class(&pod(serde_json::json!({"requests": {"cpu": "0"}}))),
            "BestEffort"
        );
    }
}
