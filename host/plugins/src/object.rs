//! Plugin objects as a Kubernetes client sees them: their resource, the fingerprint
//! of a declaration, the [`Change`] a watched object makes, and the `Loaded` condition
//! written through their status (the controller manager's and the scheduler's status
//! writer; the API server writes its own through its registry).

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use tracing::warn;

use crate::follow::{Change, Failure};
use crate::spec;

/// The `plugins.trellis.dev` resource.
pub fn plugins_resource() -> ApiResource {
    ApiResource {
        group: spec::GROUP.into(),
        version: spec::VERSION.into(),
        api_version: format!("{}/{}", spec::GROUP, spec::VERSION),
        kind: "Plugin".into(),
        plural: spec::PLURAL.into(),
    }
}

/// What changes when a Plugin object's declaration does: its uid and generation.
pub fn fingerprint(obj: &DynamicObject) -> String {
    format!(
        "{}/{}",
        obj.metadata.uid.as_deref().unwrap_or_default(),
        obj.metadata.generation.unwrap_or_default()
    )
}

/// Whether a Plugin object declares a plugin of `kind` (`controller`, `scheduler`).
pub fn is_kind(obj: &DynamicObject, kind: &str) -> bool {
    obj.data["spec"]["kind"]
        .as_str()
        .is_some_and(|k| k.eq_ignore_ascii_case(kind))
}

/// The change a watched Plugin object makes: one being deleted is gone already.
pub fn change(obj: DynamicObject, deleted: bool) -> Change<DynamicObject> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    if deleted || obj.metadata.deletion_timestamp.is_some() {
        return Change::Deleted { name };
    }
    Change::Applied {
        name,
        fingerprint: fingerprint(&obj),
        declaration: obj,
    }
}

/// Now, as a condition's `lastTransitionTime`.
fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Writes the Plugin's `Loaded` condition (and digest) through its status, as the
/// field manager `manager`. `loaded` is the reason when it runs.
pub async fn write_loaded(
    client: &kube::Client,
    manager: &str,
    obj: &DynamicObject,
    result: Result<String, Failure>,
    loaded: &'static str,
) {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let previous = obj.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Loaded"))
        .cloned()
        .unwrap_or(Value::Null);
    let (status, reason, message, digest) = match &result {
        Ok(digest) => (
            "True",
            loaded,
            format!("running {digest}"),
            Some(digest.clone()),
        ),
        Err((reason, message)) => ("False", *reason, message.clone(), None),
    };
    let since = if previous["status"] == status {
        previous["lastTransitionTime"].clone()
    } else {
        json!(now())
    };
    let mut patch = json!({"status": {
        "observedGeneration": obj.metadata.generation,
        "conditions": [{
            "type": "Loaded",
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
            "observedGeneration": obj.metadata.generation,
        }],
    }});
    if let Some(digest) = digest {
        patch["status"]["digest"] = json!(digest);
    }
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &plugins_resource());
    let params = PatchParams {
        field_manager: Some(manager.into()),
        ..PatchParams::default()
    };
    if let Err(e) = api.patch_status(&name, &params, &Patch::Merge(patch)).await {
        warn!(plugin = %name, error = %e, "writing the plugin's status failed");
    }
}
