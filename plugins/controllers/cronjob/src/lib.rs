//! The CronJob controller, as Kubernetes' cronjob controller (v2) behaves, with the
//! next run due to the second (the key is requeued for that time) rather than
//! checked every 10 s.
//!
//! - A run is the latest scheduled time in `(lastScheduleTime or creation, now]`
//!   in the CronJob's `timeZone`: after a control-plane restart only the latest
//!   missed run is started, with a `TooManyMissedTimes` warning past 100 missed;
//!   a run older than `startingDeadlineSeconds` is missed (`MissSchedule`), and the
//!   deadline also bounds how far back runs are looked for.
//! - Its Job is `<cronjob>-<minutes since the epoch>` from `jobTemplate`, owned by
//!   the CronJob, annotated `batch.kubernetes.io/cronjob-scheduled-timestamp`.
//! - `concurrencyPolicy`: `Allow`; `Forbid` skips a run while a Job is active;
//!   `Replace` deletes the active Jobs first.
//! - `status.active` lists the running Jobs, `lastScheduleTime` the latest run,
//!   `lastSuccessfulTime` the latest completion; finished Jobs beyond
//!   `successfulJobsHistoryLimit` (3) and `failedJobsHistoryLimit` (1) are deleted,
//!   oldest first. `suspend` starts nothing.
//!
//! # Layout
//! - `lib.rs` (Kubernetes' `cronjob_controllerv2.go`): the reconcile: the active
//!   list, history, and the run due.
//! - `schedule`: cron schedules, their next and most recent times in a time zone.

use std::time::Duration;

use jiff::Timestamp;
use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, Propagation, Reconcile, Write, cache, client, events, owned,
};

pub mod schedule;

use schedule::{Schedule, time_zone};

/// The annotation that says which run a Job is.
pub const SCHEDULED_TIMESTAMP: &str = "batch.kubernetes.io/cronjob-scheduled-timestamp";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CronJobs {}

fn jobs() -> GroupVersionResource {
    GroupVersionResource {
        group: "batch".into(),
        version: "v1".into(),
        resource: "jobs".into(),
    }
}

/// `Complete` or `Failed`, when the Job finished.
fn finished(job: &Value) -> Option<&str> {
    job["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| (c["type"] == "Complete" || c["type"] == "Failed") && c["status"] == "True")
        .and_then(|c| c["type"].as_str())
}

fn parse_time(v: &Value) -> Option<Timestamp> {
    v.as_str()?.parse().ok()
}

fn format_time(t: Timestamp) -> String {
    // Whole seconds, as the API server writes times.
    Timestamp::from_second(t.as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// The reference `status.active` holds for a Job.
fn reference(job: &Value) -> Value {
    json!({"apiVersion": "batch/v1", "kind": "Job",
        "name": job["metadata"]["name"], "namespace": job["metadata"]["namespace"],
        "uid": job["metadata"]["uid"], "resourceVersion": job["metadata"]["resourceVersion"]})
}

/// The Job of the run at `t` (its name from `t`'s minutes since the epoch).
pub fn job_for(cj: &Value, t: Timestamp, tz: &jiff::tz::TimeZone) -> Value {
    let template = &cj["spec"]["jobTemplate"];
    let name = cj["metadata"]["name"].as_str().unwrap_or_default();
    let mut metadata = json!({
        "name": format!("{name}-{}", t.as_second().div_euclid(60)),
        "ownerReferences": [owned::controller_reference("batch/v1", "CronJob", cj)],
    });
    if let Some(labels) = template["metadata"].get("labels").filter(|l| l.is_object()) {
        metadata["labels"] = labels.clone();
    }
    let mut annotations = template["metadata"]["annotations"].clone();
    if !annotations.is_object() {
        annotations = json!({});
    }
    // RFC 3339 in the schedule's zone, as Kubernetes writes it.
    annotations[SCHEDULED_TIMESTAMP] = json!(
        t.to_zoned(tz.clone())
            .strftime("%Y-%m-%dT%H:%M:%S%:z")
            .to_string()
            .replace("+00:00", "Z")
    );
    metadata["annotations"] = annotations;
    json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]})
}

impl Reconcile for CronJobs {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(cj) = cache::get(&key.resource, ns, &key.name)? else {
            return Ok(Action::Done);
        };
        if !cj["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let uid = cj["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let children: Vec<Value> = cache::owned_by_as::<Value>(&jobs(), &uid)?
            .into_iter()
            .filter(|j| owned::is_controlled_by(j, &uid))
            .collect();
        let mut status = match &cj["status"] {
            Value::Object(_) => cj["status"].clone(),
            _ => json!({}),
        };
        let mut failures = Vec::new();

        // Active Jobs: those of the list still there and running, plus the runs this
        // controller made that the list missed (a status write lost).
        let listed: Vec<Value> = status["active"].as_array().cloned().unwrap_or_default();
        let mut active: Vec<Value> = Vec::new();
        for r in &listed {
            match children.iter().find(|j| j["metadata"]["uid"] == r["uid"]) {
                Some(j) if finished(j).is_none() => active.push(r.clone()),
                Some(_) => {}
                None => {
                    // The cache may lag behind: only a Job the API server lacks goes.
                    let name = r["name"].as_str().unwrap_or_default();
                    match client::read(&jobs(), ns, name) {
                        Ok(Some(j))
                            if j["metadata"]["uid"] == r["uid"] && finished(&j).is_none() =>
                        {
                            active.push(r.clone());
                        }
                        Ok(_) => events::record(
                            &cj,
                            EventType::Normal,
                            "MissingJob",
                            &format!("Active job went missing: {name}"),
                        ),
                        Err(e) => failures.push(format!("read job {name}: {e}")),
                    }
                }
            }
        }
        for j in &children {
            let listed = active.iter().any(|r| r["uid"] == j["metadata"]["uid"]);
            if listed || finished(j).is_some() {
                continue;
            }
            if j["metadata"]["annotations"][SCHEDULED_TIMESTAMP].is_string() {
                active.push(reference(j));
            } else {
                events::record(
                    &cj,
                    EventType::Warning,
                    "UnexpectedJob",
                    &format!(
                        "Saw a job that the controller did not create or forgot: {}",
                        j["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                );
            }
        }
        // Finished Jobs leave the list; the latest success is remembered.
        for j in &children {
            let Some(how) = finished(j) else { continue };
            if listed.iter().any(|r| r["uid"] == j["metadata"]["uid"]) {
                events::record(
                    &cj,
                    EventType::Normal,
                    "SawCompletedJob",
                    &format!(
                        "Saw completed job: {}, status: {how}",
                        j["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                );
            }
            if how == "Complete"
                && let Some(done) = parse_time(&j["status"]["completionTime"])
                && parse_time(&status["lastSuccessfulTime"]).is_none_or(|t| done > t)
            {
                status["lastSuccessfulTime"] = json!(format_time(done));
            }
        }

        failures.extend(cleanup_history(&cj, &children)?);

        let now = Timestamp::now();
        let mut requeue = None;
        if cj["spec"]["suspend"] != true {
            match self.run(&cj, now, &mut active, &mut status) {
                Ok(next) => requeue = next,
                Err(e) => failures.push(e),
            }
        }
        if active.is_empty() {
            if let Some(o) = status.as_object_mut() {
                o.remove("active");
            }
        } else {
            status["active"] = Value::Array(active);
        }
        if status != cj["status"] {
            let mut object = cj.clone();
            object["status"] = status;
            client::update_status(&key.resource, ns, object)
                .map_err(|e| format!("update the status: {e}"))?;
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(requeue.map_or(Action::Done, Action::RequeueAfter))
    }
}

impl CronJobs {
    /// Starts the run due, if any: when to look again (the next run).
    fn run(
        &self,
        cj: &Value,
        now: Timestamp,
        active: &mut Vec<Value>,
        status: &mut Value,
    ) -> Result<Option<Duration>, String> {
        let spec = &cj["spec"];
        let schedule = match Schedule::parse(spec["schedule"].as_str().unwrap_or_default()) {
            Ok(s) => s,
            Err(e) => {
                events::record(
                    cj,
                    EventType::Warning,
                    "UnparseableSchedule",
                    &format!("unparseable schedule: {:?} : {e}", spec["schedule"]),
                );
                return Ok(None);
            }
        };
        let tz = match time_zone(spec["timeZone"].as_str()) {
            Ok(tz) => tz,
            Err(e) => {
                events::record(cj, EventType::Warning, "UnknownTimeZone", &e);
                return Ok(None);
            }
        };
        let until_next = |after: Timestamp| {
            schedule.next(after, &tz).map(|next| {
                let ms = next.as_millisecond() - now.as_millisecond();
                // A little past the second, so the run is due when the key comes back.
                Duration::from_millis(u64::try_from(ms).unwrap_or(0) + 100)
            })
        };
        let created = parse_time(&cj["metadata"]["creationTimestamp"]).unwrap_or(now);
        let mut earliest = parse_time(&status["lastScheduleTime"]).unwrap_or(created);
        let deadline = spec["startingDeadlineSeconds"].as_i64();
        if let Some(d) = deadline
            && let Ok(bound) = now.checked_sub(jiff::SignedDuration::from_secs(d))
            && bound > earliest
        {
            earliest = bound;
        }
        let Some((t, missed)) = schedule.most_recent(earliest, now, &tz) else {
            return Ok(until_next(now));
        };
        if missed > 100 {
            events::record(
                cj,
                EventType::Warning,
                "TooManyMissedTimes",
                &format!(
                    "too many missed start times: {missed}. Set or decrease .spec.startingDeadlineSeconds or check clock skew"
                ),
            );
        }
        if let Some(d) = deadline
            && t.as_second() + d < now.as_second()
        {
            events::record(
                cj,
                EventType::Warning,
                "MissSchedule",
                &format!("Missed scheduled time to start a job: {}", format_time(t)),
            );
            return Ok(until_next(now));
        }
        match spec["concurrencyPolicy"].as_str().unwrap_or("Allow") {
            "Forbid" if !active.is_empty() => {
                events::record(
                    cj,
                    EventType::Normal,
                    "JobAlreadyActive",
                    "Not starting job because prior execution is running and concurrency policy is Forbid",
                );
                return Ok(until_next(now));
            }
            "Replace" if !active.is_empty() => {
                let writes = active
                    .iter()
                    .map(|r| Write::Delete {
                        resource: jobs(),
                        namespace: r["namespace"].as_str().map(str::to_owned),
                        name: r["name"].as_str().unwrap_or_default().to_owned(),
                        propagation: Some(Propagation::Background),
                        uid: r["uid"].as_str().map(str::to_owned),
                    })
                    .collect();
                for (result, r) in client::batch(writes)?.into_iter().zip(active.iter()) {
                    match result {
                        Ok(_) => events::record(
                            cj,
                            EventType::Normal,
                            "SuccessfulDelete",
                            &format!("Deleted job {}", r["name"].as_str().unwrap_or_default()),
                        ),
                        Err(e) if e.is_not_found() => {}
                        Err(e) => return Err(format!("delete an active job: {e}")),
                    }
                }
                active.clear();
            }
            _ => {}
        }
        let job = job_for(cj, t, &tz);
        let name = job["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let ns = cj["metadata"]["namespace"].as_str();
        match client::create(&jobs(), ns, job) {
            Ok(made) => {
                events::record(
                    cj,
                    EventType::Normal,
                    "SuccessfulCreate",
                    &format!("Created job {name}"),
                );
                active.push(reference(&made));
            }
            // Made by an earlier pass whose status write was lost: it is the run.
            Err(e) if e.code == 409 && e.reason == "AlreadyExists" => {}
            Err(e) if e.is_namespace_terminating() => return Ok(None),
            Err(e) => {
                events::record(
                    cj,
                    EventType::Warning,
                    "FailedCreate",
                    &format!("Error creating job: {}", e.message),
                );
                return Err(format!("create job {name}: {e}"));
            }
        }
        status["lastScheduleTime"] = json!(format_time(t));
        Ok(until_next(now))
    }
}

/// Deletes the finished Jobs beyond the history limits, oldest first.
fn cleanup_history(cj: &Value, children: &[Value]) -> Result<Vec<String>, String> {
    let mut doomed = Vec::new();
    for (kind, field, default) in [
        ("Complete", "successfulJobsHistoryLimit", 3),
        ("Failed", "failedJobsHistoryLimit", 1),
    ] {
        let limit = cj["spec"][field].as_u64().unwrap_or(default) as usize;
        let mut done: Vec<&Value> = children
            .iter()
            .filter(|j| finished(j) == Some(kind) && j["metadata"]["deletionTimestamp"].is_null())
            .collect();
        if done.len() <= limit {
            continue;
        }
        done.sort_by_key(|j| {
            (
                j["status"]["startTime"].as_str().map(str::to_owned),
                j["metadata"]["creationTimestamp"]
                    .as_str()
                    .map(str::to_owned),
            )
        });
        let extra = done.len() - limit;
        doomed.extend(done.into_iter().take(extra));
    }
    if doomed.is_empty() {
        return Ok(Vec::new());
    }
    let writes = doomed
        .iter()
        .map(|j| Write::Delete {
            resource: jobs(),
            namespace: j["metadata"]["namespace"].as_str().map(str::to_owned),
            name: j["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            propagation: Some(Propagation::Background),
            uid: j["metadata"]["uid"].as_str().map(str::to_owned),
        })
        .collect();
    let mut failures = Vec::new();
    for (result, j) in client::batch(writes)?.into_iter().zip(&doomed) {
        let name = j["metadata"]["name"].as_str().unwrap_or_default();
        match result {
            Ok(_) => events::record(
                cj,
                EventType::Normal,
                "SuccessfulDelete",
                &format!("Deleted job {name}"),
            ),
            Err(e) if e.is_not_found() => {}
            Err(e) => failures.push(format!("delete job {name}: {e}")),
        }
    }
    Ok(failures)
}

trellis_plugin::controller!(CronJobs);

#[cfg(test)]
mod tests;
