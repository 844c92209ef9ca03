//! What a controller is: [`ControllerConfig`], its primary, owned and watched
//! resources, and how a watched object's change maps to keys ([`Mapping`]) — the
//! builder's `owns` and `watches` of controller-runtime.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use trellis_client::workqueue::RateLimits;
use trellis_plugin_host::{GroupVersionResource, PluginKind, PluginSpec};

/// A controller to run.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Its name (its identity is `system:serviceaccount:kube-system:NAME`), its
    /// configuration, deadline and memory cap; the kind is `controller`.
    pub spec: PluginSpec,
    /// The component.
    pub wasm: Arc<Vec<u8>>,
    /// The resource whose objects it reconciles.
    pub primary: GroupVersionResource,
    /// Resources whose objects it owns: a change of one reconciles its controlling
    /// owner (the ownerReference with `controller: true` of the primary's kind).
    pub owns: Vec<GroupVersionResource>,
    /// Other resources it reads, each with how a change of one maps to keys of the
    /// primary resource.
    pub watches: Vec<Watch>,
    /// Keys reconciled at once.
    pub workers: usize,
    /// Every primary object is reconciled again this often, changed or not.
    pub resync: Option<Duration>,
    /// The queue's back-off after failures.
    pub rate_limits: RateLimits,
    /// How long a key waits at most for the caches to show its last writes.
    pub expectations_timeout: Duration,
}

impl ControllerConfig {
    pub fn new(name: &str, wasm: Arc<Vec<u8>>, primary: GroupVersionResource) -> Self {
        let mut spec = PluginSpec::new(name, PluginKind::Controller);
        // A reconcile waits on writes through the API server, unlike an admission
        // call: seconds, not milliseconds.
        spec.timeout = Duration::from_secs(10);
        Self {
            spec,
            wasm,
            primary,
            owns: Vec::new(),
            watches: Vec::new(),
            workers: 2,
            resync: None,
            rate_limits: RateLimits::default(),
            expectations_timeout: Duration::from_secs(300),
        }
    }
}

/// A resource a controller watches beside its primary and owned ones.
#[derive(Clone, Debug)]
pub struct Watch {
    pub resource: GroupVersionResource,
    pub map: Mapping,
}

/// How a change of a watched object becomes keys of the primary resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// Every owner of the primary's kind its ownerReferences name (controller or not).
    Owner,
    /// The primary object named as the object's namespace: a change inside a
    /// namespace reconciles the Namespace.
    Namespace,
    /// The primary object of the same name (in the same namespace when the primary
    /// is namespaced): a node's Lease reconciles the Node.
    Name,
    /// None: the resource is only read (cached for the controller's reads).
    Cache,
    /// The primary objects in the object's namespace whose `spec.selector` (a label
    /// map, as a Service's, or `matchLabels`/`matchExpressions`) selects its labels:
    /// a pod reconciles the Services that route to it.
    Selector,
    /// Every primary object in the object's namespace: a pod's change reconciles its
    /// namespace's quotas.
    Namespaced,
    /// Every primary object of every namespace: a Node's change reconciles every
    /// DaemonSet.
    All,
}

impl Mapping {
    /// Its name in a Plugin's `spec.controller.watches[].map`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Owner => "owner",
            Self::Namespace => "namespace",
            Self::Name => "name",
            Self::Cache => "cache",
            Self::Selector => "selector",
            Self::Namespaced => "namespaced",
            Self::All => "all",
        }
    }
}

impl std::str::FromStr for Mapping {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "owner" => Ok(Self::Owner),
            "namespace" => Ok(Self::Namespace),
            "name" => Ok(Self::Name),
            "cache" => Ok(Self::Cache),
            "selector" => Ok(Self::Selector),
            "namespaced" => Ok(Self::Namespaced),
            "all" => Ok(Self::All),
            other => Err(format!(
                "Unsupported value: {other:?}: supported values: \"owner\", \"namespace\", \"name\", \"cache\", \"selector\", \"namespaced\", \"all\""
            )),
        }
    }
}

/// Whether a resource is the wildcard of a controller of every resource (`*`).
pub fn is_every(gvr: &GroupVersionResource) -> bool {
    gvr.resource == "*"
}

/// The mapping of the controller's watch of `*` (every resource: each change that
/// removes something mapped), if it has one.
pub(crate) fn watch_of_every(config: &ControllerConfig) -> Option<Mapping> {
    config
        .watches
        .iter()
        .find(|w| is_every(&w.resource))
        .map(|w| w.map)
}

/// Checks that `config` can run: a name, a primary resource, workers.
pub fn check(config: &ControllerConfig) -> anyhow::Result<()> {
    if config.spec.name.is_empty() {
        bail!("a controller needs a name");
    }
    if !is_every(&config.primary)
        && (config.primary.resource.is_empty() || config.primary.version.is_empty())
    {
        bail!("controller {}: no primary resource", config.spec.name);
    }
    Ok(())
}
