//! What the API server writes to a Plugin's status: the `Loaded` condition of each
//! load's outcome, the digest serving, and its call counters, through the registry's
//! status path.

use std::sync::Arc;

use serde_json::{Value, json};
use tracing::warn;
use trellis_plugin_host::{Plugin, Tier};
use trellis_plugins::spec;

use super::Bound;
use crate::admission::Cluster;
use crate::object::now_timestamp;

/// The field manager of the statuses the plugin host writes.
const MANAGER: &str = "trellis-plugin-host";

/// What the periodic status refresh reports: the counters and the code's tier.
pub(super) fn counters(plugin: &Plugin) -> ([u64; 4], Tier) {
    use std::sync::atomic::Ordering::Relaxed;
    let m = &plugin.metrics;
    (
        [
            m.calls.load(Relaxed),
            m.denials.load(Relaxed),
            m.errors.load(Relaxed),
            m.timeouts.load(Relaxed),
        ],
        plugin.tier(),
    )
}

pub(super) fn set_counters(status: &mut serde_json::Map<String, Value>, plugin: &Plugin) {
    let ([calls, denials, errors, timeouts], tier) = counters(plugin);
    status.insert("tier".into(), tier.as_str().into());
    status.insert("calls".into(), calls.into());
    status.insert("denials".into(), denials.into());
    status.insert("errors".into(), errors.into());
    status.insert("timeouts".into(), timeouts.into());
}

/// Records a load's outcome in the Plugin's status: the `Loaded` condition, the
/// digest serving and its counters.
pub(super) async fn write_status(
    cluster: Option<Arc<dyn Cluster>>,
    meta: &Value,
    result: Result<(), (&'static str, String)>,
    serving: Option<&Bound>,
) {
    let generation = meta["generation"].as_i64().unwrap_or(0);
    let (status, reason, message) = match (&result, serving) {
        (Ok(()), Some(bound)) => (
            "True",
            "Loaded".to_owned(),
            format!("serving {}", bound.plugin.digest()),
        ),
        // The message says what keeps serving.
        (Err((reason, message)), _) => ("False", (*reason).to_owned(), message.clone()),
        (Ok(()), None) => ("False", "NotLoaded".to_owned(), String::new()),
    };
    let uid = meta["uid"].as_str().map(str::to_owned);
    let name = meta["name"].as_str().unwrap_or_default();
    let written = update_status(cluster, name, uid.as_deref(), |s| {
        let previous = s
            .get("conditions")
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
            .cloned();
        let since = match &previous {
            Some(p) if p["status"] == status => p["lastTransitionTime"].clone(),
            _ => Value::String(now_timestamp()),
        };
        s.insert(
            "conditions".into(),
            json!([{
                "type": "Loaded",
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }]),
        );
        s.insert("observedGeneration".into(), generation.into());
        match serving {
            Some(bound) => {
                s.insert("digest".into(), bound.plugin.digest().into());
                set_counters(s, &bound.plugin);
            }
            None => {
                s.remove("digest");
            }
        }
    })
    .await;
    if let Err(e) = written {
        warn!(plugin = name, error = %e, "writing a Plugin status failed");
    }
}

/// Writes a Plugin's status through the registry's status path (the server's own
/// write, as a controller's status update).
pub(super) async fn update_status(
    cluster: Option<Arc<dyn Cluster>>,
    name: &str,
    uid: Option<&str>,
    mut change: impl FnMut(&mut serde_json::Map<String, Value>) + Send,
) -> anyhow::Result<()> {
    let Some(cluster) = cluster else {
        // The server is stopping.
        return Ok(());
    };
    let target = crate::admission::StatusTarget {
        group: spec::GROUP.into(),
        version: spec::VERSION.into(),
        plural: spec::PLURAL.into(),
        namespace: None,
        name: name.to_owned(),
        uid: uid.map(str::to_owned),
        manager: MANAGER,
    };
    cluster
        .write_status(&target, &mut |_, status| {
            change(status);
            Ok(())
        })
        .await
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!(e.message))
}
