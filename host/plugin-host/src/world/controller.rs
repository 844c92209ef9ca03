//! The `controller` world: plugins that reconcile one object at a time from the work
//! queue the controller runtime keeps for them (`trellis:controller@0.1.0`).

use wasmtime::Store;
use wasmtime::component::{HasSelf, Linker};

use super::{Call, handler_world};
use crate::bindings::controller;
use crate::state::PluginState;
use crate::{Action, ObjectKey};

handler_world! {
    /// Controller plugins.
    Controller = "controller",
    versions: [
        V0_1: controller::ControllerPre<PluginState>, controller::Controller,
            trellis_controller_handler ("trellis:controller/handler@0.1.0"),
    ],
    imports: add_imports,
}

/// The world's own imports: the controller runtime's cache, client and events.
fn add_imports(linker: &mut Linker<PluginState>) -> wasmtime::Result<()> {
    use controller::trellis::controller::{cache, client, events, types};
    types::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)?;
    cache::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)?;
    client::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)?;
    events::add_to_linker::<PluginState, HasSelf<PluginState>>(linker, |s| s)?;
    Ok(())
}

/// `reconcile`: the action, or the plugin's reason for failing.
pub(crate) struct Reconcile {
    pub(crate) key: ObjectKey,
    pub(crate) configuration: String,
}

impl Call<Controller> for Reconcile {
    type Output = Result<Action, String>;

    async fn call<'a>(
        self,
        exports: &'a Exports,
        store: &'a mut Store<PluginState>,
    ) -> wasmtime::Result<Result<Action, String>> {
        match exports {
            Exports::V0_1(e) => {
                e.trellis_controller_handler()
                    .call_reconcile(store, &self.key, &self.configuration)
                    .await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The controller world through a recording host: the fixture `children` reads
    //! the cache, writes in one batch, records events and asks to be requeued.

    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use serde_json::{Value, json};

    use crate::testing::{built, host};
    use crate::{
        ApiError, ClusterReader, ControllerHost, EventType, GroupVersionResource, HostConfig,
        LoadErrorReason, ObjectKey, PluginKind, PluginSpec, Write,
    };

    /// Objects by `namespace/name`, and what the plugin asked for.
    #[derive(Debug, Default)]
    struct Recorder {
        objects: Mutex<HashMap<String, Value>>,
        writes: Mutex<Vec<Write>>,
        events: Mutex<Vec<(String, String)>>,
    }

    fn key(namespace: Option<&str>, name: &str) -> String {
        format!("{}/{name}", namespace.unwrap_or_default())
    }

    #[async_trait::async_trait]
    impl ClusterReader for Recorder {
        async fn get(
            &self,
            _: &GroupVersionResource,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<Option<String>, String> {
            let objects = self.objects.lock().unwrap();
            Ok(objects.get(&key(namespace, name)).map(Value::to_string))
        }

        async fn list(
            &self,
            _: &GroupVersionResource,
            _: Option<&str>,
            _: &str,
        ) -> Result<Vec<String>, String> {
            Err("not used".into())
        }
    }

    #[async_trait::async_trait]
    impl ControllerHost for Recorder {
        async fn owned_by(
            &self,
            _: &GroupVersionResource,
            owner_uid: &str,
        ) -> Result<Vec<String>, String> {
            let objects = self.objects.lock().unwrap();
            Ok(objects
                .values()
                .filter(|o| o["metadata"]["ownerReferences"][0]["uid"] == owner_uid)
                .map(Value::to_string)
                .collect())
        }

        async fn dependents(&self, _: &str) -> Result<Vec<String>, String> {
            Err("not used".into())
        }

        async fn resource_of(&self, _: &str, _: &str) -> Option<crate::ServedResource> {
            None
        }

        async fn resources(&self) -> Vec<crate::ServedResource> {
            Vec::new()
        }

        async fn update_subresource(
            &self,
            _: crate::UpdateRequest,
            _: &str,
        ) -> Result<String, ApiError> {
            Err(ApiError {
                code: 405,
                reason: "MethodNotAllowed".into(),
                message: String::new(),
                causes: Vec::new(),
            })
        }

        async fn read(
            &self,
            resource: &GroupVersionResource,
            namespace: Option<&str>,
            name: &str,
        ) -> Result<Option<String>, ApiError> {
            Ok(self.get(resource, namespace, name).await.unwrap_or(None))
        }

        async fn write(&self, write: Write) -> Result<String, ApiError> {
            self.writes.lock().unwrap().push(write.clone());
            match write {
                Write::Create(c) => {
                    let object: Value = serde_json::from_str(&c.object).unwrap();
                    let name = object["metadata"]["name"].as_str().unwrap().to_owned();
                    if name.ends_with("-1") {
                        return Err(ApiError {
                            code: 409,
                            reason: "AlreadyExists".into(),
                            message: format!("configmaps \"{name}\" already exists"),
                            causes: Vec::new(),
                        });
                    }
                    Ok(object.to_string())
                }
                Write::Delete(d) => Err(ApiError {
                    code: 403,
                    reason: "Forbidden".into(),
                    message: format!("cannot delete {}", d.name),
                    causes: Vec::new(),
                }),
                _ => Err(ApiError {
                    code: 405,
                    reason: "MethodNotAllowed".into(),
                    message: String::new(),
                    causes: Vec::new(),
                }),
            }
        }

        async fn record_event(&self, _: &str, _: EventType, reason: &str, message: &str) {
            self.events
                .lock()
                .unwrap()
                .push((reason.to_owned(), message.to_owned()));
        }
    }

    fn configmaps() -> GroupVersionResource {
        GroupVersionResource {
            group: String::new(),
            version: "v1".into(),
            resource: "configmaps".into(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_controller_reads_the_cache_writes_in_one_batch_and_records_events() {
        let host = host(HostConfig::default());
        let recorder = Arc::new(Recorder::default());
        recorder.objects.lock().unwrap().insert(
            "ns/web".into(),
            json!({"metadata": {"name": "web", "namespace": "ns", "uid": "u-web",
                "annotations": {"trellis.dev/children": "3", "trellis.dev/requeue-ms": "250"}}}),
        );
        // A child past the count, owned: deleted (and the delete refused).
        recorder.objects.lock().unwrap().insert(
            "ns/web-7".into(),
            json!({"metadata": {"name": "web-7", "namespace": "ns",
                "ownerReferences": [{"uid": "u-web"}]}}),
        );
        let mut spec = PluginSpec::new("children", PluginKind::Controller);
        spec.timeout = Duration::from_secs(5);
        let plugin = host
            .load_controller(spec, built("children"), recorder.clone(), None)
            .await
            .unwrap();
        let key = ObjectKey {
            resource: configmaps(),
            namespace: Some("ns".into()),
            name: "web".into(),
        };
        let answer = plugin.reconcile(&host, &key).await.unwrap();
        // The refused delete fails the reconcile (retried with back-off); the
        // AlreadyExists of web-1 does not.
        let reason = answer.unwrap_err();
        assert!(
            reason.contains("403 Forbidden: cannot delete web-7"),
            "{reason}"
        );
        let writes = recorder.writes.lock().unwrap().clone();
        let created: Vec<String> = writes
            .iter()
            .filter_map(|w| match w {
                Write::Create(c) => {
                    let o: Value = serde_json::from_str(&c.object).unwrap();
                    assert_eq!(o["metadata"]["ownerReferences"][0]["uid"], "u-web");
                    assert_eq!(c.namespace.as_deref(), Some("ns"));
                    Some(o["metadata"]["name"].as_str().unwrap().to_owned())
                }
                _ => None,
            })
            .collect();
        assert_eq!(created, ["web-0", "web-1", "web-2"]);
        assert_eq!(writes.len(), 4, "{writes:?}");
        assert_eq!(
            *recorder.events.lock().unwrap(),
            [
                (
                    "SuccessfulCreate".to_owned(),
                    "Created 3 children".to_owned()
                ),
                (
                    "SuccessfulDelete".to_owned(),
                    "Deleted 1 children".to_owned()
                )
            ]
        );

        // Without the extra child it succeeds and asks to be requeued.
        recorder.objects.lock().unwrap().remove("ns/web-7");
        let action = plugin.reconcile(&host, &key).await.unwrap().unwrap();
        assert!(
            matches!(action, crate::Action::RequeueAfter(250)),
            "{action:?}"
        );
        // A key whose object is gone: nothing to do, nothing written.
        let before = recorder.writes.lock().unwrap().len();
        let gone = ObjectKey {
            name: "gone".into(),
            ..key
        };
        let action = plugin.reconcile(&host, &gone).await.unwrap().unwrap();
        assert!(matches!(action, crate::Action::Done), "{action:?}");
        assert_eq!(recorder.writes.lock().unwrap().len(), before);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_admission_plugin_is_not_a_controller() {
        let host = host(HostConfig::default());
        let spec = PluginSpec::new("noop", PluginKind::Controller);
        let err = host
            .load_controller(spec, built("noop"), Arc::new(Recorder::default()), None)
            .await
            .unwrap_err();
        assert_eq!(err.reason, LoadErrorReason::WrongWorld, "{err:?}");
        assert!(
            err.message.contains("trellis:controller/handler@0.1.0"),
            "{}",
            err.message
        );
    }
}
