//! What every request handler shares: the store, the resource registry (built-in and
//! custom resources, followed as CRDs change), the OpenAPI documents built from it,
//! the watch cache, the credentials and the server's settings.
//!
//! The limits on requests in flight are [`crate::inflight`]'s; the objects every
//! cluster starts with, [`crate::bootstrap`]'s.

use std::sync::{Arc, RwLock};

use tracing::warn;
use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, builtins};
use trellis_store::{ListRequest, Store};

use crate::admission::Chains;
use crate::authentication::tokens::TokenFile;
use crate::inflight::Inflight;
use crate::registry::crd::{self, CustomResources, Schema};
use crate::storage::watch_cache::WatchCache;

/// The server's limits and intervals: Kubernetes' defaults, each a setting so that
/// tests can shorten what would otherwise make them wait.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Read-only requests served at once before new ones get 429
    /// (`--max-requests-inflight`); watches are not counted. 0: no limit.
    pub max_requests_inflight: usize,
    /// Mutating requests served at once before new ones get 429
    /// (`--max-mutating-requests-inflight`). 0: no limit.
    pub max_mutating_requests_inflight: usize,
    /// How long a request other than a watch may take before it gets 504
    /// (`--request-timeout`).
    pub request_timeout: std::time::Duration,
    /// How long a new connection may take, after its TLS handshake, to send its first
    /// request's headers, and an HTTP/1.1 connection each next request's (Go's
    /// `ReadHeaderTimeout`), after which it is closed (`--header-read-timeout`).
    /// Separate from `idle_timeout`: a client that connects and says nothing is closed
    /// at this deadline, not kept until the connection idles out.
    pub header_read_timeout: std::time::Duration,
    /// How long a connection may stay open without a request in flight
    /// (`--idle-timeout`).
    pub idle_timeout: std::time::Duration,
    /// The longest ServiceAccount token a TokenRequest is given
    /// (`--service-account-max-token-expiration`); longer requests are cut to it.
    pub max_token_expiration: Option<std::time::Duration>,
    /// How often the namespace controller looks again at a terminating namespace that
    /// still holds objects (finalizers not yet removed).
    pub namespace_resync: std::time::Duration,
    /// How often a watch that asked for bookmarks gets one.
    pub bookmark_interval: std::time::Duration,
    /// How long a connection's writes may stay blocked, its client not reading, before
    /// the connection is closed. A watch whose client stops reading is dropped by the
    /// watch cache once its buffer fills (the client relists); this frees the
    /// connection behind it.
    pub stalled_write_timeout: std::time::Duration,
    /// Where Services' ClusterIPs come from (`--service-cluster-ip-range`).
    pub service_cluster_ip_range: crate::registry::service::ServiceCidr,
    /// Where NodePorts come from (`--service-node-port-range`).
    pub service_node_port_range: crate::registry::service::PortRange,
    /// How often the Service allocations are repaired from the stored Services after
    /// the pass at start (kube-apiserver: 3 minutes).
    pub service_repair_interval: std::time::Duration,
}

impl Default for Settings {
    fn default() -> Self {
        use std::time::Duration;
        Self {
            max_requests_inflight: 400,
            max_mutating_requests_inflight: 200,
            request_timeout: Duration::from_secs(60),
            header_read_timeout: Duration::from_secs(32),
            idle_timeout: Duration::from_secs(90),
            max_token_expiration: None,
            bookmark_interval: Duration::from_secs(30),
            namespace_resync: Duration::from_secs(5),
            stalled_write_timeout: Duration::from_secs(60),
            service_cluster_ip_range: Default::default(),
            service_node_port_range: Default::default(),
            service_repair_interval: Duration::from_secs(180),
        }
    }
}

/// The OpenAPI documents, serialized once.
#[derive(Debug)]
pub struct OpenApiDocs {
    /// `/openapi/v3`.
    pub index: Vec<u8>,
    /// `/openapi/v3/{path}`: the document and its hash.
    pub v3: std::collections::BTreeMap<String, (Vec<u8>, String)>,
    /// `/openapi/v2` as JSON.
    pub v2: Vec<u8>,
    /// `/openapi/v2` as gnostic's protobuf `Document`.
    pub v2_protobuf: Vec<u8>,
}

#[derive(Debug)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub cache: Arc<WatchCache>,
    pub tokens: TokenFile,
    /// Admission steps and initializers, in order.
    pub chains: Chains,
    /// Namespaces as creates check them (exists, not terminating).
    pub namespaces: crate::storage::lister::Lister,
    /// RBAC's roles and bindings as authorization reads them.
    pub rbac: crate::authorization::rbac::RbacReader,
    /// ServiceAccounts as token authentication checks them.
    pub service_accounts: crate::storage::lister::Lister,
    /// Secrets, for bootstrap tokens: a joining node sends its token with each request.
    pub secrets: crate::storage::lister::Lister,
    pub metrics: crate::observability::metrics::Metrics,
    /// Signs and checks ServiceAccount tokens.
    pub signer: crate::authentication::sa_token::TokenSigner,
    /// ServiceAccount tokens checked lately.
    pub verified_tokens: crate::authentication::sa_token::VerifiedTokens,
    pub audit: Option<crate::observability::audit::AuditLog>,
    pub settings: Settings,
    /// Requests in flight, against the limits in `settings`.
    pub inflight: Inflight,
    registry: RwLock<Vec<ResourceInfo>>,
    /// Custom resources and their schemas, from the stored CRDs.
    custom: RwLock<Arc<CustomResources>>,
    /// The OpenAPI documents and the registry generation they describe.
    openapi: RwLock<Option<(u64, Arc<OpenApiDocs>)>>,
    /// Bumped by every change of the registry.
    registry_generation: std::sync::atomic::AtomicU64,
    /// Held while the documents are built: one build at a time, whoever asks.
    openapi_build: tokio::sync::Mutex<()>,
    /// The address clients reach the server at, for discovery.
    pub server_address: String,
    /// The WASM plugins, when the server runs them.
    pub plugins: std::sync::OnceLock<Arc<crate::admission::plugins::PluginManager>>,
    /// Poked when a namespace is deleted: the namespace controller passes again.
    pub namespace_deletions: tokio::sync::Notify,
    /// HTTPS to nodes' agents, for `pods/log`.
    pub kubelet: crate::kubelet::KubeletClient,
    /// What this server believes taken in the Service ranges.
    pub services: crate::registry::service::Allocators,
    /// The APIServices served by other servers, once the aggregation layer started:
    /// a `crate::aggregator::Aggregator`, read through `aggregator::of` (held by
    /// type here, the state would import the aggregator that reads it).
    pub aggregator: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

/// What the server's state is made from, as [`crate::server::start`] prepares it.
#[derive(Debug)]
pub struct Parts {
    pub store: Arc<dyn Store>,
    pub cache: Arc<WatchCache>,
    pub tokens: TokenFile,
    pub chains: Chains,
    pub audit: Option<crate::observability::audit::AuditLog>,
    pub signer: crate::authentication::sa_token::TokenSigner,
    /// The address clients reach the server at, for discovery.
    pub server_address: String,
    pub settings: Settings,
    /// HTTPS to nodes' agents, with the API server's client certificate.
    pub kubelet: crate::kubelet::KubeletClient,
}

impl AppState {
    pub fn new(parts: Parts) -> Arc<Self> {
        let Parts {
            store,
            cache,
            tokens,
            chains,
            audit,
            signer,
            server_address,
            settings,
            kubelet,
        } = parts;
        let metrics = crate::observability::metrics::Metrics::default();
        let store: Arc<dyn Store> = Arc::new(crate::storage::metered::MeteredStore::new(
            store,
            metrics.store.clone(),
        ));
        chains.init(&store, &cache);
        let namespaces = crate::storage::lister::Lister::new("", "namespaces");
        namespaces.init(&store, &cache);
        let rbac = crate::authorization::rbac::RbacReader::default();
        rbac.init(&store, &cache);
        let service_accounts = crate::storage::lister::Lister::new("", "serviceaccounts");
        service_accounts.init(&store, &cache);
        let secrets = crate::storage::lister::Lister::new("", "secrets");
        secrets.init(&store, &cache);
        let services = crate::registry::service::Allocators::new(
            settings.service_cluster_ip_range,
            settings.service_node_port_range,
        );
        Arc::new(Self {
            store,
            cache,
            tokens,
            chains,
            namespaces,
            rbac,
            service_accounts,
            secrets,
            metrics,
            signer,
            verified_tokens: Default::default(),
            audit,
            inflight: Inflight::new(
                settings.max_requests_inflight,
                settings.max_mutating_requests_inflight,
            ),
            settings,
            registry: RwLock::new(builtins()),
            custom: RwLock::new(Arc::new(CustomResources::default())),
            openapi: RwLock::new(None),
            registry_generation: std::sync::atomic::AtomicU64::new(0),
            openapi_build: tokio::sync::Mutex::new(()),
            server_address,
            plugins: std::sync::OnceLock::new(),
            namespace_deletions: tokio::sync::Notify::new(),
            kubelet,
            services,
            aggregator: std::sync::OnceLock::new(),
        })
    }

    pub fn resources(&self) -> Vec<ResourceInfo> {
        self.registry
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The resource served at `group/version/plural`, or 404 as kube-apiserver says it.
    pub fn resource(
        &self,
        group: &str,
        version: &str,
        plural: &str,
    ) -> Result<ResourceInfo, ApiError> {
        self.registry
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|r| r.group == group && r.version == version && r.plural == plural)
            .cloned()
            .ok_or_else(|| {
                ApiError::new(
                    404,
                    trellis_api::status::Reason::NotFound,
                    "the server could not find the requested resource",
                )
            })
    }

    /// Whether `group/version` serves anything.
    pub fn serves(&self, group: &str, version: &str) -> bool {
        self.registry
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|r| r.group == group && r.version == version)
    }

    /// The schema of a custom resource, if `res` is one and declares a schema.
    pub fn schema_for(&self, res: &ResourceInfo) -> Option<Arc<Schema>> {
        let custom = self
            .custom
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        custom
            .schemas
            .get(&(res.group.clone(), res.version.clone(), res.plural.clone()))
            .cloned()
    }

    /// Rebuilds the registry from the built-in resources and the stored CRDs.
    pub async fn refresh_custom_resources(&self) -> anyhow::Result<()> {
        let page = self
            .store
            .list(ListRequest::prefix(crd::CRD_PREFIX))
            .await?;
        let mut custom = CustomResources::default();
        for kv in &page.kvs {
            let Some(obj) = crate::storage::watch_cache::decode_stored(&kv.value, kv.mod_revision)
            else {
                continue;
            };
            if let Err(reason) = crd::from_crd(&obj, &mut custom) {
                warn!(crd = %kv.key, %reason, "not serving a custom resource definition");
            }
        }
        let builtin = builtins();
        let mut registry = builtin.clone();
        for r in &custom.resources {
            // A CRD may not shadow a built-in resource.
            if !builtin
                .iter()
                .any(|b| b.group == r.group && b.plural == r.plural)
            {
                registry.push(r.clone());
            }
        }
        *self.registry.write().unwrap_or_else(|e| e.into_inner()) = registry;
        *self.custom.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(custom);
        self.registry_generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }

    /// Keeps the registry in step with CRDs written through any server sharing the store.
    pub fn follow_custom_resources(self: &Arc<Self>) {
        let state = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                let after = state.cache.revision();
                let Ok(mut sub) = state.cache.subscribe(crd::CRD_PREFIX, after) else {
                    if state.cache.is_stopped() {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                };
                if let Err(e) = state.refresh_custom_resources().await {
                    warn!(error = %e, "refreshing custom resources failed");
                }
                state.openapi().await;
                while sub.rx.recv().await.is_some() {
                    if let Err(e) = state.refresh_custom_resources().await {
                        warn!(error = %e, "refreshing custom resources failed");
                    }
                    // Ahead of the first request that needs them.
                    state.openapi().await;
                }
                if !sub.lagged.load(std::sync::atomic::Ordering::Acquire) {
                    // The cache closed: the server is stopping.
                    return;
                }
            }
        });
    }

    /// The OpenAPI documents of what is served now. Built once per registry change,
    /// by one task off the async workers (CRDs change the documents; building them
    /// takes tens of milliseconds); concurrent askers wait for that one build. The
    /// registry follower builds them ahead of the first request after a change.
    pub async fn openapi(&self) -> Arc<OpenApiDocs> {
        use std::sync::atomic::Ordering;
        let current = |state: &Self| {
            let generation = state.registry_generation.load(Ordering::Acquire);
            state
                .openapi
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .filter(|(built, _)| *built == generation)
                .map(|(_, docs)| docs.clone())
        };
        if let Some(docs) = current(self) {
            return docs;
        }
        let _one = self.openapi_build.lock().await;
        if let Some(docs) = current(self) {
            return docs;
        }
        let generation = self.registry_generation.load(Ordering::Acquire);
        let resources = self.resources();
        let custom = self
            .custom
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.metrics.openapi_builds.inc();
        let build = {
            let (resources, custom) = (resources.clone(), custom.clone());
            tokio::task::spawn_blocking(move || build_openapi(&resources, &custom))
        };
        let docs = match build.await {
            Ok(docs) => docs,
            Err(e) => {
                warn!(error = %e, "building the OpenAPI documents failed; building them here");
                build_openapi(&resources, &custom)
            }
        };
        *self.openapi.write().unwrap_or_else(|e| e.into_inner()) = Some((generation, docs.clone()));
        docs
    }
}

/// The OpenAPI documents of `resources`, with the schemas of the custom ones.
fn build_openapi(resources: &[ResourceInfo], custom: &CustomResources) -> Arc<OpenApiDocs> {
    let mut catalog = crate::endpoints::openapi::Catalog::builtin().clone();
    for r in &custom.resources {
        if let Some(schema) =
            custom
                .schemas
                .get(&(r.group.clone(), r.version.clone(), r.plural.clone()))
        {
            catalog.insert_custom_kind(r, schema.raw().clone());
        }
    }
    let documents = catalog.v3_documents(resources);
    let index = crate::endpoints::openapi::v3_index_of(&documents);
    let v3 = documents
        .iter()
        .map(|(path, doc)| {
            (
                path.clone(),
                (
                    serde_json::to_vec(doc).unwrap_or_default(),
                    crate::endpoints::openapi::content_hash(doc),
                ),
            )
        })
        .collect();
    let v2 = catalog.v2_document(resources);
    let v2_protobuf = crate::endpoints::openapi::proto::encode(&v2).unwrap_or_else(|e| {
        warn!(error = %e, "encoding OpenAPI v2 as protobuf failed");
        Vec::new()
    });
    Arc::new(OpenApiDocs {
        index: serde_json::to_vec(&index).unwrap_or_default(),
        v3,
        v2: serde_json::to_vec(&v2).unwrap_or_default(),
        v2_protobuf,
    })
}
