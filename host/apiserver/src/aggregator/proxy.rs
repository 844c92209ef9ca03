//! Passing a request to an extension API server: the APIService's Service resolved
//! to one of its endpoints (as kube-apiserver's `--enable-aggregator-routing`: the
//! server reaches endpoints directly, with no need for the node's Service proxy), a TLS
//! connection that presents the front proxy's certificate and checks the backend's
//! against the APIService's `caBundle` under the name `{service}.{namespace}.svc`, and
//! the request with the caller in `X-Remote-*` headers. The answer streams back as it
//! comes (watches included).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Uri, header};
use axum::response::{IntoResponse as _, Response};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::Value;
use trellis_api::UserInfo;

use super::front_proxy::{EXTRA_HEADER_PREFIX, GROUP_HEADER, USER_HEADER};
use super::{Aggregator, Route, ServiceRef};

/// Time to open a connection to a backend and finish the TLS handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a backend to answer with its headers.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers that belong to one connection, never passed on (RFC 9110 §7.6.1), and the
/// caller's credentials, which the backend must not see: it trusts the front proxy's
/// headers instead.
const NOT_PASSED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "authorization",
    "proxy-authorization",
];

/// Why a Service has no endpoint to send to: the `Available` condition's reason and
/// message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unresolved {
    pub reason: &'static str,
    pub message: String,
}

/// HTTPS to extension API servers, as the front proxy.
pub struct Client {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// Spreads requests over a Service's endpoints.
    next: AtomicUsize,
}

// Written by hand: it holds the client key.
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    pub fn new(cert_pem: &str, key_pem: &str) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        Ok(Self {
            chain: CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .context("parse the front proxy's client certificate")?,
            key: PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
                .context("parse the front proxy's client key")?,
            next: AtomicUsize::new(0),
        })
    }

    /// The TLS settings for `route`'s backend.
    fn tls(&self, route: &Route) -> Result<Arc<rustls::ClientConfig>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = if route.insecure_skip_tls_verify {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(trellis_pki::AcceptAnyServerCert(
                    provider.signature_verification_algorithms,
                )))
        } else {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&route.ca_bundle).flatten() {
                let _ = roots.add(cert);
            }
            builder.with_root_certificates(roots)
        };
        let mut config = builder
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| format!("use the front proxy's certificate: {e}"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Sends `request` to `host:port`, the backend of `route`; the response once its
    /// headers came, its body streaming.
    async fn send(
        &self,
        route: &Route,
        service: &ServiceRef,
        (host, port): (&str, u16),
        request: hyper::Request<Body>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let tls = self.tls(route)?;
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect((host, port)),
        )
        .await
        .map_err(|_| format!("dial tcp {authority}: i/o timeout"))?
        .map_err(|e| format!("dial tcp {authority}: connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        // The name the serving certificate must carry, as kube-aggregator checks it.
        let server_name = format!("{}.{}.svc", service.name, service.namespace);
        let name = ServerName::try_from(server_name.clone())
            .map_err(|e| format!("invalid server name {server_name:?}: {e}"))?;
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(tls).connect(name, tcp),
        )
        .await
        .map_err(|_| "net/http: TLS handshake timeout".to_owned())?
        .map_err(|e| format!("tls: {e}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        // Lives as long as the body is read; a client that goes away drops it.
        tokio::spawn(connection);
        tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(request))
            .await
            .map_err(|_| "timeout awaiting response headers".to_owned())?
            .map_err(|e| e.to_string())
    }
}

/// The address and port of one endpoint of `service` (its port named by the Service
/// port that `service.port` is), or why there is none.
pub async fn resolve(
    aggregator: &Aggregator,
    service: &ServiceRef,
) -> Result<(String, u16), Unresolved> {
    let (ns, name) = (&service.namespace, &service.name);
    let not_found = || Unresolved {
        reason: "ServiceNotFound",
        message: format!("service/{name} in {ns:?} is not present"),
    };
    let svc = aggregator
        .services
        .get(&format!("/registry/core/services/{ns}/{name}"))
        .await
        .map_err(|e| Unresolved {
            reason: "ServiceAccessError",
            message: e.to_string(),
        })?
        .ok_or_else(not_found)?;
    if svc["spec"]["type"] == "ExternalName" {
        let host = svc["spec"]["externalName"].as_str().unwrap_or_default();
        return Ok((host.to_owned(), service.port));
    }
    let port = svc["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["port"].as_u64() == Some(u64::from(service.port)))
        .ok_or_else(|| Unresolved {
            reason: "ServicePortError",
            message: format!(
                "service/{name} in {ns:?} is not listening on port {}",
                service.port
            ),
        })?;
    let port_name = port["name"].as_str().unwrap_or_default();
    let missing = || Unresolved {
        reason: "MissingEndpoints",
        message: format!(
            "endpoints for service/{name} in {ns:?} have no addresses with port name {port_name:?}"
        ),
    };
    let endpoints = aggregator
        .endpoints
        .get(&format!("/registry/core/endpoints/{ns}/{name}"))
        .await
        .map_err(|e| Unresolved {
            reason: "EndpointsAccessError",
            message: e.to_string(),
        })?
        .ok_or_else(missing)?;
    let mut candidates = Vec::new();
    for subset in endpoints
        .get("subsets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(target) = subset["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"].as_str().unwrap_or_default() == port_name)
            .and_then(|p| p["port"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for address in subset["addresses"].as_array().into_iter().flatten() {
            if let Some(ip) = address["ip"].as_str() {
                candidates.push((ip.to_owned(), target));
            }
        }
    }
    if candidates.is_empty() {
        return Err(missing());
    }
    let at = aggregator.client.next.fetch_add(1, Ordering::Relaxed) % candidates.len();
    Ok(candidates.swap_remove(at))
}

/// Passes the request on to `route`'s backend as `user`, and its answer back.
pub async fn forward(
    aggregator: &Aggregator,
    route: &Route,
    user: &UserInfo,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, String> {
    let service = route.service.as_ref().ok_or("the APIService is local")?;
    let target = resolve(aggregator, service).await.map_err(|u| u.message)?;
    let path_and_query = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_owned(), |p| p.as_str().to_owned());
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path_and_query)
        .body(body)
        .map_err(|e| e.to_string())?;
    let passed = request.headers_mut();
    for (name, value) in headers {
        let lower = name.as_str();
        if NOT_PASSED.contains(&lower)
            || lower.starts_with("impersonate-")
            || lower.starts_with("x-remote-")
        {
            continue;
        }
        passed.append(name.clone(), value.clone());
    }
    identify(passed, user);
    let authority = format!("{}:{}", target.0, target.1);
    if let Ok(host) = HeaderValue::from_str(&authority) {
        passed.insert(header::HOST, host);
    }
    let response = aggregator
        .client
        .send(route, service, (&target.0, target.1), request)
        .await?;
    let (parts, body) = response.into_parts();
    let mut answer = (parts.status, Body::new(body)).into_response();
    let kept = answer.headers_mut();
    for (name, value) in &parts.headers {
        if !NOT_PASSED.contains(&name.as_str()) {
            kept.append(name.clone(), value.clone());
        }
    }
    Ok(answer)
}

/// The caller, as the front proxy tells it: `X-Remote-User`, one `X-Remote-Group` per
/// group, `X-Remote-Extra-{key}` per extra value (the key percent-encoded).
pub fn identify(headers: &mut HeaderMap, user: &UserInfo) {
    if let Ok(name) = HeaderValue::from_str(&user.name) {
        headers.insert(USER_HEADER, name);
    }
    for group in &user.groups {
        if let Ok(group) = HeaderValue::from_str(group) {
            headers.append(GROUP_HEADER, group);
        }
    }
    for (key, values) in &user.extra {
        let key: String =
            percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC)
                .to_string()
                .to_lowercase();
        let Ok(name) = HeaderName::from_bytes(format!("{EXTRA_HEADER_PREFIX}{key}").as_bytes())
        else {
            continue;
        };
        for value in values {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.append(name.clone(), value);
            }
        }
    }
}

/// GETs `/apis/{group}/{version}` of `route`'s backend as the aggregator itself
/// (`system:kube-aggregator`, in `system:masters`), as the availability check does: the
/// backend's `APIResourceList`, or why it could not be had.
pub async fn discover(
    aggregator: &Aggregator,
    route: &Route,
    service: &ServiceRef,
    target: (&str, u16),
) -> Result<Value, String> {
    use http_body_util::BodyExt as _;
    let path = format!("/apis/{}/{}", route.group, route.version);
    let mut request = hyper::Request::get(&path)
        .header(header::ACCEPT, "application/json")
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let user = UserInfo::new(
        "system:kube-aggregator",
        [trellis_api::user::groups::MASTERS],
    );
    identify(request.headers_mut(), &user);
    if let Ok(host) = HeaderValue::from_str(&format!("{}:{}", target.0, target.1)) {
        request.headers_mut().insert(header::HOST, host);
    }
    let checked = async {
        let response = aggregator
            .client
            .send(route, service, target, request)
            .await?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "bad status from https://{}:{}{path}: {}",
                target.0,
                target.1,
                status.as_u16()
            ));
        }
        serde_json::from_slice(&body).map_err(|e| format!("decode {path}: {e}"))
    };
    tokio::time::timeout(aggregator.config.check_timeout, checked)
        .await
        .map_err(|_| {
            format!(
                "failing or missing response from https://{}:{}{path}: timed out",
                target.0, target.1
            )
        })?
}
