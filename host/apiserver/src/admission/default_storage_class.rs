//! `DefaultStorageClass`: a new PersistentVolumeClaim that names no class (no
//! `spec.storageClassName`, no beta class annotation) gets the cluster's default one,
//! as Kubernetes' admission plugin does: the StorageClass annotated
//! `storageclass.kubernetes.io/is-default-class: "true"` (or the beta annotation), the
//! newest when several are (then by name). No default: the claim is left without a
//! class. A claim that asks for `""` asked for no class, and keeps it.

use async_trait::async_trait;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_store::Store;

use super::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

/// The annotation that makes a class the default.
pub const IS_DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";
const BETA_IS_DEFAULT_CLASS: &str = "storageclass.beta.kubernetes.io/is-default-class";
const BETA_CLASS: &str = "volume.beta.kubernetes.io/storage-class";

#[derive(Debug)]
pub struct DefaultStorageClass {
    classes: Lister,
}

impl Default for DefaultStorageClass {
    fn default() -> Self {
        Self {
            classes: Lister::new("storage.k8s.io", "storageclasses"),
        }
    }
}

/// Whether `class` is marked default.
pub fn is_default(class: &Object) -> bool {
    let annotations = class.get("metadata").and_then(|m| m.get("annotations"));
    [IS_DEFAULT_CLASS, BETA_IS_DEFAULT_CLASS]
        .iter()
        .any(|a| annotations.and_then(|m| m.get(*a)).and_then(Value::as_str) == Some("true"))
}

/// The default among `classes`: the newest marked one, ties by name.
pub fn default_class(classes: &[std::sync::Arc<Object>]) -> Option<String> {
    let meta = |c: &Object, field: &str| {
        c.get("metadata")
            .and_then(|m| m.get(field))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    classes
        .iter()
        .filter(|c| is_default(c))
        // RFC 3339 times of one format sort as strings.
        .max_by_key(|c| (meta(c, "creationTimestamp"), meta(c, "name")))
        .map(|c| meta(c, "name"))
}

#[async_trait]
impl Admission for DefaultStorageClass {
    fn name(&self) -> &str {
        "DefaultStorageClass"
    }

    fn init(&self, store: &std::sync::Arc<dyn Store>, cache: &std::sync::Arc<WatchCache>) {
        self.classes.init(store, cache);
    }

    async fn mutate(
        &self,
        attrs: &Attributes<'_>,
        obj: &mut Object,
        _old: Option<&Object>,
    ) -> Result<(), ApiError> {
        if !attrs.creates_core("persistentvolumeclaims") {
            return Ok(());
        }
        let named = obj
            .get("spec")
            .and_then(|s| s.get("storageClassName"))
            .is_some_and(|c| !c.is_null())
            || obj
                .get("metadata")
                .and_then(|m| m.get("annotations"))
                .and_then(|a| a.get(BETA_CLASS))
                .is_some();
        if named {
            return Ok(());
        }
        let classes = self
            .classes
            .list_all()
            .await
            .map_err(|e| ApiError::internal(format!("read StorageClasses: {e}")))?;
        let Some(class) = default_class(&classes) else {
            return Ok(());
        };
        if let Some(Value::Object(spec)) = obj.get_mut("spec") {
            spec.insert("storageClassName".into(), Value::String(class));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn class(name: &str, created: &str, default: bool) -> Arc<Object> {
        let mut c = json!({"metadata": {"name": name, "creationTimestamp": created}});
        if default {
            c["metadata"]["annotations"] = json!({IS_DEFAULT_CLASS: "true"});
        }
        match c {
            Value::Object(m) => Arc::new(m),
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_newest_class_marked_default_is_the_default() {
        let classes = [
            class("old", "2024-01-01T00:00:00Z", true),
            class("new", "2025-01-01T00:00:00Z", true),
            class("newest-not-default", "2026-01-01T00:00:00Z", false),
        ];
        assert_eq!(default_class(&classes).as_deref(), Some("new"));
        assert_eq!(default_class(&classes[2..]), None);
    }
}
