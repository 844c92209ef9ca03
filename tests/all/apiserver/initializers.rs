//! Initializers through the API: objects wait, invisible, for the initializers that
//! apply to them; the creating client gets the initialized object, or the failure.

use std::sync::Arc;

use anyhow::{Result, ensure};
use async_trait::async_trait;
use serde_json::Value;
use trellis_api::registry::ResourceInfo;
use trellis_apiserver::admission::{Chains, Initializer};
use trellis_apiserver::object::Object;
use trellis_tests::TestCluster;

/// Annotates ConfigMaps; with a gate, only once the test opens it, so that the test
/// can look at the object meanwhile.
#[derive(Debug)]
struct Annotate {
    name: &'static str,
    gate: Option<Gate>,
}

/// Told when the initializer starts; it goes on when `open` is notified.
#[derive(Clone, Debug, Default)]
struct Gate {
    started: Arc<tokio::sync::Notify>,
    open: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Initializer for Annotate {
    fn name(&self) -> &str {
        self.name
    }
    fn applies_to(&self, resource: &ResourceInfo) -> bool {
        resource.plural == "configmaps"
    }
    async fn initialize(
        &self,
        _resource: &ResourceInfo,
        mut obj: Object,
    ) -> Result<Object, String> {
        if let Some(gate) = &self.gate {
            gate.started.notify_one();
            gate.open.notified().await;
        }
        let meta = obj
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or("no metadata")?;
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        annotations
            .as_object_mut()
            .ok_or("annotations are not a map")?
            .insert(format!("{}.example.com/done", self.name), "true".into());
        Ok(obj)
    }
}

/// Refuses every object.
#[derive(Debug)]
struct Refuse;

#[async_trait]
impl Initializer for Refuse {
    fn name(&self) -> &str {
        "refuse"
    }
    fn applies_to(&self, resource: &ResourceInfo) -> bool {
        resource.plural == "configmaps"
    }
    async fn initialize(&self, _resource: &ResourceInfo, _obj: Object) -> Result<Object, String> {
        Err("configmaps are not welcome here".into())
    }
}

fn chains(initializers: Vec<Arc<dyn Initializer>>) -> Chains {
    Chains {
        initializers,
        ..trellis_apiserver::admission::builtin()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_wait_for_initializers_in_order_and_stay_invisible_until_done() -> Result<()> {
    let gate = Gate::default();
    let first: Arc<dyn Initializer> = Arc::new(Annotate {
        name: "first",
        gate: Some(gate.clone()),
    });
    let second: Arc<dyn Initializer> = Arc::new(Annotate {
        name: "second",
        gate: None,
    });
    let cluster = TestCluster::builder()
        .with_chains(chains(vec![first, second]))
        .start()
        .await?;

    let manifest =
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"slow"},"data":{"a":"b"}}"#;
    let creating = {
        let admin = cluster.admin().clone();
        tokio::spawn(async move {
            admin
                .ok_stdin(
                    &["create", "--validate=false", "-f", "-", "-o", "json"],
                    manifest,
                )
                .await
        })
    };
    gate.started.notified().await;
    // While the first initializer works, the object exists but is invisible.
    let listed = cluster
        .kubectl_ok(&["get", "configmaps", "-o", "name"])
        .await?;
    ensure!(
        !listed.contains("configmap/slow"),
        "visible before initialization: {listed}"
    );
    let hidden = cluster.kubectl_err(&["get", "configmap", "slow"]).await?;
    ensure!(hidden.contains("NotFound"), "{hidden}");
    let listed_all = cluster
        .kubectl_ok(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/configmaps?includeUninitialized=true",
        ])
        .await?;
    ensure!(listed_all.contains("\"name\":\"slow\""), "{listed_all}");
    let raw = cluster
        .kubectl_ok(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/configmaps/slow?includeUninitialized=true",
        ])
        .await?;
    let pending: Value = serde_json::from_str(&raw)?;
    let names: Vec<&str> = pending["metadata"]["initializers"]["pending"]
        .as_array()
        .map(|p| p.iter().filter_map(|e| e["name"].as_str()).collect())
        .unwrap_or_default();
    ensure!(
        names == ["first", "second"],
        "pending initializers: {names:?}"
    );

    gate.open.notify_one();
    let created: Value = serde_json::from_str(&creating.await??)?;
    let annotations = &created["metadata"]["annotations"];
    ensure!(
        annotations["first.example.com/done"] == "true"
            && annotations["second.example.com/done"] == "true",
        "{created}"
    );
    ensure!(
        created["metadata"].get("initializers").is_none(),
        "{created}"
    );
    let listed = cluster
        .kubectl_ok(&["get", "configmaps", "-o", "name"])
        .await?;
    ensure!(
        listed.contains("configmap/slow"),
        "invisible after initialization: {listed}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_initializer_fails_the_create_and_leaves_nothing() -> Result<()> {
    let cluster = TestCluster::builder()
        .with_chains(chains(vec![Arc::new(Refuse)]))
        .start()
        .await?;
    let manifest =
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"nope"},"data":{"a":"b"}}"#;
    let error = cluster
        .kubectl_err_stdin(&["create", "--validate=false", "-f", "-"], manifest)
        .await?;
    ensure!(
        error.contains("initializer refuse failed: configmaps are not welcome here"),
        "{error}"
    );
    let raw = cluster
        .kubectl(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/configmaps/nope?includeUninitialized=true",
        ])
        .await?;
    ensure!(!raw.status.success(), "the refused object is still stored");
    // Other kinds are not held up.
    cluster
        .kubectl_ok_stdin(
            &["create", "--validate=false", "-f", "-"],
            r#"{"apiVersion":"v1","kind":"Secret","metadata":{"name":"s"}}"#,
        )
        .await?;
    Ok(())
}
