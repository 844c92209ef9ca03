//! What the table holds for each Service: pure functions from a Service and its
//! EndpointSlices to map elements and chains, and from two such states to the `nft`
//! commands that turn one into the other.
//!
//! # Layout
//! kube-proxy's nftables mode gives every Service port a chain and every endpoint a chain
//! of its own, spreading with an anonymous `numgen … vmap` per Service. With nft 1.0.6 that
//! layout loads 10,000 Services × 10 endpoints in about two minutes and rewrites one
//! Service in two seconds, since every anonymous set and every chain costs the `nft`
//! process time at each run. Here the state lives in a few named maps instead, and only
//! rules that do not depend on a Service's endpoints are written as rules:
//! - `service-ips` (`ClusterIP . proto . port : goto spread-N`) and `service-nodeports`
//!   (`proto . port : goto nodeport-cluster-N | nodeport-local-N`) dispatch a new
//!   connection to a chain shared by every frontend with N endpoints,
//! - whose one rule DNATs through `backends` / `nodeport-backends`
//!   (`frontend . index : endpoint IP . port`), the index being a hash of the client's
//!   address and port modulo N: a change of endpoints is a change of elements only,
//! - `hairpin` (`endpoint . endpoint`) masquerades a connection an endpoint made to itself
//!   through its Service, where kube-proxy marks in each endpoint's chain,
//! - `no-endpoint-services` / `no-endpoint-nodeports` reject (or, for a `Local` policy
//!   without a local endpoint, drop) new connections to frontends without endpoints,
//! - Services with `sessionAffinity: ClientIP` keep kube-proxy's shape: a chain of their
//!   own per frontend (`service-…`, `external-…`) and a set per endpoint (`affinity-…`)
//!   that remembers the clients sent there, for the affinity's timeout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

/// kube-proxy's masquerade bit.
pub const MASQUERADE_MARK: u32 = 0x4000;

/// The seed of the hash that picks an endpoint: fixed, so a frontend's choice for one
/// client and port does not move between syncs.
const HASH_SEED: u32 = 0x7472_6c73;

/// The named maps and sets whose elements are per Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Map {
    ServiceIps,
    ServiceNodePorts,
    NoEndpointServices,
    NoEndpointNodePorts,
    Backends,
    NodePortBackends,
    ClusterIps,
    ExternalSpread,
    LocalBackends,
}

impl Map {
    pub fn name(self) -> &'static str {
        match self {
            Map::ServiceIps => "service-ips",
            Map::ServiceNodePorts => "service-nodeports",
            Map::NoEndpointServices => "no-endpoint-services",
            Map::NoEndpointNodePorts => "no-endpoint-nodeports",
            Map::Backends => "backends",
            Map::NodePortBackends => "nodeport-backends",
            Map::ClusterIps => "cluster-ips",
            Map::ExternalSpread => "external-spread",
            Map::LocalBackends => "local-backends",
        }
    }
}

/// What one Service puts in the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Part {
    /// (map, key) → value.
    pub elements: BTreeMap<(Map, String), String>,
    /// Chains of this Service alone (affinity): name → rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Affinity sets: name → timeout in seconds.
    pub sets: BTreeMap<String, u32>,
    /// Shared chains this Service's elements jump to (`spread-N`, …).
    pub shared_chains: BTreeSet<String>,
    /// The endpoints in each frontend's slots (`backends` and `nodeport-backends`).
    pub slots: BTreeMap<(Map, String), Vec<String>>,
    /// This node's endpoint IPs (and those of no known node), for the hairpin set: a
    /// connection an endpoint makes to itself starts on the endpoint's node.
    pub endpoint_ips: BTreeSet<Ipv4Addr>,
    /// UDP frontends (ClusterIP or external IP, port; `0.0.0.0` and the NodePort for a
    /// NodePort, on any address) and the endpoint IPs behind them, whose stale conntrack
    /// entries go when an endpoint does.
    pub udp_frontends: BTreeMap<(Ipv4Addr, u16), BTreeSet<Ipv4Addr>>,
}

/// What the proxy needs of its configuration to render.
#[derive(Clone, Debug, Default)]
pub struct RenderConfig {
    pub node_name: String,
    pub local_service_ips: Vec<Ipv4Addr>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Endpoint {
    ip: Ipv4Addr,
    port: u16,
    /// On this node, or on no node the slice names.
    local: bool,
}

/// kube-proxy's chain names: a short hash for uniqueness, then the readable base.
fn hashed(prefix: &str, base: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, base.as_bytes());
    let mut name = format!("{prefix}-");
    for b in &digest.as_ref()[..4] {
        let _ = write!(name, "{b:02x}");
    }
    name.push('-');
    // Characters nft's unquoted names take.
    name.extend(base.chars().map(|c| {
        if c.is_ascii_alphanumeric() || "/-_.".contains(c) {
            c
        } else {
            '_'
        }
    }));
    name.truncate(240);
    name
}

fn l4(protocol: Option<&str>) -> Option<&'static str> {
    match protocol.unwrap_or("TCP") {
        "TCP" => Some("tcp"),
        "UDP" => Some("udp"),
        "SCTP" => Some("sctp"),
        _ => None,
    }
}

/// The endpoints to use of `candidates` (ready ones, or, when none is ready, the
/// serving terminating ones, as kube-proxy falls back).
fn usable(candidates: &[(Endpoint, bool, bool)]) -> Vec<Endpoint> {
    let ready: BTreeSet<Endpoint> = candidates
        .iter()
        .filter(|(_, ready, _)| *ready)
        .map(|(e, ..)| e.clone())
        .collect();
    if !ready.is_empty() {
        return ready.into_iter().collect();
    }
    candidates
        .iter()
        .filter(|(_, _, serving_terminating)| *serving_terminating)
        .map(|(e, ..)| e.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The elements and chains of `service`, with endpoints from `slices` (those labelled
/// with its name in its namespace). Headless and ExternalName Services have none.
/// `previous` is what the table holds of it now: endpoints that stay keep their slot, so
/// a changed endpoint is one element.
pub fn render_service(
    service: &Service,
    slices: &[&EndpointSlice],
    config: &RenderConfig,
    previous: Option<&Part>,
) -> Part {
    let mut part = Part::default();
    let Some(spec) = service.spec.as_ref() else {
        return part;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return part;
    }
    let Some(cluster_ip) = spec
        .cluster_ip
        .as_deref()
        .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
    else {
        return part;
    };
    if config.local_service_ips.contains(&cluster_ip) {
        return part;
    }
    let namespace = service.metadata.namespace.as_deref().unwrap_or("default");
    let name = service.metadata.name.as_deref().unwrap_or_default();
    let affinity = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .unwrap_or(10800)
            .clamp(1, 86400) as u32
    });
    let node_port_type = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"));
    let external_ips: BTreeSet<Ipv4Addr> = spec
        .external_ips
        .iter()
        .flatten()
        .filter_map(|ip| ip.parse::<Ipv4Addr>().ok())
        .filter(|ip| *ip != cluster_ip && !ip.is_unspecified())
        .collect();
    // An allocated ClusterIP: a new connection to a port none of its Service serves is
    // refused (`cluster-ips-check`), as kube-proxy does.
    part.elements
        .insert((Map::ClusterIps, cluster_ip.to_string()), String::new());
    let internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let external_local = spec.external_traffic_policy.as_deref() == Some("Local");

    for port in spec.ports.iter().flatten() {
        let Some(proto) = l4(port.protocol.as_deref()) else {
            continue;
        };
        let port_name = port.name.clone().unwrap_or_default();
        let Ok(service_port) = u16::try_from(port.port) else {
            continue;
        };
        // Endpoints of this port, matched by name per slice (the slice resolved named
        // target ports per pod).
        let mut all = Vec::new();
        let mut local = Vec::new();
        for slice in slices {
            if slice.address_type != "IPv4" {
                continue;
            }
            let Some(number) = slice.ports.iter().flatten().find_map(|p| {
                (p.name.clone().unwrap_or_default() == port_name
                    && l4(p.protocol.as_deref()) == Some(proto))
                .then_some(p.port)
                .flatten()
            }) else {
                continue;
            };
            let Ok(number) = u16::try_from(number) else {
                continue;
            };
            for endpoint in &slice.endpoints {
                let Some(ip) = endpoint
                    .addresses
                    .first()
                    .and_then(|a| a.parse::<Ipv4Addr>().ok())
                else {
                    continue;
                };
                let conditions = endpoint.conditions.as_ref();
                let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
                let serving = conditions.and_then(|c| c.serving).unwrap_or(ready);
                let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
                let on_node = endpoint.node_name.as_deref() == Some(config.node_name.as_str());
                let entry = (
                    Endpoint {
                        ip,
                        port: number,
                        local: on_node || endpoint.node_name.is_none(),
                    },
                    ready,
                    serving && terminating,
                );
                if on_node {
                    local.push(entry.clone());
                }
                all.push(entry);
            }
        }
        let cluster = usable(&all);
        let local = usable(&local);
        let base = format!("{namespace}/{name}/{proto}/{port_name}");
        // The timeout is part of a set's name: a set is made with its timeout, so a new
        // timeout is a new set.
        let timeout = affinity.unwrap_or(0);
        let affinity_set = |e: &Endpoint| {
            hashed(
                "affinity",
                &format!("{base}__{}/{}/{timeout}", e.ip, e.port),
            )
        };
        if let Some(timeout) = affinity {
            for e in cluster.iter().chain(&local) {
                part.sets.insert(affinity_set(e), timeout);
            }
        }

        // The ClusterIP.
        let frontend = format!("{cluster_ip} . {proto} . {service_port}");
        let internal = if internal_local { &local } else { &cluster };
        if cluster.is_empty() {
            part.elements.insert(
                (Map::NoEndpointServices, frontend.clone()),
                "goto reject-chain".into(),
            );
        } else if internal.is_empty() {
            part.elements
                .insert((Map::NoEndpointServices, frontend.clone()), "drop".into());
        } else {
            let n = internal.len();
            let target = match affinity {
                Some(_) => {
                    let chain = hashed("service", &base);
                    part.chains.insert(
                        chain.clone(),
                        affinity_rules(proto, &[], internal, &affinity_set),
                    );
                    chain
                }
                None => {
                    let chain = format!("spread-{n}");
                    part.shared_chains.insert(chain.clone());
                    place(&mut part, previous, Map::Backends, &frontend, internal);
                    chain
                }
            };
            part.elements.insert(
                (Map::ServiceIps, frontend.clone()),
                format!("goto {target}"),
            );
            part.endpoint_ips
                .extend(internal.iter().filter(|e| e.local).map(|e| e.ip));
            if proto == "udp" {
                part.udp_frontends.insert(
                    (cluster_ip, service_port),
                    internal.iter().map(|e| e.ip).collect(),
                );
            }
        }

        // eTP Cluster masquerades every external connection; Local keeps the client's
        // address, except the node's own (whose replies would not come back).
        let masquerade = if external_local {
            "fib saddr type local jump mark-for-masquerade"
        } else {
            "jump mark-for-masquerade"
        };
        let external = if external_local { &local } else { &cluster };

        // External IPs: frontends of `service-ips` as the ClusterIP, by the external
        // policy (kube-proxy's `external-…` chain): Cluster goes to `external-cluster`
        // (masquerade, then `external-spread`); Local to `external-local-L`, where pods
        // and the node itself follow `external-spread` (the Cluster policy, as through a
        // load balancer) and everyone else the L local endpoints.
        for ip in &external_ips {
            let frontend = format!("{ip} . {proto} . {service_port}");
            if cluster.is_empty() {
                part.elements.insert(
                    (Map::NoEndpointServices, frontend.clone()),
                    "goto reject-chain".into(),
                );
                continue;
            }
            if external.is_empty() {
                // What the short-circuits of `external-local-0` did not DNAT.
                part.elements
                    .insert((Map::NoEndpointServices, frontend.clone()), "drop".into());
            }
            if affinity.is_some() {
                // The NodePort's shape: a chain of its own with the external endpoints.
                if external.is_empty() {
                    continue;
                }
                let chain = hashed("external", &base);
                part.chains.entry(chain.clone()).or_insert_with(|| {
                    affinity_rules(proto, &[masquerade], external, &affinity_set)
                });
                part.elements
                    .insert((Map::ServiceIps, frontend.clone()), format!("goto {chain}"));
            } else {
                let spread = format!("spread-{}", cluster.len());
                part.shared_chains.insert(spread.clone());
                place(&mut part, previous, Map::Backends, &frontend, &cluster);
                part.elements.insert(
                    (Map::ExternalSpread, frontend.clone()),
                    format!("goto {spread}"),
                );
                let target = if external_local {
                    let chain = format!("external-local-{}", local.len());
                    part.shared_chains.insert(chain.clone());
                    place(&mut part, previous, Map::LocalBackends, &frontend, &local);
                    chain
                } else {
                    "external-cluster".to_owned()
                };
                part.elements.insert(
                    (Map::ServiceIps, frontend.clone()),
                    format!("goto {target}"),
                );
            }
            part.endpoint_ips
                .extend(cluster.iter().filter(|e| e.local).map(|e| e.ip));
            if proto == "udp" {
                part.udp_frontends
                    .insert((*ip, service_port), cluster.iter().map(|e| e.ip).collect());
            }
        }

        // The NodePort.
        let Some(node_port) = port
            .node_port
            .filter(|_| node_port_type)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        let frontend = format!("{proto} . {node_port}");
        if cluster.is_empty() {
            part.elements.insert(
                (Map::NoEndpointNodePorts, frontend.clone()),
                "goto reject-chain".into(),
            );
            continue;
        }
        if external.is_empty() {
            part.elements
                .insert((Map::NoEndpointNodePorts, frontend.clone()), "drop".into());
            continue;
        }
        let n = external.len();
        let target = match affinity {
            Some(_) => {
                let chain = hashed("external", &base);
                part.chains.insert(
                    chain.clone(),
                    affinity_rules(proto, &[masquerade], external, &affinity_set),
                );
                chain
            }
            None => {
                let chain = if external_local {
                    format!("nodeport-local-{n}")
                } else {
                    format!("nodeport-cluster-{n}")
                };
                part.shared_chains.insert(chain.clone());
                place(
                    &mut part,
                    previous,
                    Map::NodePortBackends,
                    &frontend,
                    external,
                );
                chain
            }
        };
        part.elements.insert(
            (Map::ServiceNodePorts, frontend.clone()),
            format!("goto {target}"),
        );
        part.endpoint_ips
            .extend(external.iter().filter(|e| e.local).map(|e| e.ip));
        if proto == "udp" {
            // On every address: kube-proxy's ClearEntriesForPortNAT.
            part.udp_frontends.insert(
                (Ipv4Addr::UNSPECIFIED, node_port),
                external.iter().map(|e| e.ip).collect(),
            );
        }
    }
    part
}

/// Puts `endpoints` in the slots `0..n` of `frontend` in `map`: those already in a slot
/// below `n` stay there, the others fill the free ones.
fn place(
    part: &mut Part,
    previous: Option<&Part>,
    map: Map,
    frontend: &str,
    endpoints: &[Endpoint],
) {
    let n = endpoints.len();
    let values: Vec<String> = endpoints
        .iter()
        .map(|e| format!("{} . {}", e.ip, e.port))
        .collect();
    let mut slots: Vec<Option<String>> = vec![None; n];
    let mut placed = BTreeSet::new();
    if let Some(old) = previous.and_then(|p| p.slots.get(&(map, frontend.to_owned()))) {
        for (i, value) in old.iter().enumerate().take(n) {
            if values.contains(value) && placed.insert(value.clone()) {
                slots[i] = Some(value.clone());
            }
        }
    }
    let mut rest = values.iter().filter(|v| !placed.contains(*v));
    let slots: Vec<String> = slots
        .into_iter()
        .map(|slot| slot.or_else(|| rest.next().cloned()).unwrap_or_default())
        .collect();
    for (i, value) in slots.iter().enumerate() {
        part.elements
            .insert((map, format!("{frontend} . {i}")), value.clone());
    }
    part.slots.insert((map, frontend.to_owned()), slots);
}

/// The rules of an affinity frontend's chain: a client seen within the timeout goes
/// back to its endpoint, a new one is spread by hash and remembered.
fn affinity_rules(
    proto: &str,
    head: &[&str],
    endpoints: &[Endpoint],
    set: &dyn Fn(&Endpoint) -> String,
) -> Vec<String> {
    let mut rules: Vec<String> = head.iter().map(|r| (*r).to_owned()).collect();
    for e in endpoints {
        let set = set(e);
        rules.push(format!(
            "ip saddr @{set} update @{set} {{ ip saddr }} meta l4proto {proto} dnat to {}:{}",
            e.ip, e.port
        ));
    }
    let n = endpoints.len();
    for (i, e) in endpoints.iter().enumerate() {
        let set = set(e);
        rules.push(format!(
            "jhash ip saddr . th sport mod {n} seed {HASH_SEED:#x} {i} update @{set} {{ ip saddr }} meta l4proto {proto} dnat to {}:{}",
            e.ip, e.port
        ));
    }
    rules
}

/// Frontends of up to this many endpoints find their shared chains in the table already:
/// every full sync writes them, used or not. nft 1.0.6 cannot add a rule that DNATs
/// through a map whose data is declared with `th dport` (see [`skeleton`]) to a table
/// in the kernel (it fails to read the declaration back), so an incremental sync never
/// adds one; a frontend with more endpoints than this is written by a full sync.
pub const PRESET_ENDPOINTS: usize = 128;

/// The shared chains of [`PRESET_ENDPOINTS`] (and `external-local-0`, for external IPs
/// of a `Local` policy without a local endpoint).
pub fn preset_shared_chains() -> impl Iterator<Item = String> {
    std::iter::once("external-local-0".to_owned()).chain((1..=PRESET_ENDPOINTS).flat_map(|n| {
        [
            "spread",
            "nodeport-cluster",
            "nodeport-local",
            "external-local",
        ]
        .map(|kind| format!("{kind}-{n}"))
    }))
}

/// The rules of a shared chain named by [`render_service`].
pub fn shared_chain_rules(name: &str) -> Option<Vec<String>> {
    let (kind, n) = name.rsplit_once('-')?;
    let n: usize = n.parse().ok()?;
    let pick = format!("jhash ip saddr . th sport mod {n} seed {HASH_SEED:#x}");
    if kind == "external-local" {
        // Pods and the node itself follow the Cluster policy (kube-proxy's
        // short-circuits); the node's connections are masqueraded, as their source is
        // the external IP's own route's.
        let mut rules = vec![
            "ip saddr @cluster-cidrs ip daddr . meta l4proto . th dport vmap @external-spread"
                .to_owned(),
            "fib saddr type local jump mark-for-masquerade".to_owned(),
            "fib saddr type local ip daddr . meta l4proto . th dport vmap @external-spread"
                .to_owned(),
        ];
        if n > 0 {
            rules.push(format!(
                "dnat ip addr . port to ip daddr . meta l4proto . th dport . {pick} map @local-backends"
            ));
        }
        return Some(rules);
    }
    if n == 0 {
        return None;
    }
    Some(match kind {
        "spread" => vec![format!(
            "dnat ip addr . port to ip daddr . meta l4proto . th dport . {pick} map @backends"
        )],
        "nodeport-cluster" => vec![
            "jump mark-for-masquerade".into(),
            format!(
                "dnat ip addr . port to meta l4proto . th dport . {pick} map @nodeport-backends"
            ),
        ],
        "nodeport-local" => vec![
            "fib saddr type local jump mark-for-masquerade".into(),
            format!(
                "dnat ip addr . port to meta l4proto . th dport . {pick} map @nodeport-backends"
            ),
        ],
        _ => return None,
    })
}

/// The table's fixed part: base chains, the chains they jump to, and the maps' and sets'
/// declarations, as one `table` block.
/// `service_cidrs`: the ranges ClusterIPs come from; a new connection to an address in
/// them that no Service holds is dropped (empty: not known, nothing dropped).
pub fn skeleton(
    table: &str,
    node_ips: &[Ipv4Addr],
    cluster_cidrs: &[String],
    service_cidrs: &[String],
) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "table ip {table} {{");
    // Declared even when empty: `external-local-N` matches pods with it.
    if cluster_cidrs.is_empty() {
        t.push_str("  set cluster-cidrs { type ipv4_addr; flags interval; }\n");
    } else {
        let _ = writeln!(
            t,
            "  set cluster-cidrs {{ type ipv4_addr; flags interval; elements = {{ {} }}; }}",
            cluster_cidrs.join(", ")
        );
    }
    if !node_ips.is_empty() {
        let ips: Vec<String> = node_ips.iter().map(|ip| ip.to_string()).collect();
        let _ = writeln!(
            t,
            "  set nodeport-ips {{ type ipv4_addr; elements = {{ {} }}; }}",
            ips.join(", ")
        );
    }
    // The maps' keys are declared with `tcp dport` for `th dport` (same bytes, same
    // type): nft 1.0.6 cannot read a `th` in a key's declaration back from the kernel.
    // Their data says `th dport`: a `tcp dport` there makes nft add a "protocol is TCP"
    // check to the rules that DNAT through the map, which would leave UDP untranslated.
    t.push_str(
        "  set hairpin { type ipv4_addr . ipv4_addr; }
  set cluster-ips { type ipv4_addr; }
  map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; }
  map external-spread { type ipv4_addr . inet_proto . inet_service : verdict; }
  map service-nodeports { type inet_proto . inet_service : verdict; }
  map no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict; }
  map no-endpoint-nodeports { type inet_proto . inet_service : verdict; }
  map backends { typeof ip daddr . meta l4proto . tcp dport . numgen random mod 2 : ip daddr . th dport; }
  map nodeport-backends { typeof meta l4proto . tcp dport . numgen random mod 2 : ip daddr . th dport; }
  map local-backends { typeof ip daddr . meta l4proto . tcp dport . numgen random mod 2 : ip daddr . th dport; }
  chain reject-chain {
    meta l4proto tcp reject with tcp reset
    reject
  }
",
    );
    let _ = writeln!(
        t,
        "  chain mark-for-masquerade {{\n    meta mark set meta mark or {MASQUERADE_MARK:#x}\n  }}"
    );
    let _ = writeln!(
        t,
        "  chain masquerading {{\n    meta mark & {MASQUERADE_MARK:#x} == 0 return\n    meta mark set meta mark xor {MASQUERADE_MARK:#x}\n    masquerade fully-random\n  }}"
    );
    let nodeport_match = if node_ips.is_empty() {
        "fib daddr type local ip daddr != 127.0.0.0/8"
    } else {
        "ip daddr @nodeport-ips"
    };
    t.push_str("  chain services {\n");
    if !cluster_cidrs.is_empty() {
        // ClusterIPs only: an external IP's chain decides for itself.
        t.push_str(
            "    ip saddr != @cluster-cidrs ip daddr @cluster-ips jump mark-for-masquerade\n",
        );
    }
    t.push_str("    ip daddr . meta l4proto . th dport vmap @service-ips\n");
    let _ = writeln!(
        t,
        "    {nodeport_match} meta l4proto . th dport vmap @service-nodeports\n  }}"
    );
    t.push_str(
        "  chain external-cluster {
    jump mark-for-masquerade
    ip daddr . meta l4proto . th dport vmap @external-spread
  }
  chain service-endpoints-check {
    ip daddr . meta l4proto . th dport vmap @no-endpoint-services
  }
",
    );
    let _ = writeln!(
        t,
        "  chain nodeport-endpoints-check {{\n    {nodeport_match} meta l4proto . th dport vmap @no-endpoint-nodeports\n  }}"
    );
    // After DNAT (the forward hook, and output past dstnat): what still goes to a
    // ClusterIP matched none of its ports; kube-proxy's `cluster-ips-check`. The node's
    // own addresses (the kube-dns ClusterIP the DNS server answers on) are left alone.
    t.push_str("  chain cluster-ips-check {\n    ip daddr @cluster-ips goto reject-chain\n");
    if !service_cidrs.is_empty() {
        let _ = writeln!(
            t,
            "    fib daddr type local return\n    ip daddr {{ {} }} drop",
            service_cidrs.join(", ")
        );
    }
    t.push_str("  }\n");
    t.push_str(
        "  chain filter-input {
    type filter hook input priority -110;
    ct state new jump nodeport-endpoints-check
    ct state new jump service-endpoints-check
  }
  chain filter-forward {
    type filter hook forward priority -110;
    ct state new jump service-endpoints-check
    ct state new jump cluster-ips-check
  }
  chain filter-output {
    type filter hook output priority -110;
    ct state new jump service-endpoints-check
  }
  chain filter-output-post-dnat {
    type filter hook output priority -90;
    ct state new jump cluster-ips-check
  }
  chain nat-prerouting {
    type nat hook prerouting priority dstnat;
    jump services
  }
  chain nat-output {
    type nat hook output priority -100;
    jump services
  }
  chain nat-postrouting {
    type nat hook postrouting priority srcnat;
    ct status dnat ip saddr . ip daddr @hairpin masquerade fully-random
    jump masquerading
  }
}
",
    );
    t
}

/// The fixed chains' names: every other chain of the table is per Service or shared by
/// endpoint count.
pub const FIXED_CHAINS: &[&str] = &[
    "reject-chain",
    "mark-for-masquerade",
    "masquerading",
    "services",
    "external-cluster",
    "service-endpoints-check",
    "nodeport-endpoints-check",
    "cluster-ips-check",
    "filter-input",
    "filter-forward",
    "filter-output",
    "filter-output-post-dnat",
    "nat-prerouting",
    "nat-output",
    "nat-postrouting",
];

/// The whole table from the parts of every Service: the skeleton, then chains, then
/// elements in large `add element` commands.
pub fn full_text(
    table: &str,
    node_ips: &[Ipv4Addr],
    cluster_cidrs: &[String],
    service_cidrs: &[String],
    parts: &HashMap<String, Part>,
) -> String {
    let mut t = String::new();
    // "add, then delete" leaves no table whatever was there: the new one replaces it in
    // the same transaction, so nothing ever sees an empty table.
    let _ = writeln!(t, "add table ip {table}\ndelete table ip {table}");
    t.push_str(&skeleton(table, node_ips, cluster_cidrs, service_cidrs));
    let mut shared: BTreeSet<String> = preset_shared_chains().collect();
    let mut sets = BTreeMap::new();
    let mut chains = BTreeMap::new();
    let mut elements: BTreeMap<Map, Vec<String>> = BTreeMap::new();
    let mut hairpin = BTreeSet::new();
    let mut keys = std::collections::HashSet::new();
    for part in parts.values() {
        shared.extend(part.shared_chains.iter().cloned());
        sets.extend(part.sets.iter().map(|(k, v)| (k.clone(), *v)));
        chains.extend(part.chains.iter().map(|(k, v)| (k.clone(), v.clone())));
        for ((map, key), value) in &part.elements {
            // Two Services may claim one external IP and port (the API allows it): one
            // of them is served, rather than the whole transaction failing.
            if !keys.insert((*map, key.as_str())) {
                continue;
            }
            let elements = elements.entry(*map).or_default();
            elements.push(element(*map, key, value));
        }
        hairpin.extend(part.endpoint_ips.iter().copied());
    }
    for (set, timeout) in &sets {
        let _ = writeln!(t, "{}", add_set(table, set, *timeout));
    }
    for chain in &shared {
        t.push_str(&chain_block(
            table,
            chain,
            &shared_chain_rules(chain).unwrap_or_default(),
        ));
    }
    for (chain, rules) in &chains {
        t.push_str(&chain_block(table, chain, rules));
    }
    for (map, elements) in &elements {
        for chunk in elements.chunks(4096) {
            let _ = writeln!(
                t,
                "add element ip {table} {} {{ {} }}",
                map.name(),
                chunk.join(", ")
            );
        }
    }
    let pairs: Vec<String> = hairpin.iter().map(|ip| format!("{ip} . {ip}")).collect();
    for chunk in pairs.chunks(4096) {
        let _ = writeln!(
            t,
            "add element ip {table} hairpin {{ {} }}",
            chunk.join(", ")
        );
    }
    t
}

/// A chain and its rules in nft's block syntax: nft 1.0.6 mistakes the protocol of a
/// map's `th` key in a DNAT given as a lone `add rule`, not in a block.
fn chain_block(table: &str, chain: &str, rules: &[String]) -> String {
    let mut t = format!("table ip {table} {{\n  chain {chain} {{\n");
    for rule in rules {
        let _ = writeln!(t, "    {rule}");
    }
    t.push_str("  }\n}\n");
    t
}

fn element(map: Map, key: &str, value: &str) -> String {
    let _ = map;
    if value.is_empty() {
        key.to_owned()
    } else {
        format!("{key} : {value}")
    }
}

fn add_set(table: &str, set: &str, timeout: u32) -> String {
    // `dynamic` always: some kernels add it themselves, and a later `add set` without it
    // then fails.
    format!(
        "add set ip {table} {set} {{ type ipv4_addr; flags dynamic,timeout; timeout {timeout}s; }}"
    )
}

/// The commands that turn `old` (what the table holds of one Service) into `new`, as
/// sections of one transaction: additions first, then changes, then deletions, so that
/// nothing is deleted while something still refers to it. `shared_present` is the set of
/// shared chains in the table; those `new` needs are added to it.
#[derive(Debug, Default)]
pub struct Transaction {
    pub adds: String,
    pub rules: String,
    pub element_deletes: String,
    pub element_adds: String,
    pub chain_deletes: String,
    pub set_deletes: String,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.adds.is_empty()
            && self.rules.is_empty()
            && self.element_deletes.is_empty()
            && self.element_adds.is_empty()
            && self.chain_deletes.is_empty()
            && self.set_deletes.is_empty()
    }

    pub fn text(&self) -> String {
        [
            &self.adds,
            &self.rules,
            &self.element_deletes,
            &self.element_adds,
            &self.chain_deletes,
            &self.set_deletes,
        ]
        .into_iter()
        .map(String::as_str)
        .collect()
    }

    /// Adds the commands from `old` to `new` of one Service.
    pub fn diff(
        &mut self,
        table: &str,
        old: &Part,
        new: &Part,
        shared_present: &mut BTreeSet<String>,
    ) {
        for chain in &new.shared_chains {
            if shared_present.insert(chain.clone()) {
                let _ = writeln!(self.adds, "add chain ip {table} {chain}");
                self.rules.push_str(&chain_block(
                    table,
                    chain,
                    &shared_chain_rules(chain).unwrap_or_default(),
                ));
            }
        }
        for (set, timeout) in &new.sets {
            if !old.sets.contains_key(set) {
                let _ = writeln!(self.adds, "{}", add_set(table, set, *timeout));
            }
        }
        for (chain, rules) in &new.chains {
            if old.chains.get(chain) == Some(rules) {
                continue;
            }
            let _ = writeln!(self.adds, "add chain ip {table} {chain}");
            let _ = writeln!(self.rules, "flush chain ip {table} {chain}");
            self.rules.push_str(&chain_block(table, chain, rules));
        }
        for ((map, key), value) in &old.elements {
            match new.elements.get(&(*map, key.clone())) {
                Some(v) if v == value => {}
                _ => {
                    let _ = writeln!(
                        self.element_deletes,
                        "delete element ip {table} {} {{ {key} }}",
                        map.name()
                    );
                }
            }
        }
        for ((map, key), value) in &new.elements {
            if old.elements.get(&(*map, key.clone())) != Some(value) {
                let _ = writeln!(
                    self.element_adds,
                    "add element ip {table} {} {{ {} }}",
                    map.name(),
                    element(*map, key, value)
                );
            }
        }
        for chain in old.chains.keys() {
            if !new.chains.contains_key(chain) {
                let _ = writeln!(self.chain_deletes, "delete chain ip {table} {chain}");
            }
        }
        for set in old.sets.keys() {
            if !new.sets.contains_key(set) {
                let _ = writeln!(self.set_deletes, "delete set ip {table} {set}");
            }
        }
    }

    /// Hairpin pairs whose reference count went from 0 to 1 or back.
    pub fn hairpin(&mut self, table: &str, added: &[Ipv4Addr], removed: &[Ipv4Addr]) {
        for ip in removed {
            let _ = writeln!(
                self.element_deletes,
                "delete element ip {table} hairpin {{ {ip} . {ip} }}"
            );
        }
        for ip in added {
            let _ = writeln!(
                self.element_adds,
                "add element ip {table} hairpin {{ {ip} . {ip} }}"
            );
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::api::discovery::v1::{
        Endpoint as SliceEndpoint, EndpointConditions, EndpointPort,
    };
    use kube::api::ObjectMeta;

    pub(crate) fn service(
        name: &str,
        ip: &str,
        ports: &[(&str, i32, &str, Option<i32>)],
    ) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(ip.into()),
                type_: Some(
                    if ports.iter().any(|p| p.3.is_some()) {
                        "NodePort"
                    } else {
                        "ClusterIP"
                    }
                    .into(),
                ),
                ports: Some(
                    ports
                        .iter()
                        .map(|(n, p, proto, np)| ServicePort {
                            name: Some((*n).into()),
                            port: *p,
                            protocol: Some((*proto).into()),
                            node_port: *np,
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A slice of `endpoints` (ip, ready, serving, terminating, node) with `ports`.
    pub(crate) fn slice(
        ports: &[(&str, i32, &str)],
        endpoints: &[(&str, bool, bool, bool, &str)],
    ) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta::default(),
            address_type: "IPv4".into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p, proto)| EndpointPort {
                        name: Some((*n).into()),
                        port: Some(*p),
                        protocol: Some((*proto).into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: endpoints
                .iter()
                .map(|(ip, ready, serving, terminating, node)| SliceEndpoint {
                    addresses: vec![(*ip).into()],
                    conditions: Some(EndpointConditions {
                        ready: Some(*ready),
                        serving: Some(*serving),
                        terminating: Some(*terminating),
                    }),
                    node_name: Some((*node).into()),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn config() -> RenderConfig {
        RenderConfig {
            node_name: "here".into(),
            local_service_ips: vec!["10.43.0.10".parse().unwrap()],
        }
    }

    fn el(part: &Part, map: Map) -> Vec<(String, String)> {
        part.elements
            .iter()
            .filter(|((m, _), _)| *m == map)
            .map(|((_, k), v)| (k.clone(), v.clone()))
            .collect()
    }

    #[test]
    fn cluster_ip_spreads_over_ready_endpoints_by_port_name() {
        let svc = service(
            "web",
            "10.43.0.5",
            &[("http", 80, "TCP", Some(30080)), ("dns", 53, "UDP", None)],
        );
        let a = slice(
            &[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
            &[("10.1.0.1", true, true, false, "here")],
        );
        // A second slice whose pods name their port with another number.
        let b = slice(
            &[("http", 9090, "TCP")],
            &[
                ("10.1.0.2", true, true, false, "there"),
                ("10.1.0.3", false, false, false, "there"),
            ],
        );
        let part = render_service(&svc, &[&a, &b], &config(), None);
        assert_eq!(
            el(&part, Map::ServiceIps),
            vec![
                ("10.43.0.5 . tcp . 80".into(), "goto spread-2".into()),
                ("10.43.0.5 . udp . 53".into(), "goto spread-1".into()),
            ]
        );
        assert_eq!(
            el(&part, Map::Backends),
            vec![
                ("10.43.0.5 . tcp . 80 . 0".into(), "10.1.0.1 . 8080".into()),
                ("10.43.0.5 . tcp . 80 . 1".into(), "10.1.0.2 . 9090".into()),
                ("10.43.0.5 . udp . 53 . 0".into(), "10.1.0.1 . 5353".into()),
            ]
        );
        assert_eq!(
            el(&part, Map::ServiceNodePorts),
            vec![("tcp . 30080".into(), "goto nodeport-cluster-2".into())]
        );
        assert_eq!(el(&part, Map::NoEndpointServices), vec![]);
        // Hairpin only for this node's endpoints.
        assert_eq!(
            part.endpoint_ips,
            BTreeSet::from(["10.1.0.1".parse().unwrap()])
        );
        assert_eq!(part.udp_frontends.len(), 1);
    }

    #[test]
    fn no_endpoints_rejects_and_local_policies_drop() {
        let svc = service("web", "10.43.0.5", &[("", 80, "TCP", Some(30080))]);
        let part = render_service(&svc, &[], &config(), None);
        assert_eq!(
            el(&part, Map::NoEndpointServices),
            vec![("10.43.0.5 . tcp . 80".into(), "goto reject-chain".into())]
        );
        assert_eq!(
            el(&part, Map::NoEndpointNodePorts),
            vec![("tcp . 30080".into(), "goto reject-chain".into())]
        );
        assert!(el(&part, Map::ServiceIps).is_empty());

        let mut local = svc.clone();
        let spec = local.spec.as_mut().unwrap();
        spec.internal_traffic_policy = Some("Local".into());
        spec.external_traffic_policy = Some("Local".into());
        let elsewhere = slice(
            &[("", 8080, "TCP")],
            &[("10.1.0.2", true, true, false, "there")],
        );
        let part = render_service(&local, &[&elsewhere], &config(), None);
        assert_eq!(
            el(&part, Map::NoEndpointServices),
            vec![("10.43.0.5 . tcp . 80".into(), "drop".into())]
        );
        assert_eq!(
            el(&part, Map::NoEndpointNodePorts),
            vec![("tcp . 30080".into(), "drop".into())]
        );
        let here = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", true, true, false, "here"),
                ("10.1.0.2", true, true, false, "there"),
            ],
        );
        let part = render_service(&local, &[&here], &config(), None);
        assert_eq!(
            el(&part, Map::ServiceNodePorts),
            vec![("tcp . 30080".into(), "goto nodeport-local-1".into())]
        );
        assert_eq!(
            el(&part, Map::Backends),
            vec![("10.43.0.5 . tcp . 80 . 0".into(), "10.1.0.1 . 8080".into())]
        );
    }

    #[test]
    fn terminating_endpoints_only_when_none_is_ready() {
        let svc = service("web", "10.43.0.5", &[("", 80, "TCP", None)]);
        let s = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", false, true, true, "here"),
                ("10.1.0.2", false, false, true, "here"),
            ],
        );
        let part = render_service(&svc, &[&s], &config(), None);
        assert_eq!(
            el(&part, Map::Backends),
            vec![("10.43.0.5 . tcp . 80 . 0".into(), "10.1.0.1 . 8080".into())]
        );
        let s = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", false, true, true, "here"),
                ("10.1.0.3", true, true, false, "here"),
            ],
        );
        let part = render_service(&svc, &[&s], &config(), None);
        assert_eq!(
            el(&part, Map::Backends),
            vec![("10.43.0.5 . tcp . 80 . 0".into(), "10.1.0.3 . 8080".into())]
        );
    }

    #[test]
    fn headless_external_name_and_local_service_ips_have_no_rules() {
        let s = slice(
            &[("", 53, "UDP")],
            &[("10.1.0.1", true, true, false, "here")],
        );
        for svc in [
            service("dns", "10.43.0.10", &[("", 53, "UDP", None)]),
            service("headless", "None", &[("", 53, "UDP", None)]),
            {
                let mut s = service("ext", "", &[]);
                s.spec.as_mut().unwrap().type_ = Some("ExternalName".into());
                s
            },
        ] {
            assert_eq!(
                render_service(&svc, &[&s], &config(), None),
                Part::default()
            );
        }
    }

    #[test]
    fn affinity_keeps_a_chain_and_a_set_per_endpoint() {
        let mut svc = service("web", "10.43.0.5", &[("", 80, "TCP", None)]);
        svc.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        let s = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", true, true, false, "here"),
                ("10.1.0.2", true, true, false, "here"),
            ],
        );
        let part = render_service(&svc, &[&s], &config(), None);
        assert_eq!(part.sets.len(), 2);
        assert!(part.sets.values().all(|t| *t == 10800));
        let (chain, rules) = part.chains.iter().next().unwrap();
        assert!(
            chain.starts_with("service-") && chain.ends_with("-ns/web/tcp/"),
            "{chain}"
        );
        assert_eq!(rules.len(), 4);
        assert!(rules[0].starts_with("ip saddr @affinity-"), "{}", rules[0]);
        assert_eq!(
            el(&part, Map::ServiceIps),
            vec![("10.43.0.5 . tcp . 80".into(), format!("goto {chain}"))]
        );
    }

    #[test]
    fn a_changed_endpoint_is_a_change_of_elements_only() {
        let svc = service("web", "10.43.0.5", &[("", 80, "TCP", None)]);
        let a = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", true, true, false, "here"),
                ("10.1.0.2", true, true, false, "here"),
            ],
        );
        let b = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.3", true, true, false, "here"),
                ("10.1.0.2", true, true, false, "here"),
            ],
        );
        let old = render_service(&svc, &[&a], &config(), None);
        // 10.1.0.2 keeps its slot; 10.1.0.3 takes the one 10.1.0.1 left.
        let new = render_service(&svc, &[&b], &config(), Some(&old));
        let mut shared = BTreeSet::from(["spread-2".to_owned()]);
        let mut tx = Transaction::default();
        tx.diff("t", &old, &new, &mut shared);
        assert_eq!(
            tx.text(),
            "delete element ip t backends { 10.43.0.5 . tcp . 80 . 0 }\n\
             add element ip t backends { 10.43.0.5 . tcp . 80 . 0 : 10.1.0.3 . 8080 }\n"
        );
    }
}

#[cfg(test)]
mod external_tests {
    use super::tests::{service, slice};
    use super::*;

    fn el(part: &Part, map: Map) -> Vec<(String, String)> {
        part.elements
            .iter()
            .filter(|((m, _), _)| *m == map)
            .map(|((_, k), v)| (k.clone(), v.clone()))
            .collect()
    }

    fn config() -> RenderConfig {
        RenderConfig {
            node_name: "here".into(),
            local_service_ips: vec![],
        }
    }

    #[test]
    fn external_ips_follow_the_external_policy() {
        let mut svc = service("web", "10.43.0.5", &[("", 80, "TCP", None)]);
        svc.spec.as_mut().unwrap().external_ips = Some(vec!["192.168.9.9".into()]);
        let s = slice(
            &[("", 8080, "TCP")],
            &[
                ("10.1.0.1", true, true, false, "here"),
                ("10.1.0.2", true, true, false, "there"),
            ],
        );
        let part = render_service(&svc, &[&s], &config(), None);
        assert_eq!(
            el(&part, Map::ServiceIps),
            vec![
                ("10.43.0.5 . tcp . 80".into(), "goto spread-2".into()),
                (
                    "192.168.9.9 . tcp . 80".into(),
                    "goto external-cluster".into()
                ),
            ]
        );
        assert_eq!(
            el(&part, Map::ExternalSpread),
            vec![("192.168.9.9 . tcp . 80".into(), "goto spread-2".into())]
        );
        assert_eq!(
            el(&part, Map::ClusterIps),
            vec![("10.43.0.5".into(), String::new())]
        );
        assert!(
            part.elements
                .contains_key(&(Map::Backends, "192.168.9.9 . tcp . 80 . 1".into()))
        );

        // Local: the local endpoint for outsiders, the Cluster policy for pods.
        svc.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
        let part = render_service(&svc, &[&s], &config(), None);
        assert_eq!(
            el(&part, Map::ServiceIps)[1],
            (
                "192.168.9.9 . tcp . 80".into(),
                "goto external-local-1".into()
            )
        );
        assert_eq!(
            el(&part, Map::LocalBackends),
            vec![(
                "192.168.9.9 . tcp . 80 . 0".into(),
                "10.1.0.1 . 8080".into()
            )]
        );
        assert!(part.shared_chains.contains("external-local-1"));
        assert!(el(&part, Map::NoEndpointServices).is_empty());

        // No local endpoint: outsiders dropped, pods still served.
        let there = slice(
            &[("", 8080, "TCP")],
            &[("10.1.0.2", true, true, false, "there")],
        );
        let part = render_service(&svc, &[&there], &config(), None);
        assert_eq!(
            el(&part, Map::NoEndpointServices),
            vec![("192.168.9.9 . tcp . 80".into(), "drop".into())]
        );
        assert_eq!(
            el(&part, Map::ServiceIps)[1].1,
            "goto external-local-0".to_owned()
        );
        // No endpoint at all: refused.
        let part = render_service(&svc, &[], &config(), None);
        assert_eq!(
            el(&part, Map::NoEndpointServices),
            vec![
                ("10.43.0.5 . tcp . 80".into(), "goto reject-chain".into()),
                ("192.168.9.9 . tcp . 80".into(), "goto reject-chain".into()),
            ]
        );
    }

    #[test]
    fn two_services_claiming_one_external_ip_and_port_leave_one_element() {
        let s = slice(
            &[("", 8080, "TCP")],
            &[("10.1.0.1", true, true, false, "here")],
        );
        let mut parts = HashMap::new();
        for (name, ip) in [("a", "10.43.0.5"), ("b", "10.43.0.6")] {
            let mut svc = service(name, ip, &[("", 80, "TCP", None)]);
            svc.spec.as_mut().unwrap().external_ips = Some(vec!["192.168.9.9".into()]);
            parts.insert(
                name.to_owned(),
                render_service(&svc, &[&s], &config(), None),
            );
        }
        let text = full_text("t", &[], &[], &[], &parts);
        assert_eq!(
            text.matches("192.168.9.9 . tcp . 80 : goto external-cluster")
                .count(),
            1
        );
        assert_eq!(text.matches("192.168.9.9 . tcp . 80 . 0 :").count(), 1);
    }

    #[test]
    fn udp_node_ports_are_conntrack_frontends_on_any_address() {
        let svc = service("dns", "10.43.0.5", &[("", 53, "UDP", Some(30053))]);
        let s = slice(
            &[("", 5353, "UDP")],
            &[("10.1.0.1", true, true, false, "here")],
        );
        let part = render_service(&svc, &[&s], &config(), None);
        let ep: Ipv4Addr = "10.1.0.1".parse().unwrap();
        assert_eq!(
            part.udp_frontends,
            BTreeMap::from([
                ((Ipv4Addr::UNSPECIFIED, 30053), BTreeSet::from([ep])),
                (("10.43.0.5".parse().unwrap(), 53), BTreeSet::from([ep])),
            ])
        );
    }

    #[test]
    fn the_skeleton_refuses_unserved_cluster_ip_ports_after_dnat() {
        let t = skeleton("t", &[], &["10.244.0.0/16".into()], &[]);
        assert!(
            t.contains(
                "chain cluster-ips-check {\n    ip daddr @cluster-ips goto reject-chain\n  }"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "type filter hook output priority -90;\n    ct state new jump cluster-ips-check"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "ct state new jump service-endpoints-check\n    ct state new jump cluster-ips-check"
            ),
            "{t}"
        );
        assert!(
            t.contains("ip saddr != @cluster-cidrs ip daddr @cluster-ips jump mark-for-masquerade")
        );
        let t = skeleton("t", &[], &[], &["10.43.0.0/16".into()]);
        assert!(
            t.contains("fib daddr type local return\n    ip daddr { 10.43.0.0/16 } drop"),
            "{t}"
        );
        assert!(t.contains("set cluster-cidrs { type ipv4_addr; flags interval; }"));
        assert_eq!(shared_chain_rules("external-local-0").unwrap().len(), 3);
        assert!(shared_chain_rules("external-local-2").unwrap()[3].contains("mod 2"));
        assert!(shared_chain_rules("spread-0").is_none());
    }
}

#[cfg(test)]
mod slot_tests {
    use super::tests::{service, slice};
    use super::*;

    fn backends(part: &Part) -> Vec<String> {
        part.slots
            .get(&(Map::Backends, "10.43.0.5 . tcp . 80".to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    #[test]
    fn endpoints_keep_their_slots_as_the_count_changes() {
        let svc = service("web", "10.43.0.5", &[("", 80, "TCP", None)]);
        let config = RenderConfig::default();
        let ep = |ip| (ip, true, true, false, "n");
        let three = slice(
            &[("", 8080, "TCP")],
            &[ep("10.1.0.1"), ep("10.1.0.2"), ep("10.1.0.3")],
        );
        let old = render_service(&svc, &[&three], &config, None);
        assert_eq!(
            backends(&old),
            ["10.1.0.1 . 8080", "10.1.0.2 . 8080", "10.1.0.3 . 8080"]
        );
        // The first goes: the second stays in slot 1, the third moves into slot 0.
        let two = slice(&[("", 8080, "TCP")], &[ep("10.1.0.2"), ep("10.1.0.3")]);
        let new = render_service(&svc, &[&two], &config, Some(&old));
        assert_eq!(backends(&new), ["10.1.0.3 . 8080", "10.1.0.2 . 8080"]);
        assert!(
            !new.elements
                .contains_key(&(Map::Backends, "10.43.0.5 . tcp . 80 . 2".into()))
        );
        // One more comes: the others stay, it takes slot 2.
        let again = slice(
            &[("", 8080, "TCP")],
            &[ep("10.1.0.2"), ep("10.1.0.3"), ep("10.1.0.0")],
        );
        let newer = render_service(&svc, &[&again], &config, Some(&new));
        assert_eq!(
            backends(&newer),
            ["10.1.0.3 . 8080", "10.1.0.2 . 8080", "10.1.0.0 . 8080"]
        );
    }
}
