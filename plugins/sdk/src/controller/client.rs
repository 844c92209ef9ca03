//! Writes through the API server under the controller's identity.

use serde_json::Value;

use super::imports::{ApiError, PatchType, Propagation, Write, current};
use crate::GroupVersionResource;

/// One object read from the API server itself, not the cache: for decisions a
/// lagging cache must not make. `None` when it does not exist.
pub fn read(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    name: &str,
) -> Result<Option<Value>, ApiError> {
    let host = current().map_err(ApiError::internal)?;
    host.read(resource, namespace, name)?
        .map(|json| {
            serde_json::from_str(&json)
                .map_err(|e| ApiError::internal(format!("decode the object read: {e}")))
        })
        .transpose()
}

/// Replaces a subresource other than `status` (`namespaces/NAME/finalize`) with
/// the whole object.
pub fn update_subresource(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    object: &Value,
    subresource: &str,
) -> Result<Value, ApiError> {
    let host = current().map_err(ApiError::internal)?;
    let json = host.update_subresource(resource, namespace, object, subresource)?;
    serde_json::from_str(&json)
        .map_err(|e| ApiError::internal(format!("decode the stored object: {e}")))
}

/// Runs `writes` concurrently in the host; results in the order given.
pub fn batch(writes: Vec<Write>) -> Result<Vec<Result<Value, ApiError>>, String> {
    let results = current()?.batch(writes);
    Ok(results
        .into_iter()
        .map(|r| {
            r.and_then(|json| {
                serde_json::from_str(&json)
                    .map_err(|e| ApiError::internal(format!("decode the stored object: {e}")))
            })
        })
        .collect())
}

/// One write.
pub fn write(write: Write) -> Result<Value, ApiError> {
    let mut results = batch(vec![write]).map_err(ApiError::internal)?;
    results
        .pop()
        .unwrap_or_else(|| Err(ApiError::internal("the host answered no write")))
}

pub fn create(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    object: Value,
) -> Result<Value, ApiError> {
    write(Write::Create {
        resource: resource.clone(),
        namespace: namespace.map(str::to_owned),
        object,
    })
}

/// Writes the object's status through the status subresource.
pub fn update_status(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    object: Value,
) -> Result<Value, ApiError> {
    write(Write::Update {
        resource: resource.clone(),
        namespace: namespace.map(str::to_owned),
        object,
        status: true,
    })
}

/// Patches the object (`status`: its status subresource).
pub fn patch(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    name: &str,
    patch_type: PatchType,
    patch: Value,
    status: bool,
) -> Result<Value, ApiError> {
    write(Write::Patch {
        resource: resource.clone(),
        namespace: namespace.map(str::to_owned),
        name: name.to_owned(),
        patch_type,
        patch,
        status,
        force: false,
    })
}

/// Merge-patches the object's status with `status`; `Ok(None)` when the object is
/// gone (deleted while it was reconciled: nothing left to report on).
pub fn patch_status(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    name: &str,
    status: Value,
) -> Result<Option<Value>, ApiError> {
    let written = patch(
        resource,
        namespace,
        name,
        PatchType::Merge,
        serde_json::json!({ "status": status }),
        true,
    );
    match written {
        Ok(object) => Ok(Some(object)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

pub fn delete(
    resource: &GroupVersionResource,
    namespace: Option<&str>,
    name: &str,
    propagation: Option<Propagation>,
) -> Result<Value, ApiError> {
    write(Write::Delete {
        resource: resource.clone(),
        namespace: namespace.map(str::to_owned),
        name: name.to_owned(),
        propagation,
        uid: None,
    })
}
