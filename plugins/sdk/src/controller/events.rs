//! Events about objects.

use serde_json::Value;

use super::imports::{EventType, current};

/// Records an event about `object` (its kind, name, namespace and uid are what
/// the event refers to). Never fails: the host drops what its limits refuse.
pub fn record(object: &Value, event_type: EventType, reason: &str, message: &str) {
    if let Ok(host) = current() {
        host.record(&object.to_string(), event_type, reason, message);
    }
}
