//! Jobs and CronJobs end to end: the bundled job, ttl-after-finished, cronjob and
//! garbage-collector controllers against a real server and one node whose `process`
//! pods really run, exit and fail (pods bound by their template's `nodeName`, no
//! scheduler). Kubernetes' Job and CronJob conformance checks by their names, with
//! kubectl (current and 1.20) creating, waiting on and reading the logs of Jobs.
//! One server, node and set of controllers for the module; each check in a Job of
//! its own, run concurrently.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use trellis_api::Shutdown;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{Informer, SharedInformers};
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::Manager;
use trellis_plugin_host::{Compilers, HostConfig, PluginHost};
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};
use trellis_tests::{Kubectl, TestCluster};

const NODE: &str = "job-node";
const POD_CIDR: &str = "10.244.127.0/24";
const BRIDGE: &str = "trellis-nt127";
const NS: &str = "default";
/// What any check may wait for one thing.
const LIMIT: Duration = Duration::from_secs(90);

/// Waits until `check` finds what it looks for in `informer`'s cache: looked at again
/// at each change the informer sees, up to `limit`.
async fn until<K, T>(
    informer: &Arc<Informer<K>>,
    what: &str,
    limit: Duration,
    mut check: impl FnMut(&Informer<K>) -> Option<T>,
) -> Result<T>
where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let mut changes = informer.subscribe();
    let found = async {
        loop {
            if let Some(found) = check(informer) {
                return Ok(found);
            }
            if changes.recv().await.is_none() {
                bail!("the informer ended");
            }
        }
    };
    tokio::time::timeout(limit, found)
        .await
        .map_err(|_| anyhow::anyhow!("{what}: not within {limit:?}"))?
}

/// One check of the module, run beside the others.
type Check<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send + 'a>>;

fn value<T: serde::Serialize>(object: &T) -> Value {
    serde_json::to_value(object).unwrap_or_default()
}

/// The Job's condition `type_` when it is true: its reason.
fn condition(job: &Job, type_: &str) -> Option<String> {
    job.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")
        .map(|c| c.reason.clone().unwrap_or_default())
}

/// A pod template of a `process` pod on the test's node running `script`.
fn template(script: &str, restart: &str) -> Value {
    json!({"spec": {"nodeName": NODE, "runtimeClassName": "process", "restartPolicy": restart,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "c", "image": "file:///bin/sh", "command": ["/bin/sh", "-c", script]}]}})
}

fn job(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": NS}, "spec": spec})
}

struct Env {
    cluster: TestCluster,
    admin: kube::Client,
    jobs: Arc<Informer<Job>>,
    pods: Arc<Informer<Pod>>,
    cronjobs: Arc<Informer<CronJob>>,
}

impl Env {
    async fn create(&self, object: Value) -> Result<()> {
        self.cluster
            .kubectl_ok_stdin(&["create", "-f", "-"], &object.to_string())
            .await?;
        Ok(())
    }

    /// The Job once `done` holds for it.
    async fn job_until(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&Job) -> bool,
    ) -> Result<Arc<Job>> {
        let key = format!("{NS}/{name}");
        until(&self.jobs, &format!("job {name} {what}"), LIMIT, |jobs| {
            jobs.get(&key).filter(|j| done(j))
        })
        .await
        .with_context(|| format!("{:?}", self.jobs.get(&key).map(|j| value(&j.status))))
    }

    /// The pods the Job with `uid` controls.
    fn pods_of(&self, job: &Job) -> Vec<Arc<Pod>> {
        let uid = job.metadata.uid.clone();
        self.pods
            .list()
            .into_iter()
            .filter(|p| {
                p.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| r.controller == Some(true) && Some(&r.uid) == uid.as_ref())
            })
            .collect()
    }

    async fn logs(&self, kubectl: &Kubectl, what: &str) -> Result<String> {
        kubectl.ok(&["logs", "-n", NS, what]).await
    }
}

/// "should run a job to completion when tasks succeed", the Job made by `kubectl
/// create job`; `kubectl wait --for=condition=complete` and `kubectl logs job/x`,
/// current and 1.20.
async fn tasks_succeed(env: &Env) -> Result<()> {
    let made = env
        .cluster
        .kubectl_ok(&[
            "create",
            "job",
            "succeed",
            "-n",
            NS,
            "--image=file:///bin/sh",
            "--dry-run=client",
            "-o",
            "json",
            "--",
            "/bin/sh",
            "-c",
            "echo task done",
        ])
        .await?;
    let mut object: Value = serde_json::from_str(&made)?;
    object["spec"]["completions"] = json!(4);
    object["spec"]["parallelism"] = json!(2);
    let spec = &mut object["spec"]["template"]["spec"];
    spec["nodeName"] = json!(NODE);
    spec["runtimeClassName"] = json!("process");
    env.create(object).await?;
    let old = env.cluster.kubectl_1_20()?;
    for kubectl in [env.cluster.admin(), &old] {
        kubectl
            .ok(&[
                "wait",
                "-n",
                NS,
                "--for=condition=complete",
                "job/succeed",
                "--timeout=90s",
            ])
            .await?;
    }
    let job = env
        .job_until("succeed", "complete", |j| {
            condition(j, "Complete").is_some()
        })
        .await?;
    let status = value(&job.status);
    ensure!(
        status["succeeded"] == 4
            && status["completionTime"].is_string()
            && status["active"].is_null(),
        "status {status}"
    );
    ensure!(env.pods_of(&job).len() == 4, "4 pods, one per completion");
    for kubectl in [env.cluster.admin(), &old] {
        let log = env.logs(kubectl, "job/succeed").await?;
        ensure!(
            log.trim() == "task done",
            "kubectl logs job/succeed: {log:?}"
        );
    }
    Ok(())
}

/// "should run a job to completion when tasks sometimes fail and are locally
/// restarted": each pod's first run fails, its restart (OnFailure, same emptyDir)
/// succeeds.
async fn tasks_sometimes_fail(env: &Env) -> Result<()> {
    let mut t = template(
        "if [ -e /data/ran ]; then exit 0; fi; touch /data/ran; exit 1",
        "OnFailure",
    );
    t["spec"]["volumes"] = json!([{"name": "data", "emptyDir": {}}]);
    t["spec"]["containers"][0]["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    env.create(job(
        "restarted",
        json!({"completions": 4, "parallelism": 2, "template": t}),
    ))
    .await?;
    let job = env
        .job_until("restarted", "complete", |j| {
            condition(j, "Complete").is_some()
        })
        .await?;
    ensure!(
        value(&job.status)["succeeded"] == 4,
        "status {}",
        value(&job.status)
    );
    let restarts: i32 = env
        .pods_of(&job)
        .iter()
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
        })
        .map(|c| c.restart_count)
        .sum();
    ensure!(
        restarts >= 4,
        "each pod was restarted in place: {restarts} restarts"
    );
    Ok(())
}

/// `backoffLimit: 2` with a failing process: three pods fail, with back-off
/// between them, then the Job fails with `BackoffLimitExceeded`.
async fn backoff_limit_exceeded(env: &Env) -> Result<()> {
    env.create(job(
        "failing",
        json!({"backoffLimit": 2, "template": template("exit 3", "Never")}),
    ))
    .await?;
    let job = env
        .job_until("failing", "failed", |j| condition(j, "Failed").is_some())
        .await?;
    ensure!(
        condition(&job, "Failed").as_deref() == Some("BackoffLimitExceeded"),
        "{}",
        value(&job.status)
    );
    ensure!(value(&job.status)["failed"] == 3, "{}", value(&job.status));
    ensure!(env.pods_of(&job).len() == 3, "one pod per try");
    Ok(())
}

/// "should fail when exceeds active deadline".
async fn active_deadline(env: &Env) -> Result<()> {
    env.create(job(
        "deadline",
        json!({"activeDeadlineSeconds": 2, "parallelism": 1, "template": template("exec sleep 600", "Never")}),
    ))
    .await?;
    let job = env
        .job_until("deadline", "failed", |j| condition(j, "Failed").is_some())
        .await?;
    ensure!(
        condition(&job, "Failed").as_deref() == Some("DeadlineExceeded"),
        "{}",
        value(&job.status)
    );
    ensure!(
        value(&job.status)["active"].is_null(),
        "{}",
        value(&job.status)
    );
    Ok(())
}

/// "should create pods for an Indexed job with completion indexes and specified
/// hostname".
async fn indexed(env: &Env) -> Result<()> {
    let t = template(
        "echo index=$JOB_COMPLETION_INDEX host=$(cat /proc/sys/kernel/hostname)",
        "Never",
    );
    env.create(job(
        "indexed",
        json!({"completions": 3, "parallelism": 3, "completionMode": "Indexed", "template": t}),
    ))
    .await?;
    let job = env
        .job_until("indexed", "complete", |j| {
            condition(j, "Complete").is_some()
        })
        .await?;
    ensure!(
        value(&job.status)["completedIndexes"] == "0-2",
        "{}",
        value(&job.status)
    );
    let pods = env.pods_of(&job);
    let mut seen = Vec::new();
    for pod in &pods {
        let index = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("batch.kubernetes.io/job-completion-index"))
            .context("no index annotation")?;
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let log = env.logs(env.cluster.admin(), name).await?;
        ensure!(
            log.trim() == format!("index={index} host=indexed-{index}"),
            "pod {name}: {log:?}"
        );
        seen.push(index.clone());
    }
    seen.sort();
    ensure!(seen == ["0", "1", "2"], "indexes {seen:?}");
    Ok(())
}

/// `backoffLimitPerIndex`: index 0 always fails and is given up after its limit,
/// index 1 completes; the Job fails with `FailedIndexes`.
async fn backoff_limit_per_index(env: &Env) -> Result<()> {
    let t = template("[ \"$JOB_COMPLETION_INDEX\" = 1 ]", "Never");
    env.create(job(
        "per-index",
        json!({"completions": 2, "parallelism": 2, "completionMode": "Indexed",
            "backoffLimitPerIndex": 1, "template": t}),
    ))
    .await?;
    let job = env
        .job_until("per-index", "failed", |j| condition(j, "Failed").is_some())
        .await?;
    let status = value(&job.status);
    ensure!(
        condition(&job, "Failed").as_deref() == Some("FailedIndexes")
            && status["failedIndexes"] == "0"
            && status["completedIndexes"] == "1"
            && status["failed"] == 2,
        "{status}"
    );
    Ok(())
}

/// A `podFailurePolicy` rule `FailJob` on an exit code fails the Job at the first
/// such failure, whatever its backoffLimit.
async fn pod_failure_policy(env: &Env) -> Result<()> {
    env.create(job(
        "policy",
        json!({"backoffLimit": 6, "template": template("exit 42", "Never"),
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "c", "operator": "In", "values": [42]}}]}}),
    ))
    .await?;
    let job = env
        .job_until("policy", "failed", |j| condition(j, "Failed").is_some())
        .await?;
    ensure!(
        condition(&job, "Failed").as_deref() == Some("PodFailurePolicy")
            && condition(&job, "FailureTarget").is_some()
            && value(&job.status)["failed"] == 1,
        "{}",
        value(&job.status)
    );
    Ok(())
}

/// A Job created suspended (by kubectl 1.20's `create job`) makes no pod until it
/// is resumed; then it runs to completion.
async fn suspended_job(env: &Env) -> Result<()> {
    let old = env.cluster.kubectl_1_20()?;
    let made = old
        .ok(&[
            "create",
            "job",
            "later",
            "-n",
            NS,
            "--image=file:///bin/sh",
            "--dry-run=client",
            "-o",
            "json",
            "--",
            "/bin/sh",
            "-c",
            "echo resumed",
        ])
        .await?;
    let mut object: Value = serde_json::from_str(&made)?;
    object["spec"]["suspend"] = json!(true);
    let spec = &mut object["spec"]["template"]["spec"];
    spec["nodeName"] = json!(NODE);
    spec["runtimeClassName"] = json!("process");
    env.create(object).await?;
    let job = env
        .job_until("later", "suspended", |j| {
            condition(j, "Suspended").is_some()
        })
        .await?;
    ensure!(env.pods_of(&job).is_empty(), "a suspended job made pods");
    ensure!(
        value(&job.status)["startTime"].is_null(),
        "{}",
        value(&job.status)
    );
    old.ok(&[
        "patch",
        "-n",
        NS,
        "job/later",
        "-p",
        r#"{"spec":{"suspend":false}}"#,
    ])
    .await?;
    let job = env
        .job_until("later", "complete", |j| condition(j, "Complete").is_some())
        .await?;
    ensure!(condition(&job, "Suspended").is_none(), "still suspended");
    let log = env.logs(&old, "job/later").await?;
    ensure!(log.trim() == "resumed", "{log:?}");
    Ok(())
}

/// "should delete a job": its pods go with it.
async fn delete_a_job(env: &Env) -> Result<()> {
    env.create(job(
        "deleted",
        json!({"parallelism": 2, "template": template("exec sleep 600", "Never")}),
    ))
    .await?;
    let job = env
        .job_until("deleted", "has 2 active pods", |j| {
            value(&j.status)["active"] == 2
        })
        .await?;
    env.cluster
        .kubectl_ok(&["delete", "-n", NS, "job/deleted", "--wait=false"])
        .await?;
    let uid = job.metadata.uid.clone();
    until(&env.pods, "the deleted job's pods gone", LIMIT, |pods| {
        let left = pods.list().into_iter().any(|p| {
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| Some(&r.uid) == uid.as_ref())
        });
        (!left).then_some(())
    })
    .await?;
    ensure!(
        env.jobs.get(&format!("{NS}/deleted")).is_none(),
        "the job is still there"
    );
    Ok(())
}

/// A finished Job with `ttlSecondsAfterFinished` is deleted by the TTL controller,
/// its pods with it.
async fn ttl_after_finished(env: &Env) -> Result<()> {
    env.create(job(
        "short-lived",
        json!({"ttlSecondsAfterFinished": 1, "template": template("exit 0", "Never")}),
    ))
    .await?;
    let job = env
        .job_until("short-lived", "complete", |j| {
            condition(j, "Complete").is_some()
        })
        .await?;
    let key = format!("{NS}/short-lived");
    until(
        &env.jobs,
        "the finished job deleted after its TTL",
        LIMIT,
        |jobs| {
            jobs.get(&key)
                .is_none_or(|j| j.metadata.uid != job.metadata.uid)
                .then_some(())
        },
    )
    .await?;
    let uid = job.metadata.uid.clone();
    until(&env.pods, "its pod gone", LIMIT, |pods| {
        (!pods.list().iter().any(|p| {
            p.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|r| Some(&r.uid) == uid.as_ref())
        }))
        .then_some(())
    })
    .await
}

fn cronjob(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": name, "namespace": NS}, "spec": spec})
}

impl Env {
    /// Says the CronJob last ran minutes ago: its run of this minute is missed and
    /// starts at once, as after a control plane that was down.
    async fn missed_runs(&self, name: &str) -> Result<()> {
        let api: Api<CronJob> = Api::namespaced(self.admin.clone(), NS);
        let past = k8s_openapi::jiff::Timestamp::now()
            .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(300))?
            .round(k8s_openapi::jiff::Unit::Second)?;
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"lastScheduleTime": past.to_string()}})),
        )
        .await?;
        Ok(())
    }

    /// The CronJob once `done` holds for it.
    async fn cronjob_until(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(&CronJob) -> bool,
    ) -> Result<Arc<CronJob>> {
        let key = format!("{NS}/{name}");
        until(
            &self.cronjobs,
            &format!("cronjob {name} {what}"),
            LIMIT,
            |cjs| cjs.get(&key).filter(|j| done(j)),
        )
        .await
        .with_context(|| format!("{:?}", self.cronjobs.get(&key).map(|j| value(&j.status))))
    }

    /// The Jobs the CronJob controls.
    fn jobs_of(&self, cj: &CronJob) -> Vec<Arc<Job>> {
        let uid = cj.metadata.uid.clone();
        self.jobs
            .list()
            .into_iter()
            .filter(|j| {
                j.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| r.controller == Some(true) && Some(&r.uid) == uid.as_ref())
            })
            .collect()
    }
}

fn active_names(cj: &CronJob) -> Vec<String> {
    cj.status
        .as_ref()
        .and_then(|s| s.active.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|r| r.name.clone())
        .collect()
}

/// A CronJob every minute whose Job runs `script`, with `extra` in its spec.
fn every_minute(name: &str, script: &str, extra: Value) -> Value {
    let mut spec = json!({"schedule": "* * * * *",
        "jobTemplate": {"spec": {"backoffLimit": 0, "template": template(script, "Never")}}});
    for (k, v) in extra.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    cronjob(name, spec)
}

/// "should schedule multiple jobs concurrently": the missed run starts at once,
/// the next minute's beside it (a time zone named).
async fn cron_concurrent(env: &Env) -> Result<()> {
    env.create(every_minute(
        "concurrent",
        "exec sleep 600",
        json!({"timeZone": "Etc/UTC"}),
    ))
    .await?;
    env.missed_runs("concurrent").await?;
    let cj = env
        .cronjob_until("concurrent", "has a job at once", |cj| {
            active_names(cj).len() == 1
        })
        .await?;
    let first = active_names(&cj)[0].clone();
    let job = env
        .jobs
        .get(&format!("{NS}/{first}"))
        .context("the first job")?;
    let stamp = job
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("batch.kubernetes.io/cronjob-scheduled-timestamp"))
        .context("no scheduled-timestamp annotation")?;
    let minute = stamp.parse::<k8s_openapi::jiff::Timestamp>()?.as_second() / 60;
    ensure!(
        first == format!("concurrent-{minute}"),
        "{first} for {stamp}"
    );
    env.cronjob_until("concurrent", "has two jobs running", |cj| {
        active_names(cj).len() == 2
    })
    .await?;
    Ok(())
}

/// "should replace jobs when ReplaceConcurrent".
async fn cron_replace(env: &Env) -> Result<()> {
    env.create(every_minute(
        "replace",
        "exec sleep 600",
        json!({"concurrencyPolicy": "Replace"}),
    ))
    .await?;
    env.missed_runs("replace").await?;
    let cj = env
        .cronjob_until("replace", "has a job", |cj| active_names(cj).len() == 1)
        .await?;
    let first = active_names(&cj)[0].clone();
    env.cronjob_until("replace", "replaced its job", |cj| {
        let names = active_names(cj);
        names.len() == 1 && names[0] != first
    })
    .await?;
    until(&env.jobs, "the replaced job gone", LIMIT, |jobs| {
        jobs.get(&format!("{NS}/{first}")).is_none().then_some(())
    })
    .await
}

/// "should delete successful/failed finished jobs with limit of one job": two
/// runs, the first one's Job deleted once the second finished.
async fn cron_history(env: &Env, name: &str, script: &str, outcome: &str) -> Result<()> {
    env.create(every_minute(
        name,
        script,
        json!({"successfulJobsHistoryLimit": 1, "failedJobsHistoryLimit": 1}),
    ))
    .await?;
    env.missed_runs(name).await?;
    let cj = env
        .cronjob_until(name, "ran", |cj| active_names(cj).len() == 1)
        .await?;
    let first = active_names(&cj)[0].clone();
    let key = format!("{NS}/{first}");
    env.job_until(&first, "finished", |j| condition(j, outcome).is_some())
        .await?;
    let cj = env
        .cronjob_until(name, "ran again", |cj| {
            active_names(cj).iter().any(|n| *n != first)
                || cj
                    .status
                    .as_ref()
                    .and_then(|s| s.last_schedule_time.as_ref())
                    .is_some_and(|t| !first.ends_with(&(t.0.as_second() / 60).to_string()))
        })
        .await?;
    until(&env.jobs, "the first run's job deleted", LIMIT, |jobs| {
        jobs.get(&key).is_none().then_some(())
    })
    .await?;
    let left = env.jobs_of(&cj);
    ensure!(left.len() == 1, "{} jobs left", left.len());
    if outcome == "Complete" {
        ensure!(
            cj.status
                .as_ref()
                .and_then(|s| s.last_successful_time.as_ref())
                .is_some(),
            "no lastSuccessfulTime"
        );
    }
    Ok(())
}

/// "should not schedule jobs when suspended": a suspended CronJob with runs missed
/// starts none (looked at once the other CronJobs ran twice, past a minute).
async fn cron_suspended_setup(env: &Env) -> Result<()> {
    env.create(every_minute(
        "suspended",
        "exit 0",
        json!({"suspend": true}),
    ))
    .await?;
    env.missed_runs("suspended").await
}

/// `kubectl create cronjob` and `kubectl create job --from=cronjob/x`.
async fn cron_kubectl(env: &Env) -> Result<()> {
    let made = env
        .cluster
        .kubectl_ok(&[
            "create",
            "cronjob",
            "made",
            "-n",
            NS,
            "--image=file:///bin/sh",
            "--schedule=0 0 1 1 *",
            "--dry-run=client",
            "-o",
            "json",
            "--",
            "/bin/sh",
            "-c",
            "echo from cron",
        ])
        .await?;
    let mut object: Value = serde_json::from_str(&made)?;
    let spec = &mut object["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    spec["nodeName"] = json!(NODE);
    spec["runtimeClassName"] = json!("process");
    env.create(object).await?;
    env.cluster
        .kubectl_ok(&["create", "job", "by-hand", "-n", NS, "--from=cronjob/made"])
        .await?;
    let job = env
        .job_until("by-hand", "complete", |j| {
            condition(j, "Complete").is_some()
        })
        .await?;
    ensure!(
        job.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| r.kind == "CronJob" && r.name == "made"),
        "owned by its CronJob"
    );
    let log = env.logs(env.cluster.admin(), "job/by-hand").await?;
    ensure!(log.trim() == "from cron", "{log:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_run_to_completion_fail_and_are_cleaned_up_as_kubernetes() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
    {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return Ok(());
    }
    let cluster = TestCluster::start().await?;
    let node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NODE,
            pod_cidr: POD_CIDR,
            bridge: BRIDGE,
            network: PodNetwork::Bridge {
                name: "jobs-test",
                hairpin: false,
            },
            client_ca: true,
            backoff_base: Some(Duration::from_millis(200)),
        },
    )
    .await?;
    node.set_pod_cidr().await?;
    let in_process = cluster.in_process();
    let admin = node.admin.clone();
    let manager = Manager {
        plugins: PluginHost::new(HostConfig {
            compilers: Compilers::Baseline,
            max_instances: 16,
            ..HostConfig::default()
        })?,
        informers: SharedInformers::new(),
        lister: in_process.client(identity::controller_manager()),
        queues: QueueMetrics::default(),
        running: Default::default(),
    };
    let (stop, stopped) = Shutdown::new();
    let mut running = Vec::new();
    for builtin in
        trellis_controllers::bundled::select("job,ttl-after-finished,cronjob,garbage-collector")?
    {
        let mut config = builtin.config();
        if builtin.name == "job" {
            // Failed pods replaced after 0.2 s, 0.4 s, … rather than 10 s, 20 s, ….
            config.spec.configuration =
                r#"{"podFailureBackoffSeconds": 0.2, "maxPodFailureBackoffSeconds": 1}"#.into();
        }
        let writer = in_process.client(identity::controller(builtin.account()));
        let events = EventRecorder::new(writer.clone(), builtin.identity, "test");
        running.push(
            manager
                .start(config, writer, events, stopped.clone())
                .await
                .with_context(|| format!("start {}", builtin.name))?,
        );
    }
    let watching = SharedInformers::new();
    let env = Env {
        jobs: watching.informer::<Job>(Api::all(admin.clone()), watcher::Config::default()),
        pods: watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default()),
        cronjobs: watching.informer::<CronJob>(Api::all(admin.clone()), watcher::Config::default()),
        admin: admin.clone(),
        cluster,
    };
    env.jobs.wait_synced().await;
    env.pods.wait_synced().await;
    env.cronjobs.wait_synced().await;

    let checks: Vec<(&str, Check<'_>)> = vec![
        (
            "should run a job to completion when tasks succeed",
            Box::pin(tasks_succeed(&env)),
        ),
        (
            "should run a job to completion when tasks sometimes fail and are locally restarted",
            Box::pin(tasks_sometimes_fail(&env)),
        ),
        (
            "backoffLimit exceeded",
            Box::pin(backoff_limit_exceeded(&env)),
        ),
        (
            "should fail when exceeds active deadline",
            Box::pin(active_deadline(&env)),
        ),
        (
            "should create pods for an Indexed job with completion indexes and specified hostname",
            Box::pin(indexed(&env)),
        ),
        ("should delete a job", Box::pin(delete_a_job(&env))),
        (
            "backoffLimitPerIndex",
            Box::pin(backoff_limit_per_index(&env)),
        ),
        (
            "podFailurePolicy FailJob",
            Box::pin(pod_failure_policy(&env)),
        ),
        ("suspend and resume", Box::pin(suspended_job(&env))),
        (
            "ttlSecondsAfterFinished",
            Box::pin(ttl_after_finished(&env)),
        ),
        (
            "should schedule multiple jobs concurrently",
            Box::pin(cron_concurrent(&env)),
        ),
        (
            "should replace jobs when ReplaceConcurrent",
            Box::pin(cron_replace(&env)),
        ),
        (
            "should delete successful finished jobs with limit of one successful job",
            Box::pin(cron_history(&env, "history-ok", "exit 0", "Complete")),
        ),
        (
            "should delete failed finished jobs with limit of one job",
            Box::pin(cron_history(&env, "history-failed", "exit 1", "Failed")),
        ),
        (
            "kubectl create cronjob, create job --from",
            Box::pin(cron_kubectl(&env)),
        ),
    ];
    cron_suspended_setup(&env).await?;
    let (names, futures): (Vec<_>, Vec<_>) = checks.into_iter().unzip();
    let results = futures::future::join_all(futures).await;
    let mut failures: Vec<String> = names
        .iter()
        .zip(results)
        .filter_map(|(name, r)| r.err().map(|e| format!("{name}: {e:#}")))
        .collect();
    // Past a minute's turn (the CronJobs above ran twice), the suspended one started
    // nothing.
    if let Some(cj) = env.cronjobs.get(&format!("{NS}/suspended")) {
        if !env.jobs_of(&cj).is_empty() || !active_names(&cj).is_empty() {
            failures.push("should not schedule jobs when suspended: it made a job".into());
        }
    } else {
        failures.push("should not schedule jobs when suspended: the cronjob is gone".into());
    }

    // Everything goes while the controllers run: the jobs (their pods' finalizers
    // are let go by the job controller), then the pods, before the node stops.
    let cronjobs_api: Api<CronJob> = Api::namespaced(admin.clone(), NS);
    let _ = cronjobs_api
        .delete_collection(&DeleteParams::background(), &ListParams::default())
        .await;
    let jobs_api: Api<Job> = Api::namespaced(admin.clone(), NS);
    let _ = jobs_api
        .delete_collection(&DeleteParams::background(), &ListParams::default())
        .await;
    let pods_api: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let names: Vec<String> = env
        .pods
        .list()
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let gone = delete_pods(&pods_api, &env.pods, &names, Duration::from_secs(30)).await;
    stop.stop();
    for r in running.drain(..) {
        r.stop().await;
    }
    node.stop().await?;
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    gone.context("the pods were not removed")??;
    env.cluster.stop().await?;
    Ok(())
}
