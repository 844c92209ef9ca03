//! The metrics server's HTTPS side: its serving certificate, who a request comes from
//! (the front proxy's certificate and `X-Remote-*` headers, or a client certificate of
//! the cluster CA), whether they may (a SubjectAccessReview), and the
//! `metrics.k8s.io/v1beta1` paths.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, header};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use trellis_api::{Shutdown, UserInfo};

use super::scrape::{Store, Usage};

const GROUP: &str = "metrics.k8s.io";
const VERSION: &str = "v1beta1";
/// How long a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whom requests are taken from: the `extension-apiserver-authentication` ConfigMap.
pub struct Authentication {
    /// Verifies a certificate of the request header CA (the front proxy's).
    front_proxy: Arc<dyn ClientCertVerifier>,
    /// The names a front proxy certificate may carry; empty: any.
    allowed_names: Vec<String>,
    user_headers: Vec<String>,
    group_headers: Vec<String>,
    extra_prefixes: Vec<String>,
    /// Both CAs, which the TLS handshake accepts client certificates of.
    roots: Arc<rustls::RootCertStore>,
}

// Written by hand: keys and verifiers have nothing to show.
impl std::fmt::Debug for Authentication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authentication").finish_non_exhaustive()
    }
}

impl Authentication {
    /// Reads the ConfigMap with `client`.
    pub async fn read(client: &kube::Client) -> anyhow::Result<Self> {
        let configmap = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
            .get("extension-apiserver-authentication")
            .await?;
        let data = configmap.data.unwrap_or_default();
        let list = |key: &str| -> Vec<String> {
            data.get(key)
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_default()
        };
        let pem = |key: &str| -> anyhow::Result<Vec<CertificateDer<'static>>> {
            let text = data.get(key).map(String::as_str).unwrap_or_default();
            CertificateDer::pem_slice_iter(text.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("parse {key}"))
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut front_proxy_roots = rustls::RootCertStore::empty();
        let mut roots = rustls::RootCertStore::empty();
        for cert in pem("requestheader-client-ca-file")? {
            front_proxy_roots.add(cert.clone())?;
            roots.add(cert)?;
        }
        for cert in pem("client-ca-file")? {
            roots.add(cert)?;
        }
        anyhow::ensure!(
            !front_proxy_roots.is_empty(),
            "the ConfigMap has no requestheader-client-ca-file"
        );
        let front_proxy =
            WebPkiClientVerifier::builder_with_provider(Arc::new(front_proxy_roots), provider)
                .build()
                .context("build the front proxy's verifier")?;
        Ok(Self {
            front_proxy,
            allowed_names: list("requestheader-allowed-names"),
            user_headers: list("requestheader-username-headers"),
            group_headers: list("requestheader-group-headers"),
            extra_prefixes: list("requestheader-extra-headers-prefix"),
            roots: Arc::new(roots),
        })
    }

    /// The user a request comes from and whether the front proxy passed it, or why it
    /// is not taken.
    fn user(
        &self,
        peer: Option<&CertificateDer<'static>>,
        headers: &hyper::HeaderMap,
    ) -> Result<(UserInfo, bool), &'static str> {
        let cert = peer.ok_or("no client certificate")?;
        let front_proxy = self
            .front_proxy
            .verify_client_cert(cert, &[], UnixTime::now())
            .is_ok();
        if !front_proxy {
            // Verified by the handshake against the client CA: it names its user.
            return trellis_pki::identity_from_cert(cert)
                .map(|u| (u, false))
                .ok_or("a certificate without a name");
        }
        let name = trellis_pki::identity_from_cert(cert).map(|u| u.name);
        if !self.allowed_names.is_empty() && !name.is_some_and(|n| self.allowed_names.contains(&n))
        {
            return Err("a request header certificate of a name not allowed");
        }
        let first = |names: &[String]| {
            names
                .iter()
                .find_map(|h| headers.get(h.as_str())?.to_str().ok())
                .map(str::to_owned)
        };
        let user = first(&self.user_headers)
            .filter(|u| !u.is_empty())
            .ok_or("no user in the request headers")?;
        let groups = self
            .group_headers
            .iter()
            .flat_map(|h| headers.get_all(h.as_str()))
            .filter_map(|v| v.to_str().ok().map(str::to_owned))
            .collect::<Vec<_>>();
        let mut info = UserInfo::new(user, groups);
        for (name, value) in headers {
            for prefix in &self.extra_prefixes {
                let Some(key) = name
                    .as_str()
                    .strip_prefix(prefix.to_ascii_lowercase().as_str())
                else {
                    continue;
                };
                let key = percent_decode(key);
                if let Ok(value) = value.to_str() {
                    info.extra.entry(key).or_default().push(value.to_owned());
                }
            }
        }
        Ok((info, true))
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(v) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A CA made at start and the serving certificate it signed, for the name the
/// aggregation layer checks (`metrics-server.kube-system.svc`) and the address served.
pub struct ServingIdentity {
    pub ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

// Written by hand: keys and verifiers have nothing to show.
impl std::fmt::Debug for ServingIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingIdentity").finish_non_exhaustive()
    }
}

impl ServingIdentity {
    pub fn generate(ip: IpAddr) -> anyhow::Result<Self> {
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(
            DnType::CommonName,
            format!("metrics-server-ca@{}", jiff::Timestamp::now().as_second()),
        );
        ca.distinguished_name = name;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut ca);
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate()?;
        let mut leaf = CertificateParams::new(vec![
            format!("{}.{}.svc", super::SERVICE, super::NAMESPACE),
            format!("{}.{}", super::SERVICE, super::NAMESPACE),
            "localhost".to_owned(),
        ])?;
        leaf.subject_alt_names.push(SanType::IpAddress(ip));
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, "metrics-server");
        leaf.distinguished_name = name;
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        set_validity(&mut leaf);
        let leaf_cert = leaf.signed_by(&key, &issuer)?;
        Ok(Self {
            ca_pem: ca_cert.pem(),
            chain: vec![leaf_cert.der().clone(), ca_cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }
}

/// Valid from a day ago (clocks that lag) to a year from now, in whole days.
fn set_validity(params: &mut CertificateParams) {
    let day = |t: jiff::Timestamp| {
        let d = t.to_zoned(jiff::tz::TimeZone::UTC).date();
        // jiff's months and days are always in range.
        rcgen::date_time_ymd(
            i32::from(d.year()),
            u8::try_from(d.month()).unwrap_or(1),
            u8::try_from(d.day()).unwrap_or(1),
        )
    };
    let now = jiff::Timestamp::now();
    params.not_before = day(now - jiff::SignedDuration::from_hours(24));
    params.not_after = day(now + jiff::SignedDuration::from_hours(24 * 365));
}

/// What the requests are served with.
pub struct Server {
    pub client: kube::Client,
    pub store: Arc<Store>,
    pub authentication: Authentication,
    /// Whether the lack of SubjectAccessReviews was logged.
    pub warned_unreviewed: std::sync::atomic::AtomicBool,
}

// Written by hand: keys and verifiers have nothing to show.
impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").finish_non_exhaustive()
    }
}

/// Serves HTTPS on `listener` until `stopped`.
pub async fn serve(
    server: Arc<Server>,
    listener: TcpListener,
    identity: ServingIdentity,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(
        server.authentication.roots.clone(),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .context("build the client certificate verifier")?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain, identity.key)
        .context("use the serving certificate")?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let config = trellis_pki::serve::Config {
        name: "metrics server",
        handshake_timeout: HANDSHAKE_TIMEOUT,
        max_connections: Some(1_000),
    };
    let connections = trellis_pki::serve::serve(
        listener,
        acceptor,
        config,
        stopped.clone(),
        move |tls, _remote| {
            let server = server.clone();
            let stopped = stopped.clone();
            async move {
                let peer = trellis_pki::serve::peer_certificate(&tls).cloned();
                let service = hyper::service::service_fn(move |request| {
                    let (server, peer) = (server.clone(), peer.clone());
                    async move {
                        Ok::<_, std::convert::Infallible>(
                            handle(&server, peer.as_ref(), request).await,
                        )
                    }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                let connection =
                    builder.serve_connection(hyper_util::rt::TokioIo::new(tls), service);
                tokio::pin!(connection);
                tokio::select! {
                    _ = connection.as_mut() => {}
                    () = stopped.wait() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.await;
                    }
                }
            }
        },
    )
    .await;
    connections.closed().await;
    Ok(())
}

type Answer = Response<Full<Bytes>>;

fn json_answer(code: StatusCode, body: &Value) -> Answer {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    json_answer(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

/// What a path asks for.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    Health,
    GroupList,
    Group,
    ResourceList,
    Nodes(Option<String>),
    Pods {
        namespace: Option<String>,
        name: Option<String>,
    },
    Unknown,
}

fn target(path: &str) -> Target {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segments.as_slice() {
        ["healthz" | "livez" | "readyz", ..] => Target::Health,
        ["apis"] => Target::GroupList,
        ["apis", GROUP] => Target::Group,
        ["apis", GROUP, VERSION] => Target::ResourceList,
        ["apis", GROUP, VERSION, "nodes"] => Target::Nodes(None),
        ["apis", GROUP, VERSION, "nodes", name] => Target::Nodes(Some((*name).to_owned())),
        ["apis", GROUP, VERSION, "pods"] => Target::Pods {
            namespace: None,
            name: None,
        },
        ["apis", GROUP, VERSION, "namespaces", ns, "pods"] => Target::Pods {
            namespace: Some((*ns).to_owned()),
            name: None,
        },
        ["apis", GROUP, VERSION, "namespaces", ns, "pods", name] => Target::Pods {
            namespace: Some((*ns).to_owned()),
            name: Some((*name).to_owned()),
        },
        _ => Target::Unknown,
    }
}

async fn handle(
    server: &Server,
    peer: Option<&CertificateDer<'static>>,
    request: Request<hyper::body::Incoming>,
) -> Answer {
    let target = target(request.uri().path());
    if target == Target::Health {
        let mut r = Response::new(Full::new(Bytes::from_static(b"ok")));
        *r.status_mut() = StatusCode::OK;
        return r;
    }
    let (user, proxied) = match server.authentication.user(peer, request.headers()) {
        Ok(user) => user,
        Err(why) => {
            tracing::debug!(why, "request refused");
            return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        }
    };
    if request.method() != hyper::Method::GET {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        );
    }
    let query: BTreeMap<String, String> =
        form_urlencoded::parse(request.uri().query().unwrap_or_default().as_bytes())
            .into_owned()
            .collect();
    let selector = match query
        .get("labelSelector")
        .map(|s| s.parse::<trellis_api::selector::LabelSelector>())
        .transpose()
    {
        Ok(s) => s,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let attributes = match &target {
        Target::Nodes(name) => Access::Resource {
            verb: if name.is_some() { "get" } else { "list" },
            resource: "nodes",
            namespace: None,
            name: name.clone(),
        },
        Target::Pods { namespace, name } => Access::Resource {
            verb: if name.is_some() { "get" } else { "list" },
            resource: "pods",
            namespace: namespace.clone(),
            name: name.clone(),
        },
        _ => Access::Path(request.uri().path().to_owned()),
    };
    match authorize(&server.client, &user, &attributes).await {
        Ok(Some(true)) => {}
        // The API server authorized the same request before passing it on; without
        // reviews to ask, that is the only decision there is.
        Ok(None) if proxied => {
            if !server
                .warned_unreviewed
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(
                    "the API server serves no SubjectAccessReviews: requests through its front proxy are taken as it authorized them"
                );
            }
        }
        Ok(_) => {
            let message = match &attributes {
                Access::Resource {
                    verb,
                    resource,
                    namespace,
                    ..
                } => {
                    let scope = match namespace {
                        Some(ns) => format!(" in the namespace {ns:?}"),
                        None => " at the cluster scope".to_owned(),
                    };
                    format!(
                        "{resource}.{GROUP} is forbidden: User {:?} cannot {verb} resource {resource:?} in API group {GROUP:?}{scope}",
                        user.name
                    )
                }
                Access::Path(path) => {
                    format!("forbidden: User {:?} cannot get path {path:?}", user.name)
                }
            };
            return status(StatusCode::FORBIDDEN, "Forbidden", &message);
        }
        Err(e) => {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &format!("authorization failed: {e:#}"),
            );
        }
    }
    let matches =
        |labels: &BTreeMap<String, String>| selector.as_ref().is_none_or(|s| s.matches_map(labels));
    match target {
        Target::GroupList => json_answer(
            StatusCode::OK,
            &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group()]}),
        ),
        Target::Group => {
            let mut g = group();
            g["kind"] = "APIGroup".into();
            g["apiVersion"] = "v1".into();
            json_answer(StatusCode::OK, &g)
        }
        Target::ResourceList => json_answer(StatusCode::OK, &resource_list()),
        Target::Nodes(name) => {
            let nodes = server.store.nodes();
            match name {
                Some(name) => match nodes.get(&name) {
                    Some(m) => json_answer(StatusCode::OK, &node_metrics(&name, m)),
                    None => not_found("nodemetrics", &name),
                },
                None => json_answer(
                    StatusCode::OK,
                    &list(
                        "NodeMetricsList",
                        nodes
                            .iter()
                            .filter(|(_, m)| matches(&m.labels))
                            .map(|(n, m)| node_metrics(n, m))
                            .collect(),
                    ),
                ),
            }
        }
        Target::Pods { namespace, name } => {
            let pods = server.store.pods();
            match (namespace, name) {
                (Some(ns), Some(name)) => match pods.get(&(ns.clone(), name.clone())) {
                    Some(m) => json_answer(StatusCode::OK, &pod_metrics(&ns, &name, m)),
                    None => not_found("podmetrics", &name),
                },
                (namespace, _) => json_answer(
                    StatusCode::OK,
                    &list(
                        "PodMetricsList",
                        pods.iter()
                            .filter(|((ns, _), m)| {
                                namespace.as_ref().is_none_or(|want| want == ns)
                                    && matches(&m.labels)
                            })
                            .map(|((ns, name), m)| pod_metrics(ns, name, m))
                            .collect(),
                    ),
                ),
            }
        }
        Target::Health | Target::Unknown => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        ),
    }
}

fn not_found(resource: &str, name: &str) -> Answer {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{resource}.{GROUP} {name:?} not found"),
    )
}

fn group() -> Value {
    let version = json!({"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION});
    json!({"name": GROUP, "versions": [version.clone()], "preferredVersion": version})
}

fn resource_list() -> Value {
    json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{GROUP}/{VERSION}"),
        "resources": [
            {"name": "nodes", "singularName": "", "namespaced": false, "kind": "NodeMetrics",
             "verbs": ["get", "list"]},
            {"name": "pods", "singularName": "", "namespaced": true, "kind": "PodMetrics",
             "verbs": ["get", "list"]},
        ],
    })
}

fn list(kind: &str, items: Vec<Value>) -> Value {
    json!({"kind": kind, "apiVersion": format!("{GROUP}/{VERSION}"), "metadata": {}, "items": items})
}

fn node_metrics(name: &str, m: &super::scrape::NodeMetrics) -> Value {
    json!({
        "kind": "NodeMetrics", "apiVersion": format!("{GROUP}/{VERSION}"),
        "metadata": {"name": name, "creationTimestamp": time(jiff::Timestamp::now()),
                     "labels": m.labels},
        "timestamp": time(m.usage.timestamp),
        "window": go_duration(m.usage.window),
        "usage": usage(&m.usage),
    })
}

fn pod_metrics(namespace: &str, name: &str, m: &super::scrape::PodMetrics) -> Value {
    json!({
        "kind": "PodMetrics", "apiVersion": format!("{GROUP}/{VERSION}"),
        "metadata": {"name": name, "namespace": namespace,
                     "creationTimestamp": time(jiff::Timestamp::now()), "labels": m.labels},
        "timestamp": time(m.timestamp),
        "window": go_duration(m.window),
        "containers": m.containers.iter()
            .map(|(c, u)| json!({"name": c, "usage": usage(u)}))
            .collect::<Vec<_>>(),
    })
}

/// CPU in nanocores and memory in KiB (or bytes), as metrics-server writes them.
fn usage(u: &Usage) -> Value {
    let memory = if u.memory_bytes.is_multiple_of(1024) {
        format!("{}Ki", u.memory_bytes / 1024)
    } else {
        u.memory_bytes.to_string()
    };
    json!({"cpu": format!("{}n", u.cpu_nano_cores), "memory": memory})
}

/// A `metav1.Time`: RFC 3339 to the second.
fn time(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A duration as Go prints one (`metav1.Duration`): `1.5s`, `15s`, `1m30s`.
fn go_duration(d: Duration) -> String {
    let millis = d.as_millis();
    let (minutes, millis) = (millis / 60_000, millis % 60_000);
    let seconds = if millis.is_multiple_of(1000) {
        format!("{}s", millis / 1000)
    } else {
        let s = format!("{}.{:03}", millis / 1000, millis % 1000);
        format!("{}s", s.trim_end_matches('0'))
    };
    if minutes > 0 {
        format!("{minutes}m{seconds}")
    } else {
        seconds
    }
}

/// What a request asks to do, for its review.
enum Access {
    Resource {
        verb: &'static str,
        resource: &'static str,
        namespace: Option<String>,
        name: Option<String>,
    },
    Path(String),
}

/// Whether `user` may, by a SubjectAccessReview; `None` when the API server serves
/// no SubjectAccessReviews.
async fn authorize(
    client: &kube::Client,
    user: &UserInfo,
    access: &Access,
) -> anyhow::Result<Option<bool>> {
    let mut spec = SubjectAccessReviewSpec {
        user: Some(user.name.clone()),
        groups: Some(user.groups.clone()),
        uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
        extra: (!user.extra.is_empty()).then(|| user.extra.clone().into_iter().collect()),
        ..SubjectAccessReviewSpec::default()
    };
    match access {
        Access::Resource {
            verb,
            resource,
            namespace,
            name,
        } => {
            spec.resource_attributes = Some(ResourceAttributes {
                group: Some(GROUP.to_owned()),
                version: Some(VERSION.to_owned()),
                resource: Some((*resource).to_owned()),
                verb: Some((*verb).to_owned()),
                namespace: namespace.clone(),
                name: name.clone(),
                ..ResourceAttributes::default()
            });
        }
        Access::Path(path) => {
            spec.non_resource_attributes = Some(NonResourceAttributes {
                path: Some(path.clone()),
                verb: Some("get".to_owned()),
            });
        }
    }
    let review = SubjectAccessReview {
        spec,
        ..SubjectAccessReview::default()
    };
    match Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
    {
        Ok(answered) => Ok(Some(answered.status.is_some_and(|s| s.allowed))),
        // A server that does not serve the review: `None`, undecided.
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_read_as_go_durations() {
        assert_eq!(go_duration(Duration::from_secs(15)), "15s");
        assert_eq!(go_duration(Duration::from_millis(1_500)), "1.5s");
        assert_eq!(go_duration(Duration::from_millis(1_005)), "1.005s");
        assert_eq!(go_duration(Duration::from_secs(90)), "1m30s");
    }

    #[test]
    fn paths_name_nodes_and_pods() {
        assert_eq!(
            target("/apis/metrics.k8s.io/v1beta1/namespaces/ns/pods/p"),
            Target::Pods {
                namespace: Some("ns".into()),
                name: Some("p".into())
            }
        );
        assert_eq!(
            target("/apis/metrics.k8s.io/v1beta1/nodes"),
            Target::Nodes(None)
        );
        assert_eq!(target("/apis/metrics.k8s.io/v1beta1"), Target::ResourceList);
        assert_eq!(
            target("/apis/metrics.k8s.io/v1beta1/services"),
            Target::Unknown
        );
    }

    #[test]
    fn extra_keys_are_percent_decoded() {
        assert_eq!(percent_decode("scopes%2eexample"), "scopes.example");
    }
}
