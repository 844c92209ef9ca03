//! A `wasi:cli` program of a pod with a network of its own opens its sockets in its
//! pod's network namespace and looks names up with its pod's `resolv.conf`: it reaches
//! a server listening only inside the pod (on the pod's loopback), not one bound only
//! to the node's loopback on the same port, and a name only the pod's DNS server knows
//! resolves. The program is `plugins/fixtures/dial` (plugins/build.sh); the runtime
//! is driven over CRI as the kubelet drives it.
//!
//! Needs root and the CNI plugins; its own bridge (`trellis-nt86`) and range
//! (10.244.86.0/24), with no gateway: the pod has no route off its bridge, so nothing
//! it sends can leave the machine.

// The helpers below are test code too, outside any `#[test]` function.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_cri::v1::*;
use tokio::io::AsyncWriteExt as _;
use trellis_runtime::{Runtime, RuntimeConfig, WASMTIME};

const BRIDGE: &str = "trellis-nt86";
const SUBNET: &str = "10.244.86.0/24";
/// The name only the pod's DNS server answers, and its answer.
const NAME: &str = "probe.trellis-test.internal";
const ANSWER: Ipv4Addr = Ipv4Addr::new(10, 244, 86, 250);

/// What the test made that a failure could leave: the sandbox's pin (unmounted, which
/// ends its namespace and veth) and the bridge.
struct Guard {
    root: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        for entry in std::fs::read_dir(self.root.join("netns"))
            .into_iter()
            .flatten()
        {
            let pin = entry.unwrap().path();
            let _ = rustix::mount::unmount(&pin, rustix::mount::UnmountFlags::DETACH);
            let _ = std::fs::remove_file(&pin);
        }
        let _ = std::process::Command::new("ip")
            .args(["link", "del", BRIDGE])
            .status();
    }
}

/// Sockets made on a thread inside the namespace pinned at `pin`: they stay there.
fn inside<T: Send + 'static>(
    pin: &Path,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> T {
    let ns = std::fs::File::open(pin).unwrap();
    std::thread::spawn(move || {
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        f()
    })
    .join()
    .unwrap()
    .unwrap()
}

/// Answers each connection with `line` until the test ends.
fn serve_line(listener: TcpListener, line: &'static str) {
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let _ = tcp.write_all(format!("{line}\n").as_bytes()).await;
        }
    });
}

/// A DNS server that answers `NAME`'s A query with `ANSWER`, and every other query
/// with no records.
fn serve_dns(socket: UdpSocket) {
    socket.set_nonblocking(true).unwrap();
    let socket = tokio::net::UdpSocket::from_std(socket).unwrap();
    tokio::spawn(async move {
        let mut query = [0u8; 512];
        while let Ok((len, from)) = socket.recv_from(&mut query).await {
            if let Some(reply) = dns_reply(&query[..len]) {
                let _ = socket.send_to(&reply, from).await;
            }
        }
    });
}

/// The reply to one query: its header and question, then one A record if it asks
/// for `NAME`'s.
fn dns_reply(query: &[u8]) -> Option<Vec<u8>> {
    // The question: labels up to the root, then type and class.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_lowercase());
        at += len;
    }
    let question = query.get(12..at + 4)?;
    let qtype = u16::from_be_bytes([query[at], query[at + 1]]);
    let found = labels.join(".") == NAME && qtype == 1;
    let mut reply = Vec::with_capacity(64);
    reply.extend_from_slice(query.get(..2)?);
    // A response, recursion desired and available, no error; one question.
    reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(found), 0, 0, 0, 0]);
    reply.extend_from_slice(question);
    if found {
        // The question's name (a pointer to offset 12), A, IN, 60 s, 4 bytes.
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        reply.extend_from_slice(&ANSWER.octets());
    }
    Some(reply)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn a_wasi_program_dials_and_looks_up_inside_its_pods_network() {
    if !rustix::process::geteuid().is_root()
        || !Path::new("/usr/lib/cni/bridge").exists()
        || !Path::new("/usr/lib/cni/host-local").exists()
    {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return;
    }
    let dial = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/dist/dial.wasm");
    assert!(
        dial.exists(),
        "{} is missing: run plugins/build.sh",
        dial.display()
    );
    let started = tokio::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let _guard = Guard { root: root.clone() };
    let conf_dir = root.join("cni/net.d");
    std::fs::create_dir_all(&conf_dir).unwrap();
    std::fs::write(
        conf_dir.join("10-wasi-sockets.conflist"),
        serde_json::to_vec(&serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "wasi-sockets",
            "plugins": [{
                "type": "bridge",
                "bridge": BRIDGE,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": SUBNET}]],
                    "dataDir": root.join("cni/networks"),
                }
            }]
        }))
        .unwrap(),
    )
    .unwrap();

    let runtime = Runtime::new(trellis_tests::sandboxed(RuntimeConfig {
        root: root.clone(),
        cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache")),
        process_handler: false,
        node_ip: "127.0.0.1".parse().unwrap(),
        ..Default::default()
    }))
    .unwrap();
    let socket = dir.path().join("cri.sock");
    let listener = trellis_runtime::listen(&socket).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(trellis_runtime::serve_on(runtime, listener, async {
        let _ = stopped.await;
    }));
    let cri = trellis_runtime::connect(&socket).await.unwrap();
    let mut runtime = cri.runtime.clone();
    runtime
        .update_runtime_config(UpdateRuntimeConfigRequest {
            runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                network_config: Some(NetworkConfig {
                    pod_cidr: SUBNET.into(),
                }),
            }),
        })
        .await
        .unwrap();
    let image = format!("file://{}", dial.canonicalize().unwrap().display());
    cri.images
        .clone()
        .pull_image(PullImageRequest {
            image: Some(ImageSpec {
                image: image.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let sandbox_config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "dialer".into(),
            uid: "uid-dialer".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: dir.path().join("logs").display().to_string(),
        labels: HashMap::from([("app".to_string(), "dialer".to_string())]),
        ..Default::default()
    };
    let sandbox = runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(sandbox_config.clone()),
            runtime_handler: WASMTIME.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    let pin = root.join("netns").join(&sandbox);
    assert!(
        pin.exists(),
        "the sandbox has a network namespace of its own"
    );

    // The pod's resolver is its own DNS server, on its own loopback.
    let resolv = root.join("sandboxes").join(&sandbox);
    std::fs::create_dir_all(&resolv).unwrap();
    std::fs::write(resolv.join("resolv.conf"), "nameserver 127.0.0.1\n").unwrap();
    let node_resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    // One port served on both loopbacks, told apart by what they say; another on the
    // node's alone.
    let (both, node_only) = (free_port(), free_port());
    serve_line(TcpListener::bind(("127.0.0.1", both)).unwrap(), "node");
    serve_line(TcpListener::bind(("127.0.0.1", node_only)).unwrap(), "node");
    let (pod_listener, dns) = inside(&pin, move || {
        Ok((
            TcpListener::bind(("127.0.0.1", both))?,
            UdpSocket::bind("127.0.0.1:53")?,
        ))
    });
    serve_line(pod_listener, "pod");
    serve_dns(dns);

    let container = runtime
        .create_container(CreateContainerRequest {
            pod_sandbox_id: sandbox.clone(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata {
                    name: "dial".into(),
                    attempt: 0,
                }),
                image: Some(ImageSpec {
                    image,
                    ..Default::default()
                }),
                envs: vec![
                    KeyValue {
                        key: "LOOKUP".into(),
                        value: NAME.into(),
                    },
                    KeyValue {
                        key: "DIAL".into(),
                        value: format!("127.0.0.1:{both},127.0.0.1:{node_only}"),
                    },
                ],
                log_path: "dial/0.log".into(),
                ..Default::default()
            }),
            sandbox_config: Some(sandbox_config),
        })
        .await
        .unwrap()
        .into_inner()
        .container_id;
    let mut events = runtime
        .get_container_events(GetEventsRequest {})
        .await
        .unwrap()
        .into_inner();
    runtime
        .start_container(StartContainerRequest {
            container_id: container.clone(),
        })
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        let status = runtime
            .container_status(ContainerStatusRequest {
                container_id: container.clone(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap();
        if status.state == ContainerState::ContainerExited as i32 {
            break status;
        }
        match tokio::time::timeout_at(deadline, events.message()).await {
            Ok(Ok(Some(_))) => {}
            other => panic!("the program did not exit: {status:?} ({other:?})"),
        }
    };
    let log = std::fs::read_to_string(&status.log_path).unwrap();
    // CRI log lines: time, stream, tag, then the line.
    let lines: Vec<&str> = log
        .lines()
        .filter_map(|l| l.splitn(4, ' ').nth(3))
        .collect();
    assert_eq!(status.exit_code, 0, "{log}");
    assert_eq!(
        lines,
        [
            format!("lookup {NAME}: {ANSWER}"),
            format!("dial 127.0.0.1:{both}: pod"),
            format!("dial 127.0.0.1:{node_only}: error ConnectionRefused"),
        ],
        "the program's sockets and name lookups are its pod's"
    );
    assert_eq!(
        std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
        node_resolv,
        "the node's resolv.conf is unchanged"
    );

    runtime
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: sandbox.clone(),
        })
        .await
        .unwrap();
    runtime
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: sandbox.clone(),
        })
        .await
        .unwrap();
    assert!(!pin.exists(), "the namespace's pin is gone");
    drop((runtime, events, cri));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    eprintln!("wasi_sockets took {:?}", started.elapsed());
}
