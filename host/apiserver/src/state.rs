//! What every request handler shares: the store, the resource registry, the watch
//! cache and the credentials, plus the server's own background work (namespace
//! cleanup).

use std::sync::{Arc, RwLock};

use bytes::Bytes;
use serde_json::json;
use tracing::{info, warn};
use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, builtins};
use trellis_store::{ListRequest, Store};

use crate::tokens::TokenFile;
use crate::watch_cache::WatchCache;

/// The namespaces every cluster starts with.
pub const INITIAL_NAMESPACES: &[&str] =
    &["default", "kube-system", "kube-public", "kube-node-lease"];

#[derive(Debug)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub cache: Arc<WatchCache>,
    pub tokens: TokenFile,
    registry: RwLock<Vec<ResourceInfo>>,
    /// The address clients reach the server at, for discovery.
    pub server_address: String,
}

impl AppState {
    pub fn new(
        store: Arc<dyn Store>,
        cache: Arc<WatchCache>,
        tokens: TokenFile,
        server_address: String,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            cache,
            tokens,
            registry: RwLock::new(builtins()),
            server_address,
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

    /// Creates the initial namespaces and the bootstrap RBAC roles if missing.
    pub async fn bootstrap(&self) -> anyhow::Result<()> {
        for (key, mut obj) in crate::rbac::bootstrap_objects() {
            obj["metadata"]["uid"] = uuid::Uuid::new_v4().to_string().into();
            obj["metadata"]["creationTimestamp"] = crate::object::now_timestamp().into();
            match self.store.create(&key, Bytes::from(obj.to_string())).await {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let namespaces = self.resource("", "v1", "namespaces")?;
        for ns in INITIAL_NAMESPACES {
            let obj = json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "uid": uuid::Uuid::new_v4().to_string(),
                             "creationTimestamp": crate::object::now_timestamp(),
                             "labels": {"kubernetes.io/metadata.name": ns}},
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            });
            match self
                .store
                .create(&namespaces.key(None, ns), Bytes::from(obj.to_string()))
                .await
            {
                Ok(_) | Err(trellis_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// A namespace was marked for deletion: delete everything in it, then the
    /// namespace itself, in the background.
    pub fn namespace_deleted(&self, name: &str) {
        let store = self.store.clone();
        let resources = self.resources();
        let name = name.to_owned();
        tokio::spawn(async move {
            if let Err(e) = empty_namespace(store.as_ref(), &resources, &name).await {
                warn!(namespace = %name, error = %e, "namespace cleanup failed");
            }
        });
    }
}

async fn empty_namespace(
    store: &dyn Store,
    resources: &[ResourceInfo],
    name: &str,
) -> anyhow::Result<()> {
    for res in resources.iter().filter(|r| r.namespaced) {
        let prefix = res.namespace_prefix(Some(name));
        loop {
            let page = store
                .list(ListRequest {
                    limit: Some(500),
                    ..ListRequest::prefix(&prefix)
                })
                .await?;
            if page.kvs.is_empty() {
                break;
            }
            for kv in &page.kvs {
                match store.delete(&kv.key, None).await {
                    Ok(_) | Err(trellis_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if !page.more {
                break;
            }
        }
    }
    let namespaces = resources
        .iter()
        .find(|r| r.plural == "namespaces" && r.group.is_empty());
    if let Some(ns) = namespaces {
        match store.delete(&ns.key(None, name), None).await {
            Ok(_) | Err(trellis_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    info!(namespace = %name, "namespace deleted");
    Ok(())
}
