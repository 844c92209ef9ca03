//! `DefaultTolerationSeconds`: a new pod that does not tolerate the
//! `node.kubernetes.io/not-ready` and `node.kubernetes.io/unreachable` NoExecute
//! taints gets tolerations of them for 300 s, as Kubernetes' admission plugin gives:
//! when its node stops answering, the pod is evicted after five minutes, not at once.

use async_trait::async_trait;
use serde_json::{Value, json};
use trellis_api::ApiError;

use super::chain::{Admission, Attributes};
use crate::object::Object;

pub const NOT_READY: &str = "node.kubernetes.io/not-ready";
pub const UNREACHABLE: &str = "node.kubernetes.io/unreachable";
/// Kubernetes' `--default-not-ready-toleration-seconds` and
/// `--default-unreachable-toleration-seconds`.
const SECONDS: i64 = 300;

#[derive(Debug)]
pub struct DefaultTolerationSeconds;

/// Whether a toleration covers NoExecute taints with `key`.
fn tolerates(t: &Value, key: &str) -> bool {
    let effect_ok = t["effect"]
        .as_str()
        .is_none_or(|e| e.is_empty() || e == "NoExecute");
    let key_ok = match t["key"].as_str() {
        None | Some("") => t["operator"] == "Exists",
        Some(k) => k == key,
    };
    effect_ok && key_ok
}

#[async_trait]
impl Admission for DefaultTolerationSeconds {
    fn name(&self) -> &str {
        "DefaultTolerationSeconds"
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
        let Some(Value::Object(spec)) = obj.get_mut("spec") else {
            return Ok(());
        };
        let tolerations = spec.entry("tolerations").or_insert_with(|| json!([]));
        let Value::Array(list) = tolerations else {
            return Ok(());
        };
        for key in [NOT_READY, UNREACHABLE] {
            if !list.iter().any(|t| tolerates(t, key)) {
                list.push(json!({
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": SECONDS,
                }));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerations_are_recognised_as_kubernetes_matches_them() {
        assert!(tolerates(
            &json!({"key": NOT_READY, "operator": "Exists"}),
            NOT_READY
        ));
        assert!(tolerates(&json!({"operator": "Exists"}), UNREACHABLE));
        assert!(!tolerates(
            &json!({"key": NOT_READY, "operator": "Exists", "effect": "NoSchedule"}),
            NOT_READY
        ));
        assert!(!tolerates(
            &json!({"key": "other", "operator": "Exists"}),
            NOT_READY
        ));
    }
}
