//! The scheduler's types (kube-scheduler's `framework/types.go`): a pod and a node as
//! the plugins read them, parsed once, with the sums filters and scores read most
//! kept current, and the cluster events a plugin waits for.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::quantity::Quantity;

/// A node's number in the view.
pub type NodeId = u32;

/// A kind of cluster change that may make a pod a plugin rejected schedulable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterEvent {
    /// `nodes`, `pods` (pods on nodes), `unscheduledpods` (pods waiting for a node,
    /// as kube-scheduler's `UnscheduledPod`), or another resource's plural.
    pub resource: String,
    pub add: bool,
    pub update: bool,
    pub delete: bool,
}

impl ClusterEvent {
    /// Nodes added or changed: what most filters wait for.
    pub fn node_added_or_changed() -> Self {
        Self {
            resource: "nodes".into(),
            add: true,
            update: true,
            delete: false,
        }
    }

    /// A pod that needs a node arrived.
    pub fn unscheduled_pod_added() -> Self {
        Self {
            resource: "unscheduledpods".into(),
            add: true,
            update: false,
            delete: false,
        }
    }

    /// Pods leaving nodes, which frees what they held.
    pub fn pod_deleted() -> Self {
        Self {
            resource: "pods".into(),
            add: false,
            update: false,
            delete: true,
        }
    }
}

/// Resources as the scheduler sums them: CPU in millicores, memory and ephemeral
/// storage in bytes, other resources (`nvidia.com/gpu`, hugepages) by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub milli_cpu: i64,
    pub memory: i64,
    pub ephemeral_storage: i64,
    pub scalar: BTreeMap<String, i64>,
}

/// A `ResourceList`'s amounts.
fn amounts(
    list: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Resources {
    let mut r = Resources::default();
    for (name, q) in list.into_iter().flatten() {
        let Ok(q) = Quantity::parse(&q.0) else {
            continue;
        };
        match name.as_str() {
            "cpu" => r.milli_cpu = q.milli_value(),
            "memory" => r.memory = q.value(),
            "ephemeral-storage" => r.ephemeral_storage = q.value(),
            // Counted by the node's pod count, not as a resource.
            "pods" => {}
            other => {
                r.scalar.insert(other.to_owned(), q.value());
            }
        }
    }
    r
}

impl Resources {
    fn add(&mut self, other: &Resources) {
        self.milli_cpu += other.milli_cpu;
        self.memory += other.memory;
        self.ephemeral_storage += other.ephemeral_storage;
        for (k, v) in &other.scalar {
            *self.scalar.entry(k.clone()).or_default() += v;
        }
    }

    fn sub(&mut self, other: &Resources) {
        self.milli_cpu -= other.milli_cpu;
        self.memory -= other.memory;
        self.ephemeral_storage -= other.ephemeral_storage;
        for (k, v) in &other.scalar {
            *self.scalar.entry(k.clone()).or_default() -= v;
        }
    }

    fn max(&mut self, other: &Resources) {
        self.milli_cpu = self.milli_cpu.max(other.milli_cpu);
        self.memory = self.memory.max(other.memory);
        self.ephemeral_storage = self.ephemeral_storage.max(other.ephemeral_storage);
        for (k, v) in &other.scalar {
            let e = self.scalar.entry(k.clone()).or_default();
            *e = (*e).max(*v);
        }
    }

    /// One resource by its name (`cpu` in millicores).
    pub fn get(&self, name: &str) -> i64 {
        match name {
            "cpu" => self.milli_cpu,
            "memory" => self.memory,
            "ephemeral-storage" => self.ephemeral_storage,
            other => self.scalar.get(other).copied().unwrap_or(0),
        }
    }
}

/// The CPU a container without a request counts as when scoring (100m), as in
/// Kubernetes.
pub const DEFAULT_MILLI_CPU_REQUEST: i64 = 100;
/// The memory a container without a request counts as when scoring (200 MiB).
pub const DEFAULT_MEMORY_REQUEST: i64 = 200 << 20;

/// A host port a container asks for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub ip: String,
    pub protocol: String,
    pub port: i32,
}

/// A pod, parsed once, with what the plugins read most.
#[derive(Clone, Debug)]
pub struct PodInfo {
    pub uid: String,
    pub pod: Pod,
    /// What the pod requests: the larger of its containers' sum and each init
    /// container, plus its overhead, as Kubernetes computes it.
    pub requests: Resources,
    /// The same with containers' missing CPU and memory requests counted as the
    /// scoring defaults.
    pub non_zero_requests: Resources,
    pub host_ports: Vec<HostPort>,
}

impl PodInfo {
    pub fn new(pod: Pod) -> Self {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let (mut requests, mut non_zero) = (Resources::default(), Resources::default());
        let mut host_ports = Vec::new();
        if let Some(spec) = &pod.spec {
            for c in &spec.containers {
                let r = amounts(c.resources.as_ref().and_then(|r| r.requests.as_ref()));
                requests.add(&r);
                let mut nz = r.clone();
                let asked = |name: &str| {
                    c.resources
                        .as_ref()
                        .and_then(|r| r.requests.as_ref())
                        .is_some_and(|r| r.contains_key(name))
                };
                if !asked("cpu") {
                    nz.milli_cpu = DEFAULT_MILLI_CPU_REQUEST;
                }
                if !asked("memory") {
                    nz.memory = DEFAULT_MEMORY_REQUEST;
                }
                non_zero.add(&nz);
                for p in c.ports.iter().flatten() {
                    if let Some(port) = p.host_port.filter(|p| *p > 0) {
                        host_ports.push(HostPort {
                            ip: p.host_ip.clone().unwrap_or_else(|| "0.0.0.0".into()),
                            protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                            port,
                        });
                    }
                }
            }
            for c in spec.init_containers.iter().flatten() {
                let r = amounts(c.resources.as_ref().and_then(|r| r.requests.as_ref()));
                requests.max(&r);
                non_zero.max(&r);
            }
            let overhead = amounts(spec.overhead.as_ref());
            requests.add(&overhead);
            non_zero.add(&overhead);
        }
        Self {
            uid,
            pod,
            requests,
            non_zero_requests: non_zero,
            host_ports,
        }
    }

    /// Parses a pod from JSON.
    pub fn from_json(json: &str) -> Result<Self, String> {
        serde_json::from_str::<Pod>(json)
            .map(Self::new)
            .map_err(|e| format!("the pod is not a Pod: {e}"))
    }

    pub fn name(&self) -> &str {
        self.pod.metadata.name.as_deref().unwrap_or_default()
    }

    pub fn namespace(&self) -> &str {
        self.pod.metadata.namespace.as_deref().unwrap_or_default()
    }

    pub fn labels(&self) -> Option<&BTreeMap<String, String>> {
        self.pod.metadata.labels.as_ref()
    }

    pub fn spec(&self) -> Option<&k8s_openapi::api::core::v1::PodSpec> {
        self.pod.spec.as_ref()
    }

    /// Whether it has pod affinity or anti-affinity terms (required or preferred).
    pub fn has_pod_affinity(&self) -> bool {
        self.spec()
            .and_then(|s| s.affinity.as_ref())
            .is_some_and(|a| a.pod_affinity.is_some() || a.pod_anti_affinity.is_some())
    }
}

/// A node and the pods on it, with their sums kept current.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub id: NodeId,
    pub node: Node,
    pub allocatable: Resources,
    /// The pods allowed on the node (`status.allocatable.pods`).
    pub allowed_pods: i64,
    /// The uids of the pods on it (bound or assumed).
    pub pods: Vec<String>,
    pub requested: Resources,
    pub non_zero_requested: Resources,
    /// Host ports in use, with how many pods use each.
    pub used_ports: HashMap<HostPort, u32>,
}

impl NodeInfo {
    pub(super) fn new(id: NodeId, node: Node) -> Self {
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let allowed_pods = allocatable
            .and_then(|a| a.get("pods"))
            .and_then(|q| Quantity::parse(&q.0).ok())
            .map_or(0, |q| q.value());
        Self {
            id,
            allocatable: amounts(allocatable),
            allowed_pods,
            node,
            pods: Vec::new(),
            requested: Resources::default(),
            non_zero_requested: Resources::default(),
            used_ports: HashMap::new(),
        }
    }

    pub fn name(&self) -> &str {
        self.node.metadata.name.as_deref().unwrap_or_default()
    }

    pub fn labels(&self) -> Option<&BTreeMap<String, String>> {
        self.node.metadata.labels.as_ref()
    }

    pub(super) fn place(&mut self, pod: &PodInfo) {
        self.pods.push(pod.uid.clone());
        self.requested.add(&pod.requests);
        self.non_zero_requested.add(&pod.non_zero_requests);
        for p in &pod.host_ports {
            *self.used_ports.entry(p.clone()).or_default() += 1;
        }
    }

    pub(super) fn unplace(&mut self, pod: &PodInfo) {
        self.pods.retain(|u| *u != pod.uid);
        self.requested.sub(&pod.requests);
        self.non_zero_requested.sub(&pod.non_zero_requests);
        for p in &pod.host_ports {
            if let Some(n) = self.used_ports.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    self.used_ports.remove(p);
                }
            }
        }
    }
}
