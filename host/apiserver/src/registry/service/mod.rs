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
use crate::state::AppState;
pub use alloc::{PortRange, ServiceCidr};
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

fn holder_value(obj: &Object) -> Bytes {
    let holder = alloc::Holder {
        namespace: meta_str(obj, "namespace").unwrap_or_default().to_owned(),
        name: object::name(obj).unwrap_or_default().to_owned(),
        uid: meta_str(obj, "uid").unwrap_or_default().to_owned(),
    };
    Bytes::from(serde_json::to_vec(&holder).unwrap_or_default())
}

/// What [`write`] stores: a new Service, or one replacing the revision `expected`.
enum Write {
    Create,
    Update(Revision),
}

/// Allocates what `obj` needs beyond `old`, then stores it with its claims (and the
/// release of what it no longer holds) in one transaction, picking again when a value
/// chosen here turns out taken. On any error `obj` is left as it came.
async fn write(
    state: &AppState,
    key: &str,
    obj: &mut Object,
    old: &Holdings,
    how: Write,
) -> ApiResult<trellis_store::Result<KeyValue>> {
    let allocators = &state.services;
    let original = obj.clone();
    let mut reloaded = false;
    for _ in 0..ALLOCATION_TRIES {
        *obj = original.clone();
        let claims = match allocators.assign(obj, old) {
            Ok(claims) => claims,
            Err(Some(e)) => {
                *obj = original;
                return Err(e.into());
            }
            Err(None) if !reloaded => {
                // Full as far as this server knows: others may have released values.
                reloaded = true;
                if let Err(e) = allocators.reload(state.store.as_ref()).await {
                    *obj = original;
                    return Ok(Err(e));
                }
                continue;
            }
            Err(None) => {
                let e = full_error(obj);
                *obj = original;
                return Err(e.into());
            }
        };
        let new = Holdings::of(obj);
        let released = Holdings {
            ips: old.ips.difference(&new.ips).copied().collect(),
            ports: old.ports.difference(&new.ports).copied().collect(),
        };
        let holder = holder_value(obj);
        let mut ops: Vec<TxnOp> = claims
            .iter()
            .map(|c| TxnOp::Create {
                key: c.key(),
                value: holder.clone(),
            })
            .collect();
        ops.extend(released.keys().into_iter().map(|key| TxnOp::Delete {
            key,
            expected: None,
        }));
        let value = object::encode(obj)?;
        ops.push(match how {
            Write::Create => TxnOp::Create {
                key: key.to_owned(),
                value,
            },
            Write::Update(expected) => TxnOp::Update {
                key: key.to_owned(),
                value,
                expected: Some(expected),
            },
        });
        match state.store.txn(ops).await {
            Ok(mut results) => {
                allocators.mark(&claims, &released);
                return match results.pop() {
                    Some(TxnResult::Put(kv)) => Ok(Ok(kv)),
                    _ => Err(
                        ApiError::internal("the store's transaction answered out of order").into(),
                    ),
                };
            }
            Err(trellis_store::Error::AlreadyExists { key: taken }) if taken != key => {
                let Some(claim) = claims.iter().find(|c| c.key() == taken) else {
                    *obj = original;
                    return Err(ApiError::internal(format!("allocation {taken} exists")).into());
                };
                allocators.mark(std::slice::from_ref(claim), &Holdings::default());
                if !matches!(
                    claim,
                    Claim::Ip { dynamic: true, .. } | Claim::Port { dynamic: true, .. }
                ) {
                    let e = taken_error(obj, claim);
                    *obj = original;
                    return Err(e.into());
                }
                // Another server allocates too: learn all it holds before picking again.
                if !reloaded {
                    reloaded = true;
                    if let Err(e) = allocators.reload(state.store.as_ref()).await {
                        *obj = original;
                        return Ok(Err(e));
                    }
                }
            }
            Err(e) => {
                *obj = original;
                return Ok(Err(e));
            }
        }
    }
    let e = full_error(&original);
    *obj = original;
    Err(e.into())
}

/// Stores a new Service at `key` with its ClusterIP and NodePorts, which it fills in.
/// The outer error is the client's (a value taken or outside its range, a range
/// full); the inner one the store's, as a plain create reports it.
pub async fn create(
    state: &AppState,
    key: &str,
    obj: &mut Object,
) -> ApiResult<trellis_store::Result<KeyValue>> {
    // As Kubernetes stores every new Service: an empty load balancer status.
    obj.entry("status")
        .or_insert_with(|| json!({"loadBalancer": {}}));
    write(state, key, obj, &Holdings::default(), Write::Create).await
}

/// What a dry run of a write shows: the values it would allocate filled in (none
/// reserved), an asked-for value that is taken or outside its range refused.
pub async fn dry_run(state: &AppState, obj: &mut Object, old: Option<&Object>) -> ApiResult<()> {
    let held = old.map(Holdings::of).unwrap_or_default();
    let original = obj.clone();
    let claims = match state.services.assign(obj, &held) {
        Ok(claims) => claims,
        Err(Some(e)) => return Err(e.into()),
        Err(None) => return Err(full_error(&original).into()),
    };
    for claim in claims.iter().filter(|c| {
        !matches!(
            c,
            Claim::Ip { dynamic: true, .. } | Claim::Port { dynamic: true, .. }
        )
    }) {
        let taken = state
            .store
            .get(&claim.key())
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if taken.is_some() {
            return Err(taken_error(&original, claim).into());
        }
    }
    Ok(())
}

/// An update of a Service (allocating and releasing with a change of type), or its
/// removal once finalized; as [`crate::registry::store_or_remove`] does for others.
pub async fn store_or_remove(
    state: &AppState,
    res: &ResourceInfo,
    namespace: Option<&str>,
    name: &str,
    obj: &mut Object,
    expected: Revision,
) -> ApiResult<(Revision, bool)> {
    let key = res.key(namespace, name);
    let current = state
        .store
        .get(&key)
        .await
        .map_err(|e| store_error(e, res, name))?
        .ok_or_else(|| ApiError::not_found(&res.group, &res.plural, name))?;
    if current.mod_revision != expected {
        return Err(ApiError::conflict(&res.group, &res.plural, name, ApiError::MODIFIED).into());
    }
    let old = crate::storage::watch_cache::decode_stored(&current.value, current.mod_revision)
        .ok_or_else(|| ApiError::internal(format!("stored object {key} is not a JSON object")))?;
    let held = Holdings::of(&old);
    if super::finalized(res, obj) {
        let deleted = remove(state, &key, &held, expected)
            .await
            .map_err(|e| store_error(e, res, name))?;
        return Ok((deleted.revision, true));
    }
    let kv = write(state, &key, obj, &held, Write::Update(expected))
        .await?
        .map_err(|e| store_error(e, res, name))?;
    Ok((kv.mod_revision, false))
}

/// Deletes the Service `obj` stored at `key` at revision `expected`, releasing what it
/// holds in the same transaction.
pub async fn delete(
    state: &AppState,
    key: &str,
    obj: &Object,
    expected: Revision,
) -> trellis_store::Result<Deleted> {
    remove(state, key, &Holdings::of(obj), expected).await
}

async fn remove(
    state: &AppState,
    key: &str,
    held: &Holdings,
    expected: Revision,
) -> trellis_store::Result<Deleted> {
    let mut ops: Vec<TxnOp> = held
        .keys()
        .into_iter()
        .map(|key| TxnOp::Delete {
            key,
            expected: None,
        })
        .collect();
    ops.push(TxnOp::Delete {
        key: key.to_owned(),
        expected: Some(expected),
    });
    let mut results = state.store.txn(ops).await?;
    state.services.mark(&[], held);
    match results.pop() {
        Some(TxnResult::Deleted(Some(deleted))) => Ok(deleted),
        _ => Err(trellis_store::Error::NotFound {
            key: key.to_owned(),
        }),
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

/// What one repair pass changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Repaired {
    /// Allocation keys whose Service is gone, or no longer holds them: released.
    pub released: Vec<String>,
    /// Values stored Services hold whose keys were missing: recorded again.
    pub restored: Vec<String>,
}

/// One pass of the repair: reads the Services and the allocation keys at one
/// revision, releases the keys no Service holds and records the values Services hold
/// without a key, then reloads what this server believes taken.
pub async fn repair(state: &AppState) -> trellis_store::Result<Repaired> {
    let store = state.store.as_ref();
    let services = state
        .resource("", "v1", "services")
        .map(|r| r.prefix())
        .unwrap_or_else(|_| "/registry/core/services/".to_owned());
    let revision = store.current_revision().await?;
    let listed = list_all(store, &services, Some(revision)).await?;
    let mut wanted: std::collections::BTreeMap<String, Bytes> = Default::default();
    for kv in &listed {
        let Some(obj) = crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
        else {
            continue;
        };
        let value = holder_value(&obj);
        for key in Holdings::of(&obj).keys() {
            if let Some(other) = wanted.insert(key.clone(), value.clone())
                && other != value
            {
                tracing::warn!(allocation = %key, "two Services hold the same allocation; recreate one of them");
            }
        }
    }
    let mut present = list_all(store, alloc::IP_PREFIX, Some(revision)).await?;
    present.extend(list_all(store, alloc::NODE_PORT_PREFIX, Some(revision)).await?);
    let mut repaired = Repaired::default();
    let present_keys: BTreeSet<&str> = present.iter().map(|kv| kv.key.as_str()).collect();
    for kv in &present {
        if wanted.contains_key(&kv.key) {
            continue;
        }
        // At the revision read: if the key changed since, someone holds it again.
        match store
            .txn(vec![TxnOp::Delete {
                key: kv.key.clone(),
                expected: Some(kv.mod_revision),
            }])
            .await
        {
            Ok(_) => repaired.released.push(kv.key.clone()),
            Err(trellis_store::Error::Conflict { .. } | trellis_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    for (key, value) in &wanted {
        if present_keys.contains(key.as_str()) {
            continue;
        }
        match store.create(key, value.clone()).await {
            Ok(_) => repaired.restored.push(key.clone()),
            Err(trellis_store::Error::AlreadyExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    state.services.reload(store).await?;
    if !repaired.released.is_empty() || !repaired.restored.is_empty() {
        tracing::info!(released = ?repaired.released, restored = ?repaired.restored, "repaired Service allocations");
    }
    Ok(repaired)
}

/// Repairs once now, then every `interval` until `stopped`.
pub async fn start_repair(
    state: std::sync::Arc<AppState>,
    stopped: trellis_api::Shutdown,
) -> trellis_store::Result<()> {
    repair(&state).await?;
    let interval = state.settings.service_repair_interval;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stopped.wait() => return,
                () = tokio::time::sleep(interval) => {}
            }
            if let Err(e) = repair(&state).await {
                tracing::warn!(error = %e, "repairing Service allocations failed");
            }
        }
    });
    Ok(())
}
