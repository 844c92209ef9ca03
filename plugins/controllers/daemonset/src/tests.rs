//! The controller against the SDK's harness: a cache of nodes, pods and revisions.

use serde_json::{Value, json};
use trellis_plugin::controller::{Action, Write};
use trellis_plugin::testing::ControllerHarness;

use super::*;

fn node(name: &str, labels: Value, taints: Value) -> Value {
    json!({"metadata": {"name": name, "labels": labels}, "spec": {"taints": taints}})
}

fn ds(template_image: &str) -> Value {
    json!({
        "metadata": {"name": "d", "namespace": "ns", "uid": "ds-uid", "generation": 1},
        "spec": {
            "selector": {"matchLabels": {"app": "d"}},
            "template": {"metadata": {"labels": {"app": "d"}},
                         "spec": {"containers": [{"name": "c", "image": template_image}]}},
        },
    })
}

fn created_pods(h: &ControllerHarness) -> Vec<Value> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            Write::Create {
                resource, object, ..
            } if resource.resource == "pods" => Some(object),
            _ => None,
        })
        .collect()
}

fn deleted_pods(h: &ControllerHarness) -> Vec<String> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            Write::Delete { resource, name, .. } if resource.resource == "pods" => Some(name),
            _ => None,
        })
        .collect()
}

/// A running, ready pod of the DaemonSet on `node` with revision `hash`.
fn running(name: &str, node: &str, hash: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"),
            "labels": {"app": "d", "controller-revision-hash": hash},
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d",
                                 "uid": "ds-uid", "controller": true}]},
           "spec": {"nodeName": node},
           "status": {"phase": "Running", "conditions": [
               {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
}

#[test]
fn one_pod_per_fitting_node_pinned_by_name_with_a_revision() {
    let h = ControllerHarness::new()
        .with_object(daemonsets(), ds("a"))
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(nodes(), node("n2", json!({}), json!([])))
        .with_object(
            nodes(),
            node(
                "n3",
                json!({}),
                json!([{"key": "k", "effect": "NoSchedule"}]),
            ),
        );
    assert_eq!(
        h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d"),
        Ok(Action::Done)
    );
    let pods = created_pods(&h);
    let targets: Vec<String> = pods
        .iter()
        .map(|p| fit::target_node(&p["spec"]).unwrap())
        .collect();
    assert_eq!(targets, ["n1", "n2"]);
    let hash = pods[0]["metadata"]["labels"][HASH_LABEL].as_str().unwrap();
    let revision = h
        .object(&history::revisions(), Some("ns"), &format!("d-{hash}"))
        .expect("the template's revision");
    assert_eq!(revision["revision"], 1);
    assert_eq!(revision["data"], history::patch_of(&ds("a")));
    assert!(
        pods[0]["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "node.kubernetes.io/unschedulable")
    );
    let status = &h.object(&daemonsets(), Some("ns"), "d").unwrap()["status"];
    assert_eq!(status["desiredNumberScheduled"], 2);
    assert_eq!(status["numberUnavailable"], 2);
}

#[test]
fn a_no_execute_taint_removes_the_pod_and_a_changed_template_rolls_one_node_at_a_time() {
    let hash = history::template_hash(&ds("a")["spec"]["template"], None);
    let h = ControllerHarness::new()
        .with_object(daemonsets(), ds("a"))
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(nodes(), node("n2", json!({}), json!([])))
        .with_object(
            nodes(),
            node(
                "n3",
                json!({}),
                json!([{"key": "k", "effect": "NoExecute"}]),
            ),
        )
        .with_object(pods(), running("p1", "n1", &hash))
        .with_object(pods(), running("p2", "n2", &hash))
        .with_object(pods(), running("p3", "n3", &hash));
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    assert_eq!(deleted_pods(&h), ["p3"]);
    assert!(created_pods(&h).is_empty());
    let status = &h.object(&daemonsets(), Some("ns"), "d").unwrap()["status"];
    assert_eq!(status["numberAvailable"], 2);
    assert_eq!(status["updatedNumberScheduled"], 2);

    // A new template: one old pod goes (maxUnavailable 1), the main pass
    // replaces it next.
    let h = h.with_object(daemonsets(), ds("b"));
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    assert_eq!(deleted_pods(&h).len(), 2, "{:?}", deleted_pods(&h));
    let status = &h.object(&daemonsets(), Some("ns"), "d").unwrap()["status"];
    assert!(status["updatedNumberScheduled"].is_null());
}

#[test]
fn a_failed_pod_is_deleted_then_held_back() {
    let hash = history::template_hash(&ds("a")["spec"]["template"], None);
    let mut failed = running("f1", "n1", &hash);
    failed["status"] = json!({"phase": "Failed"});
    let mut ds = ds("a");
    ds["metadata"]["name"] = json!("failing");
    let h = ControllerHarness::new()
        .with_configuration(json!({"failedPodBackoffSeconds": 30}))
        .with_object(daemonsets(), ds)
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(pods(), failed.clone());
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "failing")
        .unwrap();
    assert_eq!(deleted_pods(&h), ["f1"]);
    assert!(h.events().iter().any(|(r, _)| r == "FailedDaemonPod"));
    // Failing again at once: held back, and looked at again when the wait ends.
    let h = h.with_object(pods(), failed);
    let action = h
        .reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "failing")
        .unwrap();
    assert_eq!(deleted_pods(&h), ["f1"]);
    assert!(matches!(action, Action::RequeueAfter(d) if d <= Duration::from_secs(30)));
}

#[test]
fn a_pod_of_the_rolled_back_revision_counts_as_updated() {
    let p = |labels: Value| -> Pod {
        serde_json::from_value(json!({"metadata": {"labels": labels}})).unwrap()
    };
    assert!(p(json!({"controller-revision-hash": "h1"})).is_updated("h1", None));
    assert!(!p(json!({"controller-revision-hash": "h0"})).is_updated("h1", Some("2")));
    assert!(p(json!({"pod-template-generation": "2"})).is_updated("h1", Some("2")));
}

#[test]
fn a_rollback_renumbers_the_old_revision_and_replaces_only_the_stalled_pod() {
    let revision = |ds: &Value, n: i64| {
        let hash = history::template_hash(&ds["spec"]["template"], None);
        json!({"metadata": {"name": format!("d-{hash}"), "namespace": "ns", "uid": format!("rev-{n}"),
                "labels": {"app": "d", "controller-revision-hash": hash},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d",
                                     "uid": "ds-uid", "controller": true}]},
               "data": history::patch_of(ds), "revision": n})
    };
    let (a, b, bad) = (ds("a"), ds("b"), ds("bad"));
    let hash = |d: &Value| history::template_hash(&d["spec"]["template"], None);
    let mut stalled = running("p3", "n3", &hash(&bad));
    stalled["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
    let mut h = ControllerHarness::new()
        .with_object(daemonsets(), b.clone())
        .with_object(history::revisions(), revision(&a, 1))
        .with_object(history::revisions(), revision(&b, 2))
        .with_object(history::revisions(), revision(&bad, 3))
        .with_object(pods(), running("p1", "n1", &hash(&b)))
        .with_object(pods(), running("p2", "n2", &hash(&b)))
        .with_object(pods(), stalled);
    for n in ["n1", "n2", "n3"] {
        h = h.with_object(nodes(), node(n, json!({}), json!([])));
    }
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    let rev = h
        .object(
            &history::revisions(),
            Some("ns"),
            &format!("d-{}", hash(&b)),
        )
        .unwrap();
    assert_eq!(rev["revision"], 4);
    assert_eq!(deleted_pods(&h), ["p3"]);
}

#[test]
fn with_surge_the_new_pod_starts_beside_the_old_which_goes_once_it_is_available() {
    let (a, mut b) = (ds("a"), ds("b"));
    b["spec"]["updateStrategy"] = json!({"type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}});
    let hash = |d: &Value| history::template_hash(&d["spec"]["template"], None);
    let h = ControllerHarness::new()
        .with_object(daemonsets(), b.clone())
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(nodes(), node("n2", json!({}), json!([])))
        .with_object(pods(), running("old1", "n1", &hash(&a)))
        .with_object(pods(), running("old2", "n2", &hash(&a)));
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    // One surge pod, on one node, and no old pod deleted yet.
    let created = created_pods(&h);
    assert_eq!(created.len(), 1);
    assert!(deleted_pods(&h).is_empty());
    let node_of_new = fit::target_node(&created[0]["spec"]).unwrap();
    assert_eq!(
        created[0]["metadata"]["labels"][HASH_LABEL],
        json!(hash(&b))
    );

    // The new pod is available: the old one on its node goes.
    let mut new = running("new1", &node_of_new, &hash(&b));
    new["metadata"]["creationTimestamp"] = json!("2026-01-02T00:00:00Z");
    let h = ControllerHarness::new()
        .with_object(daemonsets(), b.clone())
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(nodes(), node("n2", json!({}), json!([])))
        .with_object(pods(), running("old1", "n1", &hash(&a)))
        .with_object(pods(), running("old2", "n2", &hash(&a)))
        .with_object(pods(), new);
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    let old_there = if node_of_new == "n1" { "old1" } else { "old2" };
    assert_eq!(deleted_pods(&h), [old_there]);
}

#[test]
fn on_delete_leaves_old_pods_until_someone_deletes_them() {
    let (a, mut b) = (ds("a"), ds("b"));
    b["spec"]["updateStrategy"] = json!({"type": "OnDelete"});
    let hash = history::template_hash(&a["spec"]["template"], None);
    let h = ControllerHarness::new()
        .with_object(daemonsets(), b)
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(pods(), running("old1", "n1", &hash));
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    assert!(deleted_pods(&h).is_empty() && created_pods(&h).is_empty());
    let status = &h.object(&daemonsets(), Some("ns"), "d").unwrap()["status"];
    assert_eq!(status["numberAvailable"], 1);
    assert!(status["updatedNumberScheduled"].is_null());
}

#[test]
fn pods_of_a_node_that_is_gone_are_deleted() {
    let hash = history::template_hash(&ds("a")["spec"]["template"], None);
    let h = ControllerHarness::new()
        .with_object(daemonsets(), ds("a"))
        .with_object(nodes(), node("n1", json!({}), json!([])))
        .with_object(pods(), running("p1", "n1", &hash))
        .with_object(pods(), running("gone", "n9", &hash));
    h.reconcile::<DaemonSets>(&daemonsets(), Some("ns"), "d")
        .unwrap();
    assert_eq!(deleted_pods(&h), ["gone"]);
    let status = &h.object(&daemonsets(), Some("ns"), "d").unwrap()["status"];
    assert_eq!(status["desiredNumberScheduled"], 1);
    assert_eq!(status["numberMisscheduled"], 0);
}
