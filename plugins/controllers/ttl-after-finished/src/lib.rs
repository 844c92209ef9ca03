//! The TTL-after-finished controller, as Kubernetes' behaves: a finished Job
//! (`Complete` or `Failed`) with `spec.ttlSecondsAfterFinished` is deleted that
//! long after it finished (the time its finishing condition was set), its pods
//! with it (foreground propagation). The key comes back when the time is due; the
//! Job is read again from the API server before the delete, so a TTL changed
//! meanwhile is honoured, and the delete names the Job's uid.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use trellis_plugin::controller::{
    Action, ObjectKey, Propagation, Reconcile, Write, cache, client, time,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtlAfterFinished {}

/// When the Job finished, in seconds since the epoch; `None` while it runs.
pub fn finished_at(job: &Value) -> Option<i64> {
    job["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| (c["type"] == "Complete" || c["type"] == "Failed") && c["status"] == "True")
        .map(|c| {
            c["lastTransitionTime"]
                .as_str()
                .and_then(time::parse)
                .unwrap_or_else(time::now)
        })
}

/// How long until the Job is due: `None` when it is not to be deleted (running,
/// no TTL, or being deleted already).
pub fn due_in(job: &Value, now: i64) -> Option<i64> {
    if !job["metadata"]["deletionTimestamp"].is_null() {
        return None;
    }
    let ttl = job["spec"]["ttlSecondsAfterFinished"].as_i64()?;
    Some(finished_at(job)? + ttl - now)
}

impl Reconcile for TtlAfterFinished {
    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(job) = cache::get(&key.resource, ns, &key.name)? else {
            return Ok(Action::Done);
        };
        match due_in(&job, time::now()) {
            None => return Ok(Action::Done),
            Some(left) if left > 0 => {
                return Ok(Action::RequeueAfter(Duration::from_secs(left as u64)));
            }
            Some(_) => {}
        }
        // The cache may lag: the TTL the API server has now decides.
        let live = match client::read(&key.resource, ns, &key.name) {
            Ok(Some(live)) => live,
            Ok(None) => return Ok(Action::Done),
            Err(e) => return Err(format!("read the job: {e}")),
        };
        match due_in(&live, time::now()) {
            None => return Ok(Action::Done),
            Some(left) if left > 0 => {
                return Ok(Action::RequeueAfter(Duration::from_secs(left as u64)));
            }
            Some(_) => {}
        }
        let delete = Write::Delete {
            resource: key.resource.clone(),
            namespace: key.namespace.clone(),
            name: key.name.clone(),
            propagation: Some(Propagation::Foreground),
            uid: live["metadata"]["uid"].as_str().map(str::to_owned),
        };
        match client::write(delete) {
            Ok(_) => Ok(Action::Done),
            Err(e) if e.is_not_found() || e.code == 409 => Ok(Action::Done),
            Err(e) => Err(format!("delete the job: {e}")),
        }
    }
}

trellis_plugin::controller!(TtlAfterFinished);

#[cfg(test)]
mod tests {
    use serde_json::json;
    use trellis_plugin::GroupVersionResource;
    use trellis_plugin::testing::ControllerHarness;

    use super::*;

    fn jobs() -> GroupVersionResource {
        GroupVersionResource {
            group: "batch".into(),
            version: "v1".into(),
            resource: "jobs".into(),
        }
    }

    fn job(ttl: Option<i64>, finished_secs_ago: Option<i64>) -> Value {
        let mut j = json!({"metadata": {"name": "pi", "namespace": "ns", "uid": "u"}, "spec": {}});
        if let Some(ttl) = ttl {
            j["spec"]["ttlSecondsAfterFinished"] = json!(ttl);
        }
        if let Some(ago) = finished_secs_ago {
            j["status"]["conditions"] = json!([{"type": "Complete", "status": "True",
                "lastTransitionTime": time::format(time::now() - ago)}]);
        }
        j
    }

    fn reconcile(j: Value) -> (Action, ControllerHarness) {
        let h = ControllerHarness::new().with_object(jobs(), j);
        let action = h
            .reconcile::<TtlAfterFinished>(&jobs(), Some("ns"), "pi")
            .unwrap();
        (action, h)
    }

    #[test]
    fn a_finished_job_is_deleted_in_the_foreground_once_its_ttl_passed() {
        let (action, h) = reconcile(job(Some(10), Some(11)));
        assert_eq!(action, Action::Done);
        assert!(matches!(
            &h.writes()[..],
            [Write::Delete { propagation: Some(Propagation::Foreground), uid: Some(u), .. }] if u == "u"
        ));
    }

    #[test]
    fn a_job_not_yet_due_comes_back_when_it_is() {
        let (action, h) = reconcile(job(Some(100), Some(10)));
        let Action::RequeueAfter(d) = action else {
            panic!("{action:?}")
        };
        assert!(d <= Duration::from_secs(90) && d >= Duration::from_secs(89));
        assert!(h.writes().is_empty());
    }

    #[test]
    fn running_jobs_and_jobs_without_a_ttl_are_left_alone() {
        for j in [job(Some(0), None), job(None, Some(1000))] {
            let (action, h) = reconcile(j);
            assert_eq!(action, Action::Done);
            assert!(h.writes().is_empty());
        }
    }
}
