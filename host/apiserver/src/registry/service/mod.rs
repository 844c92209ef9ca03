//! Services' REST storage: ClusterIPs and NodePorts allocated from the server's ranges
//! and stored with the Service in one store transaction, released in the transaction
//! that deletes the Service or changes its type, and repaired from the stored Services
//! at start and then periodically (kube-apiserver's repair loops).
//!
//! The verbs reach it from three hooks: a create ([`create`]), an update or the removal
//! of a finalized Service ([`store_or_remove`]) and a delete ([`delete`]); defaults and
//! validation come through [`crate::registry::typed`].
//!
//! # Layout
//! - [`alloc`]: the ranges, the bands a free value is picked in, the allocation keys.
//! - [`validation`]: defaults, type changes, `ValidateService` and its update rules.
//! - [`table`]: the columns `kubectl get services` prints.

pub mod alloc;
mod storage;
pub mod table;
pub mod validation;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use bytes::Bytes;
use serde_json::{Value, json};
use trellis_api::ApiError;
use trellis_api::registry::ResourceInfo;
use trellis_api::status::StatusCause;
use trellis_store::{Deleted, KeyValue, ListRequest, Revision, Store, TxnOp, TxnResult};

use crate::endpoints::response::{ApiResult, store_error};
use crate::object::{self, Object, meta_str};
pub use alloc::{PortRange, ServiceCidr};
pub use storage::{Repaired, create, delete, dry_run, repair, start_repair, store_or_remove};
use validation::{EXTERNAL_NAME, NONE};

/// Whether `res` is the core Service resource.
pub fn handles(res: &ResourceInfo) -> bool {
    res.group.is_empty() && res.plural == "services"
}

/// What this server knows to be taken in its ranges. Allocation keys are the truth;
/// this only steers the choice of a free value. A value another server took is learnt
/// when its key turns out to exist; one another server released is learnt when this
/// one finds its range full and reads the keys again, and at each repair.
#[derive(Debug)]
pub struct Allocators {
    pub cidr: ServiceCidr,
    pub node_ports: PortRange,
    taken: Mutex<Taken>,
}

#[derive(Debug, Default)]
struct Taken {
    /// Offsets in `cidr`.
    ips: BTreeSet<u32>,
    /// Offsets from `node_ports.first`.
    ports: BTreeSet<u32>,
}

fn lock(m: &Mutex<Taken>) -> std::sync::MutexGuard<'_, Taken> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The values a Service holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Holdings {
    ips: BTreeSet<Ipv4Addr>,
    ports: BTreeSet<u16>,
}

impl Holdings {
    fn of(obj: &Object) -> Self {
        let mut held = Self::default();
        let Some(spec) = obj.get("spec").and_then(Value::as_object) else {
            return held;
        };
        let ty = spec.get("type").and_then(Value::as_str).unwrap_or("");
        if ty != EXTERNAL_NAME {
            for ip in spec
                .get("clusterIPs")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if let Ok(ip) = ip.parse() {
                    held.ips.insert(ip);
                }
            }
        }
        if matches!(ty, validation::NODE_PORT | validation::LOAD_BALANCER) {
            let ports = spec
                .get("ports")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|p| p.get("nodePort"));
            for port in ports.chain(spec.get("healthCheckNodePort")) {
                if let Some(p) = port.as_u64().and_then(|p| u16::try_from(p).ok())
                    && p > 0
                {
                    held.ports.insert(p);
                }
            }
        }
        held
    }

    fn keys(&self) -> BTreeSet<String> {
        self.ips
            .iter()
            .map(|ip| alloc::ip_key(*ip))
            .chain(self.ports.iter().map(|p| alloc::node_port_key(*p)))
            .collect()
    }
}

/// One value a write takes.
#[derive(Clone, Debug)]
enum Claim {
    Ip {
        ip: Ipv4Addr,
        dynamic: bool,
    },
    /// `index`: the port it was asked for in (for the error's field path); `None`
    /// for the health check node port.
    Port {
        port: u16,
        index: Option<usize>,
        dynamic: bool,
    },
}

impl Claim {
    fn key(&self) -> String {
        match self {
            Claim::Ip { ip, .. } => alloc::ip_key(*ip),
            Claim::Port { port, .. } => alloc::node_port_key(*port),
        }
    }
}

/// How many times a write picks again after a dynamically chosen value turned out
/// taken (by another server, or released since this one last read the keys).
const ALLOCATION_TRIES: usize = 16;

fn invalid_service(obj: &Object, cause: StatusCause) -> ApiError {
    let name = object::name(obj).unwrap_or_default();
    ApiError::invalid("", "Service", name, vec![cause])
}

impl Allocators {
    pub fn new(cidr: ServiceCidr, node_ports: PortRange) -> Self {
        Self {
            cidr,
            node_ports,
            taken: Mutex::new(Taken::default()),
        }
    }

    fn next_ip(&self, exclude: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let taken = lock(&self.taken);
        let cidr = &self.cidr;
        alloc::pick(cidr.size(), cidr.static_band(), |o| {
            taken.ips.contains(&o) || exclude.contains(&cidr.ip(o))
        })
        .map(|o| cidr.ip(o))
    }

    fn next_port(&self, exclude: &BTreeSet<u16>) -> Option<u16> {
        let taken = lock(&self.taken);
        let range = &self.node_ports;
        let port = |o: u32| u16::try_from(u32::from(range.first) + o).unwrap_or(0);
        alloc::pick(range.size(), range.static_band(), |o| {
            taken.ports.contains(&o) || exclude.contains(&port(o))
        })
        .map(port)
    }

    fn mark(&self, claims: &[Claim], released: &Holdings) {
        let mut taken = lock(&self.taken);
        for claim in claims {
            match claim {
                Claim::Ip { ip, .. } => {
                    if let Some(o) = self.cidr.offset(*ip) {
                        taken.ips.insert(o);
                    }
                }
                Claim::Port { port, .. } => {
                    if self.node_ports.contains(*port) {
                        taken.ports.insert(u32::from(port - self.node_ports.first));
                    }
                }
            }
        }
        for ip in &released.ips {
            if let Some(o) = self.cidr.offset(*ip) {
                taken.ips.remove(&o);
            }
        }
        for port in &released.ports {
            if self.node_ports.contains(*port) {
                taken.ports.remove(&u32::from(port - self.node_ports.first));
            }
        }
    }

    /// Reads every allocation key again: what this server believes taken becomes what
    /// the store holds.
    async fn reload(&self, store: &dyn Store) -> trellis_store::Result<()> {
        let ips = list_all(store, alloc::IP_PREFIX, None).await?;
        let ports = list_all(store, alloc::NODE_PORT_PREFIX, None).await?;
        let mut taken = Taken::default();
        for kv in ips {
            if let Some(o) = kv
                .key
                .strip_prefix(alloc::IP_PREFIX)
                .and_then(|ip| ip.parse().ok())
                .and_then(|ip| self.cidr.offset(ip))
            {
                taken.ips.insert(o);
            }
        }
        for kv in ports {
            if let Some(p) = kv
                .key
                .strip_prefix(alloc::NODE_PORT_PREFIX)
                .and_then(|p| p.parse::<u16>().ok())
                .filter(|p| self.node_ports.contains(*p))
            {
                taken.ports.insert(u32::from(p - self.node_ports.first));
            }
        }
        *lock(&self.taken) = taken;
        Ok(())
    }

    /// Fills in the ClusterIP and NodePorts `obj` needs and does not hold in `old`,
    /// and returns the values to claim. `Err(None)`: a range is full as far as this
    /// server knows.
    fn assign(&self, obj: &mut Object, old: &Holdings) -> Result<Vec<Claim>, Option<ApiError>> {
        let mut claims = Vec::new();
        let snapshot = obj.clone();
        let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
            return Ok(claims);
        };
        let ty = spec
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if ty != EXTERNAL_NAME {
            let requested = spec
                .get("clusterIP")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned();
            match requested.as_str() {
                NONE => {}
                "" => {
                    let ip = self.next_ip(&old.ips).ok_or(None)?;
                    spec.insert("clusterIP".into(), json!(ip.to_string()));
                    spec.insert("clusterIPs".into(), json!([ip.to_string()]));
                    claims.push(Claim::Ip { ip, dynamic: true });
                }
                other => {
                    let ip: Ipv4Addr = other.parse().map_err(|_| {
                        Some(invalid_service(
                            &snapshot,
                            StatusCause::invalid(
                                "spec.clusterIP",
                                other,
                                "must be a valid IPv4 address",
                            ),
                        ))
                    })?;
                    if !old.ips.contains(&ip) {
                        if self.cidr.offset(ip).is_none() {
                            return Err(Some(ip_error(
                                &snapshot,
                                ip,
                                &format!(
                                    "the provided IP ({ip}) is not in the valid range. The range of valid IPs is {}",
                                    self.cidr
                                ),
                            )));
                        }
                        claims.push(Claim::Ip { ip, dynamic: false });
                    }
                }
            }
        }
        if validation::needs_node_ports(spec) || ty == validation::LOAD_BALANCER {
            let allocate = validation::needs_node_ports(spec);
            let numbers: Vec<(i64, i64)> = spec
                .get("ports")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|p| {
                    let get = |f: &str| p.get(f).and_then(Value::as_i64).unwrap_or(0);
                    (get("port"), get("nodePort"))
                })
                .collect();
            let mut chosen: Vec<i64> = numbers.iter().map(|(_, np)| *np).collect();
            let mut by_port: std::collections::BTreeMap<i64, i64> = Default::default();
            let mut claimed: BTreeSet<u16> = old.ports.clone();
            for (i, (port, node_port)) in numbers.iter().enumerate() {
                if *node_port == 0 && !allocate {
                    continue;
                }
                let request = |np: i64, claims: &mut Vec<Claim>, claimed: &mut BTreeSet<u16>| {
                    let np16 = u16::try_from(np).unwrap_or(0);
                    if claimed.contains(&np16) {
                        return Ok(());
                    }
                    if !self.node_ports.contains(np16) {
                        return Err(Some(invalid_service(
                            &snapshot,
                            StatusCause::new(
                                "FieldValueInvalid",
                                format!("spec.ports[{i}].nodePort"),
                                format!(
                                    "Invalid value: {np}: provided port is not in the valid range. The range of valid ports is {}",
                                    self.node_ports
                                ),
                            ),
                        )));
                    }
                    claimed.insert(np16);
                    claims.push(Claim::Port {
                        port: np16,
                        index: Some(i),
                        dynamic: false,
                    });
                    Ok(())
                };
                match by_port.get(port).copied() {
                    Some(allocated) => {
                        if *node_port == 0 {
                            chosen[i] = allocated;
                        } else if *node_port != allocated {
                            request(*node_port, &mut claims, &mut claimed)?;
                        }
                    }
                    None => {
                        // A value asked for in this port, or in a later one of the
                        // same number (another protocol), serves both.
                        let asked = numbers[i..]
                            .iter()
                            .find(|(p, np)| p == port && *np != 0)
                            .map_or(0, |(_, np)| *np);
                        let np = if asked != 0 {
                            request(asked, &mut claims, &mut claimed)?;
                            asked
                        } else {
                            let np = self.next_port(&claimed).ok_or(None)?;
                            claimed.insert(np);
                            claims.push(Claim::Port {
                                port: np,
                                index: Some(i),
                                dynamic: true,
                            });
                            i64::from(np)
                        };
                        chosen[i] = np;
                        by_port.insert(*port, np);
                    }
                }
            }
            for (port, np) in spec
                .get_mut("ports")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
                .filter_map(Value::as_object_mut)
                .zip(chosen)
            {
                if np != 0 {
                    port.insert("nodePort".into(), json!(np));
                }
            }
        }
        // A LoadBalancer keeping traffic on the node answers health checks on a node
        // port of its own.
        if validation::needs_health_check(spec) {
            let mut claimed: BTreeSet<u16> = old.ports.clone();
            claimed.extend(claims.iter().filter_map(|c| match c {
                Claim::Port { port, .. } => Some(*port),
                Claim::Ip { .. } => None,
            }));
            let asked = spec
                .get("healthCheckNodePort")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if asked == 0 {
                let port = self.next_port(&claimed).ok_or(None)?;
                spec.insert("healthCheckNodePort".into(), json!(port));
                claims.push(Claim::Port {
                    port,
                    index: None,
                    dynamic: true,
                });
            } else {
                let port = u16::try_from(asked).unwrap_or(0);
                if !claimed.contains(&port) {
                    if !self.node_ports.contains(port) {
                        return Err(Some(invalid_service(
                            &snapshot,
                            StatusCause::new(
                                "FieldValueInvalid",
                                "spec.healthCheckNodePort",
                                format!(
                                    "Invalid value: {asked}: failed to allocate requested HealthCheck NodePort {asked}: provided port is not in the valid range. The range of valid ports is {}",
                                    self.node_ports
                                ),
                            ),
                        )));
                    }
                    claims.push(Claim::Port {
                        port,
                        index: None,
                        dynamic: false,
                    });
                }
            }
        }
        Ok(claims)
    }
}

fn ip_error(obj: &Object, ip: Ipv4Addr, reason: &str) -> ApiError {
    let ips: Vec<&str> = obj
        .get("spec")
        .and_then(|s| s.get("clusterIPs"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let ip_text = ip.to_string();
    let shown = if ips.is_empty() {
        validation::go_strings(&[ip_text.as_str()])
    } else {
        validation::go_strings(&ips)
    };
    invalid_service(
        obj,
        StatusCause::new(
            "FieldValueInvalid",
            "spec.clusterIPs",
            format!("Invalid value: {shown}: failed to allocate IP {ip}: {reason}"),
        ),
    )
}

/// The error of a claim whose key exists: a value asked for is taken.
fn taken_error(obj: &Object, claim: &Claim) -> ApiError {
    match claim {
        Claim::Ip { ip, .. } => ip_error(obj, *ip, "provided IP is already allocated"),
        Claim::Port {
            port,
            index: Some(index),
            ..
        } => invalid_service(
            obj,
            StatusCause::new(
                "FieldValueInvalid",
                format!("spec.ports[{index}].nodePort"),
                format!("Invalid value: {port}: provided port is already allocated"),
            ),
        ),
        Claim::Port {
            port, index: None, ..
        } => invalid_service(
            obj,
            StatusCause::new(
                "FieldValueInvalid",
                "spec.healthCheckNodePort",
                format!(
                    "Invalid value: {port}: failed to allocate requested HealthCheck NodePort {port}: provided port is already allocated"
                ),
            ),
        ),
    }
}

fn full_error(obj: &Object) -> ApiError {
    // Which range: the ClusterIP is chosen first, so a missing one is the IP range.
    let ip_missing = obj
        .get("spec")
        .and_then(|s| s.get("clusterIP"))
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
        && validation::service_type(obj) != EXTERNAL_NAME;
    if ip_missing {
        ApiError::internal("failed to allocate a serviceIP: range is full")
    } else {
        ApiError::internal("failed to allocate a nodePort: range is full")
    }
}

/// Every key under `prefix`, at `revision` (or the latest), page by page.
async fn list_all(
    store: &dyn Store,
    prefix: &str,
    revision: Option<Revision>,
) -> trellis_store::Result<Vec<KeyValue>> {
    let mut request = ListRequest {
        prefix: prefix.to_owned(),
        revision,
        limit: Some(1000),
        ..Default::default()
    };
    let mut out = Vec::new();
    loop {
        let page = store.list(request.clone()).await?;
        request.revision = Some(page.revision);
        request.start_after = page.kvs.last().map(|kv| kv.key.clone());
        out.extend(page.kvs);
        if !page.more {
            return Ok(out);
        }
    }
}
