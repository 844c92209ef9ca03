//! The runtime's live state: the tables of sandbox and container records in memory,
//! kept by a [`Store`] (files, so a restarted runtime finds them, or nothing for a
//! hollow node), and the container events stream. A running container also has a
//! [`Live`] part that dies with the runtime: how to stop it and who waits for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_cri::v1::{ContainerEventResponse, ContainerEventType, ContainerState};
use tokio::sync::{Notify, broadcast, watch};

use crate::cgroup;
use crate::log::LogFile;
use crate::record::{ContainerRecord, ImageKind, SandboxRecord, now_ns};
use crate::store::Store;

/// Events kept for a slow `GetContainerEvents` reader before it misses some.
const EVENT_BACKLOG: usize = 256;

/// How a container ended.
#[derive(Debug)]
pub(crate) struct Exit {
    pub code: i32,
    pub reason: &'static str,
    pub message: String,
}

impl Exit {
    /// A program that ended by itself with `code`.
    pub(crate) fn code(code: i32) -> Self {
        Self {
            code,
            reason: if code == 0 { "Completed" } else { "Error" },
            message: String::new(),
        }
    }
}

/// A running container's part that lives in memory only.
#[derive(Debug)]
pub(crate) struct Live {
    /// Set to true once the container's record says EXITED (and its output is in
    /// the log); stoppers wait on it.
    pub exited: watch::Sender<bool>,
    pub stop: Stopper,
    pub log: Option<Arc<LogFile>>,
    /// Tasks watching a process and copying its output: they end with the runtime.
    pub tasks: Vec<tokio::task::AbortHandle>,
    /// Bytes of linear memory a WASM program holds.
    pub memory: Option<Arc<AtomicU64>>,
}

#[derive(Clone, Debug)]
pub(crate) enum Stopper {
    Process {
        pid: i32,
    },
    Wasm(Arc<Cancel>),
    /// A hollow container: nothing runs.
    Hollow,
}

/// Asks a WASM container to end. A program: the flag stops guest code at its next
/// epoch check, the notification wakes a guest waiting in a host call. An HTTP
/// handler: the notification stops its listening, and requests in flight get the
/// grace before their instances are cancelled.
#[derive(Debug, Default)]
pub(crate) struct Cancel {
    pub flag: AtomicBool,
    pub notify: Notify,
    /// The grace a stop gave, in milliseconds (`StopContainer`'s timeout).
    grace_ms: AtomicU64,
}

impl Cancel {
    /// Ends the container at once.
    pub(crate) fn cancel(&self) {
        self.stop(Duration::ZERO);
    }

    /// Ends the container, giving work in flight up to `grace` (only an HTTP handler
    /// has any: a program is cancelled at once).
    pub(crate) fn stop(&self, grace: Duration) {
        let ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        self.grace_ms.store(ms, Ordering::Relaxed);
        self.flag.store(true, Ordering::Relaxed);
        self.notify.notify_one();
    }

    /// The grace the stop gave.
    pub(crate) fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms.load(Ordering::Relaxed))
    }
}

#[derive(Debug)]
pub(crate) struct Container {
    pub record: ContainerRecord,
    pub live: Option<Live>,
}

#[derive(Debug, Default)]
pub(crate) struct Tables {
    pub sandboxes: HashMap<String, SandboxRecord>,
    pub containers: HashMap<String, Container>,
}

#[derive(Debug)]
pub(crate) struct State {
    store: Box<dyn Store>,
    tables: Mutex<Tables>,
    /// Container events, for `GetContainerEvents`; made with the first reader, so a
    /// runtime nobody watches (a hollow node's) keeps no backlog.
    events: Mutex<Option<broadcast::Sender<ContainerEventResponse>>>,
    /// Bumped at every container event: what a hollow node's driver may wait on.
    changed: watch::Sender<u64>,
    /// Set when the runtime is dropped: what its threads still report is not
    /// recorded, so the files stay as a crash would leave them.
    closed: AtomicBool,
    /// Each sandbox's cgroup parent (`cgroup::sandbox_parent`), by sandbox id: what a
    /// handler starting a container reads while the tables are locked.
    cgroup_parents: Mutex<HashMap<String, String>>,
    /// The last CPU sample of each container and sandbox (time in ns, CPU time in
    /// ns), from which the stats' `usage_nano_cores` is the rate since.
    cpu_samples: Mutex<HashMap<String, (i64, u64)>>,
}

impl State {
    pub(crate) fn open(store: Box<dyn Store>) -> anyhow::Result<Arc<Self>> {
        let mut tables = Tables::default();
        let (sandboxes, containers) = store.load()?;
        for record in sandboxes {
            tables.sandboxes.insert(record.id.clone(), record);
        }
        for record in containers {
            let id = record.id.clone();
            tables
                .containers
                .insert(id, Container { record, live: None });
        }
        Ok(Self::with(store, tables))
    }

    /// The state of `tables`, kept by `store`.
    pub(crate) fn with(store: Box<dyn Store>, tables: Tables) -> Arc<Self> {
        let cgroup_parents = tables
            .sandboxes
            .values()
            .map(|s| (s.id.clone(), cgroup::sandbox_parent(s)))
            .collect();
        Arc::new(Self {
            store,
            tables: Mutex::new(tables),
            events: Mutex::default(),
            changed: watch::channel(0).0,
            closed: AtomicBool::new(false),
            cgroup_parents: Mutex::new(cgroup_parents),
            cpu_samples: Mutex::default(),
        })
    }

    /// Notes `sandbox`'s cgroup parent, for [`State::cgroup_parent`].
    pub(crate) fn add_cgroup_parent(&self, sandbox: &SandboxRecord) {
        self.cgroup_parents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sandbox.id.clone(), cgroup::sandbox_parent(sandbox));
    }

    pub(crate) fn forget_cgroup_parent(&self, sandbox_id: &str) {
        self.cgroup_parents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(sandbox_id);
    }

    /// The cgroup the containers of sandbox `sandbox_id` get their cgroups under
    /// (`cgroup::for_container`'s parent); callable with the tables locked.
    pub(crate) fn cgroup_parent(&self, sandbox_id: &str) -> String {
        self.cgroup_parents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(sandbox_id)
            .cloned()
            .unwrap_or_else(|| cgroup::default_parent(sandbox_id))
    }

    /// The CPU rate of `id` (a container or sandbox) in nanocores since its previous
    /// sample, which `(at, cpu_ns)` replaces; none on its first.
    pub(crate) fn nano_cores(&self, id: &str, at: i64, cpu_ns: u64) -> Option<u64> {
        let mut samples = self.cpu_samples.lock().unwrap_or_else(|e| e.into_inner());
        let previous = samples.insert(id.to_owned(), (at, cpu_ns));
        let (then, then_ns) = previous?;
        let elapsed = u64::try_from(at.checked_sub(then)?)
            .ok()
            .filter(|e| *e > 0)?;
        let used = u128::from(cpu_ns.saturating_sub(then_ns));
        u64::try_from(used * 1_000_000_000 / u128::from(elapsed)).ok()
    }

    /// Forgets the CPU sample of a removed container or sandbox.
    pub(crate) fn forget_sample(&self, id: &str) {
        self.cpu_samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    pub(crate) fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// Containers a previous run left running: id, kind, pid and its start time.
    pub(crate) fn running_after_restart(
        &self,
    ) -> Vec<(String, ImageKind, Option<i32>, Option<u64>)> {
        let running = ContainerState::ContainerRunning as i32;
        self.tables()
            .containers
            .values()
            .filter(|c| c.record.state == running && c.live.is_none())
            .map(|c| {
                let r = &c.record;
                (r.id.clone(), r.kind, r.pid, r.pid_start)
            })
            .collect()
    }

    /// Records that container `id` ended, and tells those waiting for it. A
    /// container whose cgroup saw the kernel's OOM killer at its memory limit ended
    /// `OOMKilled`, as containerd reports it.
    pub(crate) fn finish(&self, id: &str, mut exit: Exit) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let mut tables = self.tables();
        let Some(container) = tables.containers.get_mut(id) else {
            return;
        };
        let record = &mut container.record;
        if record.kind == ImageKind::Process
            && let Some(cgroup) =
                cgroup::container(&self.cgroup_parent(&record.sandbox_id), &record.id)
            && cgroup.stats().is_ok_and(|s| s.oom_kills > 0)
        {
            exit.reason = "OOMKilled";
        }
        record.state = ContainerState::ContainerExited as i32;
        record.finished_at = now_ns();
        record.exit_code = exit.code;
        record.reason = exit.reason.to_string();
        record.message = exit.message;
        tracing::info!(container = %id, exit_code = exit.code, reason = exit.reason, "container exited");
        self.store.save_container(record);
        self.event(record, ContainerEventType::ContainerStoppedEvent);
        if let Some(live) = container.live.take() {
            live.exited.send_replace(true);
        }
    }

    /// Ends the runtime's own tasks and WASM programs without recording anything.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let mut tables = self.tables();
        for container in tables.containers.values_mut() {
            if let Some(live) = container.live.take() {
                for task in &live.tasks {
                    task.abort();
                }
                if let Stopper::Wasm(cancel) = &live.stop {
                    cancel.cancel();
                }
            }
        }
    }

    /// A reader of the container events from now on.
    pub(crate) fn events(&self) -> broadcast::Receiver<ContainerEventResponse> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| broadcast::channel(EVENT_BACKLOG).0)
            .subscribe()
    }

    /// A receiver that changes at every container event.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) fn event(&self, record: &ContainerRecord, kind: ContainerEventType) {
        self.changed.send_modify(|n| *n += 1);
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        // No reader is no error: nobody watches.
        if let Some(events) = events.as_ref().filter(|tx| tx.receiver_count() > 0) {
            let _ = events.send(ContainerEventResponse {
                container_id: record.id.clone(),
                container_event_type: kind as i32,
                created_at: now_ns(),
                pod_sandbox_status: None,
                containers_statuses: vec![record.status()],
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nano_cores_is_the_rate_since_the_previous_sample() {
        let state = State::with(Box::new(crate::store::Memory), Tables::default());
        assert_eq!(state.nano_cores("c", 1_000_000_000, 500), None);
        // 0.2 s of CPU over 1 s: 200m.
        assert_eq!(
            state.nano_cores("c", 2_000_000_000, 200_000_500),
            Some(200_000_000)
        );
        // No time passed: no rate, and the sample is kept.
        assert_eq!(state.nano_cores("c", 2_000_000_000, 200_000_500), None);
        state.forget_sample("c");
        assert_eq!(state.nano_cores("c", 3_000_000_000, 300_000_000), None);
    }
}
