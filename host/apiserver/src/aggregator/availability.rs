//! The availability controller: for each APIService, whether its backend answers, kept
//! in its `Available` condition as kube-aggregator's `AvailableConditionController`
//! does. A local APIService (no `spec.service`) is `Available` with reason `Local`; a
//! remote one's Service and Endpoints are resolved (`ServiceNotFound`,
//! `MissingEndpoints`, …) and its discovery document fetched (`FailedDiscoveryCheck`
//! when that fails, `Passed` when it answers). The document fetched is what discovery
//! lists for the group-version.
//!
//! Every APIService is checked on each change of APIServices and of the Services and
//! Endpoints behind them (followed through the watch cache), and every
//! [`Config::check_interval`](super::Config::check_interval) besides.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Value, json};
use tracing::{debug, info, warn};
use trellis_api::Shutdown;

use super::{Aggregator, GROUP, Route, proxy};
use crate::state::AppState;
use crate::storage::watch_cache::Subscription;

const APISERVICES: &str = "/registry/apiregistration.k8s.io/apiservices/";
const SERVICES: &str = "/registry/core/services/";
const ENDPOINTS: &str = "/registry/core/endpoints/";

/// Runs the controller until `stopped`.
pub fn start(state: Arc<AppState>, stopped: Shutdown) {
    tokio::spawn(async move {
        let Some(aggregator) = super::of(&state) else {
            return;
        };
        let mut subscriptions: Vec<Option<Subscription>> = vec![None, None, None];
        loop {
            // Subscribed before the pass: a change during it is seen after it.
            for (slot, prefix) in subscriptions
                .iter_mut()
                .zip([APISERVICES, SERVICES, ENDPOINTS])
            {
                if slot.is_none() {
                    *slot = state.cache.subscribe(prefix, state.cache.revision()).ok();
                }
            }
            if let Err(e) = check_all(&state, aggregator).await {
                warn!(error = %format!("{e:#}"), "checking the APIServices failed");
            }
            tokio::select! {
                () = tokio::time::sleep(aggregator.config.check_interval) => {}
                () = relevant_change(aggregator, &mut subscriptions) => {}
                () = stopped.wait() => return,
            }
        }
    });
}

/// Completes on a change of an APIService, or of a Service or Endpoints an APIService
/// names; a subscription that ends is dropped (and made again by the loop).
async fn relevant_change(aggregator: &Aggregator, subscriptions: &mut [Option<Subscription>]) {
    loop {
        let receivers = subscriptions
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| s.as_mut().map(|s| (i, s)))
            .map(|(i, s)| {
                Box::pin(async move {
                    if let Some(event) = s.replay.pop() {
                        return (i, Some(event));
                    }
                    (i, s.rx.recv().await)
                })
            })
            .collect::<Vec<_>>();
        if receivers.is_empty() {
            return std::future::pending().await;
        }
        let ((i, event), _, _) = futures::future::select_all(receivers).await;
        let Some(event) = event else {
            subscriptions[i] = None;
            return;
        };
        let key = &event.key;
        if key.starts_with(APISERVICES) {
            return;
        }
        // `/registry/core/{services,endpoints}/{namespace}/{name}`
        let mut parts = key.rsplitn(3, '/');
        let (Some(name), Some(namespace)) = (parts.next(), parts.next()) else {
            continue;
        };
        if aggregator.backs(namespace, name) {
            return;
        }
    }
}

/// Reads every APIService, serves their routes, and checks each.
async fn check_all(state: &AppState, aggregator: &Aggregator) -> anyhow::Result<()> {
    let objects = aggregator.apiservices.list_all().await?;
    let mut routes = BTreeMap::new();
    let mut checks = Vec::new();
    for obj in &objects {
        let obj = Value::Object((**obj).clone());
        let Some(route) = Route::from_object(&obj) else {
            continue;
        };
        let (available, reason, message) = check(aggregator, &route).await;
        let mut route = route;
        route.available = available;
        if route.service.is_some() {
            routes.insert((route.group.clone(), route.version.clone()), route.clone());
        }
        checks.push((route, obj, available, reason, message));
    }
    // Served before the statuses are written: a request right after the condition
    // turns True finds its route.
    aggregator.set_routes(routes);
    for (route, obj, available, reason, message) in checks {
        write_condition(state, &route, &obj, available, reason, &message).await;
    }
    Ok(())
}

/// Whether `route`'s backend is available, with the condition's reason and message.
async fn check(aggregator: &Aggregator, route: &Route) -> (bool, &'static str, String) {
    let Some(service) = &route.service else {
        return (
            true,
            "Local",
            "Local APIServices are always available".to_owned(),
        );
    };
    let target = match proxy::resolve(aggregator, service).await {
        Ok(target) => target,
        Err(unresolved) => {
            aggregator.set_discovery(&route.name, None);
            return (false, unresolved.reason, unresolved.message);
        }
    };
    match proxy::discover(aggregator, route, service, (&target.0, target.1)).await {
        Ok(doc) => {
            aggregator.set_discovery(&route.name, Some(doc));
            (true, "Passed", "all checks passed".to_owned())
        }
        Err(e) => (false, "FailedDiscoveryCheck", e),
    }
}

/// Writes the `Available` condition if it changed (its transition time only when its
/// status did).
async fn write_condition(
    state: &AppState,
    route: &Route,
    obj: &Value,
    available: bool,
    reason: &'static str,
    message: &str,
) {
    let status = if available { "True" } else { "False" };
    let current = obj["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Available");
    if current
        .is_some_and(|c| c["status"] == status && c["reason"] == reason && c["message"] == message)
    {
        return;
    }
    let target = crate::registry::status::StatusTarget {
        group: GROUP.to_owned(),
        version: "v1".to_owned(),
        plural: "apiservices".to_owned(),
        namespace: None,
        name: route.name.clone(),
        uid: obj["metadata"]["uid"].as_str().map(str::to_owned),
        manager: "kube-aggregator",
    };
    let now = crate::object::now_timestamp();
    let mut change = |_: &crate::object::Object,
                      status_map: &mut serde_json::Map<String, Value>| {
        let mut conditions: Vec<Value> = status_map
            .get("conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let previous = conditions.iter().position(|c| c["type"] == "Available");
        let since = previous
            .map(|i| &conditions[i])
            .filter(|c| c["status"] == status)
            .and_then(|c| c["lastTransitionTime"].as_str())
            .map_or_else(|| now.clone(), str::to_owned);
        let condition = json!({
            "type": "Available", "status": status, "lastTransitionTime": since,
            "reason": reason, "message": message,
        });
        match previous {
            Some(i) => conditions[i] = condition,
            None => conditions.push(condition),
        }
        status_map.insert("conditions".into(), Value::Array(conditions));
        Ok(())
    };
    match crate::registry::status::write_status(state, &target, &mut change).await {
        Ok(Some(_)) if available => info!(apiservice = %route.name, "available"),
        Ok(Some(_)) => info!(apiservice = %route.name, reason, %message, "not available"),
        Ok(None) => {}
        Err(e) => {
            debug!(apiservice = %route.name, error = %e.0.message, "writing the Available condition failed")
        }
    }
}
