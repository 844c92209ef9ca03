//! What a pod needs now, as the kubelet's `computePodActions` decides it: from the
//! pod's restart policy, whether its sandbox is ready, what the runtime says of its
//! containers and which of them failed their liveness probe — whether a sandbox must be
//! made, which containers to kill and which to start, each with its reason. Nothing
//! here asks the runtime or the clock; the worker carries the plan out, and the
//! back-off of a container that exited is its to check.

use std::collections::HashMap;
use std::time::Duration;

use crate::status::{Observed, Slot};

/// What a sync does to the pod.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PodActions {
    /// No sandbox of the pod is ready: a new one is made, and everything starts over
    /// in it (init containers from the first, every run as attempt 0).
    pub create_sandbox: bool,
    /// Running containers to stop.
    pub kill: Vec<Kill>,
    /// Every init container succeeded, so the pod's containers may run.
    pub initialized: bool,
    /// An init container failed and the restart policy (`Never`) does not run it again:
    /// the pod has failed.
    pub init_failed: bool,
    /// The init container to start next: they run one at a time, in order.
    pub start_init: Option<Start>,
    /// The containers to start, in the spec's order.
    pub start: Vec<Start>,
}

/// A container to start.
#[derive(Debug, PartialEq, Eq)]
pub struct Start {
    /// Its place in the spec's list (of init containers for `start_init`).
    pub index: usize,
    /// The run it starts as: its restart count.
    pub attempt: u32,
    /// `Some` when it ran and exited: it starts again only once its back-off allows,
    /// and how long it ran decides whether that back-off starts over.
    pub after_exit: Option<Duration>,
    /// Why, for the log.
    pub reason: &'static str,
}

/// A running container to stop.
#[derive(Debug, PartialEq, Eq)]
pub struct Kill {
    /// Its name in the pod.
    pub name: String,
    pub container_id: String,
    /// Why: the message of its `Killing` event.
    pub reason: String,
}

/// The plan of one sync. `init` and `main` are the spec's init containers and
/// containers with what the runtime said of them; `unhealthy` is the message of each
/// running container whose liveness probe failed, by name.
pub fn compute_pod_actions(
    restart_policy: &str,
    sandbox_ready: bool,
    init: &[Slot],
    main: &[Slot],
    unhealthy: &HashMap<String, String>,
) -> PodActions {
    if !sandbox_ready {
        // The containers of a sandbox that is gone go with it; the pod starts over.
        let kill = init
            .iter()
            .chain(main)
            .filter_map(|s| {
                let current = s.current.as_ref().filter(|_| s.running())?;
                Some(Kill {
                    name: s.name.clone(),
                    container_id: current.id.clone(),
                    reason: format!(
                        "Stopping container {}: its pod sandbox is not ready",
                        s.name
                    ),
                })
            })
            .collect();
        let fresh = |slots: &[Slot]| -> Vec<Slot> {
            slots
                .iter()
                .map(|s| Slot {
                    name: s.name.clone(),
                    image: s.image.clone(),
                    ..Default::default()
                })
                .collect()
        };
        return PodActions {
            create_sandbox: true,
            kill,
            ..compute_pod_actions(
                restart_policy,
                true,
                &fresh(init),
                &fresh(main),
                &HashMap::new(),
            )
        };
    }
    let mut actions = PodActions {
        initialized: initialized(init),
        ..Default::default()
    };
    for (index, s) in init.iter().enumerate() {
        if s.succeeded() {
            continue;
        }
        if s.running() {
            break;
        }
        let after_exit = match s.exited() {
            Some(_) if restart_policy == "Never" => {
                actions.init_failed = true;
                break;
            }
            Some(exited) => Some(ran_for(exited)),
            None => None,
        };
        actions.start_init = Some(Start {
            index,
            attempt: next_attempt(s),
            after_exit,
            reason: if after_exit.is_some() {
                "init container failed and the restart policy runs it again"
            } else {
                "init container is next"
            },
        });
        break;
    }
    if !actions.initialized {
        return actions;
    }
    for (index, s) in main.iter().enumerate() {
        if let Some(current) = s.current.as_ref().filter(|_| s.running()) {
            if let Some(message) = unhealthy.get(&s.name) {
                actions.kill.push(Kill {
                    name: s.name.clone(),
                    container_id: current.id.clone(),
                    reason: message.clone(),
                });
            }
            continue;
        }
        let after_exit = match s.exited() {
            None => None,
            Some(exited) => {
                let restart = match restart_policy {
                    "Always" => true,
                    "OnFailure" => exited.exit_code != 0,
                    _ => false,
                };
                if !restart {
                    continue;
                }
                Some(ran_for(exited))
            }
        };
        actions.start.push(Start {
            index,
            attempt: next_attempt(s),
            after_exit,
            reason: if after_exit.is_some() {
                "container exited and the restart policy restarts it"
            } else {
                "container is not running"
            },
        });
    }
    actions
}

/// Whether every init container succeeded, so that the pod's containers may run.
pub fn initialized(init: &[Slot]) -> bool {
    init.iter().all(Slot::succeeded)
}

/// The run a container starts as next: one after its latest, or the first.
fn next_attempt(s: &Slot) -> u32 {
    s.current.as_ref().map(|c| c.attempt + 1).unwrap_or(0)
}

/// How long a run lasted; zero for one that never started (a `StartError`: its start
/// time is unset), which the back-off must count as a crash, not as a long run.
pub fn ran_for(o: &Observed) -> Duration {
    if o.started_at <= 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos((o.finished_at - o.started_at).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::State;

    const SECOND: i64 = 1_000_000_000;

    fn waiting(name: &str) -> Slot {
        Slot {
            name: name.into(),
            ..Default::default()
        }
    }

    fn running(name: &str, attempt: u32) -> Slot {
        Slot {
            current: Some(Observed {
                id: format!("{name}-{attempt}"),
                attempt,
                state: State::Running,
                started_at: SECOND,
                ..Default::default()
            }),
            ..waiting(name)
        }
    }

    fn exited(name: &str, attempt: u32, exit_code: i32) -> Slot {
        Slot {
            current: Some(Observed {
                id: format!("{name}-{attempt}"),
                attempt,
                state: State::Exited,
                exit_code,
                started_at: SECOND,
                finished_at: 4 * SECOND,
                ..Default::default()
            }),
            ..waiting(name)
        }
    }

    fn plan(policy: &str, init: &[Slot], main: &[Slot]) -> PodActions {
        compute_pod_actions(policy, true, init, main, &HashMap::new())
    }

    fn started(actions: &PodActions) -> Vec<(usize, u32)> {
        actions.start.iter().map(|s| (s.index, s.attempt)).collect()
    }

    #[test]
    fn a_new_pod_starts_every_container_as_attempt_0() {
        let actions = plan("Always", &[], &[waiting("a"), waiting("b")]);
        assert!(actions.initialized && !actions.create_sandbox);
        assert_eq!(started(&actions), [(0, 0), (1, 0)]);
        assert!(actions.start.iter().all(|s| s.after_exit.is_none()));
    }

    #[test]
    fn a_crashed_container_with_restart_policy_never_is_not_restarted() {
        let actions = plan("Never", &[], &[exited("a", 0, 1), running("b", 0)]);
        assert!(actions.start.is_empty() && actions.kill.is_empty());
    }

    #[test]
    fn on_failure_restarts_only_a_failed_container_after_its_back_off() {
        let actions = plan("OnFailure", &[], &[exited("ok", 0, 0), exited("bad", 2, 1)]);
        assert_eq!(started(&actions), [(1, 3)]);
        assert_eq!(actions.start[0].after_exit, Some(Duration::from_secs(3)));
        let actions = plan("Always", &[], &[exited("ok", 0, 0)]);
        assert_eq!(started(&actions), [(0, 1)]);
    }

    #[test]
    fn a_run_that_never_started_counts_as_a_crash() {
        let mut slot = exited("a", 0, 128);
        if let Some(c) = slot.current.as_mut() {
            c.started_at = 0;
        }
        let actions = plan("Always", &[], &[slot]);
        assert_eq!(actions.start[0].after_exit, Some(Duration::ZERO));
    }

    #[test]
    fn a_container_that_failed_its_liveness_probe_is_killed_not_started() {
        let unhealthy = HashMap::from([("a".to_owned(), "liveness probe failed".to_owned())]);
        let actions = compute_pod_actions(
            "Always",
            true,
            &[],
            &[running("a", 1), running("b", 0)],
            &unhealthy,
        );
        assert_eq!(
            actions.kill,
            [Kill {
                name: "a".into(),
                container_id: "a-1".into(),
                reason: "liveness probe failed".into(),
            }]
        );
        assert!(actions.start.is_empty());
    }

    #[test]
    fn init_containers_run_one_at_a_time_before_the_containers() {
        let init = [exited("first", 0, 0), waiting("second"), waiting("third")];
        let actions = plan("Always", &init, &[waiting("app")]);
        assert!(!actions.initialized);
        assert_eq!(actions.start_init.as_ref().map(|s| s.index), Some(1));
        assert!(actions.start.is_empty());
        // One running: nothing more starts.
        let init = [running("first", 0), waiting("second")];
        let actions = plan("Always", &init, &[waiting("app")]);
        assert!(actions.start_init.is_none() && actions.start.is_empty());
    }

    #[test]
    fn a_failed_init_container_fails_the_pod_under_never_and_restarts_otherwise() {
        let init = [exited("setup", 0, 1)];
        let actions = plan("Never", &init, &[waiting("app")]);
        assert!(actions.init_failed && actions.start_init.is_none());
        let actions = plan("OnFailure", &init, &[waiting("app")]);
        assert!(!actions.init_failed);
        let start = actions.start_init.expect("restarted");
        assert_eq!((start.index, start.attempt), (0, 1));
        assert!(start.after_exit.is_some());
    }

    #[test]
    fn a_dead_sandbox_kills_everything_and_starts_over_in_a_new_one() {
        let init = [exited("setup", 0, 0)];
        let main = [running("app", 4), exited("side", 1, 1)];
        let actions = compute_pod_actions("Always", false, &init, &main, &HashMap::new());
        assert!(actions.create_sandbox);
        let killed: Vec<&str> = actions
            .kill
            .iter()
            .map(|k| k.container_id.as_str())
            .collect();
        assert_eq!(killed, ["app-4"]);
        // The init container runs again first, as the first run of the new sandbox.
        assert!(!actions.initialized);
        let start = actions.start_init.expect("init starts over");
        assert_eq!((start.index, start.attempt, start.after_exit), (0, 0, None));
        assert!(actions.start.is_empty());
    }
}
