//! The runtime's cgroups over real gRPC, as a kubelet drives a CRI runtime: a
//! `process` container's memory limit is enforced (`OOMKilled`, exit 137) and its CPU
//! limit throttles it, both measured from the stats the runtime reports from the
//! container's cgroup (`ContainerStats`, `ListContainerStats`, `PodSandboxStats`);
//! `UpdateContainerResources` changes the limit; the cgroups go with the containers.
//! Needs root and a cgroup hierarchy (skips with the reason otherwise).

// The helpers below are test code too, outside any `#[test]` function.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use k8s_cri::v1::*;
use tokio::time::Instant;
use trellis_cgroups::{Cgroup, Hierarchy, Version};
use trellis_runtime::{Client, PROCESS, Runtime, RuntimeConfig, connect, serve_on};

const MIB: i64 = 1 << 20;
/// How long the busy loop's CPU use is measured over.
const WINDOW: Duration = Duration::from_millis(1200);

/// A cgroup tree of this test's own in the machine's hierarchy: what is left in it is
/// killed and it is removed, bottom-up, also when the test fails.
struct CgroupRoot(Cgroup);

impl Drop for CgroupRoot {
    fn drop(&mut self) {
        if let Err(e) = self.0.kill_and_remove(Duration::from_secs(2)) {
            eprintln!("left the cgroup {} behind: {e}", self.0.path());
        }
    }
}

fn usable_hierarchy() -> Option<Hierarchy> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: cgroups need root");
        return None;
    }
    match Hierarchy::detect() {
        Ok(h) => Some(h),
        Err(e) => {
            eprintln!("skipped: no cgroup hierarchy: {e}");
            None
        }
    }
}

fn u64_of(value: &Option<UInt64Value>) -> u64 {
    value.as_ref().map(|v| v.value).unwrap()
}

async fn container_stats(client: &mut Client, id: &str) -> ContainerStats {
    client
        .runtime
        .container_stats(ContainerStatsRequest {
            container_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .stats
        .unwrap()
}

async fn status(client: &mut Client, id: &str) -> ContainerStatus {
    client
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

/// Waits until container `id` has exited, woken by the runtime's container events.
async fn wait_exit(client: &mut Client, id: &str) -> ContainerStatus {
    let mut events = client
        .runtime
        .get_container_events(GetEventsRequest {})
        .await
        .unwrap()
        .into_inner();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = status(client, id).await;
        if status.state == ContainerState::ContainerExited as i32 {
            return status;
        }
        match tokio::time::timeout_at(deadline, events.message()).await {
            Ok(Ok(Some(_))) => {}
            other => panic!("{id} did not exit: {status:?} ({other:?})"),
        }
    }
}

/// A sandboxed `process` container running `script` with `resources`; the script
/// waits until it is in its cgroup, so that nothing it starts escapes it (the init
/// joins it before the program runs; a runtime without one moves it after the start).
fn shell(name: &str, script: &str, resources: LinuxContainerResources) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: "file:///bin/sh".into(),
            ..Default::default()
        }),
        command: vec![
            "sh".into(),
            "-c".into(),
            format!("until grep -q trellis-test /proc/$$/cgroup; do :; done; {script}"),
        ],
        labels: HashMap::from([("name".to_string(), name.to_string())]),
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            resources: Some(resources),
            security_context: None,
        }),
        ..Default::default()
    }
}

/// The CPU the container used over `WINDOW`, in cores, from two `ContainerStats`;
/// and the rate the runtime reported from its own previous sample.
async fn cores_over_window(client: &mut Client, id: &str) -> (f64, f64) {
    let before = container_stats(client, id).await.cpu.unwrap();
    // A measurement over an interval, not a wait for a condition.
    tokio::time::sleep(WINDOW).await;
    let after = container_stats(client, id).await.cpu.unwrap();
    let used = u64_of(&after.usage_core_nano_seconds) - u64_of(&before.usage_core_nano_seconds);
    let elapsed = after.timestamp - before.timestamp;
    let reported = u64_of(&after.usage_nano_cores) as f64 / 1e9;
    (used as f64 / elapsed as f64, reported)
}

#[tokio::test]
async fn process_limits_are_enforced_and_measured_from_cgroups() {
    let Some(hierarchy) = usable_hierarchy() else {
        return;
    };
    let begun = Instant::now();
    let root_path = format!("/trellis-test-{:08x}", rand::random::<u32>());
    let root = CgroupRoot(hierarchy.cgroup(&root_path));
    // The most weight against the rest of the machine (a busy build, say), so that
    // what limits the busy loop is its quota, not the competition.
    root.0.create().unwrap();
    root.0
        .set(&trellis_cgroups::Resources {
            cpu_shares: Some(trellis_cgroups::MAX_SHARES),
            ..Default::default()
        })
        .unwrap();
    let pod_cgroup = format!("{root_path}/pod1");

    let dir = trellis_tests::test_dir().unwrap();
    let runtime = Runtime::new(trellis_tests::sandboxed(RuntimeConfig {
        root: dir.path().join("root"),
        process_handler: true,
        ..Default::default()
    }))
    .unwrap();
    let socket = dir.path().join("cri.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let listener = trellis_runtime::listen(&socket).unwrap();
    let server = tokio::spawn(serve_on(runtime, listener, async {
        let _ = stopped.await;
    }));
    let mut client = connect(&socket).await.unwrap();
    client
        .images
        .pull_image(PullImageRequest {
            image: Some(ImageSpec {
                image: "file:///bin/sh".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let sandbox_config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "limits".into(),
            uid: "uid-limits".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: dir.path().join("logs").display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            cgroup_parent: pod_cgroup.clone(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let sandbox = client
        .runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(sandbox_config.clone()),
            runtime_handler: PROCESS.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    let mut create = async |config: ContainerConfig| {
        let id = client
            .runtime
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.clone(),
                config: Some(config),
                sandbox_config: Some(sandbox_config.clone()),
            })
            .await
            .unwrap()
            .into_inner()
            .container_id;
        client
            .runtime
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap();
        id
    };
    // `tail` keeps its whole input when it holds no newline: 100 MiB against 32.
    let hog = create(shell(
        "hog",
        "head -c 104857600 /dev/zero | tail",
        LinuxContainerResources {
            memory_limit_in_bytes: 32 * MIB,
            ..Default::default()
        },
    ))
    .await;
    let spin = create(shell(
        "spin",
        "while :; do :; done",
        LinuxContainerResources {
            cpu_period: 100_000,
            cpu_quota: 20_000,
            cpu_shares: 204,
            ..Default::default()
        },
    ))
    .await;

    let spin_cgroup = hierarchy.cgroup(&format!("{pod_cgroup}/{spin}"));
    assert!(spin_cgroup.exists(), "{} was not made", spin_cgroup.path());
    let (measured, reported) = cores_over_window(&mut client, &spin).await;
    println!(
        "a busy loop limited to 200m used {measured:.3} cores by its cgroup, {reported:.3} by the runtime's rate"
    );
    assert!(
        (0.15..=0.25).contains(&measured),
        "a busy loop limited to 200m used {measured:.3} cores"
    );
    assert!(
        (0.15..=0.25).contains(&reported),
        "usage_nano_cores said {reported:.3} cores"
    );
    // The quota, not a busy machine, held it back.
    let throttled = spin_cgroup.stats().unwrap().cpu_throttled_periods;
    assert!(throttled > 0, "the busy loop was never throttled");

    let hog_status = wait_exit(&mut client, &hog).await;
    assert_eq!(
        (hog_status.exit_code, hog_status.reason.as_str()),
        (137, "OOMKilled"),
        "{hog_status:?}"
    );

    let listed = client
        .runtime
        .list_container_stats(ListContainerStatsRequest {
            filter: Some(ContainerStatsFilter {
                pod_sandbox_id: sandbox.clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .stats;
    let ids: Vec<_> = listed
        .iter()
        .map(|s| s.attributes.as_ref().unwrap().id.as_str())
        .collect();
    assert_eq!(ids, [spin.as_str()], "only the running container");
    let spin_stats = &listed[0];
    let memory = spin_stats.memory.as_ref().unwrap();
    assert!(u64_of(&memory.usage_bytes) >= u64_of(&memory.working_set_bytes));
    assert!(spin_stats.writable_layer.is_some());

    let pod = client
        .runtime
        .pod_sandbox_stats(PodSandboxStatsRequest {
            pod_sandbox_id: sandbox.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .stats
        .unwrap();
    assert_eq!(pod.attributes.as_ref().unwrap().id, sandbox);
    let linux = pod.linux.unwrap();
    assert_eq!(linux.containers.len(), 1);
    let spin_cpu = u64_of(
        &linux.containers[0]
            .cpu
            .as_ref()
            .unwrap()
            .usage_core_nano_seconds,
    );
    let pod_cpu = u64_of(&linux.cpu.as_ref().unwrap().usage_core_nano_seconds);
    // The pod's cgroup holds both containers' use, the hog's included.
    assert!(pod_cpu >= spin_cpu, "pod {pod_cpu} < container {spin_cpu}");
    assert!(u64_of(&linux.process.unwrap().process_count) >= 1);
    let listed_pods = client
        .runtime
        .list_pod_sandbox_stats(ListPodSandboxStatsRequest {
            filter: Some(PodSandboxStatsFilter {
                id: sandbox.clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .stats;
    assert_eq!(listed_pods.len(), 1);

    // A new limit: in the cgroup and in the container's status.
    client
        .runtime
        .update_container_resources(UpdateContainerResourcesRequest {
            container_id: spin.clone(),
            linux: Some(LinuxContainerResources {
                cpu_period: 100_000,
                cpu_quota: 50_000,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let quota = match hierarchy.version() {
        Version::V1 => cgroup_file(&hierarchy, "cpu", spin_cgroup.path(), "cpu.cfs_quota_us"),
        Version::V2 => cgroup_file(&hierarchy, "", spin_cgroup.path(), "cpu.max"),
    };
    assert!(quota.starts_with("50000"), "{quota}");
    let resources = status(&mut client, &spin).await.resources.unwrap();
    assert_eq!(resources.linux.unwrap().cpu_quota, 50_000);

    for id in [&spin, &hog] {
        client
            .runtime
            .remove_container(RemoveContainerRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap();
    }
    assert!(!spin_cgroup.exists(), "the container's cgroup is left");
    assert!(!hierarchy.cgroup(&format!("{pod_cgroup}/{hog}")).exists());
    client
        .runtime
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: sandbox,
        })
        .await
        .unwrap();
    // The pod's cgroup is the agent's: the runtime leaves it.
    assert!(hierarchy.cgroup(&pod_cgroup).exists());

    drop(client);
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    drop(root);
    eprintln!("took {:?}", begun.elapsed());
}

/// A cgroup file's content: `controller`'s on v1, the one directory's on v2.
fn cgroup_file(hierarchy: &Hierarchy, controller: &str, path: &str, file: &str) -> String {
    let cgroup = hierarchy.cgroup(path);
    let dir = cgroup.controller_dir(controller).unwrap();
    std::fs::read_to_string(dir.join(file)).unwrap()
}
