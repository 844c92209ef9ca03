//! Namespace deletion, as Kubernetes' namespace controller does it.
//!
//! Deleting a namespace only marks it: `deletionTimestamp`, phase `Terminating`, and
//! the `kubernetes` finalizer in `spec.finalizers`. Only `namespaces/finalize` changes
//! `spec.finalizers` (an update of the namespace keeps the stored ones, as in
//! Kubernetes), so no update can remove the finalizer early. A namespace marked for
//! deletion leaves the store once neither `spec.finalizers` nor `metadata.finalizers`
//! holds it ([`finalized`]).
//!
//! The server's own controller (unless [`crate::Config::namespace_controller`] turns
//! it off, for a controller manager's namespace controller to do the same through
//! `namespaces/finalize`) deletes every object in the namespace through the
//! registry's delete — admission sees each delete, and an object with finalizers is
//! marked and waited for, not removed — and once nothing is left, it removes its
//! finalizer, and with it the namespace when no other finalizer holds it.
//!
//! Its state is the stored namespaces, not memory: at start it takes up every
//! namespace that is still terminating (a server killed halfway resumes), it passes
//! over them again whenever a namespace is deleted, and while any waits for objects
//! (finalizers, or a create that raced the deletion) it passes again every
//! [`crate::state::Settings::namespace_resync`].

use std::sync::Arc;

use serde_json::Value;
use tracing::{debug, info, warn};
use trellis_api::registry::ResourceInfo;
use trellis_api::{ApiError, Shutdown, UserInfo};
use trellis_store::ListRequest;

use super::delete::{DeleteParams, Deletion, delete_one};
use crate::endpoints::request::{ApiRequest, BodyFormat, Query};
use crate::endpoints::response::ErrorResponse;
use crate::object::{self, meta_str};
use crate::state::AppState;
use crate::storage::watch_cache::decode_stored;

use super::NAMESPACE_FINALIZER as FINALIZER;

/// Who the controller's deletes are made as.
const CONTROLLER: &str = "system:serviceaccount:kube-system:namespace-controller";

/// Runs the namespace controller until `stop` is set.
pub fn start_controller(state: Arc<AppState>, stop: Shutdown) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let waiting = match pass(&state).await {
                Ok(waiting) => waiting,
                Err(e) => {
                    warn!(error = %e.message, "namespace deletion failed; retrying");
                    true
                }
            };
            let resync = state.settings.namespace_resync;
            tokio::select! {
                () = state.namespace_deletions.notified() => {}
                () = tokio::time::sleep(resync), if waiting => {}
                _ = stop.wait() => return,
            }
        }
    })
}

/// One pass over every terminating namespace; whether any is still waiting.
async fn pass(state: &AppState) -> Result<bool, ApiError> {
    let namespaces = state.resource("", "v1", "namespaces")?;
    let listed = state
        .store
        .list(ListRequest::prefix(namespaces.namespace_prefix(None)))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let mut waiting = false;
    for kv in &listed.kvs {
        let Some(ns) = decode_stored(&kv.value, kv.mod_revision) else {
            continue;
        };
        if meta_str(&ns, "deletionTimestamp").is_none() {
            continue;
        }
        let Some(name) = object::name(&ns).map(str::to_owned) else {
            continue;
        };
        match finalize(state, &namespaces, &name).await {
            Ok(true) => info!(namespace = %name, "namespace deleted"),
            Ok(false) => waiting = true,
            Err(e) => {
                warn!(namespace = %name, error = %e.message, "emptying the namespace failed");
                waiting = true;
            }
        }
    }
    Ok(waiting)
}

fn controller_request(resource: ResourceInfo, namespace: Option<&str>) -> ApiRequest {
    ApiRequest {
        resource,
        namespace: namespace.map(str::to_owned),
        name: None,
        subresource: None,
        verb: "delete",
        query: Query::default(),
        user: UserInfo::new(
            CONTROLLER,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:kube-system",
                trellis_api::user::groups::AUTHENTICATED,
            ],
        ),
        content_type: None,
        user_agent: Some("namespace-controller".into()),
        body_format: BodyFormat::Json,
        table: None,
        dry_run: false,
        include_uninitialized: true,
    }
}

/// Deletes what is in namespace `name`; once it is empty, the namespace. Whether the
/// namespace is gone.
async fn finalize(
    state: &AppState,
    namespaces: &ResourceInfo,
    name: &str,
) -> Result<bool, ApiError> {
    let mut remaining = 0_usize;
    for res in state.resources().into_iter().filter(|r| r.namespaced) {
        let prefix = res.namespace_prefix(Some(name));
        let listed = state
            .store
            .list(ListRequest::prefix(&prefix))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if listed.kvs.is_empty() {
            continue;
        }
        let mut req = controller_request(res, Some(name));
        for kv in &listed.kvs {
            let Some(obj) = decode_stored(&kv.value, kv.mod_revision) else {
                continue;
            };
            let Some(object_name) = object::name(&obj).map(str::to_owned) else {
                continue;
            };
            if meta_str(&obj, "deletionTimestamp").is_some() {
                // Marked already: its finalizers' owners remove it.
                remaining += 1;
                continue;
            }
            req.name = Some(object_name.clone());
            match delete_one(state, &req, &object_name, &DeleteParams::default()).await {
                Ok(Deletion::Removed(_)) => {}
                Ok(Deletion::Marked(_)) => remaining += 1,
                Err(ErrorResponse(e)) if e.code == 404 => {}
                Err(ErrorResponse(e)) => {
                    debug!(namespace = name, object = %object_name, error = %e.message, "delete refused");
                    remaining += 1;
                }
            }
        }
        req.name = None;
        req.verb = "deletecollection";
        super::after_write(state, &req).await;
    }
    if remaining > 0 {
        debug!(
            namespace = name,
            remaining, "namespace waits for its objects"
        );
        return Ok(false);
    }
    // Empty: the finalizer comes off, and the namespace goes once no other holds it.
    let mut req = controller_request(namespaces.clone(), None);
    req.name = Some(name.to_owned());
    req.verb = "update";
    let key = namespaces.key(None, name);
    let Some(kv) = state
        .store
        .get(&key)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
    else {
        return Ok(true);
    };
    let Some(mut ns) = decode_stored(&kv.value, kv.mod_revision) else {
        return Ok(false);
    };
    let removed_own = remove_finalizer(&mut ns);
    if !removed_own && !finalized(&ns) {
        // Held by another finalizer: nothing to write until it is removed.
        return Ok(false);
    }
    object::remove_meta(&mut ns, "resourceVersion");
    match super::store_or_remove(state, namespaces, None, name, &ns, kv.mod_revision).await {
        Ok((_, removed)) => {
            super::after_write(state, &req).await;
            Ok(removed)
        }
        // Changed meanwhile: the next pass sees the new state.
        Err(e) if e.code == 409 => Ok(false),
        Err(e) if e.code == 404 => Ok(true),
        Err(e) => Err(e),
    }
}

/// Removes [`FINALIZER`] from a namespace's `spec.finalizers`; whether it was there.
fn remove_finalizer(ns: &mut object::Object) -> bool {
    let Some(Value::Array(finalizers)) = ns.get_mut("spec").and_then(|s| s.get_mut("finalizers"))
    else {
        return false;
    };
    let before = finalizers.len();
    finalizers.retain(|f| f != FINALIZER);
    finalizers.len() != before
}

/// A namespace's `spec.finalizers`: what namespace controllers still have to do.
fn spec_finalizers(ns: &object::Object) -> &[Value] {
    ns.get("spec")
        .and_then(|s| s.get("finalizers"))
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// Whether a namespace is done with: marked for deletion, and held by neither
/// `spec.finalizers` nor `metadata.finalizers`. Such a namespace is removed from the
/// store instead of written (Kubernetes' `ShouldDeleteNamespaceDuringUpdate`).
pub fn finalized(ns: &object::Object) -> bool {
    meta_str(ns, "deletionTimestamp").is_some()
        && spec_finalizers(ns).is_empty()
        && object::metadata(ns)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_none_or(|f| f.is_empty())
}

/// What a write of a namespace may change of its `spec.finalizers`: through
/// `namespaces/finalize` (`finalize`) they, and only they, come from `new`, the rest
/// from the stored `old`; through any other write they stay as stored, as Kubernetes'
/// namespace strategy keeps them.
pub fn merge_finalizers(old: &object::Object, new: &mut object::Object, finalize: bool) {
    let finalizers = if finalize {
        let given = new
            .get("spec")
            .and_then(|s| s.get("finalizers"))
            .filter(|f| !f.is_null())
            .cloned();
        *new = old.clone();
        given
    } else {
        old.get("spec").and_then(|s| s.get("finalizers")).cloned()
    };
    // Written out even when empty: a missing list would be defaulted to `kubernetes`.
    let finalizers = finalizers.unwrap_or_else(|| Value::Array(Vec::new()));
    let spec = new
        .entry("spec")
        .or_insert_with(|| Value::Object(Default::default()));
    if !spec.is_object() {
        *spec = Value::Object(Default::default());
    }
    spec["finalizers"] = finalizers;
}

/// Checks a namespace's `spec.finalizers` as Kubernetes does: each a qualified name,
/// and one without a `/` prefix one of the standard finalizers.
pub fn validate_finalizers(ns: &object::Object, name: &str) -> Result<(), ApiError> {
    const STANDARD: &[&str] = &[FINALIZER, "orphan", "foregroundDeletion"];
    let mut causes = Vec::new();
    for (i, finalizer) in spec_finalizers(ns).iter().enumerate() {
        let field = format!("spec.finalizers[{i}]");
        let Some(finalizer) = finalizer.as_str() else {
            causes.push(trellis_api::status::StatusCause::invalid(
                field,
                &finalizer.to_string(),
                "must be a string",
            ));
            continue;
        };
        if let Err(reason) = trellis_api::selector::validate_key(finalizer) {
            causes.push(trellis_api::status::StatusCause::invalid(
                field, finalizer, reason,
            ));
        } else if !finalizer.contains('/') && !STANDARD.contains(&finalizer) {
            causes.push(trellis_api::status::StatusCause::invalid(
                field,
                finalizer,
                "name is neither a standard finalizer name nor is it fully qualified",
            ));
        }
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid("", "Namespace", name, causes))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ns(v: Value) -> object::Object {
        match v {
            Value::Object(o) => o,
            _ => unreachable!(),
        }
    }

    #[test]
    fn finalize_takes_only_spec_finalizers_and_an_update_keeps_them() {
        let old = ns(json!({
            "metadata": {"name": "a", "labels": {"x": "1"}},
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }));
        let body = json!({
            "metadata": {"name": "a", "labels": {"x": "2"}},
            "spec": {"finalizers": ["example.com/f"]},
            "status": {"phase": "Terminating"},
        });
        let mut new = ns(body.clone());
        merge_finalizers(&old, &mut new, true);
        assert_eq!(new["spec"]["finalizers"], json!(["example.com/f"]));
        assert_eq!(new["metadata"]["labels"]["x"], "1");
        assert_eq!(new["status"]["phase"], "Active");

        // No list, or null, finalizes everything: an empty list, not a missing one.
        let mut new = ns(json!({"metadata": {"name": "a"}}));
        merge_finalizers(&old, &mut new, true);
        assert_eq!(new["spec"]["finalizers"], json!([]));

        let mut new = ns(body);
        merge_finalizers(&old, &mut new, false);
        assert_eq!(new["spec"]["finalizers"], json!(["kubernetes"]));
        assert_eq!(new["metadata"]["labels"]["x"], "2");
        let mut new = ns(json!({"metadata": {"name": "a"}}));
        merge_finalizers(&old, &mut new, false);
        assert_eq!(new["spec"]["finalizers"], json!(["kubernetes"]));
    }

    #[test]
    fn a_namespace_is_finalized_once_marked_and_no_finalizer_holds_it() {
        let marked =
            json!({"metadata": {"name": "a", "deletionTimestamp": "2024-01-01T00:00:00Z"}});
        let mut ns_ = ns(marked.clone());
        assert!(finalized(&ns_));
        ns_.insert("spec".into(), json!({"finalizers": ["kubernetes"]}));
        assert!(!finalized(&ns_));
        assert!(remove_finalizer(&mut ns_));
        assert!(!remove_finalizer(&mut ns_));
        assert!(finalized(&ns_));
        ns_.insert("spec".into(), json!({"finalizers": ["example.com/f"]}));
        assert!(!finalized(&ns_), "another spec finalizer holds it");
        let mut held = ns(marked);
        held["metadata"]["finalizers"] = json!(["example.com/g"]);
        assert!(!finalized(&held));
        assert!(!finalized(&ns(
            json!({"metadata": {"name": "a"}, "spec": {"finalizers": []}})
        )));
    }

    #[test]
    fn finalizer_names_are_qualified_or_standard() {
        let with = |f: Value| ns(json!({"spec": {"finalizers": f}}));
        assert!(
            validate_finalizers(&with(json!(["kubernetes", "example.com/f", "orphan"])), "a")
                .is_ok()
        );
        assert!(validate_finalizers(&with(json!([])), "a").is_ok());
        let err = validate_finalizers(&with(json!(["custom"])), "a").unwrap_err();
        assert_eq!(err.code, 422);
        assert!(
            err.message.contains("spec.finalizers[0]"),
            "{}",
            err.message
        );
        assert!(validate_finalizers(&with(json!(["a/b/c"])), "a").is_err());
        assert!(validate_finalizers(&with(json!([1])), "a").is_err());
    }
}
