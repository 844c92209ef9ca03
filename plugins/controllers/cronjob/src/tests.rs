use serde_json::{Value, json};
use trellis_plugin::controller::Write;
use trellis_plugin::testing::ControllerHarness;

use super::*;

fn cronjobs() -> GroupVersionResource {
    GroupVersionResource {
        group: "batch".into(),
        version: "v1".into(),
        resource: "cronjobs".into(),
    }
}

fn ago(secs: i64) -> String {
    format_time(Timestamp::from_second(Timestamp::now().as_second() - secs).unwrap())
}

fn cronjob(spec: Value, status: Value) -> Value {
    let mut spec = spec;
    spec["jobTemplate"] = json!({"metadata": {"labels": {"app": "tick"}},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}});
    json!({"metadata": {"name": "tick", "namespace": "ns", "uid": "cj-uid", "creationTimestamp": ago(3600)},
        "spec": spec, "status": status})
}

fn child(name: &str, finished: Option<(&str, i64)>) -> Value {
    let mut j = json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("{name}-uid"),
            "creationTimestamp": ago(100),
            "annotations": {SCHEDULED_TIMESTAMP: "x"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob", "name": "tick",
                "uid": "cj-uid", "controller": true}]},
        "status": {}});
    if let Some((how, secs)) = finished {
        j["status"] = json!({"startTime": ago(secs + 10), "completionTime": ago(secs),
            "conditions": [{"type": how, "status": "True"}]});
    }
    j
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
    let mut names: Vec<String> = h
        .writes()
        .into_iter()
        .filter_map(|w| match w {
            Write::Delete { name, .. } => Some(name),
            _ => None,
        })
        .collect();
    names.sort();
    names
}

fn status(h: &ControllerHarness) -> Value {
    h.object(&cronjobs(), Some("ns"), "tick").unwrap()["status"].clone()
}

fn reconcile(h: &ControllerHarness) -> Action {
    h.reconcile::<CronJobs>(&cronjobs(), Some("ns"), "tick")
        .unwrap()
}

#[test]
fn a_run_due_starts_its_job_named_after_its_minute_and_the_next_is_waited_for() {
    let h = ControllerHarness::new().with_object(
        cronjobs(),
        cronjob(
            json!({"schedule": "* * * * *"}),
            json!({"lastScheduleTime": ago(120)}),
        ),
    );
    let action = reconcile(&h);
    let made = created(&h);
    assert_eq!(made.len(), 1, "only the latest missed run");
    let job = &made[0];
    let minute = Timestamp::now().as_second().div_euclid(60);
    assert_eq!(job["metadata"]["name"], format!("tick-{minute}"));
    assert_eq!(job["metadata"]["labels"]["app"], "tick");
    assert_eq!(job["metadata"]["ownerReferences"][0]["kind"], "CronJob");
    let stamp = job["metadata"]["annotations"][SCHEDULED_TIMESTAMP]
        .as_str()
        .unwrap();
    assert_eq!(
        stamp,
        format_time(Timestamp::from_second(minute * 60).unwrap())
    );
    assert_eq!(job["spec"]["template"]["spec"]["restartPolicy"], "Never");
    let s = status(&h);
    assert_eq!(s["lastScheduleTime"], stamp);
    assert_eq!(s["active"][0]["name"], format!("tick-{minute}"));
    let Action::RequeueAfter(wait) = action else {
        panic!("{action:?}")
    };
    assert!(wait <= Duration::from_millis(60_100), "{wait:?}");
}

#[test]
fn the_scheduled_timestamp_is_written_in_the_time_zone() {
    let cj = cronjob(
        json!({"schedule": "0 9 * * *", "timeZone": "Europe/Paris"}),
        json!({}),
    );
    let tz = time_zone(Some("Europe/Paris")).unwrap();
    let t: Timestamp = "2026-01-10T08:00:00Z".parse().unwrap();
    let job = job_for(&cj, t, &tz);
    assert_eq!(
        job["metadata"]["annotations"][SCHEDULED_TIMESTAMP],
        "2026-01-10T09:00:00+01:00"
    );
    assert_eq!(
        job["metadata"]["name"],
        format!("tick-{}", t.as_second() / 60)
    );
}

#[test]
fn forbid_skips_a_run_while_a_job_is_active_and_replace_deletes_it() {
    let active = json!({"active": [{"name": "tick-1", "namespace": "ns", "uid": "tick-1-uid"}],
        "lastScheduleTime": ago(120)});
    let h = ControllerHarness::new()
        .with_object(
            cronjobs(),
            cronjob(
                json!({"schedule": "* * * * *", "concurrencyPolicy": "Forbid"}),
                active.clone(),
            ),
        )
        .with_object(jobs(), child("tick-1", None));
    reconcile(&h);
    assert!(created(&h).is_empty());
    assert!(h.events().iter().any(|(r, _)| r == "JobAlreadyActive"));
    let h = ControllerHarness::new()
        .with_object(
            cronjobs(),
            cronjob(
                json!({"schedule": "* * * * *", "concurrencyPolicy": "Replace"}),
                active,
            ),
        )
        .with_object(jobs(), child("tick-1", None));
    reconcile(&h);
    assert_eq!(deleted(&h), ["tick-1"]);
    assert_eq!(created(&h).len(), 1);
    assert_eq!(status(&h)["active"].as_array().unwrap().len(), 1);
    assert_ne!(status(&h)["active"][0]["name"], "tick-1");
}

#[test]
fn a_suspended_cronjob_starts_nothing() {
    let h = ControllerHarness::new().with_object(
        cronjobs(),
        cronjob(
            json!({"schedule": "* * * * *", "suspend": true}),
            json!({"lastScheduleTime": ago(600)}),
        ),
    );
    assert_eq!(reconcile(&h), Action::Done);
    assert!(created(&h).is_empty());
}

#[test]
fn finished_jobs_leave_the_active_list_and_old_ones_go_beyond_the_limits() {
    let status = json!({"active": [{"name": "ok-4", "namespace": "ns", "uid": "ok-4-uid"}],
        "lastScheduleTime": ago(30)});
    let h = ControllerHarness::new()
        .with_object(
            cronjobs(),
            cronjob(json!({"schedule": "0 0 1 1 *", "successfulJobsHistoryLimit": 2, "failedJobsHistoryLimit": 1}), status),
        )
        .with_object(jobs(), child("ok-1", Some(("Complete", 400))))
        .with_object(jobs(), child("ok-2", Some(("Complete", 300))))
        .with_object(jobs(), child("ok-3", Some(("Complete", 200))))
        .with_object(jobs(), child("ok-4", Some(("Complete", 100))))
        .with_object(jobs(), child("bad-1", Some(("Failed", 350))))
        .with_object(jobs(), child("bad-2", Some(("Failed", 250))));
    reconcile(&h);
    assert_eq!(deleted(&h), ["bad-1", "ok-1", "ok-2"]);
    let s = self::status(&h);
    assert!(s.get("active").is_none(), "{s}");
    assert_eq!(s["lastSuccessfulTime"], ago(100));
    assert!(
        h.events()
            .iter()
            .any(|(r, m)| r == "SawCompletedJob" && m.contains("ok-4"))
    );
}

#[test]
fn a_run_older_than_the_starting_deadline_is_missed_and_too_many_are_reported() {
    // Every hour; the last at least a minute ago, beyond a 10 s deadline.
    let now = Timestamp::now().as_second();
    let minute = now.rem_euclid(3600) / 60;
    if minute == 0 {
        return; // the run is this very minute: nothing missed to see
    }
    let h = ControllerHarness::new().with_object(
        cronjobs(),
        cronjob(
            json!({"schedule": "0 * * * *", "startingDeadlineSeconds": 10}),
            json!({}),
        ),
    );
    reconcile(&h);
    assert!(created(&h).is_empty());
    // Without a deadline, a year of runs missed: the latest starts, with a warning.
    let mut cj = cronjob(json!({"schedule": "0 * * * *"}), json!({}));
    cj["metadata"]["creationTimestamp"] = json!(ago(366 * 86_400));
    let h = ControllerHarness::new().with_object(cronjobs(), cj);
    reconcile(&h);
    assert_eq!(created(&h).len(), 1);
    assert!(h.events().iter().any(|(r, _)| r == "TooManyMissedTimes"));
}
