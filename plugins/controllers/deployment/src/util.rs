//! What the controller reads and computes of Deployments and ReplicaSets
//! (Kubernetes' `deployment/util`): the annotations, the template hash, the
//! fenceposts of a rolling update, and [`Set`], a ReplicaSet as the passes read it.

use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;

pub const REVISION: &str = "deployment.kubernetes.io/revision";
pub(crate) const REVISION_HISTORY: &str = "deployment.kubernetes.io/revision-history";
pub(crate) const DESIRED_REPLICAS: &str = "deployment.kubernetes.io/desired-replicas";
pub(crate) const MAX_REPLICAS: &str = "deployment.kubernetes.io/max-replicas";
pub const HASH_LABEL: &str = "pod-template-hash";
/// Annotations of the Deployment not copied to its ReplicaSets.
pub(crate) const NOT_COPIED: [&str; 5] = [
    "kubectl.kubernetes.io/last-applied-configuration",
    REVISION,
    REVISION_HISTORY,
    DESIRED_REPLICAS,
    MAX_REPLICAS,
];

pub(crate) fn replicasets() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "replicasets".into(),
    }
}

/// FNV-1a, 32 bits.
pub(crate) fn fnv32a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// The hash of a template (and collision count) as the label value Kubernetes uses:
/// the decimal digits mapped onto consonants and digits that spell no words.
pub fn template_hash(template: &Value, collision_count: Option<i64>) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    // serde_json's maps are sorted: the same template always hashes the same.
    let mut text = template.to_string();
    if let Some(c) = collision_count {
        text.push_str(&c.to_string());
    }
    fnv32a(text.as_bytes())
        .to_string()
        .bytes()
        .map(|b| char::from(ALPHANUMS[usize::from(b) % ALPHANUMS.len()]))
        .collect()
}

/// Whether two templates are the same but for `pod-template-hash`.
pub fn same_template(a: &Value, b: &Value) -> bool {
    let strip = |t: &Value| {
        let mut t = t.clone();
        if let Some(labels) = t["metadata"]["labels"].as_object_mut() {
            labels.remove(HASH_LABEL);
        }
        t
    };
    strip(a) == strip(b)
}

/// A count or a percentage of `total` (`"25%"`), rounded up or down.
pub fn scaled(value: &Value, total: i64, round_up: bool) -> Result<i64, String> {
    match value {
        Value::Null => Ok(0),
        Value::Number(n) => n.as_i64().ok_or_else(|| format!("{n}: not an integer")),
        Value::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("{s:?}: not a count or a percentage"))?;
            let x = pct * total;
            Ok(if round_up { (x + 99) / 100 } else { x / 100 })
        }
        other => Err(format!("{other}: not a count or a percentage")),
    }
}

/// The Deployment's `(maxSurge, maxUnavailable)` as counts; both 0 would never
/// progress, so unavailability is then 1, as Kubernetes resolves them.
pub fn fenceposts(d: &Value) -> Result<(i64, i64), String> {
    let rolling = &d["spec"]["strategy"]["rollingUpdate"];
    let replicas = replicas_of(d);
    let default = json!("25%");
    let surge = rolling.get("maxSurge").unwrap_or(&default);
    let unavailable = rolling.get("maxUnavailable").unwrap_or(&default);
    let surge = scaled(surge, replicas, true).map_err(|e| format!("maxSurge: {e}"))?;
    let unavailable =
        scaled(unavailable, replicas, false).map_err(|e| format!("maxUnavailable: {e}"))?;
    Ok(if surge == 0 && unavailable == 0 {
        (0, 1)
    } else {
        (surge, unavailable.min(replicas))
    })
}

pub(crate) fn replicas_of(d: &Value) -> i64 {
    d["spec"]["replicas"].as_i64().unwrap_or(1)
}

pub(crate) fn is_rolling(d: &Value) -> bool {
    d["spec"]["strategy"]["type"].as_str() != Some("Recreate")
}

/// What the controller reads of a ReplicaSet.
#[derive(Clone, Debug)]
pub struct Set {
    pub object: Value,
    pub name: String,
    pub replicas: i64,
    pub status_replicas: i64,
    pub ready: i64,
    pub available: i64,
    pub revision: i64,
    pub(crate) created: String,
}

impl Set {
    pub fn new(object: Value) -> Self {
        let int = |v: &Value| v.as_i64().unwrap_or(0);
        Self {
            name: object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            replicas: int(&object["spec"]["replicas"]),
            status_replicas: int(&object["status"]["replicas"]),
            ready: int(&object["status"]["readyReplicas"]),
            available: int(&object["status"]["availableReplicas"]),
            revision: annotation(&object, REVISION)
                .and_then(|r| r.parse().ok())
                .unwrap_or(0),
            created: object["metadata"]["creationTimestamp"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            object,
        }
    }

    pub(crate) fn annotated(&self, key: &str) -> Option<i64> {
        annotation(&self.object, key).and_then(|v| v.parse().ok())
    }
}

pub(crate) fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj["metadata"]["annotations"][key].as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn surge_rounds_up_and_unavailability_down() {
        let d = |surge: Value, unavailable: Value, replicas: i64| {
            json!({"spec": {"replicas": replicas, "strategy": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}}})
        };
        assert_eq!(
            fenceposts(&d(json!("25%"), json!("25%"), 10)).unwrap(),
            (3, 2)
        );
        assert_eq!(fenceposts(&d(json!(0), json!(0), 10)).unwrap(), (0, 1));
        assert_eq!(fenceposts(&d(json!(2), json!("100%"), 4)).unwrap(), (2, 4));
        assert_eq!(
            fenceposts(&json!({"spec": {"replicas": 1000}})).unwrap(),
            (250, 250)
        );
        assert!(fenceposts(&d(json!("x"), json!(1), 1)).is_err());
    }

    #[test]
    fn the_hash_is_stable_ignores_the_hash_label_and_changes_with_collisions() {
        let t = json!({"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
        let h = template_hash(&t, None);
        assert_eq!(h, template_hash(&t.clone(), None));
        assert_ne!(h, template_hash(&t, Some(1)));
        assert!(h.chars().all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c)));
        let mut labelled = t.clone();
        labelled["metadata"]["labels"][HASH_LABEL] = json!(h);
        assert!(same_template(&labelled, &t));
        let mut other = t.clone();
        other["spec"]["containers"][0]["image"] = json!("j");
        assert!(!same_template(&other, &t));
    }

    #[test]
    fn fnv_matches_its_reference_values() {
        assert_eq!(fnv32a(b""), 0x811c_9dc5);
        assert_eq!(fnv32a(b"a"), 0xe40c_292c);
        assert_eq!(fnv32a(b"foobar"), 0xbf9c_f968);
    }
}
