//! The Services every cluster has, and who serves `kubernetes`: kube-apiserver's
//! bootstrap controller and lease endpoint reconciler.
//!
//! - The `kubernetes` Service (namespace `default`) on the first address of the service
//!   range, port `https` 443 to the API server's secure port, and the `kube-dns`
//!   Service (namespace `kube-system`) on its fixed ClusterIP, are created when missing,
//!   at start and again whenever one is deleted (checked every [`Timing::interval`]).
//!   They go through the normal create path, so the ClusterIP allocator reserves the
//!   addresses they ask for.
//! - Every API server keeps a Lease `apiserver-<id>` in `kube-system` (label
//!   `apiserver.kubernetes.io/identity: kube-apiserver`, as kube-apiserver's identity
//!   leases), renewed every interval and carrying its advertise address in the
//!   [`ADVERTISE_ANNOTATION`]. From the live leases each server writes the v1
//!   Endpoints `kubernetes` (label `endpointslice.kubernetes.io/skip-mirror: "true"`, so
//!   no mirroring controller copies it) and the EndpointSlice `kubernetes` (label
//!   `kubernetes.io/service-name: kubernetes` and no `managed-by` label: the
//!   EndpointSlice controller leaves slices it does not manage, and the Service has no
//!   selector), as kube-apiserver's `EndpointsAdapter` writes both.
//! - A server that stops deletes its lease and writes the endpoints without itself; one
//!   that dies drops out once its lease is older than [`Timing::lease_duration`].

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};
use trellis_api::Shutdown;
use trellis_api::registry::ResourceInfo;
use trellis_api::user::UserInfo;
use trellis_store::ListRequest;

use crate::endpoints::request::{ApiRequest, BodyFormat, Query};
use crate::object::{self, Object};
use crate::state::AppState;

/// The `kubernetes` Service's ClusterIP when the service range is Trellis' default
/// (`10.43.0.0/16`, as k3s): the range's first address, which the server takes from
/// `--service-cluster-ip-range`.
pub const DEFAULT_KUBERNETES_SERVICE_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 43, 0, 1));

/// The `kube-dns` Service's ClusterIP by default (k3s' `--cluster-dns`).
pub const DEFAULT_CLUSTER_DNS_SERVICE_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 43, 0, 10));

/// The label of API servers' identity leases, as kube-apiserver sets it.
pub const IDENTITY_LABEL: &str = "apiserver.kubernetes.io/identity";

/// Where a lease carries its server's advertise address: kube-apiserver keeps these
/// in etcd keys of its own (`/masterleases/<ip>`), Trellis on the identity lease.
pub const ADVERTISE_ANNOTATION: &str = "apiserver.trellis.dev/advertise-address";

/// The label that keeps the EndpointSlice mirroring controller off an Endpoints.
const SKIP_MIRROR_LABEL: &str = "endpointslice.kubernetes.io/skip-mirror";

/// The field manager and user agent of the writes.
const MANAGER: &str = "kube-apiserver";

/// How often and for how long.
#[derive(Clone, Debug)]
pub struct Timing {
    /// How often the lease is renewed and the Services and endpoints checked
    /// (kube-apiserver: `--endpoint-reconciler` every 10 s).
    pub interval: Duration,
    /// How long a lease counts after its last renewal (kube-apiserver's master lease
    /// TTL, 15 s): a server that died leaves the endpoints after it.
    pub lease_duration: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            lease_duration: Duration::from_secs(15),
        }
    }
}

/// What the reconciler keeps, as [`crate::server::start`] fills it in.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where this server is reached from pods and other servers (`--advertise-address`).
    pub advertise_address: IpAddr,
    /// The secure port: the `kubernetes` Service's targetPort and the endpoints' port.
    pub port: u16,
    /// The `kubernetes` Service's ClusterIP: the service range's first address.
    pub kubernetes_service_ip: IpAddr,
    /// The `kube-dns` Service's ClusterIP; `None`: no `kube-dns` Service (a cluster
    /// that brings its own DNS).
    pub cluster_dns_service_ip: Option<IpAddr>,
    pub timing: Timing,
}

/// The address to advertise when none is given: the listening one, unless it is
/// loopback or unspecified; then the source address of the default route (as
/// kube-apiserver's `ChooseHostInterface`), found by a route lookup that sends nothing;
/// with no route, the listening address (127.0.0.1 for an unspecified one).
pub fn default_advertise_address(listen: IpAddr) -> IpAddr {
    if !listen.is_loopback() && !listen.is_unspecified() {
        return listen;
    }
    // A UDP connect only picks the route and source address; no packet leaves.
    let routed = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|socket| {
            socket.connect((Ipv4Addr::new(192, 0, 2, 1), 9))?;
            socket.local_addr()
        })
        .map(|addr| addr.ip());
    match routed {
        Ok(ip) if !ip.is_loopback() && !ip.is_unspecified() => ip,
        _ if listen.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        _ => listen,
    }
}

/// The server's identity, kube-apiserver's `apiserver-<base32 of a hash>`: of the host
/// name as there, and also of the advertised address and port, so that two servers
/// on one machine (tests, or a second one on another port) have leases of their own.
pub fn identity(hostname: &str, advertise: IpAddr, port: u16) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{hostname}/{advertise}:{port}").as_bytes(),
    );
    let bytes = digest.as_ref().get(..16).unwrap_or_default();
    format!("apiserver-{}", base32_lower(bytes))
}

/// RFC 4648 base32 without padding, in lower case (what kube-apiserver's ID uses).
fn base32_lower(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for byte in bytes {
        buffer = (buffer << 8) | u32::from(*byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

/// Keeps the Services and this server's place in the `kubernetes` endpoints until
/// `stopped`; then takes it out. The task ends once it has.
pub fn start(state: Arc<AppState>, config: Config, stopped: Shutdown) -> JoinHandle<()> {
    let hostname = trellis_pki::hostname().unwrap_or_default();
    let name = identity(&hostname, config.advertise_address, config.port);
    let reconciler = Reconciler {
        holder: format!("{name}_{}", uuid::Uuid::new_v4()),
        name,
        hostname,
        state,
        config,
    };
    tokio::spawn(async move {
        info!(
            lease = %reconciler.name,
            advertise = %reconciler.config.advertise_address,
            "keeping the kubernetes Service's endpoints"
        );
        loop {
            if let Err(e) = reconciler.reconcile().await {
                warn!(error = %format!("{e:#}"), "reconciling the built-in Services failed");
            }
            tokio::select! {
                () = tokio::time::sleep(reconciler.config.timing.interval) => {}
                () = stopped.wait() => break,
            }
        }
        if let Err(e) = reconciler.remove_self().await {
            warn!(error = %format!("{e:#}"), "taking this server out of the kubernetes endpoints failed");
        }
    })
}

struct Reconciler {
    state: Arc<AppState>,
    config: Config,
    /// The lease's name.
    name: String,
    /// The lease's holder: the name and this run's own id.
    holder: String,
    hostname: String,
}

impl Reconciler {
    async fn reconcile(&self) -> anyhow::Result<()> {
        self.ensure_service("default", "kubernetes", self.kubernetes_service())
            .await?;
        if let Some(ip) = self.config.cluster_dns_service_ip {
            self.ensure_service("kube-system", "kube-dns", kube_dns_service(ip))
                .await?;
        }
        self.renew_lease().await?;
        let mut addresses = self.live_addresses().await?;
        addresses.insert(self.config.advertise_address);
        self.write_endpoints(&addresses).await
    }

    /// Deletes the lease and writes the endpoints without this server (kube-apiserver's
    /// `RemoveEndpoints` at shutdown).
    async fn remove_self(&self) -> anyhow::Result<()> {
        let leases = self.resource("coordination.k8s.io", "v1", "leases")?;
        let key = leases.key(Some("kube-system"), &self.name);
        match self.state.store.delete(&key, None).await {
            Ok(_) | Err(trellis_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let mut addresses = self.live_addresses().await?;
        addresses.remove(&self.config.advertise_address);
        self.write_endpoints(&addresses).await?;
        info!(lease = %self.name, "taken out of the kubernetes Service's endpoints");
        Ok(())
    }

    fn resource(&self, group: &str, version: &str, plural: &str) -> anyhow::Result<ResourceInfo> {
        self.state
            .resource(group, version, plural)
            .map_err(|e| anyhow::anyhow!("{group}/{version} {plural}: {}", e.message))
    }

    fn kubernetes_service(&self) -> Object {
        to_object(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kubernetes", "namespace": "default",
                         "labels": {"component": "apiserver", "provider": "kubernetes"}},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": self.config.kubernetes_service_ip.to_string(),
                "clusterIPs": [self.config.kubernetes_service_ip.to_string()],
                "ports": [{"name": "https", "port": 443, "protocol": "TCP",
                           "targetPort": self.config.port}],
                "sessionAffinity": "None",
            },
        }))
    }

    /// Creates the Service if it is missing; one that exists is left as it is.
    async fn ensure_service(&self, namespace: &str, name: &str, obj: Object) -> anyhow::Result<()> {
        let services = self.resource("", "v1", "services")?;
        if self
            .state
            .store
            .get(&services.key(Some(namespace), name))
            .await?
            .is_some()
        {
            return Ok(());
        }
        self.create(services, namespace, obj).await?;
        info!(%namespace, %name, "created the built-in Service");
        Ok(())
    }

    /// Creates `obj` through the normal create path (defaults, admission, the
    /// allocators); one another server created meanwhile is taken as done.
    async fn create(
        &self,
        resource: ResourceInfo,
        namespace: &str,
        obj: Object,
    ) -> anyhow::Result<()> {
        let req = internal_request(resource, namespace, "create");
        match crate::registry::create_object(&self.state, &req, obj).await {
            Ok(_) => Ok(()),
            Err(e) if e.0.code == 409 => Ok(()),
            Err(e) => Err(anyhow::anyhow!("{}", e.0.message)),
        }
    }

    async fn renew_lease(&self) -> anyhow::Result<()> {
        let leases = self.resource("coordination.k8s.io", "v1", "leases")?;
        let now = micro_time(jiff::Timestamp::now());
        let duration = self.config.timing.lease_duration.as_secs().max(1);
        let req = internal_request(leases.clone(), "kube-system", "update");
        let advertise = self.config.advertise_address.to_string();
        let renewed =
            crate::registry::guaranteed_update(&self.state, &req, &self.name, |_, new| {
                let spec = new
                    .entry("spec")
                    .or_insert_with(|| json!({}))
                    .as_object_mut();
                if let Some(spec) = spec {
                    spec.insert("holderIdentity".into(), self.holder.clone().into());
                    spec.insert("leaseDurationSeconds".into(), duration.into());
                    spec.insert("renewTime".into(), now.clone().into());
                }
                let metadata = object::metadata_mut(new);
                let annotations = metadata.entry("annotations").or_insert_with(|| json!({}));
                annotations[ADVERTISE_ANNOTATION] = advertise.clone().into();
                Ok(())
            })
            .await;
        match renewed {
            Ok(_) => Ok(()),
            Err(e) if e.0.code == 404 => {
                let lease = to_object(json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {
                        "name": self.name, "namespace": "kube-system",
                        "labels": {IDENTITY_LABEL: "kube-apiserver",
                                   "kubernetes.io/hostname": self.hostname},
                        "annotations": {ADVERTISE_ANNOTATION: advertise},
                    },
                    "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": duration,
                             "acquireTime": now, "renewTime": now},
                }));
                self.create(leases, "kube-system", lease).await
            }
            Err(e) => Err(anyhow::anyhow!(
                "renew lease {}: {}",
                self.name,
                e.0.message
            )),
        }
    }

    /// The advertise addresses of the API servers whose leases are live.
    async fn live_addresses(&self) -> anyhow::Result<BTreeSet<IpAddr>> {
        let leases = self.resource("coordination.k8s.io", "v1", "leases")?;
        let page = self
            .state
            .store
            .list(ListRequest::prefix(
                leases.namespace_prefix(Some("kube-system")),
            ))
            .await?;
        let now = jiff::Timestamp::now();
        let mut live = BTreeSet::new();
        for kv in &page.kvs {
            let Ok(lease) = serde_json::from_slice::<Value>(&kv.value) else {
                continue;
            };
            let metadata = &lease["metadata"];
            if metadata["labels"][IDENTITY_LABEL] != "kube-apiserver" {
                continue;
            }
            let Some(ip) = metadata["annotations"][ADVERTISE_ANNOTATION]
                .as_str()
                .and_then(|s| s.parse::<IpAddr>().ok())
            else {
                continue;
            };
            let renewed = lease["spec"]["renewTime"]
                .as_str()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok());
            let seconds = lease["spec"]["leaseDurationSeconds"].as_i64().unwrap_or(0);
            let expired = renewed.is_none_or(|t| {
                t.checked_add(jiff::SignedDuration::from_secs(seconds))
                    .is_ok_and(|until| until < now)
            });
            if expired {
                debug!(lease = %kv.key, "an API server's lease expired");
                continue;
            }
            live.insert(ip);
        }
        Ok(live)
    }

    /// Writes the Endpoints and the EndpointSlice `kubernetes` to list `addresses`.
    async fn write_endpoints(&self, addresses: &BTreeSet<IpAddr>) -> anyhow::Result<()> {
        let ips: Vec<String> = addresses.iter().map(ToString::to_string).collect();
        let port = self.config.port;
        let subsets = if ips.is_empty() {
            json!([])
        } else {
            json!([{
                "addresses": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>(),
                "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
            }])
        };
        let endpoints = self.resource("", "v1", "endpoints")?;
        self.put(
            endpoints,
            to_object(json!({
                "apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": "kubernetes", "namespace": "default",
                             "labels": {SKIP_MIRROR_LABEL: "true"}},
                "subsets": subsets,
            })),
            &["subsets"],
        )
        .await?;
        let slices = self.resource("discovery.k8s.io", "v1", "endpointslices")?;
        let address_type = if addresses.iter().all(IpAddr::is_ipv6) && !addresses.is_empty() {
            "IPv6"
        } else {
            "IPv4"
        };
        self.put(
            slices,
            to_object(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "kubernetes", "namespace": "default",
                             "labels": {"kubernetes.io/service-name": "kubernetes"}},
                "addressType": address_type,
                "endpoints": ips.iter()
                    .map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}}))
                    .collect::<Vec<_>>(),
                "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
            })),
            &["addressType", "endpoints", "ports"],
        )
        .await
    }

    /// Creates `wanted` (in `default`), or brings the stored one's `fields` and labels
    /// to it; an unchanged object is not written.
    async fn put(
        &self,
        resource: ResourceInfo,
        wanted: Object,
        fields: &[&str],
    ) -> anyhow::Result<()> {
        let name = object::meta_str(&wanted, "name")
            .unwrap_or_default()
            .to_owned();
        let req = internal_request(resource.clone(), "default", "update");
        let written = crate::registry::guaranteed_update(&self.state, &req, &name, |_, new| {
            for field in fields {
                match wanted.get(*field) {
                    Some(value) => {
                        new.insert((*field).to_owned(), value.clone());
                    }
                    None => {
                        new.remove(*field);
                    }
                }
            }
            if let Some(labels) = object::metadata(&wanted)
                .and_then(|m| m.get("labels"))
                .and_then(Value::as_object)
            {
                let stored = object::metadata_mut(new)
                    .entry("labels")
                    .or_insert_with(|| json!({}));
                for (key, value) in labels {
                    stored[key] = value.clone();
                }
            }
            Ok(())
        })
        .await;
        match written {
            Ok(_) => Ok(()),
            Err(e) if e.0.code == 404 => self.create(resource, "default", wanted).await,
            Err(e) => Err(anyhow::anyhow!(
                "write {} {name}: {}",
                resource.plural,
                e.0.message
            )),
        }
    }
}

/// The `kube-dns` Service as k3s and kubeadm install it, without a selector: every
/// node serves cluster DNS on this address itself.
fn kube_dns_service(ip: IpAddr) -> Object {
    to_object(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": "kube-dns", "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns", "kubernetes.io/cluster-service": "true",
                       "kubernetes.io/name": "CoreDNS"},
            "annotations": {"prometheus.io/port": "9153", "prometheus.io/scrape": "true"},
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip.to_string(),
            "clusterIPs": [ip.to_string()],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                {"name": "metrics", "port": 9153, "protocol": "TCP", "targetPort": 9153},
            ],
            "sessionAffinity": "None",
        },
    }))
}

fn to_object(value: Value) -> Object {
    match value {
        Value::Object(map) => map,
        _ => Object::new(),
    }
}

/// A `MicroTime`, as Leases carry them.
fn micro_time(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// A write of the server's own, as `system:apiserver`.
fn internal_request(resource: ResourceInfo, namespace: &str, verb: &'static str) -> ApiRequest {
    ApiRequest {
        resource,
        namespace: Some(namespace.to_owned()),
        name: None,
        subresource: None,
        verb,
        query: Query::default(),
        user: UserInfo::new(
            crate::registry::status::INTERNAL_USER,
            [trellis_api::user::groups::AUTHENTICATED],
        ),
        content_type: None,
        user_agent: Some(MANAGER.to_owned()),
        body_format: BodyFormat::Json,
        table: None,
        dry_run: false,
        include_uninitialized: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_kube_apiserver_shaped_and_differ_by_address() {
        let a = identity("host", "10.0.0.1".parse().unwrap(), 6443);
        let b = identity("host", "10.0.0.2".parse().unwrap(), 6443);
        assert_ne!(a, b);
        // 16 bytes of base32: 26 characters.
        let suffix = a.strip_prefix("apiserver-").unwrap();
        assert_eq!(suffix.len(), 26, "{a}");
        assert!(
            suffix
                .chars()
                .all(|c| c.is_ascii_lowercase() || ('2'..='7').contains(&c))
        );
    }

    #[test]
    fn base32_matches_rfc_4648() {
        assert_eq!(base32_lower(b"foobar"), "mzxw6ytboi");
        assert_eq!(base32_lower(b"f"), "my");
    }

    #[test]
    fn advertises_a_non_loopback_listen_address_as_it_is() {
        let ip: IpAddr = "192.168.1.5".parse().unwrap();
        assert_eq!(default_advertise_address(ip), ip);
        assert!(!default_advertise_address(IpAddr::V4(Ipv4Addr::UNSPECIFIED)).is_unspecified());
    }
}
