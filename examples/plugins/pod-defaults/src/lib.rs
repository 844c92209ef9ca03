//! Pod defaults: a mutating plugin that gives containers without resource requests
//! or limits the configured ones, and sets configured labels on Pods.
//!
//! Configuration (`spec.configuration` of the Plugin object):
//!
//! ```json
//! {
//!   "requests": {"cpu": "100m", "memory": "128Mi"},
//!   "limits": {"memory": "256Mi"},
//!   "labels": {"trellis.dev/defaulted": "true"}
//! }
//! ```
//!
//! A default for a resource (`cpu`, `memory`, ...) applies to a container only when
//! the container names that resource neither in its requests nor in its limits: a
//! default request above the container's own limit (or a default limit below its
//! own request) would make the Pod invalid. Regular and init containers are
//! defaulted; ephemeral containers cannot have resources. Only creates are changed,
//! since a Pod's resources are fixed once it exists.
//!
//! The plugin reads the Pod as plain JSON rather than through `k8s-openapi`, which
//! keeps the component around a sixth of the size.

use std::collections::BTreeMap;

use serde::Deserialize;
use trellis_plugin::{
    Mutate, Operation, Patch, Pointer, Request, Status, Value, json, log, pointer, serde_json,
};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PodDefaults {
    #[serde(default)]
    requests: BTreeMap<String, String>,
    #[serde(default)]
    limits: BTreeMap<String, String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

impl Mutate for PodDefaults {
    fn check_configuration(&self) -> Result<(), String> {
        for (field, map) in [("requests", &self.requests), ("limits", &self.limits)] {
            for (resource, quantity) in map {
                quantity_value(quantity).ok_or_else(|| {
                    format!(
                        "{field}.{resource}: {quantity:?} is not a quantity (e.g. 100m, 128Mi, 1)"
                    )
                })?;
            }
        }
        for (resource, request) in &self.requests {
            if let Some(limit) = self.limits.get(resource)
                && quantity_value(request) > quantity_value(limit)
            {
                return Err(format!(
                    "requests.{resource} ({request}) is above limits.{resource} ({limit})"
                ));
            }
        }
        for (key, value) in &self.labels {
            check_label(key, value)?;
        }
        Ok(())
    }

    fn mutate(&self, req: &Request) -> Result<Option<Patch>, Status> {
        if req.operation != Operation::Create || req.kind.kind != "Pod" {
            return Ok(None);
        }
        let pod = req
            .object()
            .ok_or_else(|| Status::bad_request("create without an object"))?;
        let mut patch = Patch::new();
        for (key, value) in &self.labels {
            patch = patch.set_label(pod, key, value);
        }
        let mut defaulted = Vec::new();
        for list in ["initContainers", "containers"] {
            let containers = pod
                .pointer(&format!("/spec/{list}"))
                .and_then(Value::as_array);
            for (i, container) in containers.into_iter().flatten().enumerate() {
                let before = patch.ops().len();
                patch = self.default_resources(patch, pointer!("spec", list, i), container);
                if patch.ops().len() > before {
                    defaulted.push(
                        container
                            .get("name")
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                    );
                }
            }
        }
        if !defaulted.is_empty() {
            let names = defaulted.join(",");
            log::with_fields(
                log::Level::Debug,
                "defaulted resources",
                &[("pod", &req.display_name()), ("containers", &names)],
            );
        }
        Ok(Some(patch))
    }
}

impl PodDefaults {
    /// Adds the defaults `container` does not mention, creating `resources`,
    /// `requests` or `limits` when missing (a JSON Patch `add` needs the parent).
    fn default_resources(&self, mut patch: Patch, at: Pointer, container: &Value) -> Patch {
        let resources = container.get("resources");
        let mentioned = |resource: &str| {
            ["requests", "limits"].iter().any(|f| {
                resources
                    .and_then(|r| r.get(f))
                    .and_then(|m| m.get(resource))
                    .is_some()
            })
        };
        let missing = |defaults: &BTreeMap<String, String>| -> serde_json::Map<String, Value> {
            defaults
                .iter()
                .filter(|(r, _)| !mentioned(r))
                .map(|(r, q)| (r.clone(), json!(q)))
                .collect()
        };
        let wanted = [
            ("requests", missing(&self.requests)),
            ("limits", missing(&self.limits)),
        ];
        let Some(resources) = resources.filter(|r| r.is_object()) else {
            let whole: serde_json::Map<String, Value> = wanted
                .into_iter()
                .filter(|(_, m)| !m.is_empty())
                .map(|(f, m)| (f.to_owned(), Value::Object(m)))
                .collect();
            if whole.is_empty() {
                return patch;
            }
            return patch.add(at.push("resources"), Value::Object(whole));
        };
        for (field, entries) in wanted {
            if entries.is_empty() {
                continue;
            }
            let base = at.clone().push("resources").push(field);
            if resources.get(field).is_some_and(Value::is_object) {
                for (resource, quantity) in entries {
                    patch = patch.add(base.clone().push(resource), quantity);
                }
            } else {
                patch = patch.add(base, Value::Object(entries));
            }
        }
        patch
    }
}

/// A Kubernetes quantity (`100m`, `1.5Gi`, `2`, `1e3`) as a number, for comparing a
/// request with a limit; `None` when it is not one.
fn quantity_value(q: &str) -> Option<f64> {
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        e => 10f64.powi(e.strip_prefix(['e', 'E'])?.parse().ok()?),
    };
    (number >= 0.0).then_some(number * scale)
}

/// The rules the API server applies to label keys and values, so a bad label fails
/// when the plugin loads instead of on every Pod.
fn check_label(key: &str, value: &str) -> Result<(), String> {
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let (prefix, name) = key
        .rsplit_once('/')
        .map_or((None, key), |(p, n)| (Some(p), n));
    let prefix_ok = prefix.is_none_or(|p| {
        p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    });
    if !name_ok(name) || !prefix_ok {
        return Err(format!("labels: {key:?} is not a valid label key"));
    }
    if !value.is_empty() && !name_ok(value) {
        return Err(format!(
            "labels.{key}: {value:?} is not a valid label value"
        ));
    }
    Ok(())
}

trellis_plugin::mutating!(PodDefaults);

#[cfg(test)]
mod tests {
    use trellis_plugin::testing::{self, Harness};

    use super::*;

    fn harness() -> Harness {
        Harness::new().with_configuration(json!({
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "256Mi"},
            "labels": {"trellis.dev/defaulted": "true"}
        }))
    }

    #[test]
    fn defaults_what_each_container_leaves_out() {
        let a =
            harness().mutate::<PodDefaults>(testing::create(testing::fixture("testdata/pod.json")));
        assert!(a.is_allowed());
        let pod = a.patched_object();
        let resources = |list: &str, i: usize| pod["spec"][list][i]["resources"].clone();
        // No resources at all: everything.
        assert_eq!(
            resources("containers", 0),
            json!({"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}})
        );
        // Own memory limit: memory untouched (a default request could exceed it), cpu defaulted.
        assert_eq!(
            resources("containers", 1),
            json!({"limits": {"memory": "64Mi"}, "requests": {"cpu": "100m"}})
        );
        // Everything set: unchanged.
        assert_eq!(
            resources("containers", 2),
            json!({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}})
        );
        // Init containers too; an empty requests map gets entries added into it.
        assert_eq!(
            resources("initContainers", 0),
            json!({"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}})
        );
        assert_eq!(
            pod["metadata"]["labels"],
            json!({"app": "web", "trellis.dev/defaulted": "true"})
        );
    }

    #[test]
    fn only_creates_of_pods_are_changed() {
        let pod = testing::fixture("testdata/pod.json");
        let h = harness();
        assert_eq!(
            h.mutate::<PodDefaults>(testing::update(pod.clone(), pod.clone()))
                .patch(),
            None
        );
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        assert_eq!(h.mutate::<PodDefaults>(testing::create(cm)).patch(), None);
    }

    #[test]
    fn a_pod_that_has_everything_gets_no_patch() {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"trellis.dev/defaulted": "true"}},
            "spec": {"containers": [{"name": "a", "image": "x", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]}
        });
        assert_eq!(
            harness()
                .mutate::<PodDefaults>(testing::create(pod))
                .patch(),
            None
        );
    }

    #[test]
    fn checks_the_configuration() {
        let check = |c: Value| {
            Harness::new()
                .with_configuration(c)
                .mutate_configuration::<PodDefaults>()
        };
        assert!(check(json!({})).is_ok());
        assert!(check(json!({"requests": {"cpu": "1.5"}, "limits": {"cpu": "2"}})).is_ok());
        assert!(
            check(json!({"requests": {"cpu": "lots"}}))
                .unwrap_err()
                .contains("requests.cpu: \"lots\" is not a quantity")
        );
        assert_eq!(
            check(json!({"requests": {"memory": "1Gi"}, "limits": {"memory": "512Mi"}})),
            Err("configuration: requests.memory (1Gi) is above limits.memory (512Mi)".into())
        );
        assert!(
            check(json!({"labels": {"bad key!": "x"}}))
                .unwrap_err()
                .contains("not a valid label key")
        );
        assert!(
            check(json!({"labels": {"ok": "not ok/"}}))
                .unwrap_err()
                .contains("not a valid label value")
        );
        assert!(
            check(json!({"label": {}}))
                .unwrap_err()
                .contains("unknown field `label`")
        );
    }

    #[test]
    fn quantities_compare_by_value() {
        assert_eq!(quantity_value("100m"), Some(0.1));
        assert_eq!(quantity_value("1Ki"), Some(1024.0));
        assert_eq!(quantity_value("1e3"), Some(1000.0));
        assert!(quantity_value("1Gi") > quantity_value("1000M"));
        assert_eq!(quantity_value("Mi"), None);
        assert_eq!(quantity_value("-1"), None);
    }
}
