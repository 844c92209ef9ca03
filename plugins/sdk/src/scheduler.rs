//! Scheduler plugins: the [`Plugin`] trait, the typed view of the cluster every plugin
//! of a component shares ([`Cluster`], [`NodeInfo`], [`PodInfo`]), and the
//! [`Framework`] that runs a component's plugins for the host, which
//! [`scheduler!`](crate::scheduler!) exports as the `scheduler` world.
//!
//! The host sends each node, and each pod placed on a node, once per change; the
//! view parses them once ([`Cluster::apply`]) and keeps what filters and scores read
//! most (requested resources, used host ports) precomputed per node, as
//! kube-scheduler's `NodeInfo` does. A cycle parses the pod being scheduled once.
//!
//! The same [`Framework`] runs natively: [`Framework::schedule`] filters and scores
//! like the host (without its sampling of nodes), so a plugin's table tests need no
//! host.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::quantity::Quantity;

/// A node's number in the view.
pub type NodeId = u32;

/// The framework's status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Success,
    /// The pod does not fit; preemption may help.
    Unschedulable,
    /// The pod does not fit, and preempting pods would not change that.
    UnschedulableAndUnresolvable,
    /// PreFilter and PreScore: nothing to do for this pod.
    Skip,
    Error,
}

/// A plugin's verdict, with the reasons `kubectl describe` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub reasons: Vec<String>,
}

impl Status {
    pub fn success() -> Self {
        Self {
            code: Code::Success,
            reasons: Vec::new(),
        }
    }

    pub fn skip() -> Self {
        Self {
            code: Code::Skip,
            reasons: Vec::new(),
        }
    }

    pub fn unschedulable(reason: impl Into<String>) -> Self {
        Self {
            code: Code::Unschedulable,
            reasons: vec![reason.into()],
        }
    }

    pub fn unresolvable(reason: impl Into<String>) -> Self {
        Self {
            code: Code::UnschedulableAndUnresolvable,
            reasons: vec![reason.into()],
        }
    }

    pub fn error(reason: impl Into<String>) -> Self {
        Self {
            code: Code::Error,
            reasons: vec![reason.into()],
        }
    }

    pub fn is_success(&self) -> bool {
        self.code == Code::Success
    }
}

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

/// The extension points a plugin implements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Points {
    pub pre_filter: bool,
    pub filter: bool,
    pub pre_score: bool,
    pub score: bool,
    pub reserve: bool,
    pub permit: bool,
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
    fn new(id: NodeId, node: Node) -> Self {
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

    fn place(&mut self, pod: &PodInfo) {
        self.pods.push(pod.uid.clone());
        self.requested.add(&pod.requests);
        self.non_zero_requested.add(&pod.non_zero_requests);
        for p in &pod.host_ports {
            *self.used_ports.entry(p.clone()).or_default() += 1;
        }
    }

    fn unplace(&mut self, pod: &PodInfo) {
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

/// A change of the cluster, as the host sends it.
#[derive(Clone, Debug)]
pub enum Change {
    NodeUpsert {
        node: NodeId,
        object: String,
    },
    NodeRemove(NodeId),
    PodUpsert {
        uid: String,
        node: NodeId,
        object: String,
    },
    PodRemove(String),
}

/// The cluster as a component's plugins see it: nodes by number, and the pods on
/// them.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    nodes: Vec<Option<NodeInfo>>,
    pods: HashMap<String, (NodeId, PodInfo)>,
    /// The uids of the pods with pod affinity or anti-affinity terms: what
    /// InterPodAffinity must look at for a pod without terms of its own, without a
    /// pass over every pod (kube-scheduler's `PodsWithAffinity`).
    with_affinity: std::collections::BTreeSet<String>,
}

impl Cluster {
    /// Applies one change. An object that does not parse is left out, and named.
    pub fn apply(&mut self, change: Change) -> Result<(), String> {
        match change {
            Change::NodeUpsert { node: id, object } => {
                let node: Node = serde_json::from_str(&object)
                    .map_err(|e| format!("node {id} is not a Node: {e}"))?;
                let i = id as usize;
                if self.nodes.len() <= i {
                    self.nodes.resize(i + 1, None);
                }
                let mut info = NodeInfo::new(id, node);
                // The pods stay across a node's changes.
                if let Some(old) = self.nodes[i].take() {
                    for uid in &old.pods {
                        if let Some((_, pod)) = self.pods.get(uid) {
                            info.place(pod);
                        }
                    }
                }
                self.nodes[i] = Some(info);
            }
            Change::NodeRemove(id) => {
                if let Some(slot) = self.nodes.get_mut(id as usize) {
                    *slot = None;
                }
            }
            Change::PodUpsert { uid, node, object } => {
                let pod = PodInfo::from_json(&object)?;
                self.remove_pod(&uid);
                self.place_parsed(uid, node, pod);
            }
            Change::PodRemove(uid) => self.remove_pod(&uid),
        }
        Ok(())
    }

    /// Puts back a pod taken out (preemption's dry run), parsed already.
    fn place_parsed(&mut self, uid: String, node: NodeId, pod: PodInfo) {
        if let Some(Some(n)) = self.nodes.get_mut(node as usize) {
            n.place(&pod);
        }
        if pod.has_pod_affinity() {
            self.with_affinity.insert(uid.clone());
        }
        self.pods.insert(uid, (node, pod));
    }

    fn remove_pod(&mut self, uid: &str) {
        self.with_affinity.remove(uid);
        if let Some((node, pod)) = self.pods.remove(uid)
            && let Some(Some(n)) = self.nodes.get_mut(node as usize)
        {
            n.unplace(&pod);
        }
    }

    pub fn node(&self, id: NodeId) -> Option<&NodeInfo> {
        self.nodes.get(id as usize).and_then(Option::as_ref)
    }

    /// Every node.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.iter().flatten()
    }

    /// A pod on a node, by uid.
    pub fn pod(&self, uid: &str) -> Option<&PodInfo> {
        self.pods.get(uid).map(|(_, p)| p)
    }

    /// Every pod on a node, with its node.
    pub fn pods(&self) -> impl Iterator<Item = (NodeId, &PodInfo)> {
        self.pods.values().map(|(n, p)| (*n, p))
    }

    /// Every pod on a node that has pod affinity or anti-affinity terms, with its node.
    pub fn pods_with_affinity(&self) -> impl Iterator<Item = (NodeId, &PodInfo)> {
        self.with_affinity
            .iter()
            .filter_map(|uid| self.pods.get(uid).map(|(n, p)| (*n, p)))
    }

    /// The pods on `node`.
    pub fn pods_on<'a>(&'a self, node: &'a NodeInfo) -> impl Iterator<Item = &'a PodInfo> {
        node.pods.iter().filter_map(|uid| self.pod(uid))
    }
}

/// What PreFilter says: the status, and the nodes that alone can pass (`None`: all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreFilterResult {
    pub status: Status,
    pub nodes: Option<Vec<NodeId>>,
}

impl From<Status> for PreFilterResult {
    fn from(status: Status) -> Self {
        Self {
            status,
            nodes: None,
        }
    }
}

/// Whether a pod may be bound now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Permit {
    Allow,
    Deny(Status),
    /// Wait this long (ms) for [`Plugin::allowed`] to name it.
    Wait(u64),
}

/// One scheduler plugin. Implement the extension points it has and say which in
/// [`Plugin::points`]; state for the pod being scheduled (computed in PreFilter or
/// PreScore) lives in the plugin itself, since a component schedules one pod at a
/// time.
pub trait Plugin {
    /// As kube-scheduler names it: `NodeResourcesFit`.
    fn name(&self) -> &'static str;
    fn points(&self) -> Points;
    /// The weight of its Score unless the profile gives one.
    fn weight(&self) -> u32 {
        1
    }
    /// Events that may make a pod it rejected schedulable.
    fn events(&self) -> Vec<ClusterEvent> {
        vec![ClusterEvent::node_added_or_changed()]
    }
    fn pre_filter(&mut self, _pod: &PodInfo, _cluster: &Cluster) -> PreFilterResult {
        Status::success().into()
    }
    fn filter(&self, _pod: &PodInfo, _node: &NodeInfo, _cluster: &Cluster) -> Status {
        Status::success()
    }
    /// Before Score, with the nodes that passed; `skip` leaves Score out.
    fn pre_score(&mut self, _pod: &PodInfo, _nodes: &[&NodeInfo], _cluster: &Cluster) -> Status {
        Status::success()
    }
    fn score(&self, _pod: &PodInfo, _node: &NodeInfo, _cluster: &Cluster) -> Result<i64, String> {
        Ok(0)
    }
    /// NormalizeScore: brings the scores of every node to 0..=100.
    fn normalize(&self, _scores: &mut [i64]) {}
    fn reserve(&mut self, _pod: &PodInfo, _node: &NodeInfo) -> Status {
        Status::success()
    }
    fn unreserve(&mut self, _pod: &PodInfo, _node: &NodeInfo) {}
    fn permit(&mut self, _pod: &PodInfo, _node: &NodeInfo) -> Permit {
        Permit::Allow
    }
    /// Pods waiting at its Permit that it now allows.
    fn allowed(&mut self) -> Vec<String> {
        Vec::new()
    }
}

/// The highest score a node can have after NormalizeScore.
pub const MAX_NODE_SCORE: i64 = 100;

/// Scales scores to 0..=MAX_NODE_SCORE by the highest (kube-scheduler's
/// `DefaultNormalizeScore`); `reverse` makes the lowest the best.
pub fn default_normalize(scores: &mut [i64], reverse: bool) {
    let max = scores.iter().copied().max().unwrap_or(0);
    if max == 0 {
        if reverse {
            scores.iter_mut().for_each(|s| *s = MAX_NODE_SCORE);
        }
        return;
    }
    for s in scores.iter_mut() {
        *s = MAX_NODE_SCORE * *s / max;
        if reverse {
            *s = MAX_NODE_SCORE - *s;
        }
    }
}

/// A node a plugin rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub node: NodeId,
    /// The plugin's index in the component.
    pub plugin: u32,
    pub status: Status,
}

/// A component's plugins, its view of the cluster, and the pod of the current cycle:
/// what the `scheduler` world's calls run on.
pub struct Framework {
    pub cluster: Cluster,
    pub plugins: Vec<Box<dyn Plugin>>,
    pod: Option<PodInfo>,
    /// Pods reserved and not yet seen bound, for an `unreserve` after their cycle.
    reserved: HashMap<String, PodInfo>,
    /// Pods waiting at Permit, with the plugins that have not allowed them yet:
    /// reserved until allowed or given up, even once the host's view has them on
    /// their node (it holds a waiting pod's node).
    waiting: HashMap<String, (PodInfo, Vec<usize>)>,
    /// Plugins whose PreFilter or PreScore said skip in this cycle.
    skip_filter: Vec<bool>,
    skip_score: Vec<bool>,
}

impl Framework {
    pub fn new(plugins: Vec<Box<dyn Plugin>>) -> Self {
        Self {
            cluster: Cluster::default(),
            plugins,
            pod: None,
            reserved: HashMap::new(),
            waiting: HashMap::new(),
            skip_filter: Vec::new(),
            skip_score: Vec::new(),
        }
    }

    /// Applies changes; the ones that do not parse are returned, named.
    pub fn update(&mut self, changes: impl IntoIterator<Item = Change>) -> Vec<String> {
        changes
            .into_iter()
            .filter_map(|c| {
                // A reserved pod seen on its node (bound) or gone needs no unreserve.
                match &c {
                    Change::PodUpsert { uid, .. } => {
                        self.reserved.remove(uid);
                    }
                    Change::PodRemove(uid) => {
                        self.reserved.remove(uid);
                        self.waiting.remove(uid);
                    }
                    _ => {}
                }
                self.cluster.apply(c).err()
            })
            .collect()
    }

    /// Starts a cycle for `pod`: PreFilter of each plugin that has one, as
    /// `(plugin index, result)`.
    pub fn cycle(&mut self, pod: PodInfo) -> Vec<(u32, PreFilterResult)> {
        let n = self.plugins.len();
        self.skip_filter = vec![false; n];
        self.skip_score = vec![false; n];
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            if !p.points().pre_filter {
                continue;
            }
            let result = p.pre_filter(&pod, &self.cluster);
            if result.status.code == Code::Skip {
                self.skip_filter[i] = true;
            }
            out.push((i as u32, result));
        }
        self.pod = Some(pod);
        out
    }

    /// The pod of the current cycle.
    pub fn pod(&self) -> Option<&PodInfo> {
        self.pod.as_ref()
    }

    /// Filter over `nodes`: each node stops at the first plugin that rejects it.
    pub fn filter(&self, nodes: &[NodeId]) -> Vec<Rejection> {
        let Some(pod) = &self.pod else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &id in nodes {
            let Some(node) = self.cluster.node(id) else {
                out.push(Rejection {
                    node: id,
                    plugin: 0,
                    status: Status::unresolvable("node(s) were not found"),
                });
                continue;
            };
            for (i, p) in self.plugins.iter().enumerate() {
                if !p.points().filter || self.skip_filter[i] {
                    continue;
                }
                let status = p.filter(pod, node, &self.cluster);
                if !status.is_success() {
                    out.push(Rejection {
                        node: id,
                        plugin: i as u32,
                        status,
                    });
                    break;
                }
            }
        }
        out
    }

    /// Filter as if the pods `victims` were gone: they leave the view, PreFilter runs
    /// again on it for the pod of the cycle, Filter judges `nodes`; then the view and
    /// the PreFilter state are as before.
    pub fn filter_without(&mut self, victims: &[String], nodes: &[NodeId]) -> Vec<Rejection> {
        let Some(pod) = self.pod.take() else {
            return Vec::new();
        };
        let removed: Vec<(String, NodeId, PodInfo)> = victims
            .iter()
            .filter_map(|uid| {
                let (node, info) = self.cluster.pods.get(uid).cloned()?;
                self.cluster.remove_pod(uid);
                Some((uid.clone(), node, info))
            })
            .collect();
        self.cycle(pod.clone());
        let rejected = self.filter(nodes);
        for (uid, node, info) in removed {
            self.cluster.place_parsed(uid, node, info);
        }
        self.cycle(pod);
        rejected
    }

    /// PreScore and Score of every plugin with a Score, normalized: `(plugin, scores
    /// in the order of nodes)`.
    pub fn score(&mut self, nodes: &[NodeId]) -> Result<Vec<(u32, Vec<i64>)>, String> {
        let Some(pod) = &self.pod else {
            return Err("score before a cycle".into());
        };
        let infos: Vec<&NodeInfo> = nodes
            .iter()
            .filter_map(|id| self.cluster.node(*id))
            .collect();
        if infos.len() != nodes.len() {
            return Err("score of a node not in the view".into());
        }
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            let points = p.points();
            if !points.score {
                continue;
            }
            if points.pre_score {
                let status = p.pre_score(pod, &infos, &self.cluster);
                match status.code {
                    Code::Skip => {
                        self.skip_score[i] = true;
                        continue;
                    }
                    Code::Success => {}
                    _ => return Err(format!("{}: {}", p.name(), status.reasons.join(", "))),
                }
            }
            let mut scores = Vec::with_capacity(infos.len());
            for node in &infos {
                scores.push(
                    p.score(pod, node, &self.cluster)
                        .map_err(|e| format!("{}: {e}", p.name()))?,
                );
            }
            p.normalize(&mut scores);
            out.push((i as u32, scores));
        }
        Ok(out)
    }

    pub fn reserve(&mut self, node: NodeId) -> Status {
        let (Some(pod), Some(info)) = (&self.pod, self.cluster.node(node)) else {
            return Status::error("reserve outside a cycle");
        };
        for i in 0..self.plugins.len() {
            if !self.plugins[i].points().reserve {
                continue;
            }
            let status = self.plugins[i].reserve(pod, info);
            if !status.is_success() {
                // Those reserved already are undone, in reverse, as kube-scheduler does.
                for p in self.plugins[..i].iter_mut().rev() {
                    if p.points().reserve {
                        p.unreserve(pod, info);
                    }
                }
                return status;
            }
        }
        if self.plugins.iter().any(|p| p.points().reserve) {
            self.reserved.insert(pod.uid.clone(), pod.clone());
        }
        Status::success()
    }

    pub fn unreserve(&mut self, uid: &str, node: NodeId) {
        let Some(info) = self.cluster.node(node) else {
            return;
        };
        let waiting = self.waiting.remove(uid).map(|(pod, _)| pod);
        let pod = match waiting.or_else(|| self.reserved.remove(uid)) {
            Some(pod) => pod,
            None => match &self.pod {
                Some(pod) if pod.uid == uid => pod.clone(),
                _ => return,
            },
        };
        for p in self.plugins.iter_mut().rev() {
            if p.points().reserve {
                p.unreserve(&pod, info);
            }
        }
    }

    /// Permit of each plugin with one: the first denial, else the shortest wait (the
    /// pod is given up when the first plugin's wait runs out, as kube-scheduler does).
    pub fn permit(&mut self, node: NodeId) -> Permit {
        let (Some(pod), Some(info)) = (&self.pod, self.cluster.node(node)) else {
            return Permit::Deny(Status::error("permit outside a cycle"));
        };
        let mut verdict = Permit::Allow;
        let mut waits = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            if !p.points().permit {
                continue;
            }
            match p.permit(pod, info) {
                Permit::Allow => {}
                Permit::Deny(status) => return Permit::Deny(status),
                Permit::Wait(ms) => {
                    waits.push(i);
                    if !matches!(verdict, Permit::Wait(w) if w <= ms) {
                        verdict = Permit::Wait(ms);
                    }
                }
            }
        }
        if !waits.is_empty() {
            self.waiting.insert(pod.uid.clone(), (pod.clone(), waits));
        }
        verdict
    }

    /// Waiting pods that every plugin that made them wait now allows.
    pub fn allowed(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, p) in self.plugins.iter_mut().enumerate() {
            for uid in p.allowed() {
                let Some((_, waits)) = self.waiting.get_mut(&uid) else {
                    continue;
                };
                waits.retain(|w| *w != i);
                if waits.is_empty() {
                    self.waiting.remove(&uid);
                    out.push(uid);
                }
            }
        }
        out
    }

    /// Schedules `pod` natively, as the host would with every node sampled and
    /// weights from the plugins: the chosen node's name (ties go to the lowest
    /// number), or the reasons of every rejection (`reason` → node count), sorted.
    pub fn schedule(&mut self, pod: PodInfo) -> Result<String, Vec<(String, usize)>> {
        let prefilter = self.cycle(pod);
        let mut candidates: Vec<NodeId> = self.cluster.nodes().map(|n| n.id).collect();
        for (i, result) in &prefilter {
            match result.status.code {
                Code::Success | Code::Skip => {}
                _ => {
                    let name = self.plugins[*i as usize].name();
                    return Err(result
                        .status
                        .reasons
                        .iter()
                        .map(|r| (format!("{name}: {r}"), candidates.len()))
                        .collect());
                }
            }
            if let Some(only) = &result.nodes {
                candidates.retain(|n| only.contains(n));
            }
        }
        let rejected = self.filter(&candidates);
        if rejected.len() == candidates.len() {
            let mut counts: BTreeMap<String, usize> = BTreeMap::new();
            for r in &rejected {
                for reason in &r.status.reasons {
                    *counts.entry(reason.clone()).or_default() += 1;
                }
            }
            return Err(counts.into_iter().collect());
        }
        let feasible: Vec<NodeId> = candidates
            .into_iter()
            .filter(|n| !rejected.iter().any(|r| r.node == *n))
            .collect();
        let scores = self
            .score(&feasible)
            .map_err(|e| vec![(e, feasible.len())])?;
        let mut totals = vec![0i64; feasible.len()];
        for (plugin, s) in &scores {
            let weight = i64::from(self.plugins[*plugin as usize].weight());
            for (t, v) in totals.iter_mut().zip(s) {
                *t += weight * v;
            }
        }
        let best = (0..feasible.len())
            .max_by(|a, b| totals[*a].cmp(&totals[*b]).then(b.cmp(a)))
            .unwrap_or(0);
        Ok(self
            .cluster
            .node(feasible[best])
            .map(|n| n.name().to_owned())
            .unwrap_or_default())
    }
}
