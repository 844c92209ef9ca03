//! `ServiceAccount`: pods without a service account get the namespace's `default` one.

use async_trait::async_trait;
use serde_json::Value;
use trellis_api::ApiError;

use super::chain::{Admission, Attributes};
use crate::object::Object;

/// Pods without a service account get the namespace's `default` one.
#[derive(Debug)]
pub struct ServiceAccountDefault;

#[async_trait]
impl Admission for ServiceAccountDefault {
    fn name(&self) -> &str {
        "ServiceAccount"
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
        if let Some(Value::Object(spec)) = obj.get_mut("spec") {
            let empty = spec
                .get("serviceAccountName")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty);
            if empty {
                spec.insert("serviceAccountName".into(), "default".into());
                spec.insert("serviceAccount".into(), "default".into());
            }
        }
        Ok(())
    }
}
