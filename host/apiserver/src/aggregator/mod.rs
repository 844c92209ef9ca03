//! The aggregation layer, as kube-aggregator: an `apiregistration.k8s.io/v1`
//! APIService with a `spec.service` hands its group-version to an extension API
//! server. Requests under `/apis/{group}/{version}` are authenticated and authorized
//! here as any other, then passed to one endpoint of that Service over TLS (checked
//! against the APIService's `caBundle`, or not at all with `insecureSkipTLSVerify`)
//! with the front proxy's client certificate and the user in `X-Remote-*` headers
//! ([`front_proxy`]). The group appears in `/apis` and `/apis/{group}` (and in the
//! aggregated discovery document, with the resources the backend listed at its last
//! check); `/apis/{group}/{version}` is the backend's own.
//!
//! The availability controller ([`availability`]) follows APIServices, Services and
//! Endpoints, checks each backend's discovery document, and keeps the APIService's
//! `Available` condition (`Passed`, `ServiceNotFound`, `MissingEndpoints`,
//! `FailedDiscoveryCheck`, …); a group-version that is not available answers 503
//! without a try, as kube-aggregator's proxy does.
//!
//! # Layout
//! - this file: [`Aggregator`], the routes it serves, and the request's entry
//!   ([`handle`]).
//! - [`proxy`]: resolving a Service to an endpoint and passing a request on.
//! - [`availability`]: the `Available` condition and the backends' discovery.
//! - [`front_proxy`]: the front proxy's CA, its client certificate and the
//!   `extension-apiserver-authentication` ConfigMap.
//! - [`discovery`]: a backend's `APIResourceList` in aggregated discovery's form.

pub mod availability;
pub mod discovery;
pub mod front_proxy;
pub mod proxy;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use serde_json::Value;
use trellis_api::{ApiError, UserInfo};

use crate::endpoints::request::RequestInfo;
use crate::endpoints::response::ErrorResponse;
use crate::state::AppState;
use crate::storage::lister::Lister;

/// The APIService group.
pub const GROUP: &str = "apiregistration.k8s.io";

/// Settings of the aggregation layer.
#[derive(Clone, Debug)]
pub struct Config {
    /// How often every APIService is checked again besides on changes of it, its
    /// Service or its Endpoints (kube-aggregator: 30 s).
    pub check_interval: Duration,
    /// How long a backend may take to answer its discovery check.
    pub check_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            check_interval: Duration::from_secs(30),
            check_timeout: Duration::from_secs(5),
        }
    }
}

/// Where an APIService's group-version is served from.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// The APIService's name, `{version}.{group}`.
    pub name: String,
    pub group: String,
    pub version: String,
    /// `None`: served by this server (a local APIService).
    pub service: Option<ServiceRef>,
    /// PEM roots the backend's serving certificate must chain to.
    pub ca_bundle: Vec<u8>,
    pub insecure_skip_tls_verify: bool,
    pub group_priority_minimum: i64,
    pub version_priority: i64,
    /// The `Available` condition as stored.
    pub available: bool,
}

/// `spec.service` of an APIService.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceRef {
    pub namespace: String,
    pub name: String,
    pub port: u16,
}

impl Route {
    /// The route an APIService object describes; `None` for one without a name of the
    /// form `{version}.{group}`.
    pub fn from_object(obj: &Value) -> Option<Self> {
        let name = obj["metadata"]["name"].as_str()?.to_owned();
        let spec = &obj["spec"];
        let group = spec["group"].as_str().unwrap_or_default().to_owned();
        let version = spec["version"].as_str()?.to_owned();
        let service = spec["service"].as_object().and_then(|s| {
            Some(ServiceRef {
                namespace: s.get("namespace")?.as_str()?.to_owned(),
                name: s.get("name")?.as_str()?.to_owned(),
                port: s
                    .get("port")
                    .and_then(Value::as_u64)
                    .and_then(|p| u16::try_from(p).ok())
                    .unwrap_or(443),
            })
        });
        use base64::Engine as _;
        let ca_bundle = spec["caBundle"]
            .as_str()
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
            .unwrap_or_default();
        let available = obj["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Available" && c["status"] == "True");
        Some(Self {
            name,
            group,
            version,
            service,
            ca_bundle,
            insecure_skip_tls_verify: spec["insecureSkipTLSVerify"].as_bool().unwrap_or(false),
            group_priority_minimum: spec["groupPriorityMinimum"].as_i64().unwrap_or(0),
            version_priority: spec["versionPriority"].as_i64().unwrap_or(0),
            available,
        })
    }
}

/// The aggregation layer's state: the APIServices served elsewhere, what their
/// backends listed at their last check, and the client that reaches them.
pub struct Aggregator {
    config: Config,
    /// The remote group-versions, by `(group, version)`.
    routes: RwLock<Arc<BTreeMap<(String, String), Route>>>,
    /// Each remote group-version's `APIResourceList` from its last passing check.
    discovery: RwLock<HashMap<String, Arc<Value>>>,
    client: proxy::Client,
    apiservices: Lister,
    services: Lister,
    endpoints: Lister,
}

impl std::fmt::Debug for Aggregator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregator")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Aggregator {
    /// An aggregator whose requests carry the front proxy's certificate.
    pub fn new(config: Config, front_proxy: &front_proxy::FrontProxy) -> anyhow::Result<Self> {
        Ok(Self {
            config,
            routes: RwLock::default(),
            discovery: RwLock::default(),
            client: proxy::Client::new(&front_proxy.client_cert_pem, &front_proxy.client_key_pem)?,
            apiservices: Lister::new(GROUP, "apiservices"),
            services: Lister::new("", "services"),
            endpoints: Lister::new("", "endpoints"),
        })
    }

    fn init(&self, state: &AppState) {
        self.apiservices.init(&state.store, &state.cache);
        self.services.init(&state.store, &state.cache);
        self.endpoints.init(&state.store, &state.cache);
    }

    /// The remote route of `group/version`, if an APIService sends it elsewhere.
    pub fn route(&self, group: &str, version: &str) -> Option<Route> {
        read(&self.routes)
            .get(&(group.to_owned(), version.to_owned()))
            .cloned()
    }

    /// The remote groups, each with its versions, in the order discovery lists them:
    /// groups by `groupPriorityMinimum`, versions by `versionPriority`, highest first.
    pub fn groups(&self) -> Vec<(String, Vec<String>)> {
        let routes = read(&self.routes);
        let mut by_group: BTreeMap<&str, Vec<&Route>> = BTreeMap::new();
        for route in routes.values() {
            by_group.entry(&route.group).or_default().push(route);
        }
        let mut groups: Vec<(i64, String, Vec<String>)> = by_group
            .into_iter()
            .map(|(group, mut routes)| {
                routes.sort_by(|a, b| {
                    b.version_priority
                        .cmp(&a.version_priority)
                        .then_with(|| a.version.cmp(&b.version))
                });
                let priority = routes
                    .iter()
                    .map(|r| r.group_priority_minimum)
                    .max()
                    .unwrap_or(0);
                let versions = routes.iter().map(|r| r.version.clone()).collect();
                (priority, group.to_owned(), versions)
            })
            .collect();
        groups.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        groups.into_iter().map(|(_, g, v)| (g, v)).collect()
    }

    /// The backend's `APIResourceList` of `group/version` from its last passing check,
    /// and whether the group-version is available now.
    pub fn discovered(&self, group: &str, version: &str) -> Option<(Arc<Value>, bool)> {
        let route = self.route(group, version)?;
        let doc = read(&self.discovery).get(&route.name).cloned()?;
        Some((doc, route.available))
    }

    fn set_routes(&self, routes: BTreeMap<(String, String), Route>) {
        *write(&self.routes) = Arc::new(routes);
    }

    fn set_discovery(&self, name: &str, doc: Option<Value>) {
        let mut docs = write(&self.discovery);
        match doc {
            Some(doc) => {
                docs.insert(name.to_owned(), Arc::new(doc));
            }
            None => {
                docs.remove(name);
            }
        }
    }

    /// Whether `namespace/name` is the Service of a remote APIService.
    fn backs(&self, namespace: &str, name: &str) -> bool {
        read(&self.routes).values().any(|r| {
            r.service
                .as_ref()
                .is_some_and(|s| s.namespace == namespace && s.name == name)
        })
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

/// Sets the server up for aggregation: the front proxy's credentials, their
/// ConfigMap, and the availability controller (until `stopped`).
pub async fn start(
    state: &Arc<AppState>,
    config: Config,
    pki_dir: &std::path::Path,
    cluster_ca_pem: &str,
    stopped: trellis_api::Shutdown,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let front_proxy = front_proxy::FrontProxy::load_or_create(pki_dir)
        .context("prepare the front proxy's credentials")?;
    front_proxy::publish(state, front_proxy.configmap(cluster_ca_pem))
        .await
        .context("publish the extension-apiserver-authentication ConfigMap")?;
    let aggregator = Arc::new(Aggregator::new(config, &front_proxy)?);
    aggregator.init(state);
    let _ = state.aggregator.set(aggregator);
    availability::start(state.clone(), stopped);
    Ok(())
}

/// The server's aggregator, once [`start`] set it.
pub fn of(state: &AppState) -> Option<&Aggregator> {
    state.aggregator.get()?.downcast_ref()
}

/// The remote route a request's path falls under (`/apis/{group}/{version}[/…]`),
/// if any.
pub fn route_for(state: &AppState, path: &str) -> Option<Route> {
    let aggregator = of(state)?;
    if read(&aggregator.routes).is_empty() {
        return None;
    }
    let mut segments = path.trim_start_matches('/').split('/');
    if segments.next() != Some("apis") {
        return None;
    }
    let group = segments.next()?;
    let version = segments.next()?;
    aggregator
        .route(group, version)
        .filter(|r| r.service.is_some())
}

/// A request for a remote group-version, once authenticated: authorized as
/// kube-apiserver authorizes it (discovery by URL, the rest by resource, read from the
/// path), then passed on.
pub async fn handle(
    state: &AppState,
    route: Route,
    user: &UserInfo,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ErrorResponse> {
    match RequestInfo::parse(uri.path(), |_, _, _| true) {
        RequestInfo::NonResource(_) => {
            crate::authorization::authorize_non_resource(state, user, &method, uri.path()).await?;
        }
        RequestInfo::Resource(None) => {
            return Err(ApiError::new(
                404,
                trellis_api::status::Reason::NotFound,
                "the server could not find the requested resource",
            )
            .into());
        }
        RequestInfo::Resource(Some(path)) => {
            let watch = uri
                .query()
                .map(crate::endpoints::request::form_pairs)
                .and_then(|q| q.get("watch").cloned())
                .is_some_and(|w| w == "true" || w == "1");
            let verb = crate::endpoints::request::verb(&method, path.name.is_some(), watch)
                .ok_or_else(|| {
                    ApiError::method_not_allowed(
                        "the server does not allow this method on the requested resource",
                    )
                })?;
            let resource = match &path.subresource {
                Some(sub) => format!("{}/{sub}", path.resource),
                None => path.resource.clone(),
            };
            let attributes = crate::authorization::rbac::Attributes {
                verb,
                group: &path.group,
                resource: &resource,
                namespace: path.namespace.as_deref().unwrap_or(""),
                name: path.name.as_deref().unwrap_or(""),
            };
            crate::authorization::rbac::authorize(&state.rbac, user, &attributes).await?;
        }
    }
    let Some(aggregator) = of(state) else {
        return Err(ApiError::unavailable("service unavailable").into());
    };
    // As kube-aggregator: a group-version whose last check failed is not tried.
    if !route.available {
        return Err(ApiError::unavailable("service unavailable").into());
    }
    proxy::forward(aggregator, &route, user, method, uri, headers, body)
        .await
        .map_err(|e| ApiError::unavailable(format!("error trying to reach service: {e}")).into())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn route(group: &str, version: &str, group_priority: i64, version_priority: i64) -> Route {
        Route::from_object(&json!({
            "metadata": {"name": format!("{version}.{group}")},
            "spec": {"group": group, "version": version,
                     "service": {"namespace": "ns", "name": "svc"},
                     "groupPriorityMinimum": group_priority, "versionPriority": version_priority},
        }))
        .unwrap()
    }

    #[test]
    fn an_apiservice_reads_as_its_route() {
        let r = Route::from_object(&json!({
            "metadata": {"name": "v1beta1.metrics.k8s.io"},
            "spec": {"group": "metrics.k8s.io", "version": "v1beta1",
                     "service": {"namespace": "kube-system", "name": "metrics-server", "port": 8443},
                     "caBundle": "UEVN", "insecureSkipTLSVerify": false},
            "status": {"conditions": [{"type": "Available", "status": "True"}]},
        }))
        .unwrap();
        assert_eq!(
            r.service,
            Some(ServiceRef {
                namespace: "kube-system".into(),
                name: "metrics-server".into(),
                port: 8443
            })
        );
        assert_eq!(r.ca_bundle, b"PEM");
        assert!(r.available);
        // A local one: no service, no port; the port defaults to 443.
        let local = Route::from_object(&json!({
            "metadata": {"name": "v1.apps"}, "spec": {"group": "apps", "version": "v1", "service": null},
        }))
        .unwrap();
        assert_eq!(local.service, None);
        assert!(!local.available);
        assert_eq!(route("g", "v1", 1, 1).service.unwrap().port, 443);
    }

    #[test]
    fn groups_are_listed_by_priority_and_versions_by_theirs() {
        let front_proxy =
            front_proxy::FrontProxy::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        let aggregator = Aggregator::new(Config::default(), &front_proxy).unwrap();
        let routes = [
            route("low.example.com", "v1", 100, 15),
            route("high.example.com", "v1beta1", 1000, 9),
            route("high.example.com", "v1", 1000, 15),
        ];
        aggregator.set_routes(
            routes
                .into_iter()
                .map(|r| ((r.group.clone(), r.version.clone()), r))
                .collect(),
        );
        assert_eq!(
            aggregator.groups(),
            [
                (
                    "high.example.com".to_owned(),
                    vec!["v1".to_owned(), "v1beta1".to_owned()]
                ),
                ("low.example.com".to_owned(), vec!["v1".to_owned()]),
            ]
        );
        assert!(aggregator.backs("ns", "svc"));
        assert!(!aggregator.backs("ns", "other"));
    }
}
