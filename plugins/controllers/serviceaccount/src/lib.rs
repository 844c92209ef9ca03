//! The ServiceAccount controller, as Kubernetes' behaves: every active namespace has
//! the ServiceAccounts the configuration names (`default`), created again when
//! deleted. A namespace being deleted gets none.

use serde::Deserialize;
use serde_json::json;
use trellis_plugin::GroupVersionResource;
use trellis_plugin::controller::{self, Action, ObjectKey, Reconcile, cache, client};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceAccounts {
    #[serde(default = "default_accounts")]
    service_accounts: Vec<String>,
}

fn default_accounts() -> Vec<String> {
    vec!["default".into()]
}

fn serviceaccounts() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "serviceaccounts".into(),
    }
}

impl Reconcile for ServiceAccounts {
    fn check_configuration(&self) -> Result<(), String> {
        if self.service_accounts.iter().any(String::is_empty) {
            return Err("serviceAccounts: names must not be empty".into());
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
        for name in &self.service_accounts {
            if cache::get(&serviceaccounts(), Some(&key.name), name)?.is_some() {
                continue;
            }
            match client::create(
                &serviceaccounts(),
                Some(&key.name),
                json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
            ) {
                Ok(_) => {}
                // Made meanwhile, or the namespace started terminating.
                Err(e) if e.is_already_exists() || e.is_namespace_terminating() => {}
                Err(e) => return Err(format!("create ServiceAccount {}/{name}: {e}", key.name)),
            }
        }
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(ServiceAccounts);

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_plugin::testing::ControllerHarness;

    fn namespaces() -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "namespaces".into(),
        }
    }

    #[test]
    fn an_active_namespace_gets_its_default_account_once() {
        let harness = ControllerHarness::new().with_object(
            namespaces(),
            json!({"metadata": {"name": "team"}, "status": {"phase": "Active"}}),
        );
        harness
            .reconcile::<ServiceAccounts>(&namespaces(), None, "team")
            .unwrap();
        assert!(
            harness
                .object(&serviceaccounts(), Some("team"), "default")
                .is_some()
        );
        harness
            .reconcile::<ServiceAccounts>(&namespaces(), None, "team")
            .unwrap();
        assert_eq!(harness.writes().len(), 1);
    }

    #[test]
    fn a_terminating_namespace_gets_none() {
        let harness = ControllerHarness::new().with_object(
            namespaces(),
            json!({"metadata": {"name": "old"}, "status": {"phase": "Terminating"}}),
        );
        harness
            .reconcile::<ServiceAccounts>(&namespaces(), None, "old")
            .unwrap();
        assert!(harness.writes().is_empty());
    }
}
