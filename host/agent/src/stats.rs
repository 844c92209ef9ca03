//! The node's resource usage as the kubelet reports it: the Summary API
//! (`/stats/summary`, `stats/v1alpha1`'s [`Summary`]) and the resource metrics
//! (`/metrics/resource`, Prometheus text, [`resource_metrics`]) that a metrics server
//! scrapes for `kubectl top` and autoscalers, and that eviction ranks pods by.
//!
//! Pods and containers come from the runtime over CRI (the kubelet's
//! `cri_stats_provider`): the ready sandboxes and running containers, their usage from
//! `ListContainerStats`, and the pod's own from `ListPodSandboxStats` when the runtime
//! serves it (its cgroup, network and process count), else the sum of its containers.
//! The node's own figures come from the kernel: CPU from `/proc/stat`, memory from
//! `/proc/meminfo` (working set = usage − inactive file pages, available = capacity −
//! working set, as the kubelet's eviction signal `memory.available`), the node's
//! filesystem (`nodefs`) from `statvfs` of the agent's root and the image filesystem
//! from the runtime's `ImageFsInfo`.
//!
//! `usageNanoCores` is a rate: when the runtime gives none, it is computed from this
//! reading's cumulative CPU time and the previous one of the same container, pod or
//! node (the kubelet's CPU usage cache), so the first reading of each has none.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_cri::v1::{
    ContainerState, ContainerStateValue, ContainerStatsFilter, ImageFsInfoRequest,
    ListContainerStatsRequest, ListContainersRequest, ListPodSandboxRequest,
    ListPodSandboxStatsRequest, PodSandboxState, PodSandboxStateValue,
};
use serde::{Deserialize, Serialize};

use crate::Context;

/// How long the runtime may take to answer one of the reading's calls.
const CRI_TIMEOUT: Duration = Duration::from_secs(10);
/// A CPU reading no newer than this is dropped from the cache: its container, pod or
/// node has not been read since (gone, most likely); the kubelet keeps them 10 min.
const CPU_SAMPLE_TTL: Duration = Duration::from_secs(600);
/// The kernel's `USER_HZ`, the unit of `/proc/stat`: 100 on every architecture Linux
/// exposes to user space with a fixed value.
const USER_HZ: u64 = 100;

/// The kubelet's Summary API (`k8s.io/kubelet/pkg/apis/stats/v1alpha1.Summary`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub node: NodeStats,
    pub pods: Vec<PodStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStats {
    pub node_name: String,
    /// When the machine booted.
    pub start_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    /// The filesystem of the agent's root (`nodefs`): pods' volumes and logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs: Option<FsStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimit: Option<RlimitStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStats {
    /// The filesystem holding the runtime's images (`imagefs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_fs: Option<FsStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuStats {
    pub time: String,
    /// Cores used, in billionths, averaged since the previous reading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_nano_cores: Option<u64>,
    /// CPU time used since the start, in nanoseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_core_nano_seconds: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStats {
    pub time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_bytes: Option<u64>,
    /// What eviction and `kubectl top` count: usage less the inactive file cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_faults: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major_page_faults: Option<u64>,
}

/// A network's counters: the default interface's inline (as the kubelet's
/// `InterfaceStats` is inlined), and every interface's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStats {
    pub time: String,
    #[serde(flatten)]
    pub default: InterfaceStats,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<InterfaceStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStats {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_errors: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tx_errors: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FsStats {
    pub time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes_free: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes_used: Option<u64>,
}

/// Process IDs: the most there can be and how many are in use (threads count).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RlimitStats {
    pub time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maxpid: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub curproc: Option<i64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStats {
    pub pod_ref: PodReference,
    /// When the pod's sandbox was made.
    pub start_time: String,
    pub containers: Vec<ContainerStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    /// The pod's volumes under the agent's root (emptyDir, configMap, secret, …).
    #[serde(default, rename = "volume", skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeStats>,
    /// What the pod holds of the node's filesystem: its containers' writable layers
    /// and logs, and its volumes.
    #[serde(
        default,
        rename = "ephemeral-storage",
        skip_serializing_if = "Option::is_none"
    )]
    pub ephemeral_storage: Option<FsStats>,
    #[serde(
        default,
        rename = "process_stats",
        skip_serializing_if = "Option::is_none"
    )]
    pub process_stats: Option<ProcessStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodReference {
    pub name: String,
    pub namespace: String,
    pub uid: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStats {
    pub name: String,
    /// When the container was made.
    pub start_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    /// Its writable layer, when the runtime reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<FsStats>,
    /// Its log files, on the node's filesystem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs: Option<FsStats>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStats {
    #[serde(flatten)]
    pub fs: FsStats,
    pub name: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStats {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_count: Option<u64>,
}

impl Summary {
    /// Only CPU and memory, as `/stats/summary?only_cpu_and_memory=true` answers (what
    /// a metrics server asks for).
    pub fn only_cpu_and_memory(mut self) -> Summary {
        let node = &mut self.node;
        (node.network, node.fs, node.runtime, node.rlimit) = (None, None, None, None);
        for pod in &mut self.pods {
            (pod.network, pod.ephemeral_storage, pod.process_stats) = (None, None, None);
            pod.volumes.clear();
            for c in &mut pod.containers {
                (c.rootfs, c.logs) = (None, None);
            }
        }
        self
    }
}

/// The node's Summary now: its pods (ready sandboxes) with their running containers,
/// and the node's own usage.
pub async fn summary(ctx: &Context) -> anyhow::Result<Summary> {
    let mut runtime = ctx.cri.runtime.clone();
    let sandboxes = cri_call(runtime.list_pod_sandbox(ListPodSandboxRequest {
        filter: Some(k8s_cri::v1::PodSandboxFilter {
            state: Some(PodSandboxStateValue {
                state: PodSandboxState::SandboxReady as i32,
            }),
            ..Default::default()
        }),
    }))
    .await
    .context("list the pod sandboxes")?
    .items;
    let containers = cri_call(runtime.list_containers(ListContainersRequest {
        filter: Some(k8s_cri::v1::ContainerFilter {
            state: Some(ContainerStateValue {
                state: ContainerState::ContainerRunning as i32,
            }),
            ..Default::default()
        }),
    }))
    .await
    .context("list the containers")?
    .containers;
    let container_stats = cri_call(runtime.list_container_stats(ListContainerStatsRequest {
        filter: Some(ContainerStatsFilter::default()),
    }))
    .await
    .context("list the containers' stats")?
    .stats;
    // Runtimes that have no sandbox stats (older ones) get the sum of the containers'.
    let sandbox_stats = match tokio::time::timeout(
        CRI_TIMEOUT,
        runtime.list_pod_sandbox_stats(ListPodSandboxStatsRequest { filter: None }),
    )
    .await
    {
        Ok(Ok(r)) => r.into_inner().stats,
        Ok(Err(e)) if e.code() == tonic::Code::Unimplemented => Vec::new(),
        Ok(Err(e)) => bail!("list the pod sandboxes' stats: {}", e.message()),
        Err(_) => bail!("list the pod sandboxes' stats: no answer in {CRI_TIMEOUT:?}"),
    };
    let image_fs = match cri_call(
        ctx.cri
            .images
            .clone()
            .image_fs_info(ImageFsInfoRequest::default()),
    )
    .await
    {
        Ok(info) => info.image_filesystems.into_iter().next(),
        Err(e) => {
            tracing::debug!(error = %format!("{e:#}"), "the runtime's image filesystem is unknown");
            None
        }
    };

    let node_name = ctx.config.node_name.clone();
    let root = ctx.config.root.clone();
    let host = tokio::task::spawn_blocking(move || HostReading::read(&root, image_fs))
        .await
        .context("read the node's usage")?;

    let mut cache = cpu_cache();
    let now = tokio::time::Instant::now();
    cache.retain(|_, s| now.duration_since(s.seen) < CPU_SAMPLE_TTL);
    let key = |id: &str| format!("{node_name}/{id}");

    let node = NodeStats {
        node_name: node_name.clone(),
        start_time: host.boot_time.map(time_of_secs).unwrap_or_default(),
        cpu: host.cpu_ns.map(|total| {
            let at = host.read_at;
            CpuStats {
                time: time_of_ns(at),
                usage_nano_cores: nano_cores(&mut cache, key(""), now, at, total),
                usage_core_nano_seconds: Some(total),
            }
        }),
        memory: host.memory.clone(),
        network: host.network.clone(),
        fs: host.nodefs.clone(),
        runtime: Some(RuntimeStats {
            image_fs: host.imagefs.clone(),
        }),
        rlimit: host.rlimit.clone(),
    };

    let by_sandbox: HashMap<&str, &k8s_cri::v1::PodSandboxStats> = sandbox_stats
        .iter()
        .filter_map(|s| Some((s.attributes.as_ref()?.id.as_str(), s)))
        .collect();
    let stats_of: HashMap<&str, &k8s_cri::v1::ContainerStats> = container_stats
        .iter()
        .filter_map(|s| Some((s.attributes.as_ref()?.id.as_str(), s)))
        .collect();

    let mut pods = Vec::new();
    for sandbox in &sandboxes {
        let Some(meta) = &sandbox.metadata else {
            continue;
        };
        let pod_ref = PodReference {
            name: meta.name.clone(),
            namespace: meta.namespace.clone(),
            uid: meta.uid.clone(),
        };
        let mut pod_containers = Vec::new();
        let (mut cpu_sum, mut memory_sum): (Option<(i64, u64)>, Option<MemoryStats>) = (None, None);
        for c in containers.iter().filter(|c| c.pod_sandbox_id == sandbox.id) {
            let name = c
                .metadata
                .as_ref()
                .map(|m| m.name.clone())
                .unwrap_or_default();
            let stats = stats_of.get(c.id.as_str());
            let cpu = stats.and_then(|s| s.cpu.as_ref()).map(|cpu| {
                let total = cpu.usage_core_nano_seconds.as_ref().map(|v| v.value);
                if let Some(total) = total {
                    let sum = cpu_sum.get_or_insert((cpu.timestamp, 0));
                    sum.0 = sum.0.max(cpu.timestamp);
                    sum.1 += total;
                }
                CpuStats {
                    time: time_of_ns(cpu.timestamp),
                    usage_nano_cores: match (&cpu.usage_nano_cores, total) {
                        (Some(v), _) => Some(v.value),
                        (None, Some(total)) => {
                            nano_cores(&mut cache, key(&c.id), now, cpu.timestamp, total)
                        }
                        (None, None) => None,
                    },
                    usage_core_nano_seconds: total,
                }
            });
            let memory = stats.and_then(|s| s.memory.as_ref()).map(memory_of);
            if let Some(m) = &memory {
                add_memory(memory_sum.get_or_insert_with(Default::default), m);
            }
            let rootfs = stats
                .and_then(|s| s.writable_layer.as_ref())
                .map(|l| FsStats {
                    time: time_of_ns(l.timestamp),
                    used_bytes: l.used_bytes.as_ref().map(|v| v.value),
                    inodes_used: l.inodes_used.as_ref().map(|v| v.value),
                    ..host.nodefs_capacity()
                });
            let logs = host.usage_of_logs(&pod_ref, &name);
            pod_containers.push(ContainerStats {
                name,
                start_time: time_of_ns(c.created_at),
                cpu,
                memory,
                rootfs,
                logs,
            });
        }
        let linux = by_sandbox
            .get(sandbox.id.as_str())
            .and_then(|s| s.linux.as_ref());
        let cpu = match linux.and_then(|l| l.cpu.as_ref()) {
            Some(cpu) => {
                let total = cpu.usage_core_nano_seconds.as_ref().map(|v| v.value);
                Some(CpuStats {
                    time: time_of_ns(cpu.timestamp),
                    usage_nano_cores: match (&cpu.usage_nano_cores, total) {
                        (Some(v), _) => Some(v.value),
                        (None, Some(total)) => {
                            nano_cores(&mut cache, key(&sandbox.id), now, cpu.timestamp, total)
                        }
                        (None, None) => None,
                    },
                    usage_core_nano_seconds: total,
                })
            }
            None => cpu_sum.map(|(at, total)| CpuStats {
                time: time_of_ns(at),
                usage_nano_cores: nano_cores(&mut cache, key(&sandbox.id), now, at, total),
                usage_core_nano_seconds: Some(total),
            }),
        };
        let memory = linux
            .and_then(|l| l.memory.as_ref())
            .map(memory_of)
            .or(memory_sum);
        let network = linux
            .and_then(|l| l.network.as_ref())
            .map(|n| NetworkStats {
                time: time_of_ns(n.timestamp),
                default: n
                    .default_interface
                    .as_ref()
                    .map(interface_of)
                    .unwrap_or_default(),
                interfaces: n.interfaces.iter().map(interface_of).collect(),
            });
        let process_stats = linux
            .and_then(|l| l.process.as_ref())
            .map(|p| ProcessStats {
                process_count: p.process_count.as_ref().map(|v| v.value),
            });
        let volumes = host.volumes_of(&pod_ref.uid);
        let ephemeral_storage = host.ephemeral_storage(&pod_containers, &volumes);
        pods.push(PodStats {
            pod_ref,
            start_time: time_of_ns(sandbox.created_at),
            containers: pod_containers,
            cpu,
            memory,
            network,
            volumes,
            ephemeral_storage,
            process_stats,
        });
    }
    pods.sort_by(|a, b| {
        (&a.pod_ref.namespace, &a.pod_ref.name).cmp(&(&b.pod_ref.namespace, &b.pod_ref.name))
    });
    Ok(Summary { node, pods })
}

/// One CRI call, bounded in time.
async fn cri_call<T>(
    call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(CRI_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(e)) => bail!("{}", e.message()),
        Err(_) => bail!("no answer from the runtime in {CRI_TIMEOUT:?}"),
    }
}

/// A cumulative CPU reading, kept to turn the next one into a rate.
struct CpuSample {
    /// When the reading was taken, nanoseconds since the epoch (the runtime's clock).
    at: i64,
    total_ns: u64,
    /// The rate computed at this reading, answered again when the next reading is no
    /// newer.
    nano_cores: Option<u64>,
    /// When it was last read, to forget what is no longer read.
    seen: tokio::time::Instant,
}

/// The previous CPU reading of every container, pod and node read, by
/// `NODE/ID` (`NODE/` for the node itself). Process-wide rather than per agent since a
/// reading is asked for by anyone holding a [`Context`] (the server, eviction); the
/// node name keeps apart the agents of one process (hollow and test nodes).
static CPU_SAMPLES: LazyLock<Mutex<HashMap<String, CpuSample>>> = LazyLock::new(Default::default);

fn cpu_cache() -> std::sync::MutexGuard<'static, HashMap<String, CpuSample>> {
    CPU_SAMPLES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cores used between the previous reading of `key` and this one (`total_ns` of CPU
/// time at `at`), as the kubelet's `getAndUpdateContainerUsageNanoCores`: none at the
/// first reading or after the counter went back (a restarted container).
fn nano_cores(
    cache: &mut HashMap<String, CpuSample>,
    key: String,
    now: tokio::time::Instant,
    at: i64,
    total_ns: u64,
) -> Option<u64> {
    let previous = cache.get(&key);
    let rate = match previous {
        Some(p) if total_ns >= p.total_ns && at > p.at => {
            let elapsed = (at - p.at) as f64;
            Some(((total_ns - p.total_ns) as f64 / elapsed * 1e9) as u64)
        }
        // The same reading again: the rate it had.
        Some(p) if total_ns >= p.total_ns && at == p.at => p.nano_cores,
        _ => None,
    };
    cache.insert(
        key,
        CpuSample {
            at,
            total_ns,
            nano_cores: rate,
            seen: now,
        },
    );
    rate
}

fn memory_of(m: &k8s_cri::v1::MemoryUsage) -> MemoryStats {
    let v = |x: &Option<k8s_cri::v1::UInt64Value>| x.as_ref().map(|v| v.value);
    MemoryStats {
        time: time_of_ns(m.timestamp),
        available_bytes: v(&m.available_bytes),
        usage_bytes: v(&m.usage_bytes),
        working_set_bytes: v(&m.working_set_bytes),
        rss_bytes: v(&m.rss_bytes),
        page_faults: v(&m.page_faults),
        major_page_faults: v(&m.major_page_faults),
    }
}

/// Adds a container's memory to its pod's sum; `availableBytes` has no sum (it is
/// against a limit) and is left out.
fn add_memory(sum: &mut MemoryStats, m: &MemoryStats) {
    if sum.time < m.time {
        sum.time.clone_from(&m.time);
    }
    let add = |a: &mut Option<u64>, b: Option<u64>| {
        if let Some(b) = b {
            *a = Some(a.unwrap_or(0) + b);
        }
    };
    add(&mut sum.usage_bytes, m.usage_bytes);
    add(&mut sum.working_set_bytes, m.working_set_bytes);
    add(&mut sum.rss_bytes, m.rss_bytes);
    add(&mut sum.page_faults, m.page_faults);
    add(&mut sum.major_page_faults, m.major_page_faults);
}

fn interface_of(i: &k8s_cri::v1::NetworkInterfaceUsage) -> InterfaceStats {
    let v = |x: &Option<k8s_cri::v1::UInt64Value>| x.as_ref().map(|v| v.value);
    InterfaceStats {
        name: i.name.clone(),
        rx_bytes: v(&i.rx_bytes),
        rx_errors: v(&i.rx_errors),
        tx_bytes: v(&i.tx_bytes),
        tx_errors: v(&i.tx_errors),
    }
}

/// A time as `metav1.Time` writes it: RFC 3339 in UTC, to the second.
fn time_of_ns(ns: i64) -> String {
    jiff::Timestamp::from_nanosecond(i128::from(ns))
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_default()
}

fn time_of_secs(secs: i64) -> String {
    time_of_ns(secs.saturating_mul(1_000_000_000))
}

fn now_ns() -> i64 {
    jiff::Timestamp::now().as_nanosecond() as i64
}

/// What the node's kernel and filesystems say, read at once on a blocking thread.
#[derive(Debug, Default)]
struct HostReading {
    read_at: i64,
    boot_time: Option<i64>,
    cpu_ns: Option<u64>,
    memory: Option<MemoryStats>,
    network: Option<NetworkStats>,
    nodefs: Option<FsStats>,
    imagefs: Option<FsStats>,
    rlimit: Option<RlimitStats>,
    /// The agent's root: where the pods' logs and volumes are.
    root: PathBuf,
}

impl HostReading {
    fn read(root: &Path, image_fs: Option<k8s_cri::v1::FilesystemUsage>) -> HostReading {
        let read_at = now_ns();
        let time = time_of_ns(read_at);
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let (cpu_ns, boot_time) = parse_proc_stat(&stat);
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        let memory = parse_meminfo(&meminfo, &vmstat).map(|m| MemoryStats {
            time: time.clone(),
            ..m
        });
        let network = parse_net_dev(
            &std::fs::read_to_string("/proc/net/dev").unwrap_or_default(),
            &std::fs::read_to_string("/proc/net/route").unwrap_or_default(),
        )
        .map(|n| NetworkStats {
            time: time.clone(),
            ..n
        });
        let nodefs = statvfs(root, &time);
        let imagefs = image_fs.map(|usage| {
            let mountpoint = usage
                .fs_id
                .as_ref()
                .map(|id| PathBuf::from(&id.mountpoint))
                .filter(|p| p.is_absolute());
            // Capacity from the filesystem the images are on, usage from the runtime.
            let fs = mountpoint
                .and_then(|m| statvfs(&m, &time))
                .or_else(|| nodefs.clone())
                .unwrap_or_default();
            FsStats {
                used_bytes: usage.used_bytes.map(|v| v.value).or(fs.used_bytes),
                inodes_used: usage.inodes_used.map(|v| v.value).or(fs.inodes_used),
                ..fs
            }
        });
        let rlimit = Some(RlimitStats {
            time: time.clone(),
            maxpid: max_pid(),
            curproc: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|l| parse_loadavg_tasks(&l)),
        });
        HostReading {
            read_at,
            boot_time,
            cpu_ns,
            memory,
            network,
            nodefs,
            imagefs,
            rlimit,
            root: root.to_owned(),
        }
    }

    /// The node filesystem's capacity and free space, for a part of it whose usage is
    /// known.
    fn nodefs_capacity(&self) -> FsStats {
        let fs = self.nodefs.clone().unwrap_or_default();
        FsStats {
            time: fs.time,
            available_bytes: fs.available_bytes,
            capacity_bytes: fs.capacity_bytes,
            inodes_free: fs.inodes_free,
            inodes: fs.inodes,
            ..Default::default()
        }
    }

    /// A container's log files (`ROOT/logs/NS_NAME_UID/CONTAINER/`).
    fn usage_of_logs(&self, pod: &PodReference, container: &str) -> Option<FsStats> {
        let dir = crate::paths::pod_logs_dir(
            &self.root.join("logs"),
            &pod.namespace,
            &pod.name,
            &pod.uid,
        )
        .join(container);
        let (bytes, inodes) = disk_usage(&dir)?;
        Some(FsStats {
            used_bytes: Some(bytes),
            inodes_used: Some(inodes),
            ..self.nodefs_capacity()
        })
    }

    /// The pod's volumes the agent made (`ROOT/pods/UID/volumes/NAME`).
    fn volumes_of(&self, uid: &str) -> Vec<VolumeStats> {
        if uid.is_empty() || uid.contains('/') {
            return Vec::new();
        }
        let base = self.root.join("pods").join(uid).join("volumes");
        let Ok(entries) = std::fs::read_dir(&base) else {
            return Vec::new();
        };
        let mut volumes: Vec<VolumeStats> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| {
                let (bytes, inodes) = disk_usage(&e.path())?;
                Some(VolumeStats {
                    name: e.file_name().to_string_lossy().into_owned(),
                    fs: FsStats {
                        used_bytes: Some(bytes),
                        inodes_used: Some(inodes),
                        ..self.nodefs_capacity()
                    },
                })
            })
            .collect();
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        volumes
    }

    /// The kubelet's pod `ephemeral-storage`: writable layers, logs and local volumes.
    fn ephemeral_storage(
        &self,
        containers: &[ContainerStats],
        volumes: &[VolumeStats],
    ) -> Option<FsStats> {
        let used = containers
            .iter()
            .flat_map(|c| [&c.rootfs, &c.logs])
            .flatten()
            .chain(volumes.iter().map(|v| &v.fs));
        let (mut bytes, mut inodes) = (0u64, 0u64);
        for fs in used {
            bytes += fs.used_bytes.unwrap_or(0);
            inodes += fs.inodes_used.unwrap_or(0);
        }
        self.nodefs.as_ref()?;
        Some(FsStats {
            used_bytes: Some(bytes),
            inodes_used: Some(inodes),
            ..self.nodefs_capacity()
        })
    }
}

/// `du` of a directory: the bytes its files take on disk and how many inodes, not
/// following symbolic links nor crossing into other filesystems (a volume's mount).
fn disk_usage(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let top = std::fs::symlink_metadata(dir).ok()?;
    let device = top.dev();
    let (mut bytes, mut inodes) = (0u64, 0u64);
    let mut pending = vec![(dir.to_owned(), top)];
    while let Some((path, meta)) = pending.pop() {
        // st_blocks is in 512-byte units whatever the filesystem's block size.
        bytes += meta.blocks() * 512;
        inodes += 1;
        if !meta.is_dir() {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&path) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
                continue;
            };
            if meta.dev() == device {
                pending.push((entry.path(), meta));
            }
        }
    }
    Some((bytes, inodes))
}

fn statvfs(path: &Path, time: &str) -> Option<FsStats> {
    let s = rustix::fs::statvfs(path).ok()?;
    let block = s.f_frsize;
    Some(FsStats {
        time: time.to_owned(),
        available_bytes: Some(s.f_bavail.saturating_mul(block)),
        capacity_bytes: Some(s.f_blocks.saturating_mul(block)),
        used_bytes: Some(s.f_blocks.saturating_sub(s.f_bfree).saturating_mul(block)),
        inodes_free: Some(s.f_ffree),
        inodes: Some(s.f_files),
        inodes_used: Some(s.f_files.saturating_sub(s.f_ffree)),
    })
}

/// The CPU time the machine spent working (not idle nor waiting on I/O), in
/// nanoseconds, and when it booted, from `/proc/stat`.
fn parse_proc_stat(stat: &str) -> (Option<u64>, Option<i64>) {
    let mut cpu = None;
    let mut boot = None;
    for line in stat.lines() {
        let mut fields = line.split_ascii_whitespace();
        match fields.next() {
            Some("cpu") => {
                let ticks: Vec<u64> = fields.filter_map(|f| f.parse().ok()).collect();
                // user nice system idle iowait irq softirq steal (guest is in user).
                if ticks.len() >= 8 {
                    let busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7];
                    cpu = Some(busy * (1_000_000_000 / USER_HZ));
                }
            }
            Some("btime") => boot = fields.next().and_then(|f| f.parse().ok()),
            _ => {}
        }
    }
    (cpu, boot)
}

/// The node's memory as the kubelet reads its root cgroup's: usage counts the page
/// cache, the working set does not count the inactive file pages (the kernel drops
/// them first), and available is what is left of the capacity — eviction's
/// `memory.available`.
fn parse_meminfo(meminfo: &str, vmstat: &str) -> Option<MemoryStats> {
    let field = |text: &str, name: &str, unit: u64| {
        text.lines()
            .find_map(|l| {
                let (key, rest) = l.split_once(|c: char| c == ':' || c.is_ascii_whitespace())?;
                (key == name).then(|| rest.split_ascii_whitespace().next()?.parse::<u64>().ok())?
            })
            .map(|v| v * unit)
    };
    let total = field(meminfo, "MemTotal", 1024)?;
    let free = field(meminfo, "MemFree", 1024)?;
    let usage = total.saturating_sub(free);
    let inactive_file = field(meminfo, "Inactive(file)", 1024).unwrap_or(0);
    let working_set = usage.saturating_sub(inactive_file);
    Some(MemoryStats {
        time: String::new(),
        available_bytes: Some(total.saturating_sub(working_set)),
        usage_bytes: Some(usage),
        working_set_bytes: Some(working_set),
        rss_bytes: field(meminfo, "AnonPages", 1024),
        page_faults: field(vmstat, "pgfault", 1),
        major_page_faults: field(vmstat, "pgmajfault", 1),
    })
}

/// The interfaces' counters from `/proc/net/dev`, the default one being the interface
/// of the default route (`/proc/net/route`), else the first that is not loopback.
fn parse_net_dev(dev: &str, route: &str) -> Option<NetworkStats> {
    let interfaces: Vec<InterfaceStats> = dev
        .lines()
        .skip(2)
        .filter_map(|line| {
            let (name, counters) = line.split_once(':')?;
            let n: Vec<u64> = counters
                .split_ascii_whitespace()
                .filter_map(|f| f.parse().ok())
                .collect();
            // rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets errs …
            (n.len() >= 16).then(|| InterfaceStats {
                name: name.trim().to_owned(),
                rx_bytes: Some(n[0]),
                rx_errors: Some(n[2]),
                tx_bytes: Some(n[8]),
                tx_errors: Some(n[10]),
            })
        })
        .filter(|i| i.name != "lo")
        .collect();
    let default_route = route.lines().skip(1).find_map(|l| {
        let mut f = l.split_ascii_whitespace();
        let (iface, destination) = (f.next()?, f.next()?);
        (destination == "00000000").then_some(iface)
    });
    let default = default_route
        .and_then(|name| interfaces.iter().find(|i| i.name == name))
        .or(interfaces.first())?
        .clone();
    Some(NetworkStats {
        time: String::new(),
        default,
        interfaces,
    })
}

/// The PIDs the kernel hands out: the lower of `pid_max` and `threads-max`, as the
/// kubelet's `pid.available` counts them.
fn max_pid() -> Option<i64> {
    let read = |p: &str| -> Option<i64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    match (
        read("/proc/sys/kernel/pid_max"),
        read("/proc/sys/kernel/threads-max"),
    ) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The tasks (processes and threads) there are, the 4th field of `/proc/loadavg`
/// (`running/total`): what the kubelet reads from `sysinfo`'s `procs`.
fn parse_loadavg_tasks(loadavg: &str) -> Option<i64> {
    loadavg
        .split_ascii_whitespace()
        .nth(3)?
        .split_once('/')?
        .1
        .parse()
        .ok()
}

/// The resource metrics of `/metrics/resource` in Prometheus' text format, as the
/// kubelet's resource metrics collector writes them from the Summary: each sample
/// stamped with its reading's time (milliseconds). `failed` (no Summary could be
/// read) gives only `resource_scrape_error 1`.
pub fn resource_metrics(summary: Option<&Summary>) -> String {
    struct Family {
        name: &'static str,
        kind: &'static str,
        help: &'static str,
        samples: Vec<String>,
    }
    let family = |name, kind, help| Family {
        name,
        kind,
        help,
        samples: Vec::new(),
    };
    let mut node_cpu = family(
        "node_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
    );
    let mut node_memory = family(
        "node_memory_working_set_bytes",
        "gauge",
        "Current working set of the node in bytes",
    );
    let mut container_start = family(
        "container_start_time_seconds",
        "gauge",
        "Start time of the container since unix epoch in seconds",
    );
    let mut container_cpu = family(
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
    );
    let mut container_memory = family(
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
    );
    let mut pod_cpu = family(
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
    );
    let mut pod_memory = family(
        "pod_memory_working_set_bytes",
        "gauge",
        "Current working set of the pod in bytes",
    );
    let mut scrape_error = family(
        "resource_scrape_error",
        "gauge",
        "1 if there was an error while getting container metrics, 0 otherwise",
    );
    let mut legacy_scrape_error = family(
        "scrape_error",
        "gauge",
        "1 if there was an error while getting container metrics, 0 otherwise",
    );

    let cpu_sample = |labels: &str, cpu: &Option<CpuStats>| -> Option<String> {
        let cpu = cpu.as_ref()?;
        let ns = cpu.usage_core_nano_seconds?;
        Some(format!(
            "{labels} {} {}",
            float(ns as f64 / 1e9),
            millis(&cpu.time)?
        ))
    };
    let memory_sample = |labels: &str, memory: &Option<MemoryStats>| -> Option<String> {
        let memory = memory.as_ref()?;
        let bytes = memory.working_set_bytes?;
        Some(format!(
            "{labels} {} {}",
            float(bytes as f64),
            millis(&memory.time)?
        ))
    };
    if let Some(summary) = summary {
        node_cpu.samples.extend(cpu_sample("", &summary.node.cpu));
        node_memory
            .samples
            .extend(memory_sample("", &summary.node.memory));
        for pod in &summary.pods {
            let (ns, name) = (
                label_value(&pod.pod_ref.namespace),
                label_value(&pod.pod_ref.name),
            );
            let labels = format!("{{namespace=\"{ns}\",pod=\"{name}\"}}");
            pod_cpu.samples.extend(cpu_sample(&labels, &pod.cpu));
            pod_memory
                .samples
                .extend(memory_sample(&labels, &pod.memory));
            for c in &pod.containers {
                let labels = format!(
                    "{{container=\"{}\",namespace=\"{ns}\",pod=\"{name}\"}}",
                    label_value(&c.name)
                );
                container_cpu.samples.extend(cpu_sample(&labels, &c.cpu));
                container_memory
                    .samples
                    .extend(memory_sample(&labels, &c.memory));
                if let Ok(start) = c.start_time.parse::<jiff::Timestamp>() {
                    container_start.samples.push(format!(
                        "{labels} {} {}",
                        float(start.as_second() as f64),
                        start.as_millisecond()
                    ));
                }
            }
        }
    }
    let failed = if summary.is_some() { "0" } else { "1" };
    scrape_error.samples.push(format!(" {failed}"));
    legacy_scrape_error.samples.push(format!(" {failed}"));

    let mut out = String::new();
    for f in [
        container_cpu,
        container_memory,
        container_start,
        node_cpu,
        node_memory,
        pod_cpu,
        pod_memory,
        scrape_error,
        legacy_scrape_error,
    ] {
        if f.samples.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "# HELP {} [STABLE] {}\n# TYPE {} {}\n",
            f.name, f.help, f.name, f.kind
        ));
        for s in f.samples {
            out.push_str(f.name);
            out.push_str(&s);
            out.push('\n');
        }
    }
    out
}

/// The content type of [`resource_metrics`]' text.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value escaped as the text format asks: backslash, double quote, newline.
fn label_value(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// A sample value as Go's `strconv.FormatFloat(v, 'g', -1, 64)` would not quite write
/// it, but as every text parser reads it.
fn float(v: f64) -> String {
    format!("{v}")
}

/// A Summary time in milliseconds since the epoch, the text format's timestamp.
fn millis(time: &str) -> Option<i64> {
    Some(time.parse::<jiff::Timestamp>().ok()?.as_millisecond())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_cpu_counts_busy_ticks_only() {
        let stat = "cpu  100 5 50 1000 20 3 2 1 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\nbtime 1700000000\n";
        let (cpu, boot) = parse_proc_stat(stat);
        // user + nice + system + irq + softirq + steal, at 10 ms a tick.
        assert_eq!(cpu, Some(161 * 10_000_000));
        assert_eq!(boot, Some(1_700_000_000));
    }

    #[test]
    fn node_memory_is_the_kubelets_working_set() {
        let meminfo = "MemTotal:       1000 kB\nMemFree:         200 kB\nMemAvailable:    500 kB\nInactive(file):  100 kB\nAnonPages:       300 kB\n";
        let m = parse_meminfo(meminfo, "pgfault 42\npgmajfault 3\n").unwrap();
        assert_eq!(m.usage_bytes, Some(800 * 1024));
        assert_eq!(m.working_set_bytes, Some(700 * 1024));
        assert_eq!(m.available_bytes, Some(300 * 1024));
        assert_eq!(m.rss_bytes, Some(300 * 1024));
        assert_eq!((m.page_faults, m.major_page_faults), (Some(42), Some(3)));
    }

    #[test]
    fn default_interface_is_the_default_routes() {
        let dev = "Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed\n    lo: 9 1 0 0 0 0 0 0 9 1 0 0 0 0 0 0\n  eth0: 100 2 1 0 0 0 0 0 200 3 4 0 0 0 0 0\n  eth1: 5 1 0 0 0 0 0 0 6 1 0 0 0 0 0 0\n";
        let route =
            "Iface\tDestination\tGateway\neth1\t0000FEA9\t00000000\neth1\t00000000\t0100FEA9\n";
        let n = parse_net_dev(dev, route).unwrap();
        assert_eq!(n.default.name, "eth1");
        assert_eq!(n.interfaces.len(), 2);
        let eth0 = &n.interfaces[0];
        assert_eq!(
            (eth0.rx_bytes, eth0.rx_errors, eth0.tx_bytes, eth0.tx_errors),
            (Some(100), Some(1), Some(200), Some(4))
        );
    }

    #[test]
    fn usage_nano_cores_needs_two_readings() {
        let mut cache = HashMap::new();
        let now = tokio::time::Instant::now();
        assert_eq!(
            nano_cores(&mut cache, "n/c".into(), now, 1_000_000_000, 0),
            None
        );
        // Half a second of CPU in one second: half a core.
        let rate = nano_cores(&mut cache, "n/c".into(), now, 2_000_000_000, 500_000_000);
        assert_eq!(rate, Some(500_000_000));
        // The same reading again answers the same rate.
        assert_eq!(
            nano_cores(&mut cache, "n/c".into(), now, 2_000_000_000, 500_000_000),
            rate
        );
        // A counter that went back (a new container under the same key) starts over.
        assert_eq!(
            nano_cores(&mut cache, "n/c".into(), now, 3_000_000_000, 10),
            None
        );
    }

    #[test]
    fn summary_reads_as_the_kubelets_json() {
        let summary = Summary {
            node: NodeStats {
                node_name: "n1".into(),
                start_time: "2024-01-01T00:00:00Z".into(),
                ..Default::default()
            },
            pods: vec![PodStats {
                pod_ref: PodReference {
                    name: "p".into(),
                    namespace: "default".into(),
                    uid: "u".into(),
                },
                ephemeral_storage: Some(FsStats::default()),
                process_stats: Some(ProcessStats {
                    process_count: Some(2),
                }),
                volumes: vec![VolumeStats {
                    name: "data".into(),
                    fs: FsStats {
                        used_bytes: Some(4096),
                        ..Default::default()
                    },
                }],
                ..Default::default()
            }],
        };
        let json = serde_json::to_value(&summary).unwrap();
        assert_eq!(json["node"]["nodeName"], "n1");
        let pod = &json["pods"][0];
        assert_eq!(pod["podRef"]["uid"], "u");
        assert_eq!(pod["process_stats"]["process_count"], 2);
        assert!(pod.get("ephemeral-storage").is_some());
        assert_eq!(pod["volume"][0]["name"], "data");
        assert_eq!(pod["volume"][0]["usedBytes"], 4096);
        let back: Summary = serde_json::from_value(json).unwrap();
        assert_eq!(back, summary);
    }

    #[test]
    fn resource_metrics_are_prometheus_text() {
        let time = "2024-01-01T00:00:10Z".to_owned();
        let cpu = Some(CpuStats {
            time: time.clone(),
            usage_nano_cores: None,
            usage_core_nano_seconds: Some(1_500_000_000),
        });
        let memory = Some(MemoryStats {
            time: time.clone(),
            working_set_bytes: Some(4096),
            ..Default::default()
        });
        let summary = Summary {
            node: NodeStats {
                cpu: cpu.clone(),
                memory: memory.clone(),
                ..Default::default()
            },
            pods: vec![PodStats {
                pod_ref: PodReference {
                    name: "we\"b".into(),
                    namespace: "default".into(),
                    uid: "u".into(),
                },
                containers: vec![ContainerStats {
                    name: "c".into(),
                    start_time: "2024-01-01T00:00:00Z".into(),
                    cpu: cpu.clone(),
                    memory: memory.clone(),
                    ..Default::default()
                }],
                cpu,
                memory,
                ..Default::default()
            }],
        };
        let text = resource_metrics(Some(&summary));
        for line in [
            "# TYPE container_cpu_usage_seconds_total counter",
            r#"container_cpu_usage_seconds_total{container="c",namespace="default",pod="we\"b"} 1.5 1704067210000"#,
            r#"container_memory_working_set_bytes{container="c",namespace="default",pod="we\"b"} 4096 1704067210000"#,
            r#"container_start_time_seconds{container="c",namespace="default",pod="we\"b"} 1704067200 1704067200000"#,
            "node_cpu_usage_seconds_total 1.5 1704067210000",
            "node_memory_working_set_bytes 4096 1704067210000",
            r#"pod_cpu_usage_seconds_total{namespace="default",pod="we\"b"} 1.5 1704067210000"#,
            r#"pod_memory_working_set_bytes{namespace="default",pod="we\"b"} 4096 1704067210000"#,
            "resource_scrape_error 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} is not in:\n{text}"
            );
        }
        let failed = resource_metrics(None);
        assert!(
            failed.lines().any(|l| l == "resource_scrape_error 1"),
            "{failed}"
        );
        assert!(!failed.contains("node_cpu"), "{failed}");
    }
}
