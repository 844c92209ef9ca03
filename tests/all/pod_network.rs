//! The pods' network at the runtime's CRI edge: the runtime's default network is made
//! in the runtime's own process (no CNI plugin runs, nothing is cached for them), with
//! the addresses, hostPorts and teardown the plugins would give; an operator's own
//! conflist in the config dir is run by the CNI plugins instead. Needs root, nftables
//! and the CNI plugins; each test has its range and bridge (10.244.83.0/24 on
//! `trellis-nt83`, 10.244.84.0/24 on `trellis-nt84`), removed at the end.

// The helpers below are test code too, outside any `#[test]` function.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k8s_cri::v1::*;
use serde_json::json;
use tokio::sync::oneshot;
use trellis_runtime::{Client, CniConfig, PROCESS, Runtime, RuntimeConfig, connect, serve_on};

fn can_run() -> bool {
    let ok = rustix::process::geteuid().is_root()
        && Path::new("/usr/lib/cni/bridge").exists()
        && std::process::Command::new("nft")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: pod networks need root, nftables and the CNI plugins (make deps)");
    }
    ok
}

/// Removes a test's bridge and its nftables table, and unpins the namespaces of the
/// sandboxes a failed test left under its runtime's root (their veths go with them).
struct Cleanup(&'static str, PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for kind in ["netns", "utsns", "ipcns"] {
            let pins = std::fs::read_dir(self.1.join(kind));
            for pin in pins.into_iter().flatten().flatten() {
                let _ = rustix::mount::unmount(pin.path(), rustix::mount::UnmountFlags::DETACH);
            }
        }
        for args in [
            &["ip", "link", "del", self.0][..],
            &["nft", "delete", "table", "ip", self.0][..],
        ] {
            let _ = std::process::Command::new(args[0])
                .args(&args[1..])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// A runtime whose CNI config dir is `conf_dir`, serving on a socket in `dir`.
struct Node {
    root: PathBuf,
    client: Client,
    stop: oneshot::Sender<()>,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Node {
    async fn start(dir: &Path, pod_cidr: &str, conf_dir: &Path) -> Node {
        let root = dir.join("root");
        let runtime = Runtime::with_cni(
            trellis_tests::sandboxed(RuntimeConfig {
                root: root.clone(),
                cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache")),
                process_handler: true,
                node_ip: "127.0.0.1".parse().unwrap(),
                ..Default::default()
            }),
            CniConfig {
                conf_dir: Some(conf_dir.to_path_buf()),
                bin_dirs: Vec::new(),
            },
        )
        .unwrap();
        let socket = dir.join("cri.sock");
        let listener = trellis_runtime::listen(&socket).unwrap();
        let (stop, stopped) = oneshot::channel();
        let server = tokio::spawn(serve_on(runtime, listener, async {
            let _ = stopped.await;
        }));
        let mut client = connect(&socket).await.unwrap();
        client
            .runtime
            .update_runtime_config(UpdateRuntimeConfigRequest {
                runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                    network_config: Some(NetworkConfig {
                        pod_cidr: pod_cidr.into(),
                    }),
                }),
            })
            .await
            .unwrap();
        Node {
            root,
            client,
            stop,
            server,
        }
    }

    async fn stop(self) {
        drop(self.client);
        let _ = self.stop.send(());
        self.server.await.unwrap().unwrap();
    }

    /// The runtime's `NetworkReady` condition, as its CRI `Status` tells it.
    async fn network_ready(&mut self) -> RuntimeCondition {
        self.client
            .runtime
            .status(StatusRequest { verbose: false })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
            .conditions
            .into_iter()
            .find(|c| c.r#type == "NetworkReady")
            .unwrap()
    }

    /// A pod sandbox on the pod network with `port_mappings`; its id and IP.
    async fn sandbox(
        &mut self,
        name: &str,
        port_mappings: Vec<PortMapping>,
    ) -> (String, PodSandboxConfig, String) {
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            labels: HashMap::from([("app".to_string(), name.to_string())]),
            log_directory: self.root.join("logs").join(name).display().to_string(),
            port_mappings,
            ..Default::default()
        };
        let id = self
            .client
            .runtime
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: PROCESS.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
        let status = self
            .client
            .runtime
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.clone(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        (id, config, status.network.unwrap().ip)
    }

    /// Runs `python3 -m http.server 8080` in the sandbox.
    async fn serve_http(&mut self, sandbox: &(String, PodSandboxConfig, String), dir: &Path) {
        let image = "file:///usr/bin/python3";
        self.client
            .images
            .pull_image(PullImageRequest {
                image: Some(ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap();
        let id = self
            .client
            .runtime
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.0.clone(),
                config: Some(ContainerConfig {
                    metadata: Some(ContainerMetadata {
                        name: "web".into(),
                        attempt: 0,
                    }),
                    image: Some(ImageSpec {
                        image: image.into(),
                        ..Default::default()
                    }),
                    command: ["python3", "-m", "http.server", "8080"]
                        .map(String::from)
                        .to_vec(),
                    working_dir: dir.display().to_string(),
                    log_path: "web/0.log".into(),
                    ..Default::default()
                }),
                sandbox_config: Some(sandbox.1.clone()),
            })
            .await
            .unwrap()
            .into_inner()
            .container_id;
        self.client
            .runtime
            .start_container(StartContainerRequest { container_id: id })
            .await
            .unwrap();
    }

    /// Stops (twice: again is a no-op) and removes sandbox `id`.
    async fn remove(&mut self, id: &str) {
        for _ in 0..2 {
            self.client
                .runtime
                .stop_pod_sandbox(StopPodSandboxRequest {
                    pod_sandbox_id: id.into(),
                })
                .await
                .unwrap();
        }
        self.client
            .runtime
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            })
            .await
            .unwrap();
    }
}

fn entries(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(path)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The default conflist (here on a bridge of the test's own) is done in-process: the
/// pod gets its address from the pod CIDR, recorded as host-local records it, answers
/// on it, and its hostPort answers on the bridge's address and on 127.0.0.1; no CNI
/// plugin ran (nothing cached for a DEL). Stopping leaves no veth, address, record,
/// pin or hostPort rule.
#[tokio::test]
async fn the_default_network_is_made_in_process() {
    if !can_run() {
        return;
    }
    const BRIDGE: &str = "trellis-nt84";
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = Cleanup(BRIDGE, dir.path().join("root"));
    let conf_dir = dir.path().join("net.d");
    std::fs::create_dir_all(&conf_dir).unwrap();
    let root = dir.path().join("root");
    let ipam_dir = root.join("cni/networks");
    std::fs::write(
        conf_dir.join("10-trellis.conflist"),
        serde_json::to_vec(&trellis_runtime::default_conflist(
            &["10.244.84.0/24".into()],
            BRIDGE,
            &ipam_dir,
        ))
        .unwrap(),
    )
    .unwrap();
    let mut node = Node::start(dir.path(), "10.244.84.0/24", &conf_dir).await;
    let host_port = free_port();
    let web = node
        .sandbox(
            "web",
            vec![PortMapping {
                protocol: Protocol::Tcp as i32,
                container_port: 8080,
                host_port: i32::from(host_port),
                host_ip: String::new(),
            }],
        )
        .await;
    let other = node.sandbox("other", Vec::new()).await;
    for (id, _, ip) in [&web, &other] {
        assert!(ip.starts_with("10.244.84."), "{ip}");
        assert_eq!(
            std::fs::read_to_string(ipam_dir.join("trellis").join(ip)).unwrap(),
            format!("{id}\r\neth0"),
            "recorded as host-local records it"
        );
    }
    assert_ne!(web.2, other.2);
    assert_eq!(
        entries(&root.join("cni/results")),
        Vec::<String>::new(),
        "no CNI plugin ran"
    );
    let brif = PathBuf::from(format!("/sys/class/net/{BRIDGE}/brif"));
    let ports = entries(&brif);
    assert_eq!(ports.len(), 2, "a veth per pod: {ports:?}");
    for port in &ports {
        assert_eq!(
            std::fs::read_to_string(brif.join(port).join("hairpin_mode")).unwrap(),
            "1\n"
        );
    }

    node.serve_http(&web, dir.path()).await;
    assert!(
        trellis_tests::http_answers(&web.2, 8080).await,
        "the pod answers on its IP"
    );
    for on in ["10.244.84.1", "127.0.0.1"] {
        assert!(
            trellis_tests::http_answers(on, host_port).await,
            "its hostPort {host_port} answers on {on}"
        );
    }

    for (id, _, _) in [&web, &other] {
        node.remove(id).await;
    }
    assert_eq!(entries(&brif), Vec::<String>::new(), "the veths are gone");
    let reserved: Vec<String> = entries(&ipam_dir.join("trellis"))
        .into_iter()
        .filter(|name| name.starts_with("10.244.84."))
        .collect();
    assert_eq!(reserved, Vec::<String>::new(), "the addresses are free");
    assert_eq!(entries(&root.join("bridge")), Vec::<String>::new());
    assert_eq!(entries(&root.join("netns")), Vec::<String>::new());
    let map = std::process::Command::new("nft")
        .args(["list", "map", "ip", BRIDGE, "hostports"])
        .output()
        .unwrap();
    let map = String::from_utf8_lossy(&map.stdout);
    assert!(!map.contains(&host_port.to_string()), "{map}");
    node.stop().await;
}

/// An operator's conflist: a bridge network of its own with host-local IPAM on
/// `subnet`, recording under `ipam_dir`.
fn operator_conflist(bridge: &str, subnet: &str, ipam_dir: &Path) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "cniVersion": "1.0.0",
        "name": "operator",
        "plugins": [{
            "type": "bridge",
            "bridge": bridge,
            "isGateway": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "dataDir": ipam_dir,
            }
        }]
    }))
    .unwrap()
}

/// The runtime's network is ready (`Status`'s `NetworkReady`, which the node agent
/// and the kubelet wait for before they make a sandbox on the pod's network) once
/// its config dir holds a network: with neither a pod CIDR nor a conflist it is not,
/// with the reason the kubelet shows; an operator's conflist alone, whose IPAM needs
/// no pod CIDR, makes it ready. Nothing is connected, so no root is needed.
#[tokio::test]
async fn the_network_is_ready_once_the_config_dir_holds_one() {
    let dir = tempfile::tempdir().unwrap();
    let conf_dir = dir.path().join("net.d");
    std::fs::create_dir_all(&conf_dir).unwrap();
    let mut node = Node::start(dir.path(), "", &conf_dir).await;
    let network = node.network_ready().await;
    assert!(!network.status, "no pod CIDR, no conflist: {network:?}");
    assert_eq!(network.reason, "NetworkPluginNotReady");
    assert!(
        network.message.contains("no network config found"),
        "{}",
        network.message
    );
    std::fs::write(
        conf_dir.join("10-operator.conflist"),
        // Never connected: the operator test's bridge and range.
        operator_conflist("trellis-nt83", "10.244.83.0/24", &dir.path().join("ipam")),
    )
    .unwrap();
    let network = node.network_ready().await;
    assert!(network.status, "an operator's conflist: {network:?}");
    node.stop().await;
}

/// An operator's conflist (another network, on another bridge) is not the runtime's
/// default: the CNI plugins run it, and their cached result is what DEL uses. The
/// node has no pod CIDR: the operator's network needs none.
#[tokio::test]
async fn an_operators_conflist_is_run_by_the_cni_plugins() {
    if !can_run() {
        return;
    }
    const BRIDGE: &str = "trellis-nt83";
    let dir = tempfile::tempdir().unwrap();
    let _cleanup = Cleanup(BRIDGE, dir.path().join("root"));
    let conf_dir = dir.path().join("net.d");
    std::fs::create_dir_all(&conf_dir).unwrap();
    let ipam_dir = dir.path().join("ipam");
    std::fs::write(
        conf_dir.join("10-operator.conflist"),
        operator_conflist(BRIDGE, "10.244.83.0/24", &ipam_dir),
    )
    .unwrap();
    let mut node = Node::start(dir.path(), "", &conf_dir).await;
    let (id, _, ip) = node.sandbox("op", Vec::new()).await;
    assert!(ip.starts_with("10.244.83."), "{ip}");
    assert_eq!(
        entries(&node.root.join("cni/results")),
        [format!("{id}-eth0")],
        "the plugins ran: their result is cached"
    );
    assert_eq!(entries(&node.root.join("bridge")), Vec::<String>::new());
    assert!(ipam_dir.join("operator").join(&ip).exists());
    let brif = PathBuf::from(format!("/sys/class/net/{BRIDGE}/brif"));
    assert_eq!(entries(&brif).len(), 1);
    node.remove(&id).await;
    assert_eq!(
        entries(&node.root.join("cni/results")),
        Vec::<String>::new()
    );
    assert_eq!(entries(&brif), Vec::<String>::new());
    assert!(!ipam_dir.join("operator").join(&ip).exists());
    node.stop().await;
}
