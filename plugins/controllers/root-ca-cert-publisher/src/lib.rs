//! The root CA publisher, as Kubernetes' behaves: every active namespace has the
//! ConfigMap `kube-root-ca.crt` whose `ca.crt` is the cluster CA (what a pod verifies
//! the API server with), put back as it should be when changed or deleted. The host
//! gives the CA in the configuration (`caCrt`).

use serde::Deserialize;
use serde_json::json;
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{self, Action, ObjectKey, PatchType, Reconcile, cache, client};

pub const NAME: &str = "kube-root-ca.crt";
const DESCRIPTION: &str = "Contains a CA bundle that can be used to verify the kube-apiserver when using internal endpoints such as the internal service IP or kubernetes.default.svc. No other usage is guaranteed across distributions of Kubernetes clusters.";

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RootCa {
    /// The cluster CA, PEM.
    ca_crt: String,
}

fn configmaps() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "configmaps".into(),
    }
}

impl Reconcile for RootCa {
    fn check_configuration(&self) -> Result<(), String> {
        if !self.ca_crt.contains("-----BEGIN CERTIFICATE-----") {
            return Err("caCrt: expected a PEM certificate".into());
        }
        Ok(())
    }

    fn reconcile(&self, key: &ObjectKey) -> Result<Action, String> {
        let Some(namespace) = cache::get(&key.resource, None, &key.name)? else {
            return Ok(Action::Done);
        };
        if !controller::namespace_is_active(&namespace) {
            return Ok(Action::Done);
        }
        let ns = Some(key.name.as_str());
        let wanted = json!({"ca.crt": self.ca_crt});
        let result = match cache::get(&configmaps(), ns, NAME)? {
            Some(map) if map["data"] == wanted => return Ok(Action::Done),
            Some(_) => client::patch(
                &configmaps(),
                ns,
                NAME,
                PatchType::Merge,
                json!({"data": wanted}),
                false,
            ),
            None => client::create(
                &configmaps(),
                ns,
                json!({
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": NAME, "annotations": {"kubernetes.io/description": DESCRIPTION}},
                    "data": wanted,
                }),
            ),
        };
        match result {
            Ok(_) => Ok(Action::Done),
            Err(e) if e.is_already_exists() || e.is_not_found() => Ok(Action::Done),
            Err(e) if e.is_namespace_terminating() => Ok(Action::Done),
            Err(e) => Err(format!("publish {}/{NAME}: {e}", key.name)),
        }
    }
}

trellis_plugin::controller!(RootCa);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    fn namespaces() -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "namespaces".into(),
        }
    }

    #[test]
    fn the_ca_is_published_and_put_back_when_changed() {
        let harness = ControllerHarness::new()
            .with_configuration(json!({"caCrt": PEM}))
            .with_object(namespaces(), json!({"metadata": {"name": "team"}}))
            .with_object(
                configmaps(),
                json!({"metadata": {"name": NAME, "namespace": "other"}, "data": {"ca.crt": "x"}}),
            )
            .with_object(namespaces(), json!({"metadata": {"name": "other"}}));
        harness
            .reconcile::<RootCa>(&namespaces(), None, "team")
            .unwrap();
        let map = harness.object(&configmaps(), Some("team"), NAME).unwrap();
        assert_eq!(map["data"]["ca.crt"], PEM);
        harness
            .reconcile::<RootCa>(&namespaces(), None, "other")
            .unwrap();
        let map = harness.object(&configmaps(), Some("other"), NAME).unwrap();
        assert_eq!(map["data"]["ca.crt"], PEM);
        // Up to date: nothing written.
        let before = harness.writes().len();
        harness
            .reconcile::<RootCa>(&namespaces(), None, "team")
            .unwrap();
        assert_eq!(harness.writes().len(), before);
    }

    #[test]
    fn a_configuration_without_a_certificate_is_refused() {
        let harness = ControllerHarness::new().with_configuration(json!({"caCrt": "nope"}));
        let err = harness
            .reconcile::<RootCa>(&namespaces(), None, "team")
            .unwrap_err();
        assert!(err.contains("PEM"), "{err}");
    }
}
