//! Namespace deletion: everything in a namespace, then the namespace itself.

use anyhow::Result;
use tracing::{info, warn};
use trellis_api::registry::ResourceInfo;
use trellis_store::{ListRequest, Store};

use crate::state::AppState;

/// A namespace was marked for deletion: delete everything in it, then the
/// namespace itself, in the background.
pub fn deletion_started(state: &AppState, name: &str) {
    let store = state.store.clone();
    let resources = state.resources();
    let name = name.to_owned();
    tokio::spawn(async move {
        if let Err(e) = empty_namespace(store.as_ref(), &resources, &name).await {
            warn!(namespace = %name, error = %e, "namespace cleanup failed");
        }
    });
}

async fn empty_namespace(store: &dyn Store, resources: &[ResourceInfo], name: &str) -> Result<()> {
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
