//! Label selectors as Kubernetes evaluates them (`metav1.LabelSelectorAsSelector`,
//! `labels.Requirement`, node selector requirements), read straight from the API
//! types so that matching allocates nothing: the plugins evaluate selectors of every
//! pod on every node in a cycle.

use std::collections::BTreeMap;

use trellis_plugin::k8s::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Where a selector reads labels from: an object's labels, or a namespace's.
pub trait Labels {
    fn label(&self, key: &str) -> Option<&str>;
}

impl Labels for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl<T: Labels> Labels for Option<&T> {
    fn label(&self, key: &str) -> Option<&str> {
        self.and_then(|l| l.label(key))
    }
}

/// The labels of a namespace as far as the scheduler can know them without seeing
/// Namespace objects: the `kubernetes.io/metadata.name` label the API server sets on
/// every namespace.
pub struct NamespaceLabels<'a>(pub &'a str);

/// The label the API server gives every namespace, its name.
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

impl Labels for NamespaceLabels<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        (key == NAMESPACE_NAME_LABEL).then_some(self.0)
    }
}

/// Whether `labels` satisfy `selector`. A missing selector selects nothing and an
/// empty one everything, as `LabelSelectorAsSelector` makes them; a selector
/// Kubernetes would refuse to parse (an unknown operator, `In` without values)
/// selects nothing.
pub fn matches(selector: Option<&LabelSelector>, labels: &impl Labels) -> bool {
    let Some(selector) = selector else {
        return false;
    };
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.label(k) == Some(v.as_str()));
    labels_ok
        && selector.match_expressions.iter().flatten().all(|r| {
            requirement(
                &r.key,
                &r.operator,
                r.values.as_deref().unwrap_or_default(),
                labels,
                false,
            )
            .unwrap_or(false)
        })
}

/// Whether the selector has no requirement at all (`labels.Everything()`); the
/// topology spread counts no pod for such a selector.
pub fn is_everything(selector: Option<&LabelSelector>) -> bool {
    selector.is_some_and(|s| {
        s.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
            && s.match_expressions.as_ref().is_none_or(Vec::is_empty)
    })
}

/// One requirement: `Ok(matched)`, or `Err` where Kubernetes would refuse the
/// requirement. `numeric` admits `Gt` and `Lt`, which only node selectors have.
pub fn requirement(
    key: &str,
    operator: &str,
    values: &[String],
    labels: &impl Labels,
    numeric: bool,
) -> Result<bool, ()> {
    let value = labels.label(key);
    match operator {
        "In" | "NotIn" => {
            if values.is_empty() {
                return Err(());
            }
            let found = value.is_some_and(|v| values.iter().any(|w| w == v));
            Ok(found == (operator == "In"))
        }
        "Exists" | "DoesNotExist" => {
            if !values.is_empty() {
                return Err(());
            }
            Ok(value.is_some() == (operator == "Exists"))
        }
        "Gt" | "Lt" if numeric => {
            let [bound] = values else {
                return Err(());
            };
            let bound: i64 = bound.parse().map_err(|_| ())?;
            let Some(Ok(value)) = value.map(str::parse::<i64>) else {
                return Ok(false);
            };
            Ok(if operator == "Gt" {
                value > bound
            } else {
                value < bound
            })
        }
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn selector(v: serde_json::Value) -> LabelSelector {
        serde_json::from_value(v).expect("a selector")
    }

    #[test]
    fn selectors_match_as_kubernetes_parses_them() {
        let labels: BTreeMap<String, String> =
            [("app".to_owned(), "web".to_owned())].into_iter().collect();
        let l = Some(&labels);
        assert!(!matches(None, &l), "a missing selector selects nothing");
        assert!(
            matches(Some(&selector(json!({}))), &l),
            "an empty one everything"
        );
        assert!(is_everything(Some(&selector(json!({})))));
        assert!(matches(
            Some(&selector(json!({"matchLabels": {"app": "web"}}))),
            &l
        ));
        let not_in = selector(json!({"matchExpressions": [
            {"key": "tier", "operator": "NotIn", "values": ["db"]}]}));
        assert!(
            matches(Some(&not_in), &l),
            "NotIn holds where the label is missing"
        );
        let empty_in = selector(json!({"matchExpressions": [{"key": "app", "operator": "In"}]}));
        assert!(
            !matches(Some(&empty_in), &l),
            "In without values does not parse"
        );
        assert_eq!(
            requirement("n", "Gt", &["3".into()], &NamespaceLabels("x"), true),
            Ok(false)
        );
        assert_eq!(requirement("a", "Gt", &["3".into()], &l, false), Err(()));
        let ns = selector(json!({"matchLabels": {"kubernetes.io/metadata.name": "prod"}}));
        assert!(matches(Some(&ns), &NamespaceLabels("prod")));
        assert!(!matches(Some(&ns), &NamespaceLabels("dev")));
    }
}
