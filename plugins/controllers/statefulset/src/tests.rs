use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::Write;
use trellis_plugin::testing::ControllerHarness;

use super::*;

fn sets() -> GroupVersionResource {
    GroupVersionResource {
        group: "apps".into(),
        version: "v1".into(),
        resource: "statefulsets".into(),
    }
}

fn set(spec: Value) -> Value {
    let mut s = json!({
        "metadata": {"name": "web", "namespace": "ns", "uid": "set-uid", "generation": 1},
        "spec": {
            "replicas": 3,
            "serviceName": "nginx",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": {"containers": [{"name": "c", "image": "nginx"}]}},
        },
    });
    for (k, v) in spec.as_object().into_iter().flatten() {
        s["spec"][k] = v.clone();
    }
    s
}

fn pass(h: &ControllerHarness) -> Result<Action, String> {
    h.reconcile::<StatefulSets>(&sets(), Some("ns"), "web")
}

fn pod_names(h: &ControllerHarness) -> Vec<String> {
    (0..10)
        .filter_map(|i| h.object(&pods(), Some("ns"), &format!("web-{i}")))
        .map(|p| pod::name(&p).to_owned())
        .collect()
}

/// Marks a pod Running and Ready (or not), as its node would.
fn set_ready(h: &ControllerHarness, name: &str, ready: bool) {
    let mut p = h.object(&pods(), Some("ns"), name).expect("pod");
    p["status"] = json!({"phase": "Running", "conditions": [
        {"type": "Ready", "status": if ready { "True" } else { "False" }}]});
    h.clone().with_object(pods(), p);
}

fn status(h: &ControllerHarness) -> Value {
    h.object(&sets(), Some("ns"), "web").unwrap()["status"].clone()
}

#[test]
fn ordinals_are_read_from_names_of_the_set_only() {
    assert_eq!(ordinal("web", "web-0"), Some(0));
    assert_eq!(ordinal("web", "web-12"), Some(12));
    assert_eq!(ordinal("web", "web-x"), None);
    assert_eq!(ordinal("web", "webb-1"), None);
    assert_eq!(ordinal("my-web", "my-web-3"), Some(3));
    assert_eq!(ordinal("web", "web--1"), None);
}

#[test]
fn ordered_ready_makes_one_pod_at_a_time_and_waits_for_it() {
    let h = ControllerHarness::new().with_object(sets(), set(json!({})));
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0"]);
    // Not yet ready: nothing more.
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0"]);
    set_ready(&h, "web-0", true);
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0", "web-1"]);
    set_ready(&h, "web-1", true);
    pass(&h).unwrap();
    set_ready(&h, "web-2", true);
    pass(&h).unwrap();
    let p = h.object(&pods(), Some("ns"), "web-2").unwrap();
    assert_eq!(p["spec"]["hostname"], "web-2");
    assert_eq!(p["spec"]["subdomain"], "nginx");
    assert_eq!(p["metadata"]["labels"][POD_NAME_LABEL], "web-2");
    assert_eq!(p["metadata"]["labels"][POD_INDEX_LABEL], "2");
    assert_eq!(p["metadata"]["labels"]["app"], "web");
    assert!(owned::is_controlled_by(&p, "set-uid"));
    let s = status(&h);
    assert_eq!(s["replicas"], 3);
    assert_eq!(s["readyReplicas"], 3);
    assert_eq!(s["availableReplicas"], 3);
    assert_eq!(s["updatedReplicas"], 3);
    assert_eq!(s["currentReplicas"], 3);
    assert_eq!(s["currentRevision"], s["updateRevision"]);
    assert_eq!(s["observedGeneration"], 1);
    assert_eq!(s["collisionCount"], 0);
    let rev = s["updateRevision"].as_str().unwrap();
    assert!(rev.starts_with("web-"), "{rev}");
    assert_eq!(p["metadata"]["labels"][POD_REVISION_LABEL], rev);
    let r = h
        .object(&revision::controllerrevisions(), Some("ns"), rev)
        .unwrap();
    assert_eq!(r["revision"], 1);
    assert_eq!(r["data"]["spec"]["template"]["$patch"], "replace");
    assert!(owned::is_controlled_by(&r, "set-uid"));
}

#[test]
fn parallel_makes_every_pod_at_once_and_the_ordinals_start_where_asked() {
    let h = ControllerHarness::new().with_object(
        sets(),
        set(json!({"podManagementPolicy": "Parallel", "ordinals": {"start": 5}})),
    );
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-5", "web-6", "web-7"]);
}

#[test]
fn claims_are_made_before_their_pod_and_mounted_by_it() {
    let h = ControllerHarness::new().with_object(
        sets(),
        set(json!({"replicas": 1, "volumeClaimTemplates": [{"metadata": {"name": "www"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}],
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c"}],
                "volumes": [{"name": "www", "emptyDir": {}}, {"name": "other", "emptyDir": {}}]}}})),
    );
    pass(&h).unwrap();
    let writes = h.writes();
    let claim_at = writes
        .iter()
        .position(|w| matches!(w, Write::Create { resource, .. } if resource.resource == "persistentvolumeclaims"))
        .expect("a claim made");
    let pod_at = writes
        .iter()
        .position(|w| matches!(w, Write::Create { resource, .. } if resource.resource == "pods"))
        .expect("a pod made");
    assert!(claim_at < pod_at);
    let c = h.object(&claims(), Some("ns"), "www-web-0").unwrap();
    assert_eq!(c["spec"]["resources"]["requests"]["storage"], "1Gi");
    assert_eq!(c["metadata"]["labels"]["app"], "web");
    assert!(c["metadata"]["ownerReferences"].is_null());
    let p = h.object(&pods(), Some("ns"), "web-0").unwrap();
    let volumes = p["spec"]["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 2);
    assert!(
        volumes
            .contains(&json!({"name": "www", "persistentVolumeClaim": {"claimName": "www-web-0"}}))
    );
}

#[test]
fn scale_down_goes_from_the_highest_ordinal_and_halts_on_an_unhealthy_pod() {
    let h = ControllerHarness::new()
        .with_object(sets(), set(json!({"podManagementPolicy": "Parallel"})));
    pass(&h).unwrap();
    for n in ["web-0", "web-1", "web-2"] {
        set_ready(&h, n, true);
    }
    let mut s = h.object(&sets(), Some("ns"), "web").unwrap();
    s["spec"]["replicas"] = json!(0);
    s["spec"]["podManagementPolicy"] = json!("OrderedReady");
    let h = h.with_object(sets(), s);
    // Every pod unhealthy: only the lowest, web-0, could go, and it is not the
    // highest: nothing goes.
    for n in ["web-0", "web-1", "web-2"] {
        set_ready(&h, n, false);
    }
    pass(&h).unwrap();
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0", "web-1", "web-2"]);
    for n in ["web-0", "web-1", "web-2"] {
        set_ready(&h, n, true);
    }
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0", "web-1"]);
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0"]);
    pass(&h).unwrap();
    assert!(pod_names(&h).is_empty());
}

#[test]
fn a_rolling_update_replaces_from_the_top_down_to_the_partition() {
    let h = ControllerHarness::new().with_object(
        sets(),
        set(json!({"podManagementPolicy": "Parallel",
                   "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}})),
    );
    pass(&h).unwrap();
    for n in ["web-0", "web-1", "web-2"] {
        set_ready(&h, n, true);
    }
    pass(&h).unwrap();
    let old = status(&h)["currentRevision"].as_str().unwrap().to_owned();
    let mut s = h.object(&sets(), Some("ns"), "web").unwrap();
    s["spec"]["template"]["spec"]["containers"][0]["image"] = json!("nginx:2");
    s["metadata"]["generation"] = json!(2);
    let h = h.with_object(sets(), s);
    pass(&h).unwrap();
    // web-2 replaced first; the harness deletes it at once.
    assert_eq!(pod_names(&h), ["web-0", "web-1"]);
    let st = status(&h);
    let new = st["updateRevision"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert_eq!(st["currentRevision"], old.as_str());
    pass(&h).unwrap();
    let p2 = h.object(&pods(), Some("ns"), "web-2").unwrap();
    assert_eq!(p2["spec"]["containers"][0]["image"], "nginx:2");
    assert_eq!(p2["metadata"]["labels"][POD_REVISION_LABEL], new.as_str());
    // Not ready yet: web-1 waits.
    pass(&h).unwrap();
    assert_eq!(pod_names(&h), ["web-0", "web-1", "web-2"]);
    set_ready(&h, "web-2", true);
    pass(&h).unwrap();
    pass(&h).unwrap();
    set_ready(&h, "web-1", true);
    pass(&h).unwrap();
    // web-0 is below the partition: kept at the old revision.
    let p0 = h.object(&pods(), Some("ns"), "web-0").unwrap();
    assert_eq!(p0["metadata"]["labels"][POD_REVISION_LABEL], old.as_str());
    let p1 = h.object(&pods(), Some("ns"), "web-1").unwrap();
    assert_eq!(p1["metadata"]["labels"][POD_REVISION_LABEL], new.as_str());
    let st = status(&h);
    assert_eq!(st["updatedReplicas"], 2);
    assert_eq!(st["currentReplicas"], 1);
    assert_eq!(st["currentRevision"], old.as_str());

    // Back to the first template: the old revision is renumbered the newest.
    let mut s = h.object(&sets(), Some("ns"), "web").unwrap();
    s["spec"]["template"]["spec"]["containers"][0]["image"] = json!("nginx");
    let h = h.with_object(sets(), s);
    pass(&h).unwrap();
    let st = status(&h);
    assert_eq!(st["updateRevision"], old.as_str());
    let r = h
        .object(&revision::controllerrevisions(), Some("ns"), &old)
        .unwrap();
    assert_eq!(r["revision"], 3);
}

#[test]
fn on_delete_replaces_nothing_itself() {
    let h = ControllerHarness::new().with_object(
        sets(),
        set(json!({"podManagementPolicy": "Parallel", "updateStrategy": {"type": "OnDelete"}})),
    );
    pass(&h).unwrap();
    for n in ["web-0", "web-1", "web-2"] {
        set_ready(&h, n, true);
    }
    let mut s = h.object(&sets(), Some("ns"), "web").unwrap();
    s["spec"]["template"]["spec"]["containers"][0]["image"] = json!("nginx:2");
    let h = h.with_object(sets(), s);
    let before = h.writes().len();
    pass(&h).unwrap();
    assert!(
        !h.writes()[before..]
            .iter()
            .any(|w| matches!(w, Write::Delete { resource, .. } if resource.resource == "pods"))
    );
    assert_eq!(status(&h)["updatedReplicas"], Value::Null);
}

#[test]
fn the_retention_policy_owns_claims_by_the_set_or_the_scaled_down_pod() {
    let s = |when_deleted: &str, when_scaled: &str| {
        set(
            json!({"replicas": 2, "persistentVolumeClaimRetentionPolicy":
            {"whenDeleted": when_deleted, "whenScaled": when_scaled}}),
        )
    };
    assert_eq!(retention_owners(&s("Retain", "Retain"), 0), (false, false));
    assert_eq!(retention_owners(&s("Delete", "Retain"), 5), (true, false));
    assert_eq!(retention_owners(&s("Retain", "Delete"), 1), (false, false));
    assert_eq!(retention_owners(&s("Retain", "Delete"), 2), (false, true));
    assert_eq!(retention_owners(&s("Delete", "Delete"), 0), (true, false));
    assert_eq!(retention_owners(&s("Delete", "Delete"), 2), (false, true));

    let set = s("Retain", "Delete");
    let pod = json!({"metadata": {"name": "web-2", "uid": "pod-uid"}});
    let claim = json!({"metadata": {"name": "www-web-2"}});
    let refs = retention_references(&claim, &set, &pod, 2).unwrap();
    assert_eq!(
        refs,
        json!([{"apiVersion": "v1", "kind": "Pod", "name": "web-2", "uid": "pod-uid"}])
    );
    let claim = json!({"metadata": {"name": "www-web-2", "ownerReferences": refs}});
    assert_eq!(retention_references(&claim, &set, &pod, 2), None);
}

#[test]
fn a_matching_orphan_named_as_a_replica_is_adopted_and_others_are_not() {
    let orphan = |name: &str| {
        json!({"metadata": {"name": name, "namespace": "ns", "labels": {"app": "web"}},
               "spec": {}, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})
    };
    let h = ControllerHarness::new()
        .with_object(sets(), set(json!({"replicas": 1})))
        .with_object(pods(), orphan("web-0"))
        .with_object(pods(), orphan("stray"));
    pass(&h).unwrap();
    let adopted: Vec<String> = h
        .writes()
        .iter()
        .filter_map(|w| match w {
            Write::Patch { name, patch, .. }
                if patch["metadata"]["ownerReferences"][0]["uid"] == "set-uid" =>
            {
                Some(name.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(adopted, ["web-0"]);
    let stray = h.object(&pods(), Some("ns"), "stray").unwrap();
    assert!(stray["metadata"]["ownerReferences"].is_null());
}

#[test]
fn an_orphaned_revision_of_the_template_is_adopted_and_reused() {
    let s = set(json!({"replicas": 0}));
    let data = revision::data_of(&s);
    let orphan = json!({"metadata": {"name": "web-old", "namespace": "ns",
        "labels": {"app": "web"}}, "data": data, "revision": 4});
    let h = ControllerHarness::new()
        .with_object(sets(), s)
        .with_object(revision::controllerrevisions(), orphan);
    pass(&h).unwrap();
    let r = h
        .object(&revision::controllerrevisions(), Some("ns"), "web-old")
        .unwrap();
    assert!(owned::is_controlled_by(&r, "set-uid"));
    assert_eq!(status(&h)["updateRevision"], "web-old");
    assert!(
        !h.writes()
            .iter()
            .any(|w| matches!(w, Write::Create { resource, .. } if resource.resource == "controllerrevisions"))
    );
}

#[test]
fn max_unavailable_replaces_that_many_at_once() {
    let h = ControllerHarness::new().with_object(
        sets(),
        set(json!({"replicas": 4, "podManagementPolicy": "Parallel",
                   "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}}})),
    );
    pass(&h).unwrap();
    for n in ["web-0", "web-1", "web-2", "web-3"] {
        set_ready(&h, n, true);
    }
    let mut s = h.object(&sets(), Some("ns"), "web").unwrap();
    s["spec"]["template"]["spec"]["containers"][0]["image"] = json!("nginx:2");
    let h = h.with_object(sets(), s);
    pass(&h).unwrap();
    // web-3 and web-2 replaced together (the harness deletes at once).
    assert_eq!(pod_names(&h), ["web-0", "web-1"]);
}

#[test]
fn a_failed_pod_is_deleted_and_made_again() {
    let h = ControllerHarness::new().with_object(sets(), set(json!({"replicas": 1})));
    pass(&h).unwrap();
    let mut p = h.object(&pods(), Some("ns"), "web-0").unwrap();
    p["status"] = json!({"phase": "Failed"});
    let h = h.with_object(pods(), p);
    pass(&h).unwrap();
    assert!(pod_names(&h).is_empty());
    assert!(
        h.events()
            .iter()
            .any(|(reason, message)| reason == "RecreatingFailedPod"
                && message == "StatefulSet ns/web is recreating failed Pod web-0")
    );
    pass(&h).unwrap();
    let p = h.object(&pods(), Some("ns"), "web-0").unwrap();
    assert!(p["status"].is_null());
}
