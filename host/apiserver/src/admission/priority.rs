//! `Priority`: a new pod's `spec.priority` (and `preemptionPolicy`) comes from its
//! PriorityClass, as Kubernetes' admission plugin sets them: the class its
//! `priorityClassName` names, else the class marked `globalDefault` (whose name the
//! pod then takes), else 0. A class that does not exist, or a `priority` that
//! disagrees with the class, is refused with 403 as Kubernetes refuses it. The
//! scheduler's queue order and preemption read the result.

use async_trait::async_trait;
use serde_json::Value;
use trellis_api::ApiError;
use trellis_store::Store;

use super::chain::{Admission, Attributes};
use crate::object::Object;
use crate::storage::lister::Lister;
use crate::storage::watch_cache::WatchCache;

#[derive(Debug)]
pub struct Priority {
    classes: Lister,
}

impl Default for Priority {
    fn default() -> Self {
        Self {
            classes: Lister::new("scheduling.k8s.io", "priorityclasses"),
        }
    }
}

#[async_trait]
impl Admission for Priority {
    fn name(&self) -> &str {
        "Priority"
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
        let named = obj
            .get("spec")
            .and_then(|s| s.get("priorityClassName"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .map(str::to_owned);
        let failed =
            |e: trellis_store::Error| ApiError::internal(format!("read PriorityClasses: {e}"));
        let forbidden = |reason: String| {
            ApiError::admission_forbidden(
                &attrs.resource.group,
                &attrs.resource.plural,
                attrs.name,
                &reason,
            )
        };
        let class = match &named {
            Some(name) => {
                let key = format!("{}{name}", self.classes.resource_prefix());
                let found = self.classes.get(&key).await.map_err(failed)?;
                Some(found.ok_or_else(|| {
                    forbidden(format!("no PriorityClass with name {name} was found"))
                })?)
            }
            None => self
                .classes
                .list_all()
                .await
                .map_err(failed)?
                .into_iter()
                .filter(|c| c.get("globalDefault") == Some(&Value::Bool(true)))
                // Kubernetes takes the lowest of several defaults.
                .min_by_key(|c| c.get("value").and_then(Value::as_i64).unwrap_or(0)),
        };
        let value = class
            .as_ref()
            .and_then(|c| c.get("value"))
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let Some(Value::Object(spec)) = obj.get_mut("spec") else {
            return Ok(());
        };
        if let Some(given) = spec.get("priority").and_then(Value::as_i64)
            && given != value
        {
            return Err(forbidden(format!(
                "the integer value of priority ({given}) must not be provided in pod spec; priority admission controller computed {value} from the given PriorityClass name"
            )));
        }
        spec.insert("priority".into(), value.into());
        if let Some(class) = &class {
            if named.is_none()
                && let Some(name) = class
                    .get("metadata")
                    .and_then(|m| m.get("name"))
                    .and_then(Value::as_str)
            {
                spec.insert("priorityClassName".into(), name.into());
            }
            if !spec.contains_key("preemptionPolicy")
                && let Some(policy) = class.get("preemptionPolicy")
            {
                spec.insert("preemptionPolicy".into(), policy.clone());
            }
        }
        Ok(())
    }
}
