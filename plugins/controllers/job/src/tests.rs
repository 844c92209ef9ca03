use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{Action, Write};
use trellis_plugin::testing::ControllerHarness;

use super::*;
use crate::pod::FAILURE_COUNT_KEY;

fn jobs() -> GroupVersionResource {
    GroupVersionResource {
        group: "batch".into(),
        version: "v1".into(),
        resource: "jobs".into(),
    }
}

fn job(spec: Value) -> Value {
    let mut spec = spec;
    spec["template"] = json!({"metadata": {"labels": {"batch.kubernetes.io/job-name": "pi"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}});
    json!({"metadata": {"name": "pi", "namespace": "ns", "uid": "job-uid"}, "spec": spec,
        "status": {"startTime": time::format(time::now())}})
}

fn pod(name: &str, phase: &str, extra: Value) -> Value {
    let mut p = json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"),
            "labels": {"batch.kubernetes.io/job-name": "pi"},
            "finalizers": [TRACKING_FINALIZER],
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "pi",
                "uid": "job-uid", "controller": true}]},
        "status": {"phase": phase}});
    json_patch_merge(&mut p, extra);
    p
}

fn json_patch_merge(target: &mut Value, patch: Value) {
    if let (Value::Object(t), Value::Object(p)) = (&mut *target, &patch) {
        for (k, v) in p {
            json_patch_merge(t.entry(k.clone()).or_insert(Value::Null), v.clone());
        }
    } else {
        *target = patch;
    }
}

fn created(h: &ControllerHarness) -> Vec<Value> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            Write::Create { object, .. } => Some(object),
            _ => None,
        })
        .collect()
}

fn deleted(h: &ControllerHarness) -> Vec<String> {
    h.writes()
        .into_iter()
        .filter_map(|w| match w {
            Write::Delete { name, .. } => Some(name),
            _ => None,
        })
        .collect()
}

fn status(h: &ControllerHarness) -> Value {
    h.object(&jobs(), Some("ns"), "pi").unwrap()["status"].clone()
}

fn cond(h: &ControllerHarness, type_: &str) -> Option<Value> {
    status(h)["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

#[test]
fn parallelism_pods_are_made_owned_and_held_by_the_tracking_finalizer() {
    let h = ControllerHarness::new()
        .with_object(jobs(), job(json!({"completions": 5, "parallelism": 3})));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let made = created(&h);
    assert_eq!(made.len(), 3);
    let p = &made[0];
    assert_eq!(p["metadata"]["generateName"], "pi-");
    assert_eq!(p["metadata"]["finalizers"], json!([TRACKING_FINALIZER]));
    assert_eq!(p["metadata"]["ownerReferences"][0]["kind"], "Job");
    assert_eq!(
        p["metadata"]["labels"]["batch.kubernetes.io/job-name"],
        "pi"
    );
    assert_eq!(status(&h)["active"], 3);
    assert_eq!(status(&h)["ready"], 0);
}

#[test]
fn finished_pods_are_counted_once_and_the_job_completes() {
    let h = ControllerHarness::new()
        .with_object(jobs(), job(json!({"completions": 2, "parallelism": 2})))
        .with_object(pods(), pod("a", "Succeeded", json!({})))
        .with_object(pods(), pod("b", "Succeeded", json!({})));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(created(&h).is_empty());
    let s = status(&h);
    assert_eq!(s["succeeded"], 2);
    assert_eq!(s["uncountedTerminatedPods"], json!({}));
    assert_eq!(cond(&h, "Complete").unwrap()["status"], "True");
    assert_eq!(cond(&h, "SuccessCriteriaMet").unwrap()["status"], "True");
    assert!(s["completionTime"].is_string());
    // The finalizers went (the harness merges the directive as a key: it is there).
    let patched = h
        .writes()
        .iter()
        .filter(|w| matches!(w, Write::Patch { .. }))
        .count();
    assert_eq!(patched, 2);
    // A second pass of the finished Job counts nothing again.
    let mut a = h.object(&pods(), Some("ns"), "a").unwrap();
    a["metadata"]["finalizers"] = json!([]);
    let h = h.with_object(pods(), a);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert_eq!(status(&h)["succeeded"], 2);
}

#[test]
fn a_pod_still_held_stays_uncounted_until_its_finalizer_goes() {
    // The uid was recorded by an earlier pass; the finalizer is still there and
    // now goes: it is counted once.
    let mut j = job(json!({"completions": 3, "parallelism": 1}));
    j["status"]["uncountedTerminatedPods"] = json!({"failed": ["a-uid"]});
    j["status"]["failed"] = json!(1);
    let h = ControllerHarness::new()
        .with_configuration(json!({"podFailureBackoffSeconds": 0}))
        .with_object(jobs(), j)
        .with_object(pods(), pod("a", "Failed", json!({})));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let s = status(&h);
    assert_eq!(s["failed"], 2);
    assert_eq!(s["uncountedTerminatedPods"], json!({}));
    assert_eq!(created(&h).len(), 1, "the failed pod replaced");
}

#[test]
fn failures_past_the_backoff_limit_fail_the_job_and_delete_its_pods() {
    let mut j = job(json!({"completions": 3, "parallelism": 2, "backoffLimit": 1}));
    j["status"]["failed"] = json!(1);
    let h = ControllerHarness::new()
        .with_object(jobs(), j)
        .with_object(pods(), pod("a", "Failed", json!({})))
        .with_object(pods(), pod("b", "Running", json!({})));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let target = cond(&h, "FailureTarget").unwrap();
    assert_eq!(target["reason"], "BackoffLimitExceeded");
    assert_eq!(deleted(&h), ["b"]);
    assert!(cond(&h, "Failed").is_none(), "b is not counted yet");
    // b terminates: now it is counted and the Job fails.
    // (The harness removed it at once; the API server marks it.)
    let b = pod(
        "b",
        "Running",
        json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
    );
    let h = ControllerHarness::new()
        .with_object(jobs(), h.object(&jobs(), Some("ns"), "pi").unwrap())
        .with_object(pods(), b);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let failed = cond(&h, "Failed").unwrap();
    assert_eq!(failed["reason"], "BackoffLimitExceeded");
    assert_eq!(
        failed["message"],
        "Job has reached the specified backoff limit"
    );
    assert_eq!(status(&h)["failed"], 3);
    assert!(h.events().iter().any(|(r, _)| r == "BackoffLimitExceeded"));
}

#[test]
fn a_failed_pod_is_replaced_only_after_the_backoff() {
    let now = time::now();
    let failed_at = |secs_ago: i64| {
        json!({"status": {"containerStatuses": [{"name": "c", "state": {"terminated": {
            "exitCode": 1, "finishedAt": time::format(now - secs_ago)}}}]},
            "metadata": {"finalizers": []}})
    };
    let mut j = job(json!({"completions": 1, "parallelism": 1}));
    j["status"]["failed"] = json!(2);
    let h = ControllerHarness::new()
        .with_object(jobs(), j)
        .with_object(pods(), pod("a", "Failed", failed_at(30)))
        .with_object(pods(), pod("b", "Failed", failed_at(5)));
    // Two failures: 20 s after the last one, which was 5 s ago.
    let action = h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let Action::RequeueAfter(wait) = action else {
        panic!("{action:?}")
    };
    assert!(
        wait <= Duration::from_secs(15) && wait > Duration::from_secs(13),
        "{wait:?}"
    );
    assert!(created(&h).is_empty());
    // A shorter back-off set by the configuration has passed.
    let h = h.with_configuration(json!({"podFailureBackoffSeconds": 1}));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert_eq!(created(&h).len(), 1);
}

#[test]
fn indexed_pods_carry_their_index_hostname_and_variable() {
    let mut j = job(json!({"completions": 4, "parallelism": 2, "completionMode": "Indexed"}));
    j["status"]["completedIndexes"] = json!("0");
    j["status"]["succeeded"] = json!(1);
    let h = ControllerHarness::new()
        .with_object(jobs(), j)
        .with_object(
            pods(),
            pod(
                "pi-1-x",
                "Running",
                json!({"metadata": {"annotations": {INDEX_KEY: "1"}}}),
            ),
        )
        .with_object(
            pods(),
            pod(
                "pi-2-y",
                "Succeeded",
                json!({"metadata": {"annotations": {INDEX_KEY: "2"}}}),
            ),
        );
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let made = created(&h);
    assert_eq!(made.len(), 1, "index 3: 1 runs, 0 and 2 are done");
    let p = &made[0];
    assert_eq!(p["metadata"]["generateName"], "pi-3-");
    assert_eq!(p["metadata"]["annotations"][INDEX_KEY], "3");
    assert_eq!(p["metadata"]["labels"][INDEX_KEY], "3");
    assert_eq!(p["spec"]["hostname"], "pi-3");
    assert_eq!(
        p["spec"]["containers"][0]["env"][0]["name"],
        "JOB_COMPLETION_INDEX"
    );
    assert_eq!(
        p["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        format!("metadata.annotations['{INDEX_KEY}']")
    );
    let s = status(&h);
    assert_eq!(s["completedIndexes"], "0,2");
    assert_eq!(s["succeeded"], 2);
}

#[test]
fn the_active_deadline_fails_the_job_and_is_waited_for() {
    let mut j = job(json!({"activeDeadlineSeconds": 100}));
    let h = ControllerHarness::new().with_object(jobs(), j.clone());
    let action = h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(matches!(action, Action::RequeueAfter(d) if d > Duration::from_secs(95)));
    j["status"]["startTime"] = json!(time::format(time::now() - 101));
    let h = ControllerHarness::new().with_object(jobs(), j);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(created(&h).is_empty());
    assert_eq!(cond(&h, "Failed").unwrap()["reason"], "DeadlineExceeded");
}

#[test]
fn a_fail_job_rule_fails_the_job_and_an_ignore_rule_leaves_the_failure_uncounted() {
    let policy = json!({"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
        {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [7]}},
    ]});
    let exited = |code: i64| json!({"status": {"containerStatuses": [{"name": "c", "state": {"terminated": {"exitCode": code}}}]}});
    let h = ControllerHarness::new()
        .with_object(
            jobs(),
            job(json!({"completions": 2, "podFailurePolicy": policy})),
        )
        .with_object(pods(), pod("a", "Failed", exited(7)));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(status(&h).get("failed").is_none(), "{}", status(&h));
    assert_eq!(created(&h).len(), 1);
    let h = ControllerHarness::new()
        .with_object(
            jobs(),
            job(json!({"completions": 2, "podFailurePolicy": policy})),
        )
        .with_object(pods(), pod("a", "Failed", exited(42)));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let failed = cond(&h, "Failed").unwrap();
    assert_eq!(failed["reason"], "PodFailurePolicy");
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .contains("exit code 42 matching FailJob rule at index 0")
    );
}

#[test]
fn a_suspended_job_deletes_its_pods_uncounted_and_resuming_restarts_the_clock() {
    let h = ControllerHarness::new()
        .with_object(jobs(), job(json!({"suspend": true, "parallelism": 1})))
        .with_object(pods(), pod("a", "Running", json!({})));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert_eq!(deleted(&h), ["a"]);
    assert_eq!(cond(&h, "Suspended").unwrap()["status"], "True");
    assert!(status(&h).get("startTime").is_none(), "{}", status(&h));
    // Its deletion seen while suspended: no failure.
    let a = pod(
        "a",
        "Running",
        json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
    );
    let mut j = h.object(&jobs(), Some("ns"), "pi").unwrap();
    j["status"]["startTime"] = json!("2020-01-01T00:00:00Z");
    let h = ControllerHarness::new()
        .with_object(jobs(), j)
        .with_object(pods(), a);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(status(&h).get("failed").is_none(), "{}", status(&h));
    assert!(created(&h).is_empty());
    // Resumed: the clock starts again and a pod is made.
    let mut j = h.object(&jobs(), Some("ns"), "pi").unwrap();
    j["spec"]["suspend"] = json!(false);
    let h = ControllerHarness::new().with_object(jobs(), j);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert_eq!(cond(&h, "Suspended").unwrap()["status"], "False");
    assert_eq!(cond(&h, "Suspended").unwrap()["reason"], "JobResumed");
    assert_ne!(status(&h)["startTime"], "2020-01-01T00:00:00Z");
    assert_eq!(created(&h).len(), 1);
}

#[test]
fn with_a_limit_per_index_an_index_fails_alone_and_its_replacement_counts_failures() {
    let spec = json!({"completions": 3, "parallelism": 3, "completionMode": "Indexed",
        "backoffLimitPerIndex": 1});
    let failed = |name: &str, index: &str, count: &str| {
        pod(
            name,
            "Failed",
            json!({"metadata": {"annotations": {INDEX_KEY: index, FAILURE_COUNT_KEY: count}}}),
        )
    };
    let h = ControllerHarness::new()
        .with_configuration(json!({"podFailureBackoffSeconds": 0}))
        .with_object(jobs(), job(spec.clone()))
        // Index 0 failed a second time: past its limit of 1.
        .with_object(pods(), failed("pi-0-b", "0", "1"))
        // Index 1 failed once: it runs again, its pod saying so.
        .with_object(pods(), failed("pi-1-a", "1", "0"))
        .with_object(
            pods(),
            pod(
                "pi-2-a",
                "Succeeded",
                json!({"metadata": {"annotations": {INDEX_KEY: "2"}}}),
            ),
        );
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    let s = status(&h);
    assert_eq!(s["failedIndexes"], "0", "{s}");
    assert_eq!(s["completedIndexes"], "2");
    assert_eq!(s["failed"], 2);
    assert!(
        cond(&h, "Failed").is_none(),
        "the backoffLimit (6) does not apply: {s}"
    );
    let made = created(&h);
    assert_eq!(made.len(), 1);
    assert_eq!(made[0]["metadata"]["annotations"][INDEX_KEY], "1");
    assert_eq!(made[0]["metadata"]["annotations"][FAILURE_COUNT_KEY], "1");

    // Index 1 fails again too: every index done, some failed.
    let mut j = h.object(&jobs(), Some("ns"), "pi").unwrap();
    j["spec"]["maxFailedIndexes"] = json!(5);
    let h = ControllerHarness::new()
        .with_object(jobs(), j)
        .with_object(pods(), failed("pi-1-b", "1", "1"));
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert_eq!(status(&h)["failedIndexes"], "0-1");
    assert_eq!(cond(&h, "Failed").unwrap()["reason"], "FailedIndexes");
}

#[test]
fn the_pods_of_a_deleted_job_are_let_go_even_without_its_label() {
    let mut unlabelled = pod("b", "Running", json!({}));
    unlabelled["metadata"]["labels"] = json!({"app": "manual"});
    let h = ControllerHarness::new().with_object(pods(), unlabelled);
    h.reconcile::<Jobs>(&jobs(), Some("ns"), "pi").unwrap();
    assert!(matches!(
        &h.writes()[..],
        [Write::Patch { name, patch, .. }]
            if name == "b" && patch["metadata"]["$deleteFromPrimitiveList/finalizers"][0] == TRACKING_FINALIZER
    ));
}
