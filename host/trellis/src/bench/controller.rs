//! `trellis bench controller`: what a controller plugin's writes cost, batched and one
//! host call at a time.
//!
//! A server on the embedded store in this process; the `children` controller plugin
//! (`plugins/fixtures/children`) run by `trellis-controllers` over the in-process
//! transport as its own user. For each round a parent ConfigMap asks for `--objects`
//! children, and the time from its create to the last child seen by a watch is taken:
//! - `batch_s`: the plugin hands all creates to the host in one `client.batch` call,
//!   which runs them concurrently;
//! - `sequential_s`: the same plugin configured to call `client.create` once per child,
//!   each a guest↔host round trip waiting for its answer.

use std::sync::Arc;
use std::time::Duration;
use trellis_api::Shutdown;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use trellis_client::events::EventRecorder;
use trellis_client::identity;
use trellis_client::informer::{BY_LABEL, SharedInformers};
use trellis_client::workqueue::QueueMetrics;
use trellis_controllers::{ControllerConfig, Manager};
use trellis_plugin_host::{GroupVersionResource, HostConfig, PluginHost};

use super::cluster::LocalCluster;

#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Children each parent asks for.
    #[arg(long, default_value_t = 500)]
    objects: usize,

    /// Parents per mode; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,

    /// The `children` controller component.
    #[arg(
        long,
        default_value = "plugins/target/dist/children.wasm",
        value_name = "FILE"
    )]
    plugin: std::path::PathBuf,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    objects: usize,
    rounds: usize,
    batch_s: f64,
    sequential_s: f64,
    batch_objects_per_s: f64,
    sequential_objects_per_s: f64,
}

const NAMESPACE: &str = "bench";

fn configmaps() -> GroupVersionResource {
    GroupVersionResource {
        group: String::new(),
        version: "v1".into(),
        resource: "configmaps".into(),
    }
}

pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let wasm = Arc::new(std::fs::read(&args.plugin).with_context(|| {
        format!(
            "read {} (build it with `make plugins`)",
            args.plugin.display()
        )
    })?);
    let cluster = LocalCluster::start().await?;
    let measured = measure(&cluster, &args, wasm).await;
    let stopped = cluster.stop().await;
    let report = measured?;
    stopped?;
    super::print_report(args.json, &report, || {
        format!(
            "controller: {} children created in {:.3} s batched ({:.0}/s), {:.3} s one call at a time ({:.0}/s)",
            report.objects,
            report.batch_s,
            report.batch_objects_per_s,
            report.sequential_s,
            report.sequential_objects_per_s,
        )
    })
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

async fn measure(
    cluster: &LocalCluster,
    args: &ControllerArgs,
    wasm: Arc<Vec<u8>>,
) -> anyhow::Result<Report> {
    let in_process = trellis_client::InProcess::new(cluster.server.in_process.clone());
    let admin = in_process.client(trellis_api::UserInfo::new("admin", ["system:masters"]));
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await
        .context("create the namespace")?;
    let plugins = PluginHost::new(HostConfig::default())?;
    let mut samples = [Vec::new(), Vec::new()];
    for (mode, sequential) in [false, true].into_iter().enumerate() {
        let name = if sequential {
            "children-seq"
        } else {
            "children"
        };
        let user = identity::controller(name).name;
        // Its writes are its own user's: bound to the admin role for the benchmark.
        let binding = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": format!("bench-{name}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "User", "name": user}],
        });
        Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
            .create(&PostParams::default(), &serde_json::from_value(binding)?)
            .await
            .context("bind the controller's role")?;
        let manager = Manager {
            plugins: plugins.clone(),
            informers: SharedInformers::new(),
            lister: in_process.client(identity::controller_manager()),
            queues: QueueMetrics::default(),
            running: Default::default(),
        };
        let writer = in_process.client(identity::controller(name));
        let recorder = EventRecorder::new(writer.clone(), name, "bench");
        let mut config = ControllerConfig::new(name, wasm.clone(), configmaps());
        config.owns = vec![configmaps()];
        config.spec.configuration = json!({"sequential": sequential}).to_string();
        config.spec.timeout = Duration::from_secs(60);
        let (_stop, stopped) = Shutdown::new();
        let running = manager.start(config, writer, recorder, stopped).await?;

        let watching = SharedInformers::new();
        let maps = watching.informer::<ConfigMap>(
            Api::namespaced(admin.clone(), NAMESPACE),
            watcher::Config::default(),
        );
        maps.wait_synced().await;
        let mut changes = maps.subscribe();
        let api: Api<ConfigMap> = Api::namespaced(admin.clone(), NAMESPACE);
        for round in 0..args.rounds {
            let parent = format!("{name}-{round}");
            let selector = format!("trellis.dev/parent={parent}");
            let started = Instant::now();
            api.create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": parent,
                    "annotations": {"trellis.dev/children": args.objects.to_string()}}}))?,
            )
            .await
            .context("create a parent")?;
            let deadline = Duration::from_secs(300);
            tokio::time::timeout(deadline, async {
                while maps.by_index(BY_LABEL, &selector).len() < args.objects {
                    if changes.recv().await.is_none() {
                        bail!("the informer stopped");
                    }
                }
                anyhow::Ok(())
            })
            .await
            .with_context(|| {
                format!("{} children of {parent} within {deadline:?}", args.objects)
            })??;
            samples[mode].push(started.elapsed().as_secs_f64());
        }
        running.stop().await;
    }
    let [batch, sequential] = samples;
    let batch_s = median(batch);
    let sequential_s = median(sequential);
    let per_s = |s: f64| {
        if s > 0.0 {
            args.objects as f64 / s
        } else {
            0.0
        }
    };
    Ok(Report {
        objects: args.objects,
        rounds: args.rounds,
        batch_s,
        sequential_s,
        batch_objects_per_s: per_s(batch_s),
        sequential_objects_per_s: per_s(sequential_s),
    })
}
