//! WASM containers' CPU limit and usage through the CRI, against an in-process runtime:
//! a busy loop limited to `200m` uses a fifth of a core (its CRI stats and its thread's
//! time in /proc agree), an unlimited one is not held back, and an idle container that
//! allocated memory shows that memory and no CPU. (The memory limit's OOM kill is
//! `runtime::wasm_memory_limit_is_an_oom_kill_and_a_trap_is_reported`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use k8s_cri::v1::*;
use tokio::sync::oneshot;
use tokio::time::Instant;
use trellis_runtime::{Client, Runtime, RuntimeConfig, WASMTIME, connect, serve_on};

/// How long the CPU is measured: many CFS periods, so one period's overrun is noise.
const WINDOW: Duration = Duration::from_millis(1500);
/// Clock ticks a second in /proc (`USER_HZ`, 100 on every Linux architecture).
const USER_HZ: f64 = 100.0;

fn workload() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/dist/workload.wasm");
    assert!(
        path.exists(),
        "{} is missing: run plugins/build.sh",
        path.display()
    );
    format!("file://{}", path.canonicalize().unwrap().display())
}

fn cpu_limit(milli: i64) -> impl FnOnce(&mut ContainerConfig) {
    move |c: &mut ContainerConfig| {
        c.linux = Some(LinuxContainerConfig {
            resources: Some(LinuxContainerResources {
                // As the kubelet converts limits.cpu: quota per 100 ms period.
                cpu_period: 100_000,
                cpu_quota: milli * 100,
                memory_limit_in_bytes: 64 << 20,
                ..Default::default()
            }),
            ..Default::default()
        })
    }
}

async fn create(
    client: &mut Client,
    sandbox: &(String, PodSandboxConfig),
    name: &str,
    args: &[&str],
    edit: impl FnOnce(&mut ContainerConfig),
) -> String {
    let mut config = ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: workload(),
            ..Default::default()
        }),
        args: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    };
    edit(&mut config);
    let id = client
        .runtime
        .create_container(CreateContainerRequest {
            pod_sandbox_id: sandbox.0.clone(),
            config: Some(config),
            sandbox_config: Some(sandbox.1.clone()),
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
}

async fn stats(client: &mut Client, id: &str) -> ContainerStats {
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

/// The container's cumulative CPU time (ns) as the CRI reports it.
fn cpu_ns(stats: &ContainerStats) -> u64 {
    stats
        .cpu
        .as_ref()
        .and_then(|c| c.usage_core_nano_seconds.as_ref())
        .map(|v| v.value)
        .expect("a WASM container reports its CPU time")
}

fn working_set(stats: &ContainerStats) -> u64 {
    stats
        .memory
        .as_ref()
        .and_then(|m| m.working_set_bytes.as_ref())
        .map(|v| v.value)
        .expect("a WASM container reports its memory")
}

/// The CPU time (s) of the container's thread as the kernel counts it: the thread is
/// named `wasm-` and the start of the container's id (cut to the 15 bytes of a
/// thread's name).
fn thread_cpu(id: &str) -> f64 {
    let comm = format!("wasm-{}", &id[..10]);
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if name.trim() != comm {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
        // After the name: state is field 3, utime and stime fields 14 and 15.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        return ticks as f64 / USER_HZ;
    }
    panic!("no thread {comm} in this process");
}

#[tokio::test]
async fn wasm_containers_are_held_to_their_cpu_limit_and_report_their_usage() {
    let dir = trellis_tests::test_dir().unwrap();
    let runtime = Runtime::new(RuntimeConfig {
        root: dir.path().join("root"),
        cache_dir: Some(Path::new(env!("CARGO_TARGET_TMPDIR")).join("runtime-cache")),
        ..Default::default()
    })
    .unwrap();
    let socket = dir.path().join("cri.sock");
    let (shutdown, stopped) = oneshot::channel::<()>();
    let listener = trellis_runtime::listen(&socket).unwrap();
    let server = tokio::spawn(serve_on(runtime, listener, async {
        let _ = stopped.await;
    }));
    let mut client = connect(&socket).await.unwrap();
    client
        .images
        .pull_image(PullImageRequest {
            image: Some(ImageSpec {
                image: workload(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "limits".into(),
            uid: "uid-limits".into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        ..Default::default()
    };
    let sandbox_id = client
        .runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: WASMTIME.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    let sandbox = (sandbox_id, config);

    let limited = create(&mut client, &sandbox, "limited", &["spin"], cpu_limit(200)).await;
    let free = create(&mut client, &sandbox, "free", &["spin"], |_| {}).await;
    let idle = create(
        &mut client,
        &sandbox,
        "idle",
        &["alloc", "16", "--", "sleep", "600000"],
        cpu_limit(200),
    )
    .await;
    // The idle one has allocated once its memory shows (a bounded probe).
    let deadline = Instant::now() + Duration::from_secs(10);
    while working_set(&stats(&mut client, &idle).await) < 16 << 20 {
        assert!(Instant::now() < deadline, "the 16 MiB never showed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let ids = [&limited, &free, &idle];
    let mut before = Vec::new();
    for id in ids {
        before.push((cpu_ns(&stats(&mut client, id).await), thread_cpu(id)));
    }
    let start = Instant::now();
    // The measurement itself: CPU used over a stretch of wall time.
    tokio::time::sleep(WINDOW).await;
    let mut after = Vec::new();
    for id in ids {
        after.push((cpu_ns(&stats(&mut client, id).await), thread_cpu(id)));
    }
    let wall = start.elapsed().as_secs_f64();
    let cores: Vec<(f64, f64)> = before
        .iter()
        .zip(&after)
        .map(|((ns0, t0), (ns1, t1))| ((ns1 - ns0) as f64 / 1e9 / wall, (t1 - t0) / wall))
        .collect();
    println!(
        "cores used over {wall:.2} s (CRI stats, /proc): limited {:.3} {:.3}, free {:.3} {:.3}, idle {:.3} {:.3}",
        cores[0].0, cores[0].1, cores[1].0, cores[1].1, cores[2].0, cores[2].1
    );

    let (limited_cores, limited_proc) = cores[0];
    let (free_cores, free_proc) = cores[1];
    assert!(
        limited_cores <= 0.25,
        "a 200m busy loop used {limited_cores:.3} cores"
    );
    assert!(
        (limited_proc - limited_cores).abs() < 0.05 && (free_proc - free_cores).abs() < 0.1,
        "the stats and the kernel disagree: {cores:?}"
    );
    // On a machine too busy to give a busy loop more than its limit, the loops cannot
    // be told apart; otherwise the limited one gets its limit, the other more.
    if free_cores >= 0.4 {
        assert!(
            limited_cores >= 0.15,
            "a 200m busy loop used {limited_cores:.3} cores"
        );
        assert!(
            free_cores > 1.5 * limited_cores,
            "an unlimited busy loop used {free_cores:.3} cores, a 200m one {limited_cores:.3}"
        );
    } else {
        println!(
            "the machine is busy: an unlimited busy loop got {free_cores:.3} cores, so the 200m one is checked against its limit only"
        );
    }
    // Its own thread's time alone, though its siblings spin in the same process.
    assert!(
        cores[2].0 < 0.02,
        "an idle program used {:.3} cores",
        cores[2].0
    );
    let memory = working_set(&stats(&mut client, &idle).await);
    assert!(
        (16 << 20..32 << 20).contains(&memory),
        "an idle program holding 16 MiB reports {memory} bytes"
    );

    for id in ids {
        client
            .runtime
            .stop_container(StopContainerRequest {
                container_id: id.clone(),
                timeout: 0,
            })
            .await
            .unwrap();
    }
    drop(client);
    let _ = shutdown.send(());
    server.await.unwrap().unwrap();
}
