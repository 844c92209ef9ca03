//! A pod's own network: its namespace (`netns`) and the CNI plugins that connect it
//! (`cni`), under one [`PodNetwork`] the sandbox service asks; a hollow node's pods
//! get addresses from its pod CIDR and nothing else (`fake`).
//!
//! The runtime's default network (the conflist it writes) is done in-process
//! (`bridge`, over `netlink` requests and `ipam` in host-local's records): the same
//! bridge, addresses and rules as the plugins would make, without their executables.
//! Any other network in the config dir goes through the plugins. A sandbox's DEL
//! follows what its ADD used, whatever the config dir holds by then.
//!
//! Nothing is made until the network is ready: the config dir holds a network, the
//! default one (written once the node has a pod CIDR, `UpdateRuntimeConfig`, as the
//! kubelet sends it from its Node's `spec.podCIDR`) or an operator's, whose own IPAM
//! needs no pod CIDR. Until then every sandbox is on the node's network, as
//! host-network sandboxes always are, and `Status` says `NetworkReady` false.

mod bridge;
pub(crate) mod cni;
mod fake;
pub(crate) mod forward;
mod ipam;
mod netlink;
pub(crate) mod netns;
pub(crate) mod recover;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use k8s_cri::v1::{NamespaceMode, PodSandboxConfig, Protocol};
use serde::{Deserialize, Serialize};
use tonic::Status;

/// Where the runtime finds its CNI network and plugins.
#[derive(Clone, Debug, Default)]
pub struct CniConfig {
    /// The network's config dir; `None` is `<root>/cni/net.d`. The default conflist is
    /// written there when it holds none.
    pub conf_dir: Option<PathBuf>,
    /// Where plugins are looked for, in order; empty is `/usr/lib/cni` (Debian's
    /// `containernetworking-plugins`) then `/opt/cni/bin`.
    pub bin_dirs: Vec<PathBuf>,
}

/// What the runtime keeps of the node's network across restarts.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Persisted {
    #[serde(rename = "podCIDR")]
    pod_cidr: String,
}

/// The bridge of the default network.
const BRIDGE: &str = "trellis0";

/// The default network's conflist, as the runtime writes it into an empty config dir:
/// a bridge `bridge` with host-local IPAM on `subnets` keeping its reservations under
/// `ipam_dir`, and portmap. Written by another hand (a benchmark's own bridge), it is
/// still the runtime's own network.
pub fn default_conflist(subnets: &[String], bridge: &str, ipam_dir: &Path) -> serde_json::Value {
    cni::DefaultNetwork {
        subnets: subnets.to_vec(),
        bridge: bridge.to_string(),
        ipam_dir: ipam_dir.to_path_buf(),
    }
    .conflist()
}

/// The pods' network of one runtime.
#[derive(Debug)]
pub(crate) enum PodNetwork {
    /// Namespaces connected by CNI.
    Cni(CniNetwork),
    /// Addresses only, for a hollow node.
    Fake(fake::FakeNetwork),
}

/// A sandbox's network, once connected.
#[derive(Debug)]
pub(crate) struct Attached {
    /// Its pinned namespace; none for a hollow node's.
    pub netns: Option<PathBuf>,
    pub ips: Vec<IpAddr>,
}

impl PodNetwork {
    /// The CNI network of the runtime whose state is under `root`.
    pub(crate) fn cni(root: &Path, config: CniConfig) -> Self {
        Self::Cni(CniNetwork::open(root, config))
    }

    /// A hollow node's addresses.
    pub(crate) fn fake() -> Self {
        Self::Fake(fake::FakeNetwork::default())
    }

    /// Sets the node's pod CIDR (one, or an IPv4 and an IPv6 one separated by a comma,
    /// as the kubelet sends them); an empty one changes nothing.
    pub(crate) fn set_pod_cidr(&self, pod_cidr: &str) -> Result<(), Status> {
        let subnets: Vec<String> = pod_cidr
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if subnets.is_empty() {
            return Ok(());
        }
        for subnet in &subnets {
            if parse_cidr(subnet).is_none() {
                return Err(Status::invalid_argument(format!(
                    "pod CIDR {subnet:?} is not an address/prefix"
                )));
            }
        }
        match self {
            Self::Cni(cni) => cni.set_pod_cidr(subnets),
            Self::Fake(fake) => {
                fake.set_pod_cidr(&subnets);
                Ok(())
            }
        }
    }

    /// Whether pods can be given a network of their own (CRI's `NetworkReady`): for
    /// the CNI network, the config dir holds one that loads; for a hollow node's, it
    /// has a pod CIDR. `Err` says why not.
    pub(crate) fn ready(&self) -> Result<(), String> {
        match self {
            Self::Cni(cni) => cni.ready(),
            Self::Fake(fake) if fake.has_pod_cidr() => Ok(()),
            Self::Fake(_) => Err("the node has no pod CIDR yet".into()),
        }
    }

    /// Whether a sandbox of `config` gets a network of its own: it asks for the pod's
    /// network namespace (not the node's) and the network is ready (or the node has
    /// a pod CIDR: then a config dir that does not load fails the sandbox rather
    /// than putting it on the node's network).
    pub(crate) fn wanted(&self, config: &PodSandboxConfig) -> bool {
        let mode = config
            .linux
            .as_ref()
            .and_then(|linux| linux.security_context.as_ref())
            .and_then(|security| security.namespace_options.as_ref())
            .map_or(NamespaceMode::Pod as i32, |options| options.network);
        mode == NamespaceMode::Pod as i32
            && match self {
                Self::Cni(cni) => cni.has_pod_cidr() || cni.ready().is_ok(),
                Self::Fake(fake) => fake.has_pod_cidr(),
            }
    }

    /// Connects sandbox `id`; on a failure, nothing is left behind.
    pub(crate) async fn attach(
        &self,
        id: &str,
        config: &PodSandboxConfig,
    ) -> Result<Attached, Status> {
        match self {
            Self::Cni(cni) => cni.attach(id, config).await,
            Self::Fake(fake) => Ok(Attached {
                netns: None,
                ips: vec![fake.allocate(id)?],
            }),
        }
    }

    /// Disconnects sandbox `id` (whose namespace is `netns`); what is already gone is
    /// not an error.
    pub(crate) async fn detach(&self, id: &str, netns: Option<&Path>) -> Result<(), Status> {
        match (self, netns) {
            (Self::Cni(cni), Some(netns)) => cni.detach(id, netns).await,
            (Self::Cni(_), None) => Ok(()),
            (Self::Fake(fake), _) => {
                fake.release(id);
                Ok(())
            }
        }
    }
}

/// The address and prefix length of `cidr` (`10.42.0.0/24`).
fn parse_cidr(cidr: &str) -> Option<(IpAddr, u8)> {
    let (ip, bits) = cidr.split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    let bits: u8 = bits.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (bits <= max).then_some((ip, bits))
}

/// Pods' namespaces connected by the CNI network of the config dir.
#[derive(Debug)]
pub(crate) struct CniNetwork {
    root: PathBuf,
    cni: cni::Cni,
    /// The node's pod CIDR, empty until `UpdateRuntimeConfig` sets it.
    pod_cidr: Mutex<String>,
}

impl CniNetwork {
    /// The network of the runtime whose state is under `root`, with the pod CIDR a
    /// previous run was given.
    fn open(root: &Path, config: CniConfig) -> Self {
        let bin_dirs = if config.bin_dirs.is_empty() {
            vec![PathBuf::from("/usr/lib/cni"), PathBuf::from("/opt/cni/bin")]
        } else {
            config.bin_dirs
        };
        let persisted: Persisted = std::fs::read(root.join("network.json"))
            .ok()
            .and_then(|text| serde_json::from_slice(&text).ok())
            .unwrap_or_default();
        Self {
            root: root.to_path_buf(),
            cni: cni::Cni {
                conf_dir: config
                    .conf_dir
                    .unwrap_or_else(|| root.join("cni").join("net.d")),
                bin_dirs,
                cache_dir: root.join("cni").join("results"),
            },
            pod_cidr: Mutex::new(persisted.pod_cidr),
        }
    }

    fn has_pod_cidr(&self) -> bool {
        !self
            .pod_cidr
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_empty()
    }

    /// Whether the config dir holds a network that loads, as containerd's CRI plugin
    /// tells it (the kubelet shows the message).
    fn ready(&self) -> Result<(), String> {
        match self.cni.load() {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(format!(
                "cni plugin not initialized: no network config found in {}",
                self.cni.conf_dir.display()
            )),
            Err(e) => Err(format!("cni plugin not initialized: {e}")),
        }
    }

    /// Sets the node's pod CIDRs, keeps them for the next run, and writes the default
    /// network if the config dir has none.
    fn set_pod_cidr(&self, subnets: Vec<String>) -> Result<(), Status> {
        let joined = subnets.join(",");
        let internal =
            |what: &str, e: &dyn std::fmt::Display| Status::internal(format!("cannot {what}: {e}"));
        let text = serde_json::to_vec(&Persisted {
            pod_cidr: joined.clone(),
        })
        .unwrap_or_default();
        std::fs::create_dir_all(&self.root)
            .and_then(|()| std::fs::write(self.root.join("network.json"), text))
            .map_err(|e| internal("keep the pod CIDR", &e))?;
        let wrote = self
            .cni
            .write_default(&cni::DefaultNetwork {
                subnets,
                bridge: BRIDGE.into(),
                ipam_dir: self.root.join("cni").join("networks"),
            })
            .map_err(|e| internal("write the default CNI network", &e))?;
        if wrote {
            tracing::info!(pod_cidr = %joined, dir = %self.cni.conf_dir.display(), "wrote the default CNI network");
        }
        *self
            .pod_cidr
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = joined;
        Ok(())
    }

    /// Makes sandbox `id`'s network namespace and connects it; on a failure, nothing is
    /// left behind.
    async fn attach(&self, id: &str, config: &PodSandboxConfig) -> Result<Attached, Status> {
        let network = self
            .cni
            .load()
            .map_err(|e| Status::failed_precondition(e.to_string()))?
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "no CNI network in {}",
                    self.cni.conf_dir.display()
                ))
            })?;
        let pin = netns::pin_path(&self.root, id);
        let made = pin.clone();
        tokio::task::spawn_blocking(move || netns::create(&made))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| {
                Status::internal(format!("cannot make the pod's network namespace: {e}"))
            })?;
        let metadata = config.metadata.clone().unwrap_or_default();
        let pod = cni::Pod {
            id: id.to_string(),
            namespace: metadata.namespace,
            name: metadata.name,
            uid: metadata.uid,
            netns: pin.clone(),
            port_mappings: config
                .port_mappings
                .iter()
                .filter(|p| p.host_port > 0)
                .map(|p| cni::PortMapping {
                    host_port: p.host_port,
                    container_port: p.container_port,
                    protocol: match Protocol::try_from(p.protocol) {
                        Ok(Protocol::Udp) => "udp",
                        Ok(Protocol::Sctp) => "sctp",
                        _ => "tcp",
                    }
                    .into(),
                    host_ip: p.host_ip.clone(),
                })
                .collect(),
        };
        let added = match bridge::Bridge::of(&network) {
            Some(bridge) => {
                let root = self.root.clone();
                let pod = pod.clone();
                tokio::task::spawn_blocking(move || bridge.attach(&root, &pod))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|added| added.map(|ip| vec![ip]).map_err(|e| e.to_string()))
            }
            None => self
                .cni
                .add(&network, &pod)
                .await
                .map_err(|e| e.to_string()),
        };
        match added {
            Ok(ips) => Ok(Attached {
                netns: Some(pin),
                ips,
            }),
            Err(e) => {
                if let Err(removed) = netns::remove(&pin) {
                    tracing::warn!(sandbox = %id, "failed to remove the network namespace: {removed}");
                }
                Err(Status::unavailable(format!(
                    "sandbox {id}: cannot connect the pod's network: {e}"
                )))
            }
        }
    }

    /// Disconnects sandbox `id` as its ADD connected it: CNI DEL with its cached
    /// result, or the in-process bridge's DEL with its record; each is a no-op unless
    /// the ADD went that way, and again is a no-op. Its namespace is left.
    pub(crate) async fn disconnect(&self, id: &str) -> Result<(), String> {
        self.cni.del(id).await.map_err(|e| e.to_string())?;
        let root = self.root.clone();
        let sandbox = id.to_string();
        tokio::task::spawn_blocking(move || bridge::detach(&root, &sandbox))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// Disconnects sandbox `id` and removes its namespace; what is already gone is not
    /// an error.
    async fn detach(&self, id: &str, netns: &Path) -> Result<(), Status> {
        self.disconnect(id).await.map_err(|e| {
            Status::internal(format!(
                "sandbox {id}: cannot disconnect the pod's network: {e}"
            ))
        })?;
        let pin = netns.to_path_buf();
        tokio::task::spawn_blocking(move || netns::remove(&pin))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| {
                Status::internal(format!(
                    "sandbox {id}: cannot remove the network namespace: {e}"
                ))
            })
    }
}
