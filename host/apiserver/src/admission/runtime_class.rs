//! `RuntimeClass`: a new pod that names a RuntimeClass gets what the class asks of
//! scheduling and resources, as Kubernetes' admission plugin does: the class's
//! `scheduling.nodeSelector` merged into the pod's (a key the pod already sets to
//! another value is refused), its `scheduling.tolerations` added, and its
//! `overhead.podFixed` as the pod's `overhead` (a pod that sets another is refused).
//! A class that does not exist is refused with 403.
//!
//! Trellis' own classes (`wasmtime`, `process`) select the nodes whose agent reports
//! the handler (the label `handler.trellis.dev/NAME: "true"`), so that a pod only
//! lands on a node that can run it.

use async_trait::async_trait;
use serde_json::{Map, Value};
use trellis_api::ApiError;
use trellis_store::Store;

use super::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

#[derive(Debug)]
pub struct RuntimeClass {
    classes: Lister,
}

impl Default for RuntimeClass {
    fn default() -> Self {
        Self {
            classes: Lister::new("node.k8s.io", "runtimeclasses"),
        }
    }
}

#[async_trait]
impl Admission for RuntimeClass {
    fn name(&self) -> &str {
        "RuntimeClass"
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
        if !attrs.creates_core("pods") {
            return Ok(());
        }
        let Some(name) = obj
            .get("spec")
            .and_then(|s| s.get("runtimeClassName"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
        else {
            return Ok(());
        };
        let forbidden = |reason: String| {
            ApiError::admission_forbidden(
                &attrs.resource.group,
                &attrs.resource.plural,
                attrs.name,
                &reason,
            )
        };
        let key = format!("{}{name}", self.classes.resource_prefix());
        let class = self
            .classes
            .get(&key)
            .await
            .map_err(|e| ApiError::internal(format!("read RuntimeClasses: {e}")))?
            .ok_or_else(|| forbidden(format!("pod rejected: RuntimeClass \"{name}\" not found")))?;
        let Some(Value::Object(spec)) = obj.get_mut("spec") else {
            return Ok(());
        };
        apply(spec, &class, &name).map_err(forbidden)
    }
}

/// Merges the class's scheduling and overhead into the pod spec.
fn apply(spec: &mut Map<String, Value>, class: &Object, name: &str) -> Result<(), String> {
    let scheduling = class.get("scheduling");
    if let Some(Value::Object(selector)) = scheduling.and_then(|s| s.get("nodeSelector")) {
        let pod_selector = spec
            .entry("nodeSelector")
            .or_insert_with(|| Value::Object(Map::new()));
        if !pod_selector.is_object() {
            *pod_selector = Value::Object(Map::new());
        }
        if let Value::Object(pod_selector) = pod_selector {
            for (key, value) in selector {
                match pod_selector.get(key) {
                    Some(existing) if existing != value => {
                        return Err(format!(
                            "pod rejected: conflict with RuntimeClass \"{name}\" nodeSelector: {key}={} and {key}={}",
                            existing.as_str().unwrap_or_default(),
                            value.as_str().unwrap_or_default()
                        ));
                    }
                    _ => {
                        pod_selector.insert(key.clone(), value.clone());
                    }
                }
            }
        }
    }
    if let Some(Value::Array(tolerations)) = scheduling.and_then(|s| s.get("tolerations")) {
        let pod_tolerations = spec
            .entry("tolerations")
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(list) = pod_tolerations {
            for t in tolerations {
                if !list.contains(t) {
                    list.push(t.clone());
                }
            }
        }
    }
    if let Some(fixed) = class.get("overhead").and_then(|o| o.get("podFixed")) {
        match spec.get("overhead") {
            Some(given) if given != fixed => {
                return Err(
                    "pod rejected: Pod's Overhead doesn't match RuntimeClass's defined Overhead"
                        .to_owned(),
                );
            }
            _ => {
                spec.insert("overhead".into(), fixed.clone());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn the_class_scheduling_and_overhead_reach_the_pod() {
        let class = obj(json!({"handler": "process",
            "scheduling": {"nodeSelector": {"handler.trellis.dev/process": "true"},
                           "tolerations": [{"key": "k", "operator": "Exists"}]},
            "overhead": {"podFixed": {"memory": "10Mi"}}}));
        let mut spec = obj(json!({"nodeSelector": {"zone": "a"}, "containers": []}));
        apply(&mut spec, &class, "process").unwrap();
        assert_eq!(
            spec["nodeSelector"],
            json!({"zone": "a", "handler.trellis.dev/process": "true"})
        );
        assert_eq!(
            spec["tolerations"],
            json!([{"key": "k", "operator": "Exists"}])
        );
        assert_eq!(spec["overhead"], json!({"memory": "10Mi"}));

        let mut conflicting =
            obj(json!({"nodeSelector": {"handler.trellis.dev/process": "false"}}));
        let err = apply(&mut conflicting, &class, "process").unwrap_err();
        assert!(
            err.contains("conflict with RuntimeClass \"process\""),
            "{err}"
        );
        let mut other_overhead = obj(json!({"overhead": {"memory": "1Mi"}}));
        assert!(apply(&mut other_overhead, &class, "process").is_err());
    }
}
