//! The runtime over real gRPC on a Unix socket, driven as a kubelet drives a CRI
//! runtime: WASM programs from `plugins/target/dist/workload.wasm` (built by
//! `plugins/build.sh`) and native processes from `/bin/sh`.

// The helpers below are test code too, outside any `#[test]` function.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use k8s_cri::v1::*;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::Code;
use trellis_runtime::{Client, PROCESS, Runtime, RuntimeConfig, WASMTIME, connect, serve_on};

const NODE_IP: [u8; 4] = [10, 1, 2, 3];

/// The path of fixture `name` built by `plugins/build.sh`.
fn fixture(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/dist")
        .join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: run plugins/build.sh",
        path.display()
    );
    path.canonicalize().unwrap()
}

/// The WASI program the tests run (`plugins/fixtures/workload`).
fn workload() -> String {
    format!("file://{}", fixture("workload").display())
}

/// The `wasi:http` component the tests serve (`examples/workloads/hello-http`).
fn http_hello() -> String {
    format!("file://{}", fixture("hello-http").display())
}

/// A runtime serving on a socket in a temporary directory, and a client of it.
struct Node {
    dir: PathBuf,
    client: Client,
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    runtime: Weak<Runtime>,
}

impl Node {
    async fn start(dir: &Path) -> Node {
        Self::start_on(dir, NODE_IP.into()).await
    }

    /// A node whose IP is `node_ip`: where its `wasi:http` containers listen.
    async fn start_on(dir: &Path, node_ip: IpAddr) -> Node {
        let runtime = Runtime::new(trellis_tests::sandboxed(RuntimeConfig {
            root: dir.join("root"),
            // Shared by the tests: the component is compiled once.
            cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache")),
            process_handler: true,
            node_ip,
            ..Default::default()
        }))
        .unwrap();
        let weak = Arc::downgrade(&runtime);
        let socket = dir.join("cri.sock");
        let (tx, rx) = oneshot::channel();
        let listener = trellis_runtime::listen(&socket).unwrap();
        let server = tokio::spawn(serve_on(runtime, listener, async {
            let _ = rx.await;
        }));
        let client = connect(&socket).await.unwrap();
        Node {
            dir: dir.to_path_buf(),
            client,
            shutdown: Some(tx),
            server,
            runtime: weak,
        }
    }

    /// Stops serving and waits until the runtime is dropped, as a crash would end it.
    async fn stop(mut self) {
        drop(self.client);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.server.await.unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.runtime.upgrade().is_some() {
            assert!(Instant::now() < deadline, "the runtime was not dropped");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn pull(&mut self, reference: &str) -> String {
        self.client
            .images
            .pull_image(PullImageRequest {
                image: Some(spec(reference)),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .image_ref
    }

    async fn sandbox_status(&mut self, id: &str) -> PodSandboxStatus {
        self.client
            .runtime
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.to_owned(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
    }

    async fn sandbox(&mut self, name: &str, handler: &str) -> (String, PodSandboxConfig) {
        self.sandbox_with(name, handler, |_| {}).await
    }

    /// A sandbox whose config `edit` changes.
    async fn sandbox_with(
        &mut self,
        name: &str,
        handler: &str,
        edit: impl FnOnce(&mut PodSandboxConfig),
    ) -> (String, PodSandboxConfig) {
        let mut config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            log_directory: self.dir.join("logs").join(name).display().to_string(),
            labels: HashMap::from([("app".to_string(), name.to_string())]),
            ..Default::default()
        };
        edit(&mut config);
        let id = self
            .client
            .runtime
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
        (id, config)
    }

    async fn create(
        &mut self,
        sandbox: &(String, PodSandboxConfig),
        image: &str,
        name: &str,
        args: &[&str],
        edit: impl FnOnce(&mut ContainerConfig),
    ) -> Result<String, tonic::Status> {
        let mut config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(spec(image)),
            args: args.iter().map(|a| a.to_string()).collect(),
            log_path: format!("{name}/0.log"),
            ..Default::default()
        };
        edit(&mut config);
        self.client
            .runtime
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.0.clone(),
                config: Some(config),
                sandbox_config: Some(sandbox.1.clone()),
            })
            .await
            .map(|r| r.into_inner().container_id)
    }

    async fn start_container(&mut self, id: &str) {
        self.client
            .runtime
            .start_container(StartContainerRequest {
                container_id: id.into(),
            })
            .await
            .unwrap();
    }

    async fn status(&mut self, id: &str) -> ContainerStatus {
        self.client
            .runtime
            .container_status(ContainerStatusRequest {
                container_id: id.into(),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
    }

    /// Waits until the container has exited, woken by the runtime's container events
    /// (subscribed before the first look, so an exit in between is not missed).
    async fn wait_exit(&mut self, id: &str) -> ContainerStatus {
        let mut events = self
            .client
            .runtime
            .get_container_events(k8s_cri::v1::GetEventsRequest {})
            .await
            .unwrap()
            .into_inner();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let status = self.status(id).await;
            if status.state == ContainerState::ContainerExited as i32 {
                return status;
            }
            match tokio::time::timeout_at(deadline, events.message()).await {
                Ok(Ok(Some(_))) => {}
                other => panic!("{id} did not exit: {status:?} ({other:?})"),
            }
        }
    }

    async fn run(
        &mut self,
        sandbox: &(String, PodSandboxConfig),
        image: &str,
        name: &str,
        args: &[&str],
        edit: impl FnOnce(&mut ContainerConfig),
    ) -> ContainerStatus {
        let id = self.create(sandbox, image, name, args, edit).await.unwrap();
        self.start_container(&id).await;
        self.wait_exit(&id).await
    }

    async fn stop_container(&mut self, id: &str, timeout: i64) {
        self.client
            .runtime
            .stop_container(StopContainerRequest {
                container_id: id.into(),
                timeout,
            })
            .await
            .unwrap();
    }
}

fn spec(image: &str) -> ImageSpec {
    ImageSpec {
        image: image.into(),
        ..Default::default()
    }
}

/// The records of a CRI log: (stream, tag, content), each timestamp checked.
fn log(status: &ContainerStatus) -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(&status.log_path).unwrap_or_default();
    parse_log(&text)
}

fn parse_log(text: &str) -> Vec<(String, String, String)> {
    text.lines()
        .map(|line| {
            let mut parts = line.splitn(4, ' ');
            let time = parts.next().unwrap();
            assert!(
                time.ends_with('Z') && time.parse::<jiff::Timestamp>().is_ok(),
                "bad timestamp in {line:?}"
            );
            let stream = parts.next().unwrap().to_string();
            let tag = parts.next().unwrap().to_string();
            (stream, tag, parts.next().unwrap_or_default().to_string())
        })
        .collect()
}

fn rec(stream: &str, tag: &str, content: &str) -> (String, String, String) {
    (stream.into(), tag.into(), content.into())
}

/// Lets a sandboxed container see the test's directory `dir` at its own path, as
/// root: where the test and the container meet through files.
fn sees_host_dir(config: &mut ContainerConfig, dir: &Path) {
    config.mounts.push(k8s_cri::v1::Mount {
        container_path: dir.display().to_string(),
        host_path: dir.display().to_string(),
        ..Default::default()
    });
    let linux = config.linux.get_or_insert_with(Default::default);
    linux
        .security_context
        .get_or_insert_with(Default::default)
        .run_as_user = Some(k8s_cri::v1::Int64Value { value: 0 });
}

fn env(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: value.into(),
    }
}

async fn wait_for_log(path: &str, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if parse_log(&text).iter().any(|(_, _, c)| c == line) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{line:?} never in {path}: {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn wasm_programs_write_the_cri_log_and_see_only_their_args_env_and_mounts() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    let image = workload();
    let id = node.pull(&image).await;
    assert!(id.starts_with("sha256:") && id.len() == 71, "{id}");
    let sandbox = node.sandbox("wasm", "").await;
    let mut events = node
        .client
        .runtime
        .get_container_events(GetEventsRequest {})
        .await
        .unwrap()
        .into_inner();

    let status = node
        .run(
            &sandbox,
            &image,
            "out",
            &[
                "echo", "hello", "world", "--", "stderr", "oops", "--", "env", "GREETING", "--",
                "nonl", "tail",
            ],
            |c| c.envs = vec![env("GREETING", "hi")],
        )
        .await;
    assert_eq!((status.exit_code, status.reason.as_str()), (0, "Completed"));
    assert_eq!(status.image_ref, id);
    assert!(status.started_at >= status.created_at && status.finished_at >= status.started_at);
    assert_eq!(
        Path::new(&status.log_path),
        dir.path().join("logs/wasm/out/0.log")
    );
    assert_eq!(
        log(&status),
        [
            rec("stdout", "F", "hello world"),
            rec("stderr", "F", "oops"),
            rec("stdout", "F", "GREETING=hi"),
            rec("stdout", "P", "tail"),
        ]
    );
    let mut kinds = Vec::new();
    while kinds.len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(5), events.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(event.container_id, status.id);
        assert_eq!(event.containers_statuses[0].id, status.id);
        kinds.push((
            event.container_event_type,
            event.containers_statuses[0].state,
        ));
    }
    assert_eq!(
        kinds,
        [
            (
                ContainerEventType::ContainerCreatedEvent as i32,
                ContainerState::ContainerCreated as i32
            ),
            (
                ContainerEventType::ContainerStartedEvent as i32,
                ContainerState::ContainerRunning as i32
            ),
            (
                ContainerEventType::ContainerStoppedEvent as i32,
                ContainerState::ContainerExited as i32
            ),
        ]
    );
    // An open stream would hold the server's graceful shutdown.
    drop(events);

    // Without a command, argv[0] is the container's name; no host environment.
    let status = node.run(&sandbox, &image, "named", &["args"], |_| {}).await;
    assert_eq!(log(&status)[0], rec("stdout", "F", "named"));
    let status = node
        .run(&sandbox, &image, "nohome", &["env", "HOME"], |_| {})
        .await;
    assert_eq!(status.exit_code, 2, "the host's HOME leaked in");

    let status = node
        .run(&sandbox, &image, "three", &["exit", "3"], |_| {})
        .await;
    assert_eq!((status.exit_code, status.reason.as_str()), (3, "Error"));

    let data = dir.path().join("data");
    let scratch = dir.path().join("scratch");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&scratch).unwrap();
    std::fs::write(data.join("in.txt"), "from the host\n").unwrap();
    let mounts = vec![
        Mount {
            container_path: "/data".into(),
            host_path: data.display().to_string(),
            readonly: true,
            ..Default::default()
        },
        Mount {
            container_path: "/scratch".into(),
            host_path: scratch.display().to_string(),
            ..Default::default()
        },
    ];
    let status = node
        .run(
            &sandbox,
            &image,
            "files",
            &[
                "cat",
                "/data/in.txt",
                "--",
                "write",
                "/scratch/out.txt",
                "written",
                "--",
                "ls",
                "/data",
            ],
            |c| c.mounts = mounts.clone(),
        )
        .await;
    assert_eq!(status.exit_code, 0, "{:?}", log(&status));
    assert_eq!(
        log(&status),
        [
            rec("stdout", "F", "from the host"),
            rec("stdout", "F", "in.txt")
        ]
    );
    assert_eq!(
        std::fs::read_to_string(scratch.join("out.txt")).unwrap(),
        "written"
    );
    assert_eq!(status.mounts.len(), 2);
    let status = node
        .run(
            &sandbox,
            &image,
            "readonly",
            &["write", "/data/new.txt", "nope"],
            |c| c.mounts = mounts.clone(),
        )
        .await;
    assert_eq!(status.exit_code, 1);
    assert!(!data.join("new.txt").exists());
    assert!(
        log(&status)[0].2.starts_with("workload: write: "),
        "{:?}",
        log(&status)
    );
    let status = node
        .run(&sandbox, &image, "unmounted", &["ls", "/"], |_| {})
        .await;
    assert_eq!(status.exit_code, 1, "the host's root is visible");
    node.stop().await;
}

#[tokio::test]
async fn wasm_memory_limit_is_an_oom_kill_and_a_trap_is_reported() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    let image = workload();
    node.pull(&image).await;
    let sandbox = node.sandbox("limits", WASMTIME).await;
    let limit = |c: &mut ContainerConfig| {
        c.linux = Some(LinuxContainerConfig {
            resources: Some(LinuxContainerResources {
                memory_limit_in_bytes: 32 << 20,
                ..Default::default()
            }),
            ..Default::default()
        })
    };
    let status = node
        .run(&sandbox, &image, "small", &["alloc", "8"], limit)
        .await;
    assert_eq!((status.exit_code, status.reason.as_str()), (0, "Completed"));
    let status = node
        .run(&sandbox, &image, "big", &["alloc", "64"], limit)
        .await;
    assert_eq!(
        (status.exit_code, status.reason.as_str()),
        (137, "OOMKilled"),
        "{}",
        status.message
    );
    assert!(status.message.contains("33554432"), "{}", status.message);

    let status = node.run(&sandbox, &image, "trap", &["trap"], |_| {}).await;
    assert_eq!((status.exit_code, status.reason.as_str()), (1, "Error"));
    assert!(
        status.message.starts_with("wasm trap: ") && status.message.contains("unreachable"),
        "{}",
        status.message
    );
    assert!(status.message.contains("backtrace"), "{}", status.message);
    assert!(
        log(&status)
            .iter()
            .any(|(s, _, c)| s == "stderr" && c.contains("the workload was asked to trap")),
        "{:?}",
        log(&status)
    );
    node.stop().await;
}

#[tokio::test]
async fn stop_cancels_wasm_at_once_and_sends_a_process_sigterm() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    let image = workload();
    node.pull(&image).await;
    let wasm = node.sandbox("spin", "").await;
    let spin = node
        .create(&wasm, &image, "spin", &["spin"], |_| {})
        .await
        .unwrap();
    let sleep = node
        .create(
            &wasm,
            &image,
            "sleep",
            &["echo", "up", "--", "sleep", "60000"],
            |_| {},
        )
        .await
        .unwrap();
    node.start_container(&spin).await;
    node.start_container(&sleep).await;
    let status = node.status(&spin).await;
    assert_eq!(status.state, ContainerState::ContainerRunning as i32);
    wait_for_log(&node.status(&sleep).await.log_path, "up").await;
    for id in [&spin, &sleep] {
        let begun = Instant::now();
        node.stop_container(id, 30).await;
        assert!(
            begun.elapsed() < Duration::from_secs(2),
            "{:?}",
            begun.elapsed()
        );
        let status = node.status(id).await;
        assert_eq!(status.state, ContainerState::ContainerExited as i32);
        assert_eq!(status.exit_code, 137);
        assert!(status.message.starts_with("stopped"), "{}", status.message);
        // Idempotent.
        node.stop_container(id, 30).await;
    }

    let process = node.sandbox("proc", PROCESS).await;
    node.pull("file:///bin/sh").await;
    let id = node
        .create(&process, "file:///bin/sh", "sleeper", &[], |c| {
            c.command = vec!["sh".into(), "-c".into(), "echo started; sleep 60".into()];
        })
        .await
        .unwrap();
    node.start_container(&id).await;
    let log_path = node.status(&id).await.log_path;
    wait_for_log(&log_path, "started").await;
    let begun = Instant::now();
    node.stop_container(&id, 10).await;
    assert!(
        begun.elapsed() < Duration::from_secs(2),
        "{:?}",
        begun.elapsed()
    );
    let status = node.status(&id).await;
    assert_eq!(status.state, ContainerState::ContainerExited as i32);
    assert_eq!((status.exit_code, status.reason.as_str()), (143, "Error"));
    node.stop().await;
}

#[tokio::test]
async fn exec_sync_runs_beside_a_process_and_is_refused_for_wasm_and_logs_reopen() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    node.pull("file:///bin/sh").await;
    let sandbox = node.sandbox("exec", PROCESS).await;
    let id = node
        .create(&sandbox, "file:///bin/sh", "shell", &[], |c| {
            c.command = vec![
                "sh".into(),
                "-c".into(),
                "echo one; while [ ! -e go ]; do sleep 0.02; done; echo two; sleep 60".into(),
            ];
            c.envs = vec![env("FOO", "bar")];
            c.working_dir = dir.path().display().to_string();
            sees_host_dir(c, dir.path());
        })
        .await
        .unwrap();
    node.start_container(&id).await;
    let reply = node
        .client
        .runtime
        .exec_sync(ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec![
                "/bin/sh".into(),
                "-c".into(),
                "echo $FOO; pwd; echo err >&2; exit 4".into(),
            ],
            timeout: 5,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        String::from_utf8_lossy(&reply.stdout),
        format!("bar\n{}\n", dir.path().display())
    );
    assert_eq!(reply.stderr, b"err\n");
    assert_eq!(reply.exit_code, 4);
    let err = node
        .client
        .runtime
        .exec_sync(ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec!["/bin/sleep".into(), "5".into()],
            timeout: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");

    // The kubelet rotates a log by renaming it and asking for a reopen.
    let log_path = node.status(&id).await.log_path;
    wait_for_log(&log_path, "one").await;
    std::fs::rename(&log_path, format!("{log_path}.1")).unwrap();
    node.client
        .runtime
        .reopen_container_log(ReopenContainerLogRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
    std::fs::write(dir.path().join("go"), "").unwrap();
    wait_for_log(&log_path, "two").await;
    let rotated = parse_log(&std::fs::read_to_string(format!("{log_path}.1")).unwrap());
    assert_eq!(rotated, [rec("stdout", "F", "one")]);

    let stats = node
        .client
        .runtime
        .container_stats(ContainerStatsRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .stats
        .unwrap();
    assert!(stats.memory.unwrap().rss_bytes.unwrap().value > 0);

    let image = workload();
    node.pull(&image).await;
    let wasm = node.sandbox("wasm", "").await;
    let spin = node
        .create(&wasm, &image, "spin", &["spin"], |_| {})
        .await
        .unwrap();
    node.start_container(&spin).await;
    let err = node
        .client
        .runtime
        .exec_sync(ExecSyncRequest {
            container_id: spin.clone(),
            cmd: vec!["sh".into()],
            timeout: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(
        err.message(),
        format!("container {spin} runs a WebAssembly component: it has no shell to exec into")
    );

    // Removing the sandboxes stops and removes their containers; again is no error.
    for sandbox in [&sandbox.0, &wasm.0, &sandbox.0] {
        node.client
            .runtime
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: sandbox.clone(),
            })
            .await
            .unwrap();
    }
    let left = node
        .client
        .runtime
        .list_containers(ListContainersRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert!(left.is_empty(), "{left:?}");
    node.stop().await;
}

#[tokio::test]
async fn handlers_images_and_sandboxes_answer_as_cri_says() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    let version = node
        .client
        .runtime
        .version(VersionRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            version.runtime_name.as_str(),
            version.runtime_api_version.as_str()
        ),
        ("trellis", "v1")
    );
    let status = node
        .client
        .runtime
        .status(StatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    let handlers: Vec<_> = status
        .runtime_handlers
        .iter()
        .map(|h| h.name.as_str())
        .collect();
    assert_eq!(handlers, [WASMTIME, PROCESS]);
    // Ready to run containers; no pod network yet: no pod CIDR, no conflist.
    let conditions: Vec<_> = status
        .status
        .unwrap()
        .conditions
        .into_iter()
        .map(|c| (c.r#type, c.status, c.reason))
        .collect();
    assert_eq!(
        conditions,
        [
            ("RuntimeReady".to_string(), true, String::new()),
            (
                "NetworkReady".to_string(),
                false,
                "NetworkPluginNotReady".to_string()
            ),
        ]
    );

    let err = node
        .client
        .runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(PodSandboxConfig::default()),
            runtime_handler: "runc".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        err.message(),
        "no runtime handler \"runc\" on this node (it has: wasmtime, process)"
    );

    let pull = |reference: String| {
        let mut images = node.client.images.clone();
        async move {
            images
                .pull_image(PullImageRequest {
                    image: Some(spec(&reference)),
                    ..Default::default()
                })
                .await
        }
    };
    let missing = dir.path().join("missing.wasm");
    let err = pull(format!("file://{}", missing.display()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        err.message().contains(&missing.display().to_string()),
        "{err:?}"
    );
    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let err = pull(format!("file://{}", core.display()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("not a WebAssembly component"),
        "{err:?}"
    );
    let err = pull("Busybox:Latest".into()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("lowercase"), "{err:?}");
    // A registry that does not answer.
    let err = pull(format!("127.0.0.1:{}/app:v1", free_port()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    let image = workload();
    let sandbox = node.sandbox("images", "").await;
    let err = node
        .create(&sandbox, &image, "early", &[], |_| {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("not present"), "{err:?}");
    let id = node.pull(&image).await;
    node.pull("file:///bin/sh").await;
    let err = node
        .create(&sandbox, "file:///bin/sh", "native", &[], |_| {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // An image may be named by its id too.
    node.create(&sandbox, &id, "by-id", &[], |_| {})
        .await
        .unwrap();

    let status = node
        .client
        .images
        .image_status(ImageStatusRequest {
            image: Some(spec(&image)),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    assert_eq!(
        (status.id.as_str(), status.repo_tags.clone()),
        (id.as_str(), vec![image.clone()])
    );
    let size = std::fs::metadata(image.trim_start_matches("file://"))
        .unwrap()
        .len();
    assert_eq!(status.size, size);
    let listed = node
        .client
        .images
        .list_images(ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(listed.len(), 2);
    let fs = node
        .client
        .images
        .image_fs_info(ImageFsInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fs.image_filesystems[0].used_bytes.unwrap().value, size);
    for _ in 0..2 {
        node.client
            .images
            .remove_image(RemoveImageRequest {
                image: Some(spec(&image)),
            })
            .await
            .unwrap();
    }
    let gone = node
        .client
        .images
        .image_status(ImageStatusRequest {
            image: Some(spec(&image)),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .image;
    assert!(gone.is_none());

    let other = node.sandbox("other", PROCESS).await;
    let status = node.sandbox_status(&sandbox.0).await;
    assert_eq!(status.network.unwrap().ip, "10.1.2.3");
    assert_eq!(status.runtime_handler, WASMTIME);
    assert_eq!(status.metadata.unwrap().name, "images");
    node.client
        .runtime
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: other.0.clone(),
        })
        .await
        .unwrap();
    let list = |filter: PodSandboxFilter| {
        let mut runtime = node.client.runtime.clone();
        async move {
            let items = runtime
                .list_pod_sandbox(ListPodSandboxRequest {
                    filter: Some(filter),
                })
                .await
                .unwrap()
                .into_inner()
                .items;
            items.into_iter().map(|s| s.id).collect::<Vec<_>>()
        }
    };
    let ready = PodSandboxStateValue {
        state: PodSandboxState::SandboxReady as i32,
    };
    assert_eq!(
        list(PodSandboxFilter {
            state: Some(ready),
            ..Default::default()
        })
        .await,
        [sandbox.0.as_str()]
    );
    assert_eq!(
        list(PodSandboxFilter {
            label_selector: HashMap::from([("app".into(), "other".into())]),
            ..Default::default()
        })
        .await,
        [other.0.as_str()]
    );
    // Unknown sandboxes: stopping and removing them is no error.
    node.client
        .runtime
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: "nope".into(),
        })
        .await
        .unwrap();
    node.stop().await;
}

#[tokio::test]
async fn a_restarted_runtime_adopts_a_live_process_and_reports_a_lost_wasm_program() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;
    let image = workload();
    node.pull(&image).await;
    node.pull("file:///bin/sh").await;
    let process = node.sandbox("proc", PROCESS).await;
    let go = dir.path().join("go");
    let sleeper = node
        .create(&process, "file:///bin/sh", "sleeper", &[], |c| {
            c.command = vec![
                "sh".into(),
                "-c".into(),
                format!(
                    "echo before; while [ ! -e {} ]; do sleep 0.02; done; echo after; sleep 60",
                    go.display()
                ),
            ];
            sees_host_dir(c, dir.path());
        })
        .await
        .unwrap();
    node.start_container(&sleeper).await;
    let log_path = node.status(&sleeper).await.log_path;
    wait_for_log(&log_path, "before").await;
    let wasm = node.sandbox("wasm", "").await;
    let spin = node
        .create(&wasm, &image, "spin", &["spin"], |_| {})
        .await
        .unwrap();
    node.start_container(&spin).await;
    node.stop().await;

    let mut node = Node::start(dir.path()).await;
    let status = node.status(&sleeper).await;
    assert_eq!(status.state, ContainerState::ContainerRunning as i32);
    // Output written while no runtime ran is in the pipe, and is copied on.
    std::fs::write(&go, "").unwrap();
    wait_for_log(&log_path, "after").await;
    let status = node.status(&spin).await;
    assert_eq!(status.state, ContainerState::ContainerExited as i32);
    assert_eq!(status.message, "the runtime restarted while it ran");
    // The same sandboxes and images are there.
    let err = node
        .create(&process, &image, "x", &[], |_| {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    let begun = Instant::now();
    node.stop_container(&sleeper, 10).await;
    assert!(
        begun.elapsed() < Duration::from_secs(2),
        "{:?}",
        begun.elapsed()
    );
    let status = node.status(&sleeper).await;
    assert_eq!(status.state, ContainerState::ContainerExited as i32);
    assert_eq!(
        (status.exit_code, status.message.as_str()),
        (137, "exit status lost across a runtime restart")
    );
    assert_eq!(
        parse_log(&std::fs::read_to_string(&log_path).unwrap()),
        [rec("stdout", "F", "before"), rec("stdout", "F", "after")]
    );
    node.stop().await;
}

/// A port free on the loopback address: bound, then released for a container.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The container annotation through which the kubelet (and the node agent) tells a
/// runtime the container's ports.
fn ports_annotation(port: u16) -> HashMap<String, String> {
    HashMap::from([(
        "io.kubernetes.container.ports".to_string(),
        format!(r#"[{{"name":"http","containerPort":{port},"protocol":"TCP"}}]"#),
    )])
}

/// GETs `path` from 127.0.0.1:`port` on a connection of its own: status and body.
async fn get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    use http_body_util::BodyExt as _;
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
    tokio::spawn(connection);
    let request = hyper::Request::get(path)
        .header("host", format!("127.0.0.1:{port}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let response =
        tokio::time::timeout(Duration::from_secs(10), sender.send_request(request)).await??;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test]
async fn wasi_http_components_serve_each_request_with_a_fresh_instance() {
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start_on(dir.path(), IpAddr::from([127, 0, 0, 1])).await;
    let image = http_hello();
    node.pull(&image).await;
    let sandbox = node.sandbox("web", "").await;
    let port = free_port();
    let id = node
        .create(&sandbox, &image, "hello", &[], |c| {
            c.annotations = ports_annotation(port);
            c.envs = vec![env("GREETING", "trellis")];
            c.linux = Some(LinuxContainerConfig {
                resources: Some(LinuxContainerResources {
                    memory_limit_in_bytes: 32 << 20,
                    ..Default::default()
                }),
                ..Default::default()
            });
        })
        .await
        .unwrap();
    node.start_container(&id).await;
    let status = node.status(&id).await;
    assert_eq!(status.state, ContainerState::ContainerRunning as i32);

    assert_eq!(
        get(port, "/").await.unwrap(),
        (200, "hello from trellis\n".into())
    );
    assert_eq!(
        get(port, "/env/GREETING").await.unwrap(),
        (200, "trellis\n".into())
    );
    // Only the container's environment: not the host's.
    assert_eq!(get(port, "/env/HOME").await.unwrap().0, 404);
    let together = futures::future::join_all((0..8).map(|_| get(port, "/"))).await;
    assert!(
        together
            .iter()
            .all(|r| r.as_ref().is_ok_and(|(status, _)| *status == 200)),
        "{together:?}"
    );

    // A trap, or an instance over the memory limit, is that request's 500 alone.
    assert_eq!(get(port, "/trap").await.unwrap().0, 500);
    assert_eq!(get(port, "/alloc/8").await.unwrap().0, 200);
    assert_eq!(get(port, "/alloc/64").await.unwrap().0, 500);
    assert_eq!(
        get(port, "/").await.unwrap(),
        (200, "hello from trellis\n".into())
    );
    let status = node.status(&id).await;
    assert_eq!(status.state, ContainerState::ContainerRunning as i32);
    wait_for_log(&status.log_path, "GET /alloc/64").await;
    let records = log(&status);
    let stderr: Vec<&str> = records
        .iter()
        .filter(|(s, _, _)| s == "stderr")
        .map(|(_, _, c)| c.as_str())
        .collect();
    assert!(
        stderr
            .iter()
            .any(|l| l.contains("hello-http was asked to trap")),
        "{stderr:?}"
    );
    assert!(
        stderr
            .iter()
            .any(|l| l.starts_with("request GET /trap failed: wasm trap: ")),
        "{stderr:?}"
    );
    assert!(
        stderr
            .iter()
            .any(|l| l.starts_with("request GET /alloc/64 failed: ")
                && l.contains("memory limit of 33554432 bytes")),
        "{stderr:?}"
    );
    assert!(
        records
            .iter()
            .any(|(s, _, c)| s == "stdout" && c == "GET /env/GREETING"),
        "{records:?}"
    );

    // A second server on the same port: the start fails with the bind error.
    let twin = node
        .create(&sandbox, &image, "twin", &[], |c| {
            c.annotations = ports_annotation(port);
        })
        .await
        .unwrap();
    let err = node
        .client
        .runtime
        .start_container(StartContainerRequest {
            container_id: twin.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains(&format!("127.0.0.1:{port}")) && err.message().contains("in use"),
        "{err:?}"
    );
    let status = node.status(&twin).await;
    assert_eq!(
        (status.state, status.reason.as_str()),
        (ContainerState::ContainerExited as i32, "StartError")
    );
    // No port, no server.
    let portless = node
        .create(&sandbox, &image, "portless", &[], |_| {})
        .await
        .unwrap();
    let err = node
        .client
        .runtime
        .start_container(StartContainerRequest {
            container_id: portless,
        })
        .await
        .unwrap_err();
    assert!(
        err.message()
            .contains("a wasi:http component needs a containerPort"),
        "{err:?}"
    );

    // A stop ends the listening; nothing was in flight, so the exit is clean.
    let begun = Instant::now();
    node.stop_container(&id, 30).await;
    assert!(
        begun.elapsed() < Duration::from_secs(2),
        "{:?}",
        begun.elapsed()
    );
    let status = node.status(&id).await;
    assert_eq!(
        (status.state, status.exit_code, status.reason.as_str()),
        (ContainerState::ContainerExited as i32, 0, "Completed"),
        "{}",
        status.message
    );
    assert!(get(port, "/").await.is_err(), "still listening");
    node.stop().await;
}

#[tokio::test]
async fn components_are_pulled_from_an_oci_registry_and_named_by_tag_digest_and_id() {
    let registry = trellis_tests::registry::Registry::start().await.unwrap();
    let module = std::fs::read(fixture("workload")).unwrap();
    let manifest = registry
        .push("wasm/workload", "v1", "application/wasm", &module)
        .await
        .unwrap();
    let dir = trellis_tests::test_dir().unwrap();
    let mut node = Node::start(dir.path()).await;

    // As the kubelet does: pull by the pod's name, then create by the ref it returned.
    let name = format!("{}/wasm/workload:v1", registry.address);
    let image_ref = node.pull(&name).await;
    let pinned = format!("{}/wasm/workload@{manifest}", registry.address);
    assert_eq!(image_ref, pinned);
    assert!(
        registry
            .tokens_issued
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0,
        "the registry's Bearer challenge was not answered"
    );
    let status = node
        .client
        .images
        .image_status(ImageStatusRequest {
            image: Some(spec(&name)),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    let id = trellis_plugin_host::digest_of(&module);
    assert_eq!(status.id, id);
    assert_eq!(status.repo_tags, [name.as_str()]);
    assert_eq!(status.repo_digests, [pinned.as_str()]);
    assert_eq!(status.size, module.len() as u64);
    let sandbox = node.sandbox("oci", "").await;
    let status = node
        .run(
            &sandbox,
            &image_ref,
            "pulled",
            &["echo", "from", "oci"],
            |_| {},
        )
        .await;
    assert_eq!(status.exit_code, 0, "{}", status.message);
    assert_eq!(log(&status), [rec("stdout", "F", "from oci")]);

    // By digest, with credentials from an imagePullSecret: the same image, no new tag.
    let again = node
        .client
        .images
        .pull_image(PullImageRequest {
            image: Some(spec(&pinned)),
            auth: Some(AuthConfig {
                username: "puller".into(),
                password: "secret".into(),
                ..Default::default()
            }),
            sandbox_config: None,
        })
        .await
        .unwrap()
        .into_inner()
        .image_ref;
    assert_eq!(again, pinned);
    let listed = node
        .client
        .images
        .list_images(ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].repo_tags, [name.as_str()]);

    let err = node
        .client
        .images
        .pull_image(PullImageRequest {
            image: Some(spec(&format!("{}/wasm/workload:v2", registry.address))),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("MANIFEST_UNKNOWN"), "{err:?}");
    node.stop().await;
}

/// With a pod CIDR (as the kubelet sends it), POD-network sandboxes get a network
/// namespace of their own, connected by the default CNI network, and their processes
/// run in it; host-network sandboxes keep the node's. Needs root and the CNI plugins.
#[tokio::test]
async fn pod_network_sandboxes_get_their_own_ips_from_cni() {
    if !rustix::process::geteuid().is_root() || !Path::new("/usr/lib/cni/bridge").exists() {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return;
    }
    // The default network's bridge and table, in this machine's namespace.
    let _made = trellis_tests::NetworkLeftovers::new(&["trellis0"], &["ip trellis0"]);
    let dir = trellis_tests::test_dir().unwrap();
    let root = dir.path().join("root");
    let mut node = Node::start(dir.path()).await;
    node.client
        .runtime
        .update_runtime_config(UpdateRuntimeConfigRequest {
            runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                network_config: Some(NetworkConfig {
                    pod_cidr: "10.244.78.0/24".into(),
                }),
            }),
        })
        .await
        .unwrap();
    let conflist = std::fs::read_to_string(root.join("cni/net.d/10-trellis.conflist")).unwrap();
    assert!(conflist.contains("10.244.78.0/24"), "{conflist}");

    let python = "file:///usr/bin/python3";
    node.pull(python).await;
    let ports_before = bridge_ports();
    let host_port = free_port();
    let mut pods = Vec::new();
    for name in ["net-a", "net-b"] {
        // a's port 8080 is also the node's host_port.
        let sandbox = node
            .sandbox_with(name, PROCESS, |c| {
                if name == "net-a" {
                    c.port_mappings = vec![PortMapping {
                        protocol: Protocol::Tcp as i32,
                        container_port: 8080,
                        host_port: i32::from(host_port),
                        host_ip: String::new(),
                    }];
                }
            })
            .await;
        let status = node.sandbox_status(&sandbox.0).await;
        let ip = status.network.unwrap().ip;
        assert!(ip.starts_with("10.244.78."), "{ip}");
        let options = status.linux.unwrap().namespaces.unwrap().options.unwrap();
        assert_eq!(options.network, NamespaceMode::Pod as i32);
        // The same port in both pods.
        let id = node
            .create(&sandbox, python, "web", &[], |c| {
                c.command = ["python3", "-m", "http.server", "8080"]
                    .map(String::from)
                    .to_vec();
                c.working_dir = dir.path().display().to_string();
            })
            .await
            .unwrap();
        node.start_container(&id).await;
        pods.push((sandbox.0, ip));
    }
    assert_ne!(pods[0].1, pods[1].1);
    assert_eq!(
        bridge_ports().len(),
        ports_before.len() + 2,
        "a veth per pod"
    );
    for (_, ip) in &pods {
        assert!(
            trellis_tests::http_answers(ip, 8080).await,
            "the pod at {ip} answers from the host"
        );
    }
    // The hostPort, on the bridge's address (one of the node's own).
    assert!(
        trellis_tests::http_answers("10.244.78.1", host_port).await,
        "a's hostPort {host_port} answers"
    );

    // A wasi:http component listens in its pod's namespace, on the pod's IP.
    let image = http_hello();
    node.pull(&image).await;
    let web = node.sandbox("net-web", WASMTIME).await;
    let id = node
        .create(&web, &image, "hello", &[], |c| {
            c.annotations = ports_annotation(8080);
        })
        .await
        .unwrap();
    node.start_container(&id).await;
    let web_ip = node.sandbox_status(&web.0).await.network.unwrap().ip;
    assert!(
        trellis_tests::http_answers(&web_ip, 8080).await,
        "the component at {web_ip} answers"
    );
    pods.push((web.0, web_ip));

    // A host-network sandbox is on the node's network, as every sandbox was before.
    let host = node
        .client
        .runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(PodSandboxConfig {
                metadata: Some(PodSandboxMetadata {
                    name: "host".into(),
                    uid: "uid-host".into(),
                    namespace: "default".into(),
                    attempt: 0,
                }),
                linux: Some(LinuxPodSandboxConfig {
                    security_context: Some(LinuxSandboxSecurityContext {
                        namespace_options: Some(NamespaceOption {
                            network: NamespaceMode::Node as i32,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            runtime_handler: PROCESS.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    let status = node.sandbox_status(&host).await;
    assert_eq!(
        status.network.unwrap().ip,
        IpAddr::from(NODE_IP).to_string()
    );

    // Stopping tears the network down: no pin, no veth, no address reserved; again is
    // a no-op, and so is removing.
    for (id, _) in &pods {
        for _ in 0..2 {
            node.client
                .runtime
                .stop_pod_sandbox(StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                })
                .await
                .unwrap();
        }
        node.client
            .runtime
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await
            .unwrap();
    }
    let entries = |path: PathBuf| {
        std::fs::read_dir(path)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    assert_eq!(entries(root.join("netns")), Vec::<String>::new());
    assert_eq!(entries(root.join("cni/results")), Vec::<String>::new());
    let reserved: Vec<_> = entries(root.join("cni/networks/trellis"))
        .into_iter()
        .filter(|name| name.starts_with("10.244.78."))
        .collect();
    assert_eq!(reserved, Vec::<String>::new());
    assert_eq!(bridge_ports(), ports_before, "the pods' veths are gone");
    node.stop().await;
}

/// The interfaces on the default network's bridge.
fn bridge_ports() -> Vec<String> {
    let mut ports: Vec<String> = std::fs::read_dir("/sys/class/net/trellis0/brif")
        .map(|d| {
            d.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    ports.sort();
    ports
}

/// A hollow node's runtime hands its pods addresses from its pod CIDR, and nothing
/// else (no namespace, no CNI).
#[tokio::test]
async fn hollow_sandboxes_get_addresses_from_the_pod_cidr() {
    use trellis_runtime::hollow::{HollowConfig, HollowRuntime};
    let hollow = HollowRuntime::new(HollowConfig::default());
    let mut client = trellis_runtime::hollow::connect(hollow).await.unwrap();
    let mut control = client.runtime.clone();
    let mut run = async |name: &str| {
        let id = client
            .runtime
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(PodSandboxConfig {
                    metadata: Some(PodSandboxMetadata {
                        name: name.into(),
                        uid: format!("uid-{name}"),
                        namespace: "default".into(),
                        attempt: 0,
                    }),
                    ..Default::default()
                }),
                runtime_handler: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
        let status = client
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
        (id, status.network.unwrap().ip)
    };
    // No pod CIDR: the node's address, as before.
    assert_eq!(run("before").await.1, "127.0.0.1");
    control
        .update_runtime_config(UpdateRuntimeConfigRequest {
            runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                network_config: Some(NetworkConfig {
                    pod_cidr: "10.42.7.0/24".into(),
                }),
            }),
        })
        .await
        .unwrap();
    let (_, a) = run("a").await;
    let (_, b) = run("b").await;
    assert_eq!((a.as_str(), b.as_str()), ("10.42.7.2", "10.42.7.3"));
}

/// What a pod-network test made that a failure could leave: its sandboxes' pins
/// (unmounted, which ends their namespaces and veths) and its bridge, removed on drop.
struct NetworkGuard {
    root: PathBuf,
    bridge: &'static str,
}

impl Drop for NetworkGuard {
    fn drop(&mut self) {
        for kind in ["netns", "utsns", "ipcns"] {
            for entry in std::fs::read_dir(self.root.join(kind))
                .into_iter()
                .flatten()
                .flatten()
            {
                let pin = entry.path();
                let _ = rustix::mount::unmount(&pin, rustix::mount::UnmountFlags::DETACH);
                let _ = std::fs::remove_file(&pin);
            }
        }
        let _ = std::process::Command::new("ip")
            .args(["link", "del", self.bridge])
            .status();
        // The in-process default network's table, named after its bridge.
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "ip", self.bridge])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The names in `dir`, sorted; none when it does not exist.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A runtime restart keeps its pods' networks: sandboxes whose namespaces are still
/// pinned are READY with the same IPs and answer on them. What no record names (the
/// runtime died between ADD and saving the sandbox's record) is torn down before the
/// runtime serves: no pin, record of the ADD, reserved address or veth is left. A
/// sandbox whose namespace did not survive (a reboot unmounts the pins) is no longer
/// ready, and its address is freed. Both ways a network is made: an operator's
/// conflist through the CNI plugins (10.244.82.0/26), and the runtime's default
/// network in-process (10.244.82.64/26). Needs root and the CNI plugins.
#[tokio::test]
async fn a_restarted_runtime_keeps_its_pods_addresses_and_tears_down_what_no_record_names() {
    if !rustix::process::geteuid().is_root() || !Path::new("/usr/lib/cni/bridge").exists() {
        eprintln!("skipped: pod networks need root and the CNI plugins (make deps)");
        return;
    }
    restart_recovers("trellis-nt82r", "10.244.82.0/26", false).await;
    restart_recovers("trellis-nt82d", "10.244.82.64/26", true).await;
}

/// The restart of [`a_restarted_runtime_keeps_its_pods_addresses_and_tears_down_what_no_record_names`]
/// on bridge `bridge` and `subnet`: with the runtime's `default` network (made
/// in-process), else with a conflist of the bridge and host-local plugins.
async fn restart_recovers(bridge_name: &'static str, subnet: &str, default: bool) {
    let dir = trellis_tests::test_dir().unwrap();
    let root = dir.path().join("root");
    let _guard = NetworkGuard {
        root: root.clone(),
        bridge: bridge_name,
    };
    let conf_dir = root.join("cni/net.d");
    std::fs::create_dir_all(&conf_dir).unwrap();
    let ipam = root.join("cni/networks");
    let (network, conflist) = if default {
        let conflist = trellis_runtime::default_conflist(&[subnet.into()], bridge_name, &ipam);
        ("trellis", conflist)
    } else {
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "restart-test",
            "plugins": [{
                "type": "bridge",
                "bridge": bridge_name,
                "isGateway": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "dataDir": ipam,
                }
            }]
        });
        ("restart-test", conflist)
    };
    std::fs::write(
        conf_dir.join("10-restart-test.conflist"),
        serde_json::to_vec(&conflist).unwrap(),
    )
    .unwrap();
    // What records an ADD: the plugins' cached result, or the in-process network's.
    let (added_dir, added_name): (PathBuf, fn(&str) -> String) = if default {
        (root.join("bridge"), |id| format!("{id}.json"))
    } else {
        (root.join("cni/results"), |id| format!("{id}-eth0"))
    };
    let mut node = Node::start(dir.path()).await;
    node.client
        .runtime
        .update_runtime_config(UpdateRuntimeConfigRequest {
            runtime_config: Some(k8s_cri::v1::RuntimeConfig {
                network_config: Some(NetworkConfig {
                    pod_cidr: subnet.into(),
                }),
            }),
        })
        .await
        .unwrap();
    let python = "file:///usr/bin/python3";
    node.pull(python).await;
    let mut kept = Vec::new();
    for name in ["keep-a", "keep-b"] {
        let sandbox = node.sandbox(name, PROCESS).await;
        let id = node
            .create(&sandbox, python, "web", &[], |c| {
                c.command = ["python3", "-m", "http.server", "8080"]
                    .map(String::from)
                    .to_vec();
                c.working_dir = dir.path().display().to_string();
            })
            .await
            .unwrap();
        node.start_container(&id).await;
        let ip = node.sandbox_status(&sandbox.0).await.network.unwrap().ip;
        assert!(trellis_tests::http_answers(&ip, 8080).await, "{ip} answers");
        kept.push((sandbox.0, ip));
    }
    // A crash between ADD and saving the record: the network is there, the record not.
    let (crashed, _) = node.sandbox("crashed", PROCESS).await;
    std::fs::remove_file(root.join("sandboxes").join(format!("{crashed}.json"))).unwrap();
    let (rebooted, _) = node.sandbox("rebooted", PROCESS).await;
    let bridge = Path::new("/sys/class/net").join(bridge_name).join("brif");
    assert_eq!(names_in(&bridge).len(), 4, "a veth per sandbox");
    // A reboot: the pin is a plain file, its namespace gone.
    rustix::mount::unmount(
        root.join("netns").join(&rebooted),
        rustix::mount::UnmountFlags::DETACH,
    )
    .unwrap();
    node.stop().await;
    let restarted = Instant::now();
    let mut node = Node::start(dir.path()).await;
    let recovery = restarted.elapsed();
    for (id, ip) in &kept {
        let status = node.sandbox_status(id).await;
        assert_eq!(status.state, PodSandboxState::SandboxReady as i32);
        assert_eq!(&status.network.unwrap().ip, ip, "the same IP");
        assert!(
            trellis_tests::http_answers(ip, 8080).await,
            "{ip} still answers"
        );
    }
    let err = node
        .client
        .runtime
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: crashed.clone(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let status = node.sandbox_status(&rebooted).await;
    assert_eq!(status.state, PodSandboxState::SandboxNotready as i32);
    let kept_ids: Vec<String> = {
        let mut ids: Vec<String> = kept.iter().map(|(id, _)| id.clone()).collect();
        ids.sort();
        ids
    };
    assert_eq!(names_in(&root.join("netns")), kept_ids, "pins");
    let mut with_rebooted = kept_ids.clone();
    with_rebooted.push(rebooted.clone());
    with_rebooted.sort();
    for kind in ["utsns", "ipcns"] {
        assert_eq!(names_in(&root.join(kind)), with_rebooted, "{kind} pins");
    }
    assert!(
        !root.join("sandboxes").join(&crashed).exists(),
        "the files of the sandbox with no record"
    );
    let added: Vec<String> = kept_ids.iter().map(|id| added_name(id)).collect();
    assert_eq!(names_in(&added_dir), added, "records of ADDs");
    let reserved = || {
        let mut owners: Vec<String> = names_in(&ipam.join(network))
            .into_iter()
            .filter(|name| name.starts_with("10.244.82."))
            .map(|name| {
                let text = std::fs::read_to_string(ipam.join(network).join(name)).unwrap();
                text.lines().next().unwrap().trim().to_string()
            })
            .collect();
        owners.sort();
        owners
    };
    assert_eq!(reserved(), kept_ids, "addresses reserved");
    // A namespace's veth goes with it, which the kernel finishes a moment after the
    // last reference: the bridge is looked at again for a while.
    assert_eq!(
        bridge_ports_settle(&bridge, 2).await,
        2,
        "the veths of the kept pods only"
    );
    eprintln!("{bridge_name}: recovery and restart took {recovery:?}");

    for id in kept_ids.iter().chain([&rebooted]) {
        node.client
            .runtime
            .stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await
            .unwrap();
        node.client
            .runtime
            .remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await
            .unwrap();
    }
    for kind in ["netns", "utsns", "ipcns", "cni/results", "bridge"] {
        assert_eq!(names_in(&root.join(kind)), Vec::<String>::new(), "{kind}");
    }
    assert_eq!(reserved(), Vec::<String>::new());
    assert_eq!(bridge_ports_settle(&bridge, 0).await, 0, "no veth left");
    node.stop().await;
}

/// The number of ports of the bridge whose `brif` directory is `brif`, once it is
/// `expected` or after 5 s of looking again every 20 ms.
async fn bridge_ports_settle(brif: &Path, expected: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ports = names_in(brif).len();
        if ports == expected || Instant::now() >= deadline {
            return ports;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
