//! A restarted runtime's recovery of what the previous run left, done when the runtime
//! opens its state and before it serves, so that no CRI call sees half of it:
//! - sandboxes: one whose network namespace is still pinned is adopted as it is (same
//!   IPs, ready if it was); one whose namespace is gone (the host rebooted) is no
//!   longer ready, so the kubelet makes a new one, and its CNI state is released;
//!   the network of a sandbox with no record (the runtime died between CNI ADD and
//!   saving the record) is torn down (`network::recover`), and so are its UTS and IPC
//!   namespaces and its /etc files;
//! - containers: a process still running is adopted; a WASM program, whose store died
//!   with the run, is reported ended.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use k8s_cri::v1::PodSandboxState;

use crate::network::netns;
use crate::network::recover::Recorded;
use crate::{Runtime, namespaces, pod_files, process, record, state};

impl Runtime {
    pub(crate) fn recover(&self) {
        self.recover_sandboxes();
        self.recover_containers();
    }

    fn recover_sandboxes(&self) {
        let ready = PodSandboxState::SandboxReady as i32;
        let recorded: Vec<Recorded> = self
            .state
            .tables()
            .sandboxes
            .values()
            .map(|s| Recorded {
                id: s.id.clone(),
                netns: s.netns.clone(),
                ready: s.state == ready,
            })
            .collect();
        // CNI plugins are child processes awaited on a runtime's reactor; the caller
        // may be on a current-thread runtime, which a blocking wait would stall, so
        // the recovery has a thread and a reactor of its own. Only what a previous run
        // left costs a plugin exec.
        let network = &self.network;
        let recovered = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let reactor = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    Ok::<_, std::io::Error>(reactor.block_on(network.recover(&recorded)))
                })
                .join()
        });
        let recovered = match recovered {
            Ok(Ok(recovered)) => recovered,
            Ok(Err(e)) => {
                tracing::warn!("failed to recover the pods' network: {e}");
                return;
            }
            Err(_) => {
                tracing::warn!("the recovery of the pods' network panicked");
                return;
            }
        };
        if !recovered.released.is_empty() {
            tracing::info!(sandboxes = ?recovered.released, "tore down the network of sandboxes with no record");
        }
        self.remove_unrecorded(&recorded);
        let mut tables = self.state.tables();
        for id in &recovered.lost {
            if let Some(sandbox) = tables.sandboxes.get_mut(id) {
                sandbox.state = PodSandboxState::SandboxNotready as i32;
                self.state.store().save_sandbox(sandbox);
            }
        }
    }

    /// Removes the UTS and IPC namespaces and the /etc files of sandboxes that have no
    /// record: made by a `RunPodSandbox` the runtime died in.
    fn remove_unrecorded(&self, recorded: &[Recorded]) {
        let Some(root) = self.state.store().root() else {
            return;
        };
        let known: HashSet<&str> = recorded.iter().map(|s| s.id.as_str()).collect();
        let unknown = |dir: &Path| -> Vec<PathBuf> {
            std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(|id| !known.contains(id)))
                .map(|e| e.path())
                .collect()
        };
        let pins = [
            namespaces::uts_pin(root, "_"),
            namespaces::ipc_pin(root, "_"),
        ];
        for dir in pins.iter().filter_map(|pin| pin.parent()) {
            for pin in unknown(dir) {
                tracing::info!(pin = %pin.display(), "removing a namespace of a sandbox with no record");
                if let Err(e) = netns::remove(&pin) {
                    tracing::warn!(pin = %pin.display(), "failed to remove a namespace: {e}");
                }
            }
        }
        // The records themselves are files beside the sandboxes' directories.
        if let Some(dir) = pod_files::sandbox_dir(root, "_").parent() {
            for files in unknown(dir).into_iter().filter(|path| path.is_dir()) {
                if let Err(e) = pod_files::remove(&files) {
                    tracing::warn!(dir = %files.display(), "failed to remove a sandbox's files: {e}");
                }
            }
        }
    }

    /// Containers that were running: adopted (a live process) or reported as ended (a
    /// WASM program).
    fn recover_containers(&self) {
        for (id, kind, pid, start) in self.state.running_after_restart() {
            match kind {
                record::ImageKind::Process => {
                    let alive = pid.zip(start).filter(|&(pid, start)| {
                        crate::pid::start_time(pid).is_some_and(|now| now == start)
                    });
                    match alive {
                        Some((pid, start)) => {
                            tracing::info!(container = %id, pid, "adopting a running process");
                            process::adopt(&self.state, &id, pid, start);
                        }
                        None => self.state.finish(
                            &id,
                            state::Exit {
                                code: 137,
                                reason: "Error",
                                message: "exit status lost across a runtime restart".into(),
                            },
                        ),
                    }
                }
                record::ImageKind::Wasm | record::ImageKind::Hollow => self.state.finish(
                    &id,
                    state::Exit {
                        code: 1,
                        reason: "Error",
                        message: "the runtime restarted while it ran".into(),
                    },
                ),
            }
        }
    }
}
