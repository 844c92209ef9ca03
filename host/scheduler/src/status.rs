//! What the scheduler writes about a pod it could not place, beside its event: the
//! PodScheduled condition and the nominated node, and the deletion of the victims
//! when it preempts. The writes run beside the loop; a failed one is logged.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tracing::{debug, info, warn};
use trellis_client::events::{EventRecorder, EventType};

use crate::event_handlers::key_of;
use crate::preemption::Nomination;

/// Deletes the victims of a preemption (each told why in a `Preempted` event, as
/// kube-scheduler tells them); their deletion moves the preemptor back into the
/// queue, and it is scheduled on the node they leave.
pub(crate) fn preempt(api: &Api<Pod>, events: &EventRecorder, pod: &Pod, nomination: Nomination) {
    let preemptor = pod.metadata.uid.clone().unwrap_or_default();
    info!(
        pod = %key_of(pod),
        node = %nomination.node,
        victims = nomination.victims.len(),
        "preempting lower-priority pods"
    );
    for victim in nomination.victims {
        events.record(
            &*victim,
            EventType::Normal,
            "Preempted",
            &format!("Preempted by pod {preemptor} on node {}", nomination.node),
        );
        let namespace = victim.metadata.namespace.clone().unwrap_or_default();
        let name = victim.metadata.name.clone().unwrap_or_default();
        let uid = victim.metadata.uid.clone();
        let api: Api<Pod> = Api::namespaced(api.clone().into_client(), &namespace);
        tokio::spawn(async move {
            let params = kube::api::DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid,
                    resource_version: None,
                }),
                ..Default::default()
            };
            if let Err(e) = api.delete(&name, &params).await {
                warn!(pod = %name, error = %e, "deleting a preemption victim failed");
            }
        });
    }
}

/// Sets the pod's PodScheduled condition to False (Unschedulable) with the message,
/// as kube-scheduler does, and its `nominatedNodeName` when it preempts, unless they
/// say so already.
pub(crate) fn mark_unschedulable(
    api: &Api<Pod>,
    pod: &Pod,
    message: &str,
    nomination: Option<&Nomination>,
) {
    let current = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"));
    let nominated = pod
        .status
        .as_ref()
        .and_then(|s| s.nominated_node_name.as_deref());
    if current.is_some_and(|c| c.status == "False" && c.message.as_deref() == Some(message))
        && nominated == nomination.map(|n| n.node.as_str())
    {
        return;
    }
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(api.clone().into_client(), &namespace);
    let mut patch = json!({"status": {"conditions": [{
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
        "lastTransitionTime": jiff_now(),
    }]}});
    if let Some(n) = nomination {
        patch["status"]["nominatedNodeName"] = json!(n.node);
    }
    tokio::spawn(async move {
        let params = PatchParams::default();
        if let Err(e) = api
            .patch_status(&name, &params, &Patch::Strategic(patch))
            .await
        {
            debug!(pod = %name, error = %e, "setting PodScheduled=False failed");
        }
    });
}

fn jiff_now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}
