//! Projected ServiceAccount tokens are kept fresh: a running pod's token file is
//! replaced by a new token of its ServiceAccount before the old one expires, as the
//! kubelet's token manager does. The agent asks again after a thousandth of the token's
//! lifetime here (Kubernetes' shortest token lasts ten minutes), not 80 %.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use trellis_agent::AgentConfig;
use trellis_api::{Shutdown, UserInfo};
use trellis_client::identity;
use trellis_client::informer::SharedInformers;
use trellis_runtime::{Runtime, RuntimeConfig};
use trellis_tests::TestCluster;

const NODE: &str = "token-node";

fn workload() -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/dist/workload.wasm")
        .canonicalize()
        .context("plugins/target/dist/workload.wasm is missing: run plugins/build.sh")?;
    Ok(format!("file://{}", path.display()))
}

/// Who `token` authenticates as (a SelfSubjectReview over HTTPS with only the token).
async fn whoami(cluster: &TestCluster, token: &str) -> Result<String> {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(&cluster.ca_pem);
    let yaml = format!(
        "apiVersion: v1\nkind: Config\n\
         clusters:\n- name: trellis\n  cluster:\n    server: \"{}\"\n    certificate-authority-data: {ca}\n\
         users:\n- name: pod\n  user:\n    token: \"{token}\"\n\
         contexts:\n- name: trellis\n  context:\n    cluster: trellis\n    user: pod\n\
         current-context: trellis\n",
        cluster.url
    );
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let client = kube::Client::try_from(config)?;
    let reviews: Api<SelfSubjectReview> = Api::all(client);
    let answer = reviews
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    answer
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .context("no username in the SelfSubjectReview")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_pods_projected_token_is_replaced_before_it_expires() -> Result<()> {
    let cluster = TestCluster::start().await?;
    let dir = trellis_tests::test_dir()?;
    let root = dir.path();
    let (stop, stopped) = Shutdown::new();
    let runtime = Runtime::new(trellis_tests::sandboxed(RuntimeConfig {
        root: root.join("runtime"),
        cache_dir: Some(root.join("compiled")),
        node_ip: "127.0.0.1".parse()?,
        ..Default::default()
    }))?;
    let socket = root.join("cri.sock");
    let listener = trellis_runtime::listen(&socket)?;
    let server_stop = stopped.clone();
    let server = tokio::spawn(async move {
        trellis_runtime::serve_on(runtime, listener, async move {
            server_stop.wait().await;
        })
        .await
    });
    let cri = trellis_runtime::connect(&socket).await?;
    let mut config = AgentConfig::new(NODE, "127.0.0.1".parse()?, root.join("agent"));
    config.relist_period = Duration::from_millis(50);
    config.port = 0;
    config.eviction_hard = None;
    // Ten minutes (the shortest token) / 1000: asked again about every 0.6 s.
    config.token_refresh_fraction = 0.001;
    config.token_retry = Duration::from_millis(200);
    let client = cluster.in_process().client(identity::node(NODE));
    let agent = tokio::spawn(trellis_agent::run(
        config,
        client,
        cri,
        SharedInformers::new(),
        stopped,
    ));

    let admin = cluster
        .in_process()
        .client(UserInfo::new("admin", ["system:masters"]));
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), "default");
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "reader"}}))?,
        )
        .await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "reader"},
        "spec": {"nodeName": NODE, "serviceAccountName": "reader",
            "automountServiceAccountToken": false,
            "volumes": [{"name": "api", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}}]}}],
            "containers": [{"name": "main", "image": workload()?,
                "volumeMounts": [{"name": "api", "mountPath": "/var/run/secrets/tokens", "readOnly": true}],
                "args": ["sleep", "600000"]}]}
    }))?;
    let pod = pods.create(&PostParams::default(), &pod).await?;
    let uid = pod.metadata.uid.clone().context("no uid")?;
    let running =
        kube::runtime::wait::await_condition(pods.clone(), "reader", |p: Option<&Pod>| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                == Some("Running")
        });
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .context("the pod did not run")??;

    let volume = root.join("agent/pods").join(&uid).join("volumes/api");
    let file = volume.join("token");
    let first = std::fs::read_to_string(&file).context("the pod's token")?;
    ensure!(
        whoami(&cluster, &first).await? == "system:serviceaccount:default:reader",
        "the first token is not the account's"
    );
    let started = std::time::Instant::now();
    // The file is replaced whole (a rename into the directory): woken by inotify.
    let second = trellis_tests::wait_written(
        &volume,
        || {
            std::fs::read_to_string(&file)
                .ok()
                .filter(|t| !t.is_empty() && *t != first)
        },
        Duration::from_secs(10),
    )
    .await?
    .context("the pod's token was not replaced within 10 s")?;
    println!("replaced after {:?}", started.elapsed());
    ensure!(
        whoami(&cluster, &second).await? == "system:serviceaccount:default:reader",
        "the new token is not the account's"
    );
    // Never a partial file: nothing but the token and no leftover temporary file.
    let names: Vec<String> = std::fs::read_dir(&volume)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ensure!(names == ["token"], "{names:?}");

    // The pod goes: its token is no longer kept.
    let agent_root = std::path::absolute(root.join("agent"))?;
    ensure!(
        trellis_agent::tokens::tracked(&agent_root) == [file.clone()],
        "{:?}",
        trellis_agent::tokens::tracked(&agent_root)
    );
    pods.delete("reader", &DeleteParams::default().grace_period(0))
        .await?;
    let gone = kube::runtime::wait::await_condition(
        pods.clone(),
        "reader",
        kube::runtime::wait::conditions::is_deleted(&uid),
    );
    tokio::time::timeout(Duration::from_secs(30), gone)
        .await
        .context("the pod was not deleted")??;
    // Woken by the removals in the token's directory as the pod's files go.
    let kept = || {
        trellis_agent::tokens::tracked(&agent_root)
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
    };
    trellis_tests::wait_removed(&volume, kept, Duration::from_secs(5))
        .await
        .context("still kept after the pod went")?;

    stop.stop();
    agent.await??;
    server.await??;
    Ok(())
}
