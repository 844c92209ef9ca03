//! The Job controller: pods run to completion, as Kubernetes' job controller
//! (1.30) behaves.
//!
//! - Pods are made from the template, owned by the Job, with the finalizer
//!   `batch.kubernetes.io/job-tracking`: a finished pod is counted exactly once by
//!   first listing its uid in `status.uncountedTerminatedPods`, then removing its
//!   finalizer, then moving it to `succeeded`/`failed` (a pass cut short anywhere
//!   resumes where it stopped).
//! - `NonIndexed`: up to `parallelism` pods at a time until `completions` pods
//!   succeeded (without `completions`, until one succeeded and none is running).
//!   `Indexed`: one pod per index not yet completed, with its index in the
//!   annotation and label `batch.kubernetes.io/job-completion-index`, the variable
//!   `JOB_COMPLETION_INDEX` and the hostname `<job>-<index>`; `completedIndexes`.
//! - Failed pods are replaced after an exponential back-off (10 s doubling, at most
//!   6 min: the configuration's `podFailureBackoffSeconds` and
//!   `maxPodFailureBackoffSeconds`) counted from the failures since the last
//!   success. More than `backoffLimit` failures (with `restartPolicy: OnFailure`,
//!   the containers' restarts count too) fail the Job (`BackoffLimitExceeded`), so
//!   does `activeDeadlineSeconds` (`DeadlineExceeded`) and a `podFailurePolicy`
//!   rule `FailJob` (`PodFailurePolicy`); `Ignore` rules leave a failure uncounted.
//! - A finishing Job first gets `FailureTarget` or `SuccessCriteriaMet`, its
//!   running pods are deleted, and once every pod is counted it gets `Failed` or
//!   `Complete` (with `completionTime`).
//! - `suspend` deletes the running pods (not counted as failures) and sets
//!   `Suspended`; resuming restarts the deadline's clock (`startTime`).
//!
//! - `backoffLimitPerIndex` (Indexed): each index has its own failures (the
//!   annotation `batch.kubernetes.io/job-index-failure-count` of its pods) and
//!   back-off; an index past its limit, or failed by a `FailIndex` rule, is listed
//!   in `failedIndexes` and not run again; more than `maxFailedIndexes` fail the Job
//!   (`MaxFailedIndexesExceeded`), and so do indexes all done with some failed
//!   (`FailedIndexes`).
//!
//! Left out: adopting orphan pods by selector, `successPolicy`,
//! `podReplacementPolicy` other than its defaults.
//!
//! # Layout
//! - `lib.rs` (Kubernetes' `job_controller.go`): the reconcile, `Pass` (counting
//!   finished pods, the finishing conditions, managing pods, the status).
//! - `pod`: what the controller reads of a pod, and the pod failure policy.
//! - `indexes`: `completedIndexes`/`failedIndexes` as interval strings.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, Write, cache, client, events, owned, time,
};

pub mod indexes;
pub mod pod;

use pod::{FAILURE_COUNT_KEY, INDEX_KEY, Judgement, Outcome, Pod, TRACKING_FINALIZER, judge};

/// The most pods created or deleted in one pass (Kubernetes' `MaxPodCreateDeletePerSync`).
const BURST: usize = 500;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Jobs {
    /// The first back-off before a failed pod is replaced; it doubles with each
    /// failure since the last success.
    #[serde(default = "default_backoff")]
    pub pod_failure_backoff_seconds: f64,
    /// The longest back-off.
    #[serde(default = "default_max_backoff")]
    pub max_pod_failure_backoff_seconds: f64,
}

fn default_backoff() -> f64 {
    10.0
}

fn default_max_backoff() -> f64 {
    360.0
}

fn pods() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "pods".into(),
    }
}

/// How a Job ends.
#[derive(Clone, Debug, PartialEq)]
enum Finish {
    Complete,
    Failed { reason: String, message: String },
}

fn condition<'a>(job: &'a Value, type_: &str) -> Option<&'a Value> {
    job["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn condition_true(job: &Value, type_: &str) -> bool {
    condition(job, type_).is_some_and(|c| c["status"] == "True")
}

/// Whether a status (not a Job) has the condition `type_` true.
fn status_says(status: &Value, type_: &str) -> bool {
    status["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

/// Finished: `Complete` or `Failed`.
pub fn is_finished(job: &Value) -> bool {
    condition_true(job, "Complete") || condition_true(job, "Failed")
}

/// Sets the condition `type_` to `status` (its transition time kept when the
/// status does not change); `false` when it already said so.
fn set_condition(
    status: &mut Value,
    type_: &str,
    value: &str,
    reason: &str,
    message: &str,
    now: i64,
) -> bool {
    if !status["conditions"].is_array() {
        status["conditions"] = json!([]);
    }
    let list = status["conditions"].as_array_mut().expect("an array");
    let now = time::format(now);
    match list.iter_mut().find(|c| c["type"] == type_) {
        Some(c) if c["status"] == value && c["reason"] == reason && c["message"] == message => {
            false
        }
        Some(c) => {
            if c["status"] != value {
                c["lastTransitionTime"] = json!(now);
            }
            c["status"] = json!(value);
            c["reason"] = json!(reason);
            c["message"] = json!(message);
            c["lastProbeTime"] = json!(now);
            true
        }
        None => {
            list.push(json!({"type": type_, "status": value, "reason": reason,
                "message": message, "lastProbeTime": now, "lastTransitionTime": now}));
            true
        }
    }
}

fn uids(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|u| u.as_str().map(str::to_owned))
        .collect()
}

impl Reconcile for Jobs {
    fn check_configuration(&self) -> Result<(), String> {
        if !(self.pod_failure_backoff_seconds >= 0.0
            && self.max_pod_failure_backoff_seconds >= self.pod_failure_backoff_seconds)
        {
            return Err("podFailureBackoffSeconds must be at least 0 and at most maxPodFailureBackoffSeconds".into());
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(job) = cache::get(&key.resource, ns, &key.name)? else {
            return release_orphans(ns, &key.name);
        };
        let uid = job["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let pods: Vec<Pod> = cache::owned_by_as::<Pod>(&pods(), &uid)?
            .into_iter()
            .filter(|p| p.is_controlled_by(&uid))
            .collect();
        // A finished or deleted Job counts nothing more: its pods are let go.
        if is_finished(&job) || !job["metadata"]["deletionTimestamp"].is_null() {
            let held: Vec<&Pod> = pods.iter().filter(|p| p.has_finalizer()).collect();
            let failures = remove_finalizers(ns, &held)?.1;
            return if failures.is_empty() {
                Ok(Action::Done)
            } else {
                Err(failures.join("; "))
            };
        }
        Pass {
            config: self,
            key,
            job,
            pods,
            now: time::now(),
        }
        .run()
    }
}

/// The pods of a Job that is gone keep no finalizer of it.
fn release_orphans(ns: Option<&str>, name: &str) -> Result<Action, String> {
    let selector = format!("batch.kubernetes.io/job-name={name}");
    let mut orphans: Vec<Pod> = cache::list_as(&pods(), ns, &selector)?;
    // A Job with `manualSelector` gives its pods no such label: its namespace's
    // pods are looked through.
    if orphans.is_empty() {
        orphans = cache::list_as(&pods(), ns, "")?;
    }
    let held: Vec<&Pod> = orphans
        .iter()
        .filter(|p| {
            p.has_finalizer()
                && p.metadata
                    .owner_references
                    .iter()
                    .any(|r| r["controller"] == true && r["kind"] == "Job" && r["name"] == name)
        })
        .collect();
    let failures = remove_finalizers(ns, &held)?.1;
    if failures.is_empty() {
        Ok(Action::Done)
    } else {
        Err(failures.join("; "))
    }
}

/// Removes the tracking finalizer from `held`: the uids now free of it, and the
/// failures.
fn remove_finalizers(
    ns: Option<&str>,
    held: &[&Pod],
) -> Result<(HashSet<String>, Vec<String>), String> {
    let writes = held
        .iter()
        .map(|p| Write::Patch {
            resource: pods(),
            namespace: ns.map(str::to_owned),
            name: p.metadata.name.clone(),
            patch_type: PatchType::Strategic,
            // The uid makes the patch fail rather than touch a new pod of that name.
            patch: json!({"metadata": {
                "$deleteFromPrimitiveList/finalizers": [TRACKING_FINALIZER],
                "uid": p.metadata.uid,
            }}),
            status: false,
            force: false,
        })
        .collect::<Vec<_>>();
    let mut done = HashSet::new();
    let mut failures = Vec::new();
    if writes.is_empty() {
        return Ok((done, failures));
    }
    for (result, p) in client::batch(writes)?.into_iter().zip(held) {
        match result {
            Ok(_) => {
                done.insert(p.metadata.uid.clone());
            }
            Err(e) if e.is_not_found() => {
                done.insert(p.metadata.uid.clone());
            }
            Err(e) => failures.push(format!("remove the finalizer of {}: {e}", p.metadata.name)),
        }
    }
    Ok((done, failures))
}

/// One reconcile of a Job that is not finished.
struct Pass<'a> {
    config: &'a Jobs,
    key: &'a ObjectKey,
    job: Value,
    pods: Vec<Pod>,
    now: i64,
}

impl Pass<'_> {
    fn ns(&self) -> Option<&str> {
        self.key.namespace.as_deref()
    }

    fn spec(&self) -> &Value {
        &self.job["spec"]
    }

    fn indexed(&self) -> bool {
        self.spec()["completionMode"] == "Indexed"
    }

    fn completions(&self) -> Option<u64> {
        self.spec()["completions"].as_u64()
    }

    /// `backoffLimitPerIndex`, for an Indexed Job that sets it.
    fn per_index(&self) -> Option<u64> {
        self.spec()["backoffLimitPerIndex"]
            .as_u64()
            .filter(|_| self.indexed())
    }

    /// The judgement of a failed pod: its policy's, or counted.
    fn judgement(&self, p: &Pod) -> Judgement {
        match self.policy() {
            Some(policy) if p.phase() == "Failed" => judge(policy, p),
            _ => Judgement::Count,
        }
    }

    /// Whether a counted failure of `p` fails its index.
    fn fails_index(&self, p: &Pod) -> bool {
        let Some(limit) = self.per_index() else {
            return false;
        };
        self.judgement(p) == Judgement::FailIndex || p.failure_count() + 1 > limit
    }

    /// An index's failures so far and when the last one finished.
    fn index_failures(&self, index: u64) -> (u64, Option<i64>) {
        let failed = self.pods.iter().filter(|p| {
            p.index() == Some(index)
                && p.outcome(self.policy().is_some()) == Some(Outcome::Failed)
                && self.judgement(p) != Judgement::Ignore
        });
        failed.fold((0, None), |(n, last), p| {
            let at = p.finished_at(self.now);
            (
                n.max(p.failure_count() + 1),
                Some(last.map_or(at, |l: i64| l.max(at))),
            )
        })
    }

    fn policy(&self) -> Option<&Value> {
        Some(&self.spec()["podFailurePolicy"]).filter(|p| p.is_object())
    }

    fn run(mut self) -> Result<Action, String> {
        let ns = self.ns().map(str::to_owned);
        let ns = ns.as_deref();
        let suspended = self.spec()["suspend"] == true;
        let waits_for_terminal = self.policy().is_some();
        let mut failures = Vec::new();

        // 1. Newly finished pods: their uids are recorded before their finalizers go.
        let stored = self.job["status"]["uncountedTerminatedPods"].clone();
        let (mut unc_succeeded, mut unc_failed) =
            (uids(&stored["succeeded"]), uids(&stored["failed"]));
        let mut release: Vec<&Pod> = Vec::new();
        let mut fail_job: Option<String> = None;
        for p in self.pods.iter().filter(|p| p.has_finalizer()) {
            let uid = &p.metadata.uid;
            if unc_succeeded.contains(uid) || unc_failed.contains(uid) {
                release.push(p);
                continue;
            }
            // Pods deleted because the Job is suspended are no failures.
            if suspended && p.is_terminating() {
                release.push(p);
                continue;
            }
            match p.outcome(waits_for_terminal) {
                None => {}
                Some(Outcome::Succeeded) => {
                    unc_succeeded.push(uid.clone());
                    release.push(p);
                }
                Some(Outcome::Failed) => {
                    match self.judgement(p) {
                        Judgement::Ignore => {}
                        Judgement::FailJob(message) => {
                            fail_job.get_or_insert(message);
                            unc_failed.push(uid.clone());
                        }
                        Judgement::Count | Judgement::FailIndex => unc_failed.push(uid.clone()),
                    }
                    release.push(p);
                }
            }
        }
        let mut status = match &self.job["status"] {
            Value::Object(_) => self.job["status"].clone(),
            _ => json!({}),
        };
        if let Some(message) = &fail_job
            && !condition_true(&self.job, "FailureTarget")
        {
            set_condition(
                &mut status,
                "FailureTarget",
                "True",
                "PodFailurePolicy",
                message,
                self.now,
            );
        }
        let known = uids(&stored["succeeded"]).len() + uids(&stored["failed"]).len();
        if unc_succeeded.len() + unc_failed.len() > known {
            status["uncountedTerminatedPods"] =
                json!({"succeeded": unc_succeeded, "failed": unc_failed});
        }
        if status != self.job["status"] {
            self.job = write_status(self.key, &self.job, status)?;
        }

        // 2. Their finalizers go.
        let (freed, errs) = remove_finalizers(ns, &release)?;
        failures.extend(errs);

        // 3. Counted: what is free of the finalizer, or gone.
        let held: HashSet<&str> = self
            .pods
            .iter()
            .filter(|p| p.has_finalizer() && !freed.contains(&p.metadata.uid))
            .map(|p| p.metadata.uid.as_str())
            .collect();
        let completions = self.completions();
        let mut completed = indexes::parse(
            self.job["status"]["completedIndexes"]
                .as_str()
                .unwrap_or_default(),
            completions.unwrap_or(0),
        );
        let mut succeeded = self.job["status"]["succeeded"].as_u64().unwrap_or(0);
        let mut failed = self.job["status"]["failed"].as_u64().unwrap_or(0);
        unc_succeeded.retain(|uid| {
            if held.contains(uid.as_str()) {
                return true;
            }
            succeeded += 1;
            if let Some(i) = self
                .pods
                .iter()
                .find(|p| &p.metadata.uid == uid)
                .and_then(Pod::index)
                && i < completions.unwrap_or(0)
            {
                completed.insert(i);
            }
            false
        });
        let mut failed_indexes = indexes::parse(
            self.job["status"]["failedIndexes"]
                .as_str()
                .unwrap_or_default(),
            completions.unwrap_or(0),
        );
        unc_failed.retain(|uid| {
            if held.contains(uid.as_str()) {
                return true;
            }
            failed += 1;
            if let Some(p) = self.pods.iter().find(|p| &p.metadata.uid == uid)
                && let Some(i) = p.index()
                && i < completions.unwrap_or(0)
                && self.fails_index(p)
            {
                failed_indexes.insert(i);
            }
            false
        });
        if self.indexed() {
            succeeded = completed.len() as u64;
        }

        // 4. What the Job is now.
        let active: Vec<&Pod> = self.pods.iter().filter(|p| p.is_active()).collect();
        let mut status = self.job["status"].clone();
        let mut recheck: Option<Duration> = None;
        if status["startTime"].is_null() && !suspended {
            status["startTime"] = json!(time::format(self.now));
        }
        let finish = self.finish(
            &status,
            fail_job,
            succeeded,
            failed + unc_failed.len() as u64,
            &active,
            &completed,
            &failed_indexes,
            &mut recheck,
        );

        // 5. Pods: deleted when finishing or suspended, else as many as wanted.
        let mut active_now = active.len() as i64;
        if let Some(finish) = &finish {
            let (target, reason, message) = match finish {
                Finish::Complete => (
                    "SuccessCriteriaMet",
                    "CompletionsReached",
                    "Reached expected number of succeeded pods",
                ),
                Finish::Failed { reason, message } => {
                    ("FailureTarget", reason.as_str(), message.as_str())
                }
            };
            if !status_says(&status, target) {
                set_condition(&mut status, target, "True", reason, message, self.now);
            }
            failures.extend(self.delete_pods(&active)?);
            active_now = 0;
            let settled = held.is_empty() && unc_succeeded.is_empty() && unc_failed.is_empty();
            if settled {
                self.finished(&mut status, finish);
            }
        } else if suspended {
            if set_condition(
                &mut status,
                "Suspended",
                "True",
                "JobSuspended",
                "Job suspended",
                self.now,
            ) {
                events::record(&self.job, EventType::Normal, "Suspended", "Job suspended");
            }
            failures.extend(self.delete_pods(&active)?);
            active_now = 0;
            // A suspended Job has not started (so its template's scheduling
            // directives may change); resuming starts the clock again.
            if let Some(o) = status.as_object_mut() {
                o.remove("startTime");
            }
        } else {
            if status_says(&status, "Suspended") {
                set_condition(
                    &mut status,
                    "Suspended",
                    "False",
                    "JobResumed",
                    "Job resumed",
                    self.now,
                );
                events::record(&self.job, EventType::Normal, "Resumed", "Job resumed");
                // The deadline counts the time the Job runs, from its resumption.
                status["startTime"] = json!(time::format(self.now));
            }
            let (created, deleted, wait) = self.manage(
                &active,
                succeeded,
                &completed,
                &failed_indexes,
                &mut failures,
            )?;
            active_now += created as i64 - deleted as i64;
            if let Some(wait) = wait {
                recheck = Some(recheck.map_or(wait, |r| r.min(wait)));
            }
        }

        // 6. The status.
        let ready = active.iter().filter(|p| p.is_ready()).count();
        let terminating = self.pods.iter().filter(|p| p.is_terminating()).count();
        for (field, n) in [
            ("active", active_now.max(0) as u64),
            ("succeeded", succeeded),
            ("failed", failed),
        ] {
            if n > 0 {
                status[field] = json!(n);
            } else if let Some(o) = status.as_object_mut() {
                o.remove(field);
            }
        }
        status["ready"] = json!(ready);
        status["terminating"] = json!(terminating);
        status["uncountedTerminatedPods"] = json!({});
        if !unc_succeeded.is_empty() {
            status["uncountedTerminatedPods"]["succeeded"] = json!(unc_succeeded);
        }
        if !unc_failed.is_empty() {
            status["uncountedTerminatedPods"]["failed"] = json!(unc_failed);
        }
        if self.indexed() {
            status["completedIndexes"] = json!(indexes::format(&completed));
        }
        if self.per_index().is_some() {
            status["failedIndexes"] = json!(indexes::format(&failed_indexes));
        }
        if status != self.job["status"] {
            self.job = write_status(self.key, &self.job, status)?;
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        Ok(recheck.map_or(Action::Done, Action::RequeueAfter))
    }

    /// Whether the Job ends now, and how.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        status: &Value,
        fail_job: Option<String>,
        succeeded: u64,
        failed: u64,
        active: &[&Pod],
        completed: &BTreeSet<u64>,
        failed_indexes: &BTreeSet<u64>,
        recheck: &mut Option<Duration>,
    ) -> Option<Finish> {
        let target = |type_: &str| {
            status["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == type_ && c["status"] == "True")
                .cloned()
        };
        if let Some(c) = target("FailureTarget") {
            return Some(Finish::Failed {
                reason: c["reason"].as_str().unwrap_or_default().to_owned(),
                message: c["message"].as_str().unwrap_or_default().to_owned(),
            });
        }
        if target("SuccessCriteriaMet").is_some() {
            return Some(Finish::Complete);
        }
        if let Some(message) = fail_job {
            return Some(Finish::Failed {
                reason: "PodFailurePolicy".into(),
                message,
            });
        }
        let limit = self.spec()["backoffLimit"].as_u64().unwrap_or(6);
        let on_failure = self.spec()["template"]["spec"]["restartPolicy"] == "OnFailure";
        let restarts: i64 = active
            .iter()
            .filter(|p| matches!(p.phase(), "Running" | "Pending"))
            .map(|p| p.restarts())
            .sum();
        let past_restarts = on_failure
            && if limit == 0 {
                restarts > 0
            } else {
                restarts as u64 >= limit
            };
        if let Some(max) = self.spec()["maxFailedIndexes"].as_u64()
            && self.per_index().is_some()
            && failed_indexes.len() as u64 > max
        {
            return Some(Finish::Failed {
                reason: "MaxFailedIndexesExceeded".into(),
                message: "Job has exceeded the specified maximal number of failed indexes".into(),
            });
        }
        // With a limit per index, the Job's own limit does not apply.
        if self.per_index().is_none() && (failed > limit || past_restarts) {
            return Some(Finish::Failed {
                reason: "BackoffLimitExceeded".into(),
                message: "Job has reached the specified backoff limit".into(),
            });
        }
        if let Some(deadline) = self.spec()["activeDeadlineSeconds"].as_i64()
            && self.spec()["suspend"] != true
            && let Some(start) = status["startTime"].as_str().and_then(time::parse)
        {
            let left = start + deadline - self.now;
            if left <= 0 {
                return Some(Finish::Failed {
                    reason: "DeadlineExceeded".into(),
                    message: "Job was active longer than specified deadline".into(),
                });
            }
            *recheck = Some(Duration::from_secs(left as u64));
        }
        let complete = match (self.completions(), self.indexed()) {
            (Some(c), true) => completed.len() as u64 >= c,
            (Some(c), false) => succeeded >= c,
            (None, _) => succeeded > 0 && active.is_empty(),
        };
        if !complete
            && let Some(c) = self.completions()
            && !failed_indexes.is_empty()
            && (completed.len() + failed_indexes.len()) as u64 >= c
        {
            return Some(Finish::Failed {
                reason: "FailedIndexes".into(),
                message: "Job has failed indexes".into(),
            });
        }
        complete.then_some(Finish::Complete)
    }

    /// The final condition, once every pod is counted.
    fn finished(&self, status: &mut Value, finish: &Finish) {
        match finish {
            Finish::Complete => {
                set_condition(
                    status,
                    "Complete",
                    "True",
                    "CompletionsReached",
                    "Reached expected number of succeeded pods",
                    self.now,
                );
                status["completionTime"] = json!(time::format(self.now));
                events::record(&self.job, EventType::Normal, "Completed", "Job completed");
            }
            Finish::Failed { reason, message } => {
                set_condition(status, "Failed", "True", reason, message, self.now);
                events::record(&self.job, EventType::Warning, reason, message);
            }
        }
    }

    /// How long until a failed pod may be replaced: the back-off of the failures
    /// since the last success, from the last failure.
    fn backoff(&self) -> Duration {
        let policy = self.policy();
        let mut finished: Vec<(i64, bool)> = self
            .pods
            .iter()
            .filter_map(|p| {
                let outcome = p.outcome(policy.is_some())?;
                let counted = match (outcome, policy) {
                    (Outcome::Failed, Some(policy)) if p.phase() == "Failed" => {
                        judge(policy, p) != Judgement::Ignore
                    }
                    _ => true,
                };
                counted.then(|| (p.finished_at(self.now), outcome == Outcome::Failed))
            })
            .collect();
        finished.sort();
        let since_success: Vec<i64> = finished
            .iter()
            .rev()
            .take_while(|(_, failed)| *failed)
            .map(|(at, _)| *at)
            .collect();
        let Some(&last) = since_success.first() else {
            return Duration::ZERO;
        };
        self.delay(since_success.len() as u64, last)
    }

    /// What is left at `now` of the back-off after `failures` failures, the last
    /// at `last`.
    fn delay(&self, failures: u64, last: i64) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let n = failures.min(32) as i32;
        let delay = (self.config.pod_failure_backoff_seconds * 2f64.powi(n - 1))
            .min(self.config.max_pod_failure_backoff_seconds);
        // Whole seconds of the API server's times: the fraction is from now.
        let left = last as f64 + delay - self.now as f64;
        if left <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(left)
        }
    }

    /// Creates and deletes pods toward `parallelism`: how many it created and
    /// deleted, and when to look again (a back-off that holds creation).
    fn manage(
        &self,
        active: &[&Pod],
        succeeded: u64,
        completed: &BTreeSet<u64>,
        failed_indexes: &BTreeSet<u64>,
        failures: &mut Vec<String>,
    ) -> Result<(usize, usize, Option<Duration>), String> {
        let parallelism = self.spec()["parallelism"].as_u64().unwrap_or(1) as usize;
        // A pod failure policy waits for replaced pods to finish (podReplacementPolicy Failed).
        let terminating = if self.policy().is_some() {
            self.pods.iter().filter(|p| p.is_terminating()).count()
        } else {
            0
        };
        let mut surplus: Vec<&Pod> = Vec::new();
        let mut to_create: Vec<Option<u64>> = Vec::new();
        if self.indexed() {
            let completions = self.completions().unwrap_or(0);
            let mut running: BTreeSet<u64> = BTreeSet::new();
            let mut by_index: Vec<&Pod> = active.to_vec();
            by_index.sort_by_key(|p| (p.index(), p.metadata.creation_timestamp.clone()));
            for p in by_index {
                match p.index() {
                    Some(i)
                        if i < completions
                            && !completed.contains(&i)
                            && !failed_indexes.contains(&i)
                            && running.insert(i) => {}
                    _ => surplus.push(p),
                }
            }
            let kept = running.len();
            if kept > parallelism {
                let extra: Vec<u64> = running
                    .iter()
                    .rev()
                    .take(kept - parallelism)
                    .copied()
                    .collect();
                surplus.extend(
                    active
                        .iter()
                        .filter(|p| p.index().is_some_and(|i| extra.contains(&i))),
                );
            }
            let room = parallelism.saturating_sub(kept + terminating);
            let mut index_wait: Option<Duration> = None;
            to_create = (0..completions)
                .filter(|i| {
                    !completed.contains(i) && !running.contains(i) && !failed_indexes.contains(i)
                })
                // With a limit per index, each index has its own back-off.
                .filter(|i| {
                    if self.per_index().is_none() {
                        return true;
                    }
                    let (n, last) = self.index_failures(*i);
                    let wait = last.map_or(Duration::ZERO, |last| self.delay(n, last));
                    if wait.is_zero() {
                        return true;
                    }
                    index_wait = Some(index_wait.map_or(wait, |w| w.min(wait)));
                    false
                })
                .take(room)
                .map(Some)
                .collect();
            if self.per_index().is_some() {
                surplus.truncate(BURST);
                let deleted = surplus.len();
                failures.extend(self.delete_pods(&surplus)?);
                let created = self.create_pods(&to_create, failures)?;
                return Ok((created, deleted, index_wait));
            }
        } else {
            let want = match self.completions() {
                None if succeeded > 0 => active.len().min(parallelism),
                None => parallelism,
                Some(c) => (c.saturating_sub(succeeded) as usize).min(parallelism),
            };
            if active.len() > want {
                let mut order: Vec<&Pod> = active.to_vec();
                removal_order(&mut order);
                surplus = order.into_iter().take(active.len() - want).collect();
            } else {
                let n = want.saturating_sub(active.len() + terminating);
                to_create = vec![None; n];
            }
        }
        surplus.truncate(BURST);
        let deleted = surplus.len();
        failures.extend(self.delete_pods(&surplus)?);
        if to_create.is_empty() {
            return Ok((0, deleted, None));
        }
        let wait = self.backoff();
        if !wait.is_zero() {
            return Ok((0, deleted, Some(wait)));
        }
        to_create.truncate(BURST);
        let created = self.create_pods(&to_create, failures)?;
        Ok((created, deleted, None))
    }

    /// The pod for `index` (or a NonIndexed one).
    fn pod(&self, index: Option<u64>) -> Value {
        let job = &self.job;
        let template = &job["spec"]["template"];
        let name = job["metadata"]["name"].as_str().unwrap_or_default();
        let mut metadata = json!({
            "generateName": format!("{name}-"),
            "ownerReferences": [owned::controller_reference("batch/v1", "Job", job)],
        });
        for field in ["labels", "annotations"] {
            if let Some(v) = template["metadata"].get(field).filter(|v| v.is_object()) {
                metadata[field] = v.clone();
            }
        }
        let mut finalizers: Vec<Value> = template["metadata"]["finalizers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        finalizers.push(json!(TRACKING_FINALIZER));
        metadata["finalizers"] = Value::Array(finalizers);
        let mut spec = template["spec"].clone();
        if let Some(i) = index {
            metadata["generateName"] = json!(format!("{name}-{i}-"));
            metadata["annotations"][INDEX_KEY] = json!(i.to_string());
            if self.per_index().is_some() {
                metadata["annotations"][FAILURE_COUNT_KEY] =
                    json!(self.index_failures(i).0.to_string());
            }
            metadata["labels"][INDEX_KEY] = json!(i.to_string());
            if spec["hostname"].as_str().is_none_or(str::is_empty) {
                spec["hostname"] = json!(format!("{name}-{i}"));
            }
            let var = json!({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": format!("metadata.annotations['{INDEX_KEY}']")}}});
            for list in ["initContainers", "containers"] {
                for c in spec[list].as_array_mut().into_iter().flatten() {
                    if !c["env"].is_array() {
                        c["env"] = json!([]);
                    }
                    let env = c["env"].as_array_mut().expect("an array");
                    if !env.iter().any(|e| e["name"] == "JOB_COMPLETION_INDEX") {
                        env.push(var.clone());
                    }
                }
            }
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    }

    /// Creates the pods in slow-start batches (1, 2, 4, …), a failed batch ending
    /// the pass; how many it created.
    fn create_pods(
        &self,
        wanted: &[Option<u64>],
        failures: &mut Vec<String>,
    ) -> Result<usize, String> {
        let mut created = 0;
        let mut left = wanted;
        let mut size = 1;
        while !left.is_empty() {
            let (batch, rest) = left.split_at(size.min(left.len()));
            left = rest;
            size *= 2;
            let writes = batch
                .iter()
                .map(|i| Write::Create {
                    resource: pods(),
                    namespace: self.key.namespace.clone(),
                    object: self.pod(*i),
                })
                .collect();
            let mut stop = false;
            for result in client::batch(writes)? {
                match result {
                    Ok(pod) => {
                        created += 1;
                        events::record(
                            &self.job,
                            EventType::Normal,
                            "SuccessfulCreate",
                            &format!(
                                "Created pod: {}",
                                pod["metadata"]["name"].as_str().unwrap_or_default()
                            ),
                        );
                    }
                    Err(e) if e.is_namespace_terminating() => stop = true,
                    Err(e) => {
                        events::record(
                            &self.job,
                            EventType::Warning,
                            "FailedCreate",
                            &format!("Error creating: {}", e.message),
                        );
                        failures.push(format!("create a pod: {e}"));
                        stop = true;
                    }
                }
            }
            if stop {
                break;
            }
        }
        Ok(created)
    }

    fn delete_pods(&self, doomed: &[&Pod]) -> Result<Vec<String>, String> {
        if doomed.is_empty() {
            return Ok(Vec::new());
        }
        let writes = doomed
            .iter()
            .map(|p| Write::Delete {
                resource: pods(),
                namespace: self.key.namespace.clone(),
                name: p.metadata.name.clone(),
                propagation: None,
                uid: Some(p.metadata.uid.clone()),
            })
            .collect();
        let mut failures = Vec::new();
        for (result, p) in client::batch(writes)?.into_iter().zip(doomed) {
            match result {
                Ok(_) => events::record(
                    &self.job,
                    EventType::Normal,
                    "SuccessfulDelete",
                    &format!("Deleted pod: {}", p.metadata.name),
                ),
                Err(e) if e.is_not_found() => {}
                Err(e) => {
                    events::record(
                        &self.job,
                        EventType::Warning,
                        "FailedDelete",
                        &format!("Error deleting: {}", e.message),
                    );
                    failures.push(format!("delete pod {}: {e}", p.metadata.name));
                }
            }
        }
        Ok(failures)
    }
}

/// Writes the whole status at the resourceVersion read (a Job's counts must not
/// be written over a newer status); the object written.
fn write_status(key: &ObjectKey, job: &Value, status: Value) -> Result<Value, String> {
    let mut object = job.clone();
    object["status"] = status;
    client::update_status(&key.resource, key.namespace.as_deref(), object)
        .map_err(|e| format!("update the status: {e}"))
}

/// The order surplus pods go in: unscheduled before scheduled, pending before
/// running, not ready before ready, newer before older.
fn removal_order(pods: &mut [&Pod]) {
    pods.sort_by(|a, b| {
        let scheduled = |p: &Pod| p.spec.node_name.as_deref().is_some_and(|n| !n.is_empty());
        let running = |p: &Pod| p.phase() == "Running";
        scheduled(a)
            .cmp(&scheduled(b))
            .then(running(a).cmp(&running(b)))
            .then(a.is_ready().cmp(&b.is_ready()))
            .then(
                b.metadata
                    .creation_timestamp
                    .cmp(&a.metadata.creation_timestamp),
            )
    });
}

trellis_plugin::controller!(Jobs);

#[cfg(test)]
mod tests;
