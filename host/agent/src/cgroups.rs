//! The pods' cgroups, one tree per QoS class as the kubelet makes them with
//! `--cgroups-per-qos`:
//!
//! ```text
//! <cgroup-root>/kubepods                 the pods' share of the node (its allocatable)
//! <cgroup-root>/kubepods/pod<uid>        a Guaranteed pod
//! <cgroup-root>/kubepods/burstable/pod<uid>   (weighs as its pods' requests together)
//! <cgroup-root>/kubepods/besteffort/pod<uid>   (the smallest CPU weight)
//! ```
//!
//! A pod's cgroup is made, with the pod's limits (the kubelet's
//! `ResourceConfigForPod`), before its sandbox, which is given its path as
//! `cgroup_parent`: the runtime makes the containers' cgroups below it. It is removed
//! once the pod's sandboxes are gone, after anything left in it is killed; the
//! cgroups of pods deleted while the agent was down go once their sandboxes are
//! collected ([`PodCgroups::collect`], at each relist).
//!
//! Where cgroups cannot be used (none mounted, no permission to write them) pods get
//! no cgroup of their own: a warning says so and pods run as before.

use std::collections::BTreeMap;
use std::io;
use std::time::Duration;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Container, Pod};
use tracing::{info, warn};
use trellis_cgroups::{Cgroup, Hierarchy, Resources};
use trellis_quantity::Quantity;

use crate::status;

/// The cgroup below the cgroup root that holds every pod.
pub const KUBEPODS: &str = "kubepods";
/// The kubelet's CFS period (µs).
const CPU_PERIOD: u64 = 100_000;
/// How long the processes a removed pod left behind may take to exit once killed.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// The node's pod cgroups: where they are, or that there are none.
#[derive(Debug)]
pub struct PodCgroups {
    /// `None`: pods get no cgroup of their own.
    hierarchy: Option<Hierarchy>,
    /// `<cgroup-root>/kubepods`, from the hierarchy's root, with a leading `/`.
    kubepods: String,
    /// The CPU shares of each Burstable pod made by this agent, by UID: `burstable`
    /// weighs as much as they do together, as the kubelet's QoS manager sets it.
    burstable_shares: std::sync::Mutex<BTreeMap<String, u64>>,
}

/// What of the node the pods may have: the limits of `kubepods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocatable {
    pub cpu_milli: i64,
    pub memory: i64,
    /// Process IDs, when some are reserved (`pid=` of the reservations).
    pub pids: Option<i64>,
}

impl PodCgroups {
    /// Pods get no cgroup of their own.
    pub fn disabled() -> Self {
        Self {
            hierarchy: None,
            kubepods: String::new(),
            burstable_shares: Default::default(),
        }
    }

    /// Makes `kubepods` under `cgroup_root` limited to `allocatable`, and its
    /// `burstable` and `besteffort` cgroups; disabled, with a warning, where that
    /// cannot be done.
    pub fn start(cgroup_root: &str, allocatable: Allocatable) -> Self {
        let hierarchy = match Hierarchy::detect() {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %e, "no cgroups on this node: pods get no cgroup of their own");
                return Self::disabled();
            }
        };
        let root = cgroup_root.trim_matches('/');
        let kubepods = if root.is_empty() {
            format!("/{KUBEPODS}")
        } else {
            format!("/{root}/{KUBEPODS}")
        };
        let made = Self {
            hierarchy: Some(hierarchy),
            kubepods,
            burstable_shares: Default::default(),
        };
        if let Err(e) = made.make_qos_cgroups(allocatable) {
            warn!(cgroup = %made.kubepods, error = %e,
                "cannot make the pods' cgroups: pods get no cgroup of their own");
            return Self::disabled();
        }
        info!(cgroup = %made.kubepods, version = ?made.hierarchy.as_ref().map(Hierarchy::version),
            "pods' cgroups per QoS class");
        made
    }

    fn make_qos_cgroups(&self, allocatable: Allocatable) -> io::Result<()> {
        let kubepods = self.cgroup(&self.kubepods)?;
        kubepods.create()?;
        // The kubelet's `--enforce-node-allocatable=pods`: all pods together get no
        // more than the node's allocatable (reserved resources and the eviction
        // threshold aside, which the kubelet keeps out of the memory limit).
        kubepods.set(&Resources {
            cpu_shares: Some(trellis_cgroups::milli_cpu_to_shares(allocatable.cpu_milli)),
            memory_limit: (allocatable.memory > 0).then_some(allocatable.memory),
            pids_limit: allocatable.pids.filter(|p| *p > 0),
            ..Default::default()
        })?;
        let burstable = kubepods.child("burstable");
        burstable.create()?;
        let best_effort = kubepods.child("besteffort");
        best_effort.create()?;
        // BestEffort pods get CPU only when nobody else wants it.
        best_effort.set(&Resources {
            cpu_shares: Some(trellis_cgroups::milli_cpu_to_shares(0)),
            ..Default::default()
        })
    }

    fn cgroup(&self, path: &str) -> io::Result<Cgroup> {
        match &self.hierarchy {
            Some(h) => Ok(h.cgroup(path)),
            None => Err(io::Error::other("pods have no cgroups on this node")),
        }
    }

    /// Whether pods get a cgroup of their own.
    pub fn enabled(&self) -> bool {
        self.hierarchy.is_some()
    }

    /// The cgroup of pod `uid` by its QoS class: `kubepods/pod<uid>` (Guaranteed),
    /// `kubepods/burstable/pod<uid>`, `kubepods/besteffort/pod<uid>`; `None` when
    /// pods get none.
    pub fn pod_cgroup(&self, pod: &Pod, uid: &str) -> Option<String> {
        self.enabled()
            .then(|| pod_cgroup_path(&self.kubepods, status::qos_class(pod), uid))
    }

    /// Makes the pod cgroup `path` with `resources` ([`pod_resources`]).
    pub fn create(&self, path: &str, resources: &cri::LinuxContainerResources) -> io::Result<()> {
        let cgroup = self.cgroup(path)?;
        cgroup.create()?;
        if let Some(uid) = path
            .strip_prefix(&format!("{}/burstable/pod", self.kubepods))
            .filter(|_| resources.cpu_shares > 0)
        {
            self.set_burstable_shares(|pods| {
                pods.insert(uid.to_owned(), resources.cpu_shares as u64);
            })?;
        }
        cgroup.set(&Resources {
            cpu_shares: u64::try_from(resources.cpu_shares).ok().filter(|s| *s > 0),
            cpu_quota: (resources.cpu_quota > 0).then_some(resources.cpu_quota),
            cpu_period: (resources.cpu_quota > 0)
                .then(|| u64::try_from(resources.cpu_period).ok())
                .flatten(),
            memory_limit: (resources.memory_limit_in_bytes > 0)
                .then_some(resources.memory_limit_in_bytes),
            ..Default::default()
        })
    }

    /// Changes the Burstable pods' shares with `change` and gives `burstable` their sum
    /// (at least the smallest weight).
    fn set_burstable_shares(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, u64>),
    ) -> io::Result<()> {
        let total = {
            let mut pods = self
                .burstable_shares
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            change(&mut pods);
            pods.values().sum::<u64>()
        };
        self.cgroup(&format!("{}/burstable", self.kubepods))?
            .set(&Resources {
                cpu_shares: Some(total.max(trellis_cgroups::milli_cpu_to_shares(0))),
                ..Default::default()
            })
    }

    /// Removes pod `uid`'s cgroup, wherever its QoS class put it, killing what is
    /// left in it first (its sandboxes are gone: nothing there is the pod's any more).
    pub async fn remove(&self, uid: &str) {
        if !self.enabled() {
            return;
        }
        for qos in ["Guaranteed", "Burstable", "BestEffort"] {
            let path = pod_cgroup_path(&self.kubepods, qos, uid);
            let Ok(cgroup) = self.cgroup(&path) else {
                return;
            };
            if !cgroup.exists() {
                continue;
            }
            if let Err(e) = remove_cgroup(&cgroup).await {
                warn!(cgroup = %path, error = %e, "remove the pod's cgroup");
            }
        }
        let known = self
            .burstable_shares
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(uid);
        if known
            && let Err(e) = self.set_burstable_shares(|pods| {
                pods.remove(uid);
            })
        {
            warn!(error = %e, "set the Burstable pods' CPU weight");
        }
    }
}

impl PodCgroups {
    /// Removes the cgroups of pods this node no longer has (`live` says which it has)
    /// and that have no sandbox in `sandboxes` (the runtime's, as a relist saw them):
    /// those of pods deleted while the agent was down, once their sandboxes are
    /// collected. Returns how many it removed.
    pub async fn collect(&self, live: crate::gc::Live<'_>, sandboxes: &[cri::PodSandbox]) -> usize {
        if !self.enabled() {
            return 0;
        }
        let mut removed = 0;
        for parent in [
            self.kubepods.clone(),
            format!("{}/burstable", self.kubepods),
            format!("{}/besteffort", self.kubepods),
        ] {
            let Ok(cgroup) = self.cgroup(&parent) else {
                return removed;
            };
            // One controller's directory lists them all.
            let Some(dir) = cgroup
                .procs_files()
                .first()
                .and_then(|f| f.parent().map(|d| d.to_owned()))
            else {
                continue;
            };
            let uids: Vec<String> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_prefix("pod")
                        .map(str::to_owned)
                })
                .collect();
            for uid in uids {
                let has_sandbox = sandboxes
                    .iter()
                    .any(|s| s.labels.get(crate::labels::POD_UID) == Some(&uid));
                if live(&uid) || has_sandbox {
                    continue;
                }
                let path = format!("{parent}/pod{uid}");
                info!(cgroup = %path, pod_uid = %uid, "removing the cgroup of a pod that is gone");
                match remove_cgroup(&cgroup.child(&format!("pod{uid}"))).await {
                    Ok(()) => removed += 1,
                    Err(e) => {
                        warn!(cgroup = %path, error = %e, "remove the cgroup of a pod that is gone")
                    }
                }
            }
        }
        removed
    }
}

/// Kills what is in `cgroup` and removes it, waiting (a bounded while) for the
/// killed processes to exit.
async fn remove_cgroup(cgroup: &Cgroup) -> io::Result<()> {
    let removing = cgroup.clone();
    tokio::task::spawn_blocking(move || removing.kill_and_remove(KILL_WAIT))
        .await
        .map_err(io::Error::other)??;
    remove_elsewhere(cgroup.path());
    Ok(())
}

/// Removes the cgroup at `path` from the hierarchies without a controller
/// (`name=systemd`, a v2 mount beside v1 controllers), where runc (containerd's) also
/// makes its containers' cgroups, and so their parents: empty directories, deepest
/// first.
fn remove_elsewhere(path: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for mount in mounts.lines().filter_map(|l| {
        let mut fields = l.split(' ');
        let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
        matches!(kind, "cgroup" | "cgroup2").then_some(point)
    }) {
        let dir = std::path::Path::new(mount).join(path.trim_start_matches('/'));
        if dir.is_dir() {
            remove_tree(&dir);
        }
    }
}

fn remove_tree(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path());
        }
    }
    if let Err(e) = std::fs::remove_dir(dir)
        && e.kind() != io::ErrorKind::NotFound
    {
        warn!(cgroup = %dir.display(), error = %e, "remove the pod's cgroup");
    }
}

fn pod_cgroup_path(kubepods: &str, qos: &str, uid: &str) -> String {
    match qos {
        "Guaranteed" => format!("{kubepods}/pod{uid}"),
        "Burstable" => format!("{kubepods}/burstable/pod{uid}"),
        _ => format!("{kubepods}/besteffort/pod{uid}"),
    }
}

type ResourceList = BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>;

fn quantity(list: Option<&ResourceList>, resource: &str) -> Option<Quantity> {
    list?.get(resource)?.0.parse().ok()
}

/// A container's request of `resource`: its request, else its limit (the API
/// server's default).
fn request(c: &Container, resource: &str) -> Option<Quantity> {
    let r = c.resources.as_ref();
    quantity(r.and_then(|r| r.requests.as_ref()), resource)
        .or_else(|| quantity(r.and_then(|r| r.limits.as_ref()), resource))
}

fn limit(c: &Container, resource: &str) -> Option<Quantity> {
    let r = c.resources.as_ref();
    quantity(r.and_then(|r| r.limits.as_ref()), resource).filter(|q| !q.is_zero())
}

/// What the pod as a whole asks of `resource` by `of` (the kubelet's `PodRequests`
/// and `PodLimits`): the sum over its containers, or the largest init container's if
/// that is more (they run one at a time, before the others); plus its overhead.
fn pod_total(pod: &Pod, resource: &str, of: fn(&Container, &str) -> Option<Quantity>) -> i64 {
    let Some(spec) = &pod.spec else { return 0 };
    let value = |q: Quantity| {
        if resource == "cpu" {
            q.milli_value()
        } else {
            q.value()
        }
    };
    let sum: i64 = spec
        .containers
        .iter()
        .filter_map(|c| of(c, resource))
        .map(value)
        .sum();
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .filter_map(|c| of(c, resource))
        .map(value)
        .max()
        .unwrap_or(0);
    let overhead = quantity(spec.overhead.as_ref(), resource)
        .map(value)
        .unwrap_or(0);
    sum.max(init) + overhead
}

/// The pod cgroup's limits, as the kubelet's `ResourceConfigForPod`: a Guaranteed
/// pod's CPU weight, quota and memory limit from the sum of its containers'; a
/// Burstable one's weight from its requests, and a quota or memory limit only when
/// every container has that limit; a BestEffort one the smallest weight. Carried to
/// the runtime as the sandbox's `linux.resources`.
pub fn pod_resources(pod: &Pod) -> cri::LinuxContainerResources {
    let qos = status::qos_class(pod);
    if qos == "BestEffort" {
        return cri::LinuxContainerResources {
            cpu_shares: trellis_cgroups::milli_cpu_to_shares(0) as i64,
            ..Default::default()
        };
    }
    let containers: Vec<&Container> = pod
        .spec
        .iter()
        .flat_map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        })
        .collect();
    let all_limit = |resource: &str| containers.iter().all(|c| limit(c, resource).is_some());
    let cpu_quota = trellis_cgroups::milli_cpu_to_quota(pod_total(pod, "cpu", limit), CPU_PERIOD);
    let with_quota = qos == "Guaranteed" || all_limit("cpu");
    let with_memory = qos == "Guaranteed" || all_limit("memory");
    cri::LinuxContainerResources {
        cpu_shares: trellis_cgroups::milli_cpu_to_shares(pod_total(pod, "cpu", request)) as i64,
        cpu_quota: if with_quota { cpu_quota } else { 0 },
        cpu_period: if with_quota { CPU_PERIOD as i64 } else { 0 },
        memory_limit_in_bytes: if with_memory {
            pod_total(pod, "memory", limit)
        } else {
            0
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(containers: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {"containers": containers},
        }))
        .unwrap()
    }

    #[test]
    fn each_qos_class_has_its_place_in_the_tree() {
        let kubepods = "/trellis-test-x/kubepods";
        assert_eq!(
            pod_cgroup_path(kubepods, "Guaranteed", "u"),
            "/trellis-test-x/kubepods/podu"
        );
        assert_eq!(
            pod_cgroup_path(kubepods, "Burstable", "u"),
            "/trellis-test-x/kubepods/burstable/podu"
        );
        assert_eq!(
            pod_cgroup_path(kubepods, "BestEffort", "u"),
            "/trellis-test-x/kubepods/besteffort/podu"
        );
    }

    #[test]
    fn a_guaranteed_pod_is_limited_to_the_sum_of_its_containers_limits() {
        let p = pod(serde_json::json!([
            {"name": "a", "resources": {"limits": {"cpu": "200m", "memory": "64Mi"}}},
            {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}},
        ]));
        let r = pod_resources(&p);
        assert_eq!(r.cpu_shares, 1228);
        assert_eq!((r.cpu_quota, r.cpu_period), (120_000, 100_000));
        assert_eq!(r.memory_limit_in_bytes, (64 << 20) + (1 << 30));
    }

    #[test]
    fn a_burstable_pod_gets_a_limit_only_when_every_container_has_one() {
        let p = pod(serde_json::json!([
            {"name": "a", "resources": {"requests": {"cpu": "100m"}, "limits": {"cpu": "200m", "memory": "64Mi"}}},
            {"name": "b", "resources": {"requests": {"memory": "10Mi"}}},
        ]));
        let r = pod_resources(&p);
        assert_eq!(r.cpu_shares, 102);
        assert_eq!((r.cpu_quota, r.memory_limit_in_bytes), (0, 0));
        let p = pod(serde_json::json!([
            {"name": "a", "resources": {"requests": {"cpu": "100m"}, "limits": {"cpu": "200m"}}},
        ]));
        let r = pod_resources(&p);
        assert_eq!((r.cpu_quota, r.cpu_period), (20_000, 100_000));
        assert_eq!(r.memory_limit_in_bytes, 0);
    }

    #[test]
    fn a_best_effort_pod_gets_the_smallest_weight() {
        let r = pod_resources(&pod(serde_json::json!([{"name": "a"}])));
        assert_eq!(r.cpu_shares, 2);
        assert_eq!((r.cpu_quota, r.memory_limit_in_bytes), (0, 0));
    }
}
