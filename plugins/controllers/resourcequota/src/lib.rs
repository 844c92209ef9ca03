//! The ResourceQuota controller, as Kubernetes' behaves: every quota's `status.hard`
//! is its `spec.hard`, and its `status.used` what its namespace uses, recounted from
//! the informer caches, so that usage converges after anything that left it wrong
//! (an API server that stopped after a delete and before its recount, a status
//! written by hand).
//!
//! The API server charges creates at admission and recounts after writes
//! (`host/apiserver/src/admission/quota.rs`); the controller counts by the same
//! rules, from the crate both use (`trellis-quota`, in `host/quota`: what an object
//! counts for, which objects a scoped quota counts), and compares *parsed*
//! quantities, so a value the server spelled differently is no difference. It
//! writes only when its count differs from the status, after reading the quota
//! again from the API server and counting again, with an update that carries that
//! read's resourceVersion: a quota the server changed meanwhile answers 409 and the
//! key is looked at again.
//!
//! # The race left
//!
//! A create the server has charged but not yet stored is in no cache, and a cache
//! may not yet show an object the server has stored: a count in that moment is one
//! object short, and a write of it would put `status.used` below the truth. So a
//! status the server's accounting wrote in the current second (its managedFields
//! say when) is left alone for that second; the object's arrival, or the requeue,
//! brings the quota back. What stays wrong longer than that is written over. A
//! create still in flight after that (one that waits long for its initializers) is
//! counted short all the same: the server recounts from its store, charged creates
//! included, after every write of a quota, the controller's own too, so the usage is
//! right again once the controller's write is answered; a create admitted in
//! between, in the same namespace, is judged against the lower usage and may pass a
//! hard limit by what was miscounted. Kubernetes' controller has the same window.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::controller::{
    Action, ObjectKey, Reconcile, ServedResource, cache, client, time,
};
use trellis_plugin::log;
use trellis_plugin::quantity::Quantity;

use trellis_quota::{
    Usage, add, amounts, counted_resource, counted_resources, plural_and_group, selects, to_json,
    usage_of,
};

/// How soon a quota whose status write lost to another writer is looked at again;
/// the other write's change brings it back too.
const CONFLICT_RETRY: Duration = Duration::from_millis(100);

/// The field manager of the API server's quota accounting, and this controller's
/// (the ServiceAccount it writes as): Kubernetes' name for its quota controller.
const MANAGER: &str = "resourcequota-controller";

/// How long a status the accounting wrote is trusted over a different count: the
/// time a charged create takes to be stored and reach the caches, rounded up to the
/// whole seconds managedFields record.
const SETTLE_SECONDS: i64 = 1;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceQuotas {}

/// A quota's usage, as counted from the caches.
#[derive(Debug, Default, PartialEq)]
pub struct Counted {
    /// Every name in `spec.hard`, with what its namespace uses.
    pub used: Usage,
    /// Names counted from a resource the caches do not hold (a `count/` of a resource
    /// discovery has not shown the controller yet): their usage is left as the
    /// status has it, rather than written as zero over the server's count.
    pub uncached: BTreeSet<String>,
}

/// Counts what `quota` uses in `namespace`. `served` is what the caches hold.
///
/// As the server counts: each resource its names count from is listed once, and
/// every object the quota's scopes select adds what it uses to the names the quota
/// has. Objects are added in the server's order (by name), so that a sum is written
/// in the notation the server's would be.
pub fn count(quota: &Value, namespace: &str, served: &[ServedResource]) -> Result<Counted, String> {
    let hard = amounts(quota, "spec", "hard");
    let mut counted = Counted {
        used: hard.keys().map(|n| (n.clone(), Quantity::ZERO)).collect(),
        uncached: BTreeSet::new(),
    };
    for resource in counted_resources(hard.keys()) {
        let (plural, group) = plural_and_group(resource);
        let Some(found) = served
            .iter()
            .find(|s| s.resource.group == group && s.resource.resource == plural)
        else {
            counted.uncached.extend(
                hard.keys()
                    .filter(|n| counted_resource(n) == Some(resource))
                    .cloned(),
            );
            continue;
        };
        // Nothing of a cluster-scoped resource is in a namespace.
        if !found.namespaced {
            continue;
        }
        let mut objects: Vec<Value> = cache::list_as(&found.resource, Some(namespace), "")?;
        objects.sort_by(|a, b| {
            a["metadata"]["name"]
                .as_str()
                .cmp(&b["metadata"]["name"].as_str())
        });
        for obj in objects.iter().filter(|o| selects(quota, group, plural, *o)) {
            add(&mut counted.used, &usage_of(group, plural, obj));
        }
    }
    Ok(counted)
}

/// When the accounting (the server's or this controller's) last wrote `quota`'s
/// status, in seconds since the epoch, if it was the last to write it: a status a
/// person or another tool wrote since is no count to wait for.
pub fn accounted_at(quota: &Value) -> Option<i64> {
    let (mut ours, mut others) = (None, None);
    let entries = quota["metadata"]["managedFields"].as_array();
    for entry in entries.into_iter().flatten() {
        if entry["subresource"] != "status" {
            continue;
        }
        let Some(at) = entry["time"].as_str().and_then(time::parse) else {
            continue;
        };
        let newest = if entry["manager"] == MANAGER {
            &mut ours
        } else {
            &mut others
        };
        *newest = (*newest).max(Some(at));
    }
    ours.filter(|at| others.is_none_or(|other| *at > other))
}

/// The `hard` and `used` `quota`'s status should have, when they differ from what
/// it has (compared as quantities); `None` when it is right.
pub fn correction(quota: &Value, counted: &Counted) -> Option<(Usage, Usage)> {
    let hard = amounts(quota, "spec", "hard");
    let current = amounts(quota, "status", "used");
    let mut used = counted.used.clone();
    for name in &counted.uncached {
        used.insert(name.clone(), current.get(name).copied().unwrap_or_default());
    }
    (amounts(quota, "status", "hard") != hard || current != used).then_some((hard, used))
}

impl Reconcile for ResourceQuotas {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let Some(namespace) = key.namespace.as_deref() else {
            return Ok(Action::Done);
        };
        let Some(cached) = cache::get(&key.resource, Some(namespace), &key.name)? else {
            return Ok(Action::Done);
        };
        let served = cache::resources();
        if correction(&cached, &count(&cached, namespace, &served)?).is_none() {
            return Ok(Action::Done);
        }
        // The cached quota may be behind the server's last charge: what is written is
        // judged against the quota as the server has it now, and held to its version.
        let quota = match client::read(&key.resource, Some(namespace), &key.name) {
            Ok(Some(quota)) => quota,
            Ok(None) => return Ok(Action::Done),
            Err(e) => return Err(format!("read ResourceQuota {namespace}/{}: {e}", key.name)),
        };
        // Counted again after the read: an object the server stored before it answered
        // has had that long to reach the caches, so a lagging cache is seldom taken
        // for usage gone.
        let Some((hard, used)) = correction(&quota, &count(&quota, namespace, &served)?) else {
            return Ok(Action::Done);
        };
        if let Some(at) = accounted_at(&quota) {
            // A clock behind the server's waits no longer than the settling time.
            let wait = (at + SETTLE_SECONDS - time::now()).min(SETTLE_SECONDS);
            if wait > 0 {
                return Ok(Action::RequeueAfter(Duration::from_secs(
                    wait.unsigned_abs(),
                )));
            }
        }
        let was = quota["status"]["used"].to_string();
        let mut update = quota;
        update["status"] = json!({"hard": to_json(&hard), "used": to_json(&used)});
        let used = update["status"]["used"].to_string();
        match client::update_status(&key.resource, Some(namespace), update) {
            Ok(_) => {
                log::with_fields(
                    log::Level::Debug,
                    "quota usage written",
                    &[
                        ("namespace", namespace),
                        ("name", &key.name),
                        ("was", &was),
                        ("used", &used),
                    ],
                );
                Ok(Action::Done)
            }
            Err(e) if e.is_conflict() => Ok(Action::RequeueAfter(CONFLICT_RETRY)),
            Err(e) if e.is_not_found() => Ok(Action::Done),
            Err(e) => Err(format!(
                "update the status of ResourceQuota {namespace}/{}: {e}",
                key.name
            )),
        }
    }
}

trellis_plugin::controller!(ResourceQuotas);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::GroupVersionResource;
    use trellis_plugin::controller::Write;
    use trellis_plugin::testing::ControllerHarness;

    fn core(resource: &str) -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: resource.into(),
        }
    }

    /// A harness that serves pods, configmaps and quotas, with these objects in `ns`.
    fn cluster(objects: &[(&str, Value)]) -> ControllerHarness {
        let mut h = ControllerHarness::new()
            .with_kind("v1", "Pod", core("pods"), true)
            .with_kind("v1", "ConfigMap", core("configmaps"), true)
            .with_kind("v1", "ResourceQuota", core("resourcequotas"), true);
        for (resource, mut obj) in objects.iter().cloned() {
            obj["metadata"]["namespace"] = json!("ns");
            h = h.with_object(core(resource), obj);
        }
        h
    }

    fn quota(name: &str, spec: Value, used: Value) -> (&'static str, Value) {
        let mut hard = spec["hard"].clone();
        if hard.is_null() {
            hard = json!({});
        }
        (
            "resourcequotas",
            json!({"metadata": {"name": name, "resourceVersion": "7"}, "spec": spec,
                   "status": {"hard": hard, "used": used}}),
        )
    }

    fn pod(name: &str, spec: Value, phase: &str) -> (&'static str, Value) {
        (
            "pods",
            json!({"metadata": {"name": name}, "spec": spec, "status": {"phase": phase}}),
        )
    }

    fn sized(cpu: &str) -> Value {
        json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}}]})
    }

    /// Reconciles quota `name`; its status afterwards.
    fn reconcile(h: &ControllerHarness, name: &str) -> Value {
        let done = h.reconcile::<ResourceQuotas>(&core("resourcequotas"), Some("ns"), name);
        assert_eq!(done, Ok(Action::Done));
        h.object(&core("resourcequotas"), Some("ns"), name).unwrap()["status"].clone()
    }

    #[test]
    fn usage_is_recounted_from_the_caches_and_written_with_the_read_version() {
        let h = cluster(&[
            quota(
                "q",
                json!({"hard": {"pods": "10", "count/configmaps": "5", "requests.cpu": "2",
                                "memory": "1Gi", "count/pods": "20", "persistentvolumeclaims": "3"}}),
                // Left too high by a delete the server never recounted.
                json!({"pods": "7"}),
            ),
            pod("a", sized("250m"), "Running"),
            // Its init container runs alone and asks for more than its container.
            pod(
                "b",
                json!({"containers": sized("500m")["containers"],
                "initContainers": [{"name": "i", "resources": {"limits": {"cpu": "1"}}}]}),
                "Pending",
            ),
            // Finished: counted by `count/pods` only.
            pod("done", sized("1"), "Succeeded"),
            ("configmaps", json!({"metadata": {"name": "c1"}})),
            ("configmaps", json!({"metadata": {"name": "c2"}})),
        ]);
        let status = reconcile(&h, "q");
        assert_eq!(
            status["used"],
            json!({"pods": "2", "count/configmaps": "2", "requests.cpu": "1250m",
                   "memory": "128Mi", "count/pods": "3", "persistentvolumeclaims": "0"})
        );
        assert_eq!(status["hard"]["memory"], "1Gi");
        let writes = h.writes();
        assert_eq!(writes.len(), 1);
        let Write::Update { object, status, .. } = &writes[0] else {
            panic!("not an update: {:?}", writes[0]);
        };
        assert!(status, "written through the status subresource");
        assert_eq!(object["metadata"]["resourceVersion"], "7");
    }

    #[test]
    fn a_status_right_but_spelled_otherwise_is_left_alone() {
        let h = cluster(&[
            quota(
                "q",
                json!({"hard": {"requests.cpu": "1", "requests.memory": "1Gi"}}),
                json!({"requests.cpu": "0.5", "requests.memory": "0.125Gi"}),
            ),
            pod("a", sized("500m"), "Running"),
            pod(
                "b",
                json!({"containers": [{"name": "c",
                "resources": {"requests": {"memory": "64Mi"}}}]}),
                "Running",
            ),
        ]);
        reconcile(&h, "q");
        assert!(h.writes().is_empty(), "{:?}", h.writes());
    }

    #[test]
    fn scoped_quotas_count_only_the_pods_their_scopes_select() {
        let deadline = json!({"activeDeadlineSeconds": 30, "priorityClassName": "high",
                              "containers": [{"name": "c"}]});
        let reaching = json!({"containers": [{"name": "c"}], "affinity": {"podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1,
                "podAffinityTerm": {"topologyKey": "zone", "namespaceSelector": {}}}]}}});
        let zero = json!({"pods": "0"});
        let h = cluster(&[
            quota(
                "best-effort",
                json!({"hard": {"pods": "9", "count/configmaps": "9"}, "scopes": ["BestEffort"]}),
                zero.clone(),
            ),
            quota(
                "terminating",
                json!({"hard": {"pods": "9"}, "scopes": ["Terminating", "BestEffort"]}),
                zero.clone(),
            ),
            quota(
                "sized",
                json!({"hard": {"pods": "9"}, "scopes": ["NotBestEffort", "NotTerminating"]}),
                zero.clone(),
            ),
            quota(
                "high",
                json!({"hard": {"pods": "9"}, "scopeSelector": {"matchExpressions": [
                {"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]}}),
                zero.clone(),
            ),
            quota(
                "not-high",
                json!({"hard": {"pods": "9"}, "scopeSelector": {"matchExpressions": [
                {"scopeName": "PriorityClass", "operator": "NotIn", "values": ["high"]}]}}),
                zero.clone(),
            ),
            quota(
                "reaching",
                json!({"hard": {"pods": "9"}, "scopes": ["CrossNamespacePodAffinity"]}),
                zero.clone(),
            ),
            pod("deadline", deadline, "Running"),
            pod("reaching", reaching, "Running"),
            pod("sized", sized("100m"), "Running"),
            ("configmaps", json!({"metadata": {"name": "c"}})),
        ]);
        let used = |name: &str| reconcile(&h, name)["used"].clone();
        // Scoped quotas count pods, never ConfigMaps.
        assert_eq!(
            used("best-effort"),
            json!({"pods": "2", "count/configmaps": "0"})
        );
        assert_eq!(used("terminating"), json!({"pods": "1"}));
        assert_eq!(used("sized"), json!({"pods": "1"}));
        assert_eq!(used("high"), json!({"pods": "1"}));
        assert_eq!(used("not-high"), json!({"pods": "2"}));
        assert_eq!(used("reaching"), json!({"pods": "1"}));
    }

    #[test]
    fn names_of_resources_not_cached_keep_the_usage_the_server_counted() {
        let h = cluster(&[
            quota(
                "q",
                json!({"hard": {"count/widgets.example.com": "5", "configmaps": "5"}}),
                json!({"count/widgets.example.com": "3", "configmaps": "4"}),
            ),
            ("configmaps", json!({"metadata": {"name": "c"}})),
        ]);
        assert_eq!(
            reconcile(&h, "q")["used"],
            json!({"count/widgets.example.com": "3", "configmaps": "1"})
        );
    }

    #[test]
    fn a_status_the_accounting_just_wrote_waits_and_one_written_by_hand_does_not() {
        let entry = |manager: &str, at: i64| {
            json!({"manager": manager, "operation": "Update", "subresource": "status",
                   "time": time::format(at)})
        };
        let wrong = |fields: Value| {
            let (resource, mut q) =
                quota("q", json!({"hard": {"pods": "5"}}), json!({"pods": "2"}));
            q["metadata"]["managedFields"] = fields;
            (resource, q)
        };
        // Just written by the server (whose clock is ahead): a pod may be in flight.
        let ahead = time::now() + 60;
        let h = cluster(&[wrong(json!([entry(MANAGER, ahead)]))]);
        assert_eq!(
            h.reconcile::<ResourceQuotas>(&core("resourcequotas"), Some("ns"), "q"),
            Ok(Action::RequeueAfter(Duration::from_secs(1)))
        );
        assert!(h.writes().is_empty(), "{:?}", h.writes());
        // Written over by someone else since, or long ago: put right at once.
        for fields in [
            json!([entry(MANAGER, ahead), entry("kubectl", ahead)]),
            json!([entry(MANAGER, ahead - 120)]),
        ] {
            let h = cluster(&[wrong(fields)]);
            assert_eq!(reconcile(&h, "q")["used"], json!({"pods": "0"}));
        }
    }

    #[test]
    fn a_new_quota_gets_its_hard_and_used_and_a_deleted_one_nothing() {
        let h = cluster(&[
            (
                "resourcequotas",
                json!({"metadata": {"name": "new"}, "spec": {"hard": {"resourcequotas": "2", "pods": "3"}}}),
            ),
            quota(
                "other",
                json!({"hard": {"pods": "1"}}),
                json!({"pods": "0"}),
            ),
        ]);
        let status = reconcile(&h, "new");
        assert_eq!(status["hard"], json!({"resourcequotas": "2", "pods": "3"}));
        assert_eq!(status["used"], json!({"resourcequotas": "2", "pods": "0"}));
        let gone = h.reconcile::<ResourceQuotas>(&core("resourcequotas"), Some("ns"), "gone");
        assert_eq!(gone, Ok(Action::Done));
        assert_eq!(h.writes().len(), 1);
    }
}
