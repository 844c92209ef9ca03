//! `kubectl port-forward` through the API server to a node whose pods have networks of
//! their own: two pods listen on the same port, each reached in its own network
//! namespace, with the current kubectl (SPDY tunnelled in a WebSocket) and kubectl 1.20
//! (SPDY/3.1); a port nobody listens on gives kubectl the kubelet's error; a user
//! without `create` on `pods/portforward` is refused.
//!
//! Needs root and the CNI plugins; the node has a CNI network of its own on
//! 10.244.81.0/24 (bridge `trellis-nt81`, removed at the end).

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use trellis_client::informer::SharedInformers;
use trellis_tests::pod_network::{NetworkedNode, NetworkedNodeOptions, PodNetwork, delete_pods};
use trellis_tests::{Kubectl, TestCluster};

use super::node::wait_pod;

const NODE: &str = "pf-node";
const POD_CIDR: &str = "10.244.81.0/24";
const BRIDGE: &str = "trellis-nt81";
const PODS: [&str; 2] = ["web-a", "web-b"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_reaches_each_pods_own_port() -> Result<()> {
    if !rustix::process::geteuid().is_root()
        || !std::path::Path::new("/usr/lib/cni/bridge").exists()
    {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return Ok(());
    }
    let cluster = TestCluster::start().await?;
    let node = NetworkedNode::start(
        &cluster,
        NetworkedNodeOptions {
            node: NODE,
            pod_cidr: POD_CIDR,
            bridge: BRIDGE,
            network: PodNetwork::Bridge {
                name: "port-forward-test",
                hairpin: false,
            },
            client_ca: true,
            backoff_base: None,
        },
    )
    .await?;
    let admin = node.admin.clone();
    let watching = SharedInformers::new();
    let pods = watching.informer::<Pod>(Api::all(admin.clone()), watcher::Config::default());
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let work = async {
        node.set_pod_cidr().await?;
        for name in PODS {
            // Each serves a directory whose index names the pod, on the same port.
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"nodeName": NODE, "runtimeClassName": "process",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "web", "image": "file:///bin/sh",
                        "command": ["/bin/sh", "-c", "mkdir -p $NAME && echo \"I am $NAME\" > $NAME/index.html && cd $NAME && exec /usr/bin/python3 -m http.server 8080"],
                        "env": [{"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        // Its own /tmp, in its sandbox.
                        "workingDir": "/tmp",
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}]}
            }))?;
            api.create(&PostParams::default(), &pod).await?;
        }
        for name in PODS {
            wait_pod(&pods, name, Duration::from_secs(60), |p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                    .is_some_and(|c| c.status == "True")
            })
            .await?;
        }

        let current = cluster.admin().clone();
        let old = cluster.kubectl_1_20()?;
        for (kubectl, which) in [(&current, "current"), (&old, "1.20")] {
            for name in PODS {
                let mut forward = Forward::start(kubectl, name, 8080).await?;
                // Twice over one session: each local connection is a pair of streams.
                for _ in 0..2 {
                    let body = forward.get().await?;
                    ensure!(
                        body.contains(&format!("I am {name}")),
                        "kubectl {which} to {name} reached: {body}"
                    );
                }
                // The current kubectl tries the WebSocket first and says (at -v=4)
                // when it falls back to SPDY: the tunnel must have served it.
                let said = forward.said.borrow().clone();
                ensure!(
                    !said.contains("fallback"),
                    "kubectl {which} fell back from the WebSocket: {said}"
                );
                forward.stop().await;
            }
        }

        // Nobody listens on port 9: kubectl shows the node's error.
        for (kubectl, which) in [(&current, "current"), (&old, "1.20")] {
            let mut forward = Forward::start(kubectl, "web-a", 9).await?;
            let answer = forward.get().await.unwrap_or_default();
            ensure!(answer.is_empty(), "port 9 answered {answer:?}");
            let stderr = forward.stderr_until("error forwarding port 9 to pod").await;
            ensure!(
                stderr.contains("error forwarding port 9 to pod")
                    && stderr.contains("connect: connection refused"),
                "kubectl {which} said: {stderr}"
            );
            forward.stop().await;
        }

        // Reading pods is not enough: port-forward needs `create` on pods/portforward.
        current
            .ok_stdin(
                &["apply", "-f", "-"],
                r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: pod-reader, namespace: default}
rules: [{apiGroups: [""], resources: ["pods"], verbs: ["get", "list"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: jane-reads-pods, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: jane}]
"#,
            )
            .await?;
        let jane = cluster.kubectl_with_cert("jane", &[])?;
        let refused = jane
            .run(&["port-forward", "pod/web-a", ":8080"], None)
            .await?;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        ensure!(
            !refused.status.success()
                && stderr.contains(r#"cannot create resource "pods/portforward""#),
            "jane's port-forward: {stderr}"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;

    // Deleted whatever happened above, so that no namespace outlives the test.
    let gone = delete_pods(&api, &pods, &PODS, Duration::from_secs(30)).await;
    // The agent removes a deleted pod's sandbox (its processes, namespaces and pins)
    // right after the pod is gone from the API: stopped before that, they would stay.
    let removed = async {
        let mut probe = node.cri().await?.runtime;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = probe
                .list_pod_sandbox(k8s_cri::v1::ListPodSandboxRequest::default())
                .await?
                .into_inner()
                .items;
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("sandboxes left: {left:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    .await;
    node.stop().await?;
    work?;
    gone.context("the pods were not removed")??;
    removed.context("the pods' sandboxes were not removed")?;
    cluster.stop().await?;
    Ok(())
}

/// A running `kubectl port-forward pod/NAME :PORT` (at `-v=4`), the local port it
/// chose and what it said on stderr so far.
struct Forward {
    child: tokio::process::Child,
    local: u16,
    said: tokio::sync::watch::Receiver<String>,
}

impl Forward {
    async fn start(kubectl: &Kubectl, pod: &str, port: u16) -> Result<Forward> {
        let target = format!("pod/{pod}");
        let ports = format!(":{port}");
        let mut child = kubectl
            .command(&[
                "port-forward",
                &target,
                &ports,
                "--address",
                "127.0.0.1",
                "-v=4",
            ])
            .spawn()
            .context("start kubectl port-forward")?;
        let stdout = child.stdout.take().context("kubectl's stdout")?;
        let mut stderr = BufReader::new(child.stderr.take().context("kubectl's stderr")?).lines();
        // Read all along, so that the pipe never fills.
        let (tell, said) = tokio::sync::watch::channel(String::new());
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                tell.send_modify(|said| {
                    said.push_str(&line);
                    said.push('\n');
                });
            }
        });
        let mut lines = BufReader::new(stdout).lines();
        // "Forwarding from 127.0.0.1:PORT -> 8080" once it listens.
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:")
                    && let Some((local, _)) = rest.split_once(' ')
                {
                    return Ok(Some(local.parse::<u16>()?));
                }
            }
            anyhow::Ok(None)
        })
        .await;
        let local = match found {
            Ok(Ok(Some(local))) => local,
            _ => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                let said = said.borrow().clone();
                bail!("kubectl port-forward {target} {ports} did not start: {said}");
            }
        };
        // Its further "Handling connection" lines must not fill the pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Forward { child, local, said })
    }

    /// `GET /` through the local port: the whole answer, empty when the connection
    /// closed with none.
    async fn get(&mut self) -> Result<String> {
        let exchange = async {
            let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.local)).await?;
            tcp.write_all(b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n")
                .await?;
            let mut reply = Vec::new();
            tcp.read_to_end(&mut reply).await?;
            anyhow::Ok(String::from_utf8_lossy(&reply).into_owned())
        };
        tokio::time::timeout(Duration::from_secs(20), exchange)
            .await
            .context("no answer through the forwarded port in 20 s")?
    }

    /// kubectl's stderr once it has `wanted` (or 20 s passed, or it ended).
    async fn stderr_until(&mut self, wanted: &str) -> String {
        let waited = tokio::time::timeout(
            Duration::from_secs(20),
            self.said.wait_for(|said| said.contains(wanted)),
        )
        .await;
        drop(waited);
        self.said.borrow().clone()
    }

    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}
