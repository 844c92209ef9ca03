//! An example controller for a custom resource: for each `Greeting`
//! (`examples.trellis.dev/v1`) it keeps a ConfigMap `NAME-message` whose `message`
//! says the greeting, owned by the Greeting (so it goes when the Greeting does), and
//! reports the message in the Greeting's status.
//!
//! The ConfigMap is written with server-side apply: the controller states what it
//! wants and the API server merges it, whether the ConfigMap exists or not, and
//! leaves fields other managers own alone.

use serde::Deserialize;
use serde_json::{Value, json};
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{
    Action, EventType, ObjectKey, PatchType, Reconcile, Write, cache, client, events, owned,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Greetings {
    /// What ends every message.
    #[serde(default = "exclamation")]
    punctuation: String,
}

fn exclamation() -> String {
    "!".into()
}

fn configmaps() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "configmaps".into(),
    }
}

impl Greetings {
    /// The message a Greeting asks for.
    pub fn message(&self, greeting: &Value) -> Result<String, String> {
        let name = greeting["spec"]["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .ok_or("spec.name: Required value")?;
        let word = greeting["spec"]["greeting"].as_str().unwrap_or("Hello");
        Ok(format!("{word}, {name}{}", self.punctuation))
    }
}

impl Reconcile for Greetings {
    fn check_configuration(&self) -> Result<(), String> {
        if self.punctuation.chars().count() > 3 {
            return Err("punctuation: at most 3 characters".into());
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let ns = key.namespace.as_deref();
        let Some(greeting) = cache::get(&key.resource, ns, &key.name)? else {
            // Deleted: its ConfigMap goes with it (the garbage collector).
            return Ok(Action::Done);
        };
        if !greeting["metadata"]["deletionTimestamp"].is_null() {
            return Ok(Action::Done);
        }
        let message = match self.message(&greeting) {
            Ok(message) => message,
            Err(e) => {
                events::record(&greeting, EventType::Warning, "InvalidGreeting", &e);
                return Ok(Action::Done);
            }
        };
        let map = format!("{}-message", key.name);
        client::write(Write::Patch {
            resource: configmaps(),
            namespace: key.namespace.clone(),
            name: map.clone(),
            patch_type: PatchType::Apply,
            patch: json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": map,
                    "ownerReferences": [owned::controller_reference(
                        "examples.trellis.dev/v1", "Greeting", &greeting)],
                },
                "data": {"message": message},
            }),
            status: false,
            force: true,
        })
        .map_err(|e| format!("apply ConfigMap {map}: {e}"))?;
        let status = &greeting["status"];
        let generation = &greeting["metadata"]["generation"];
        if status["message"] != message.as_str() || status["observedGeneration"] != *generation {
            client::patch(
                &key.resource,
                ns,
                &key.name,
                PatchType::Merge,
                json!({"status": {
                    "message": message,
                    "configMap": map,
                    "observedGeneration": generation,
                }}),
                true,
            )
            .map_err(|e| format!("update the status: {e}"))?;
            events::record(
                &greeting,
                EventType::Normal,
                "Greeted",
                &format!("ConfigMap {map} says {message:?}"),
            );
        }
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(Greetings);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn greetings() -> GroupVersionResource {
        GroupVersionResource {
            group: "examples.trellis.dev".into(),
            version: "v1".into(),
            resource: "greetings".into(),
        }
    }

    #[test]
    fn a_greeting_gets_its_configmap_and_status() {
        let harness = ControllerHarness::new()
            .with_configuration(json!({"punctuation": "."}))
            .with_object(
                greetings(),
                json!({"metadata": {"name": "hello", "namespace": "default", "generation": 1},
                       "spec": {"name": "world", "greeting": "Hi"}}),
            );
        let action = harness.reconcile::<Greetings>(&greetings(), Some("default"), "hello");
        assert_eq!(action, Ok(Action::Done));
        let map = harness
            .object(&configmaps(), Some("default"), "hello-message")
            .expect("the ConfigMap");
        assert_eq!(map["data"]["message"], "Hi, world.");
        let greeting = harness
            .object(&greetings(), Some("default"), "hello")
            .unwrap();
        assert!(owned::is_controlled_by(
            &map,
            greeting["metadata"]["uid"].as_str().unwrap()
        ));
        assert_eq!(greeting["status"]["message"], "Hi, world.");
        assert_eq!(harness.events()[0].0, "Greeted");

        // Nothing changed: the ConfigMap is applied again, the status is not.
        harness
            .reconcile::<Greetings>(&greetings(), Some("default"), "hello")
            .unwrap();
        assert_eq!(harness.writes().len(), 3);
        assert_eq!(harness.events().len(), 1);
    }

    #[test]
    fn a_greeting_without_a_name_is_reported_not_retried() {
        let harness = ControllerHarness::new().with_object(
            greetings(),
            json!({"metadata": {"name": "bad", "namespace": "default"}, "spec": {}}),
        );
        let action = harness.reconcile::<Greetings>(&greetings(), Some("default"), "bad");
        assert_eq!(action, Ok(Action::Done));
        assert!(harness.writes().is_empty());
        assert_eq!(harness.events()[0].0, "InvalidGreeting");
    }

    #[test]
    fn long_punctuation_is_refused_at_load() {
        let harness = ControllerHarness::new().with_configuration(json!({"punctuation": "!!!!"}));
        let err = harness
            .reconcile::<Greetings>(&greetings(), Some("default"), "x")
            .unwrap_err();
        assert!(err.contains("at most 3"), "{err}");
    }
}
