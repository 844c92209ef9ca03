//! The pods bound to this node: a worker per pod (see [`crate::worker`]), fed the
//! pod's versions from a shared informer of `spec.nodeName=NAME`, and woken by a
//! relist of the runtime's containers and sandboxes when one of its containers or
//! sandboxes changes state (the kubelet's PLEG). At each relist, once the pods are listed, what the runtime holds
//! of pods that no longer exist is collected ([`crate::gc`]).
//!
//! Many agents of one process (hollow nodes) share one informer of every pod instead
//! of a watch each: [`PodDispatch`] hands each node the changes of its own pods.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tracing::warn;
use trellis_api::Shutdown;
use trellis_client::informer::{BY_NODE_NAME, Change, Informer, pod_node_name};

use crate::Context;
use crate::labels::POD_UID;
use crate::{gc, worker};

struct Handle {
    pod: watch::Sender<Option<Arc<Pod>>>,
    poke: Arc<Notify>,
    task: JoinHandle<()>,
}

/// One node's pods from a [`PodDispatch`]: the shared informer (indexed by
/// `spec.nodeName`) and the changes of this node's pods.
#[derive(Debug)]
pub struct NodePods {
    informer: Arc<Informer<Pod>>,
    changes: mpsc::UnboundedReceiver<Change<Pod>>,
}

/// Hands the changes of one informer of every pod to the agents of the nodes they
/// are bound to, one map lookup per change: N agents of one process then cost one
/// watch, rather than N watches each filtered by the API server.
#[derive(Debug)]
pub struct PodDispatch {
    task: JoinHandle<()>,
}

impl PodDispatch {
    /// Starts dispatching `informer`'s changes (it must list every pod, or every bound
    /// pod) to `nodes`: the returned feeds are in the order of `nodes`.
    pub fn start(informer: Arc<Informer<Pod>>, nodes: &[String]) -> (Self, Vec<NodePods>) {
        informer.add_index(BY_NODE_NAME, pod_node_name());
        let mut senders = HashMap::with_capacity(nodes.len());
        let mut feeds = Vec::with_capacity(nodes.len());
        for node in nodes {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.insert(node.clone(), tx);
            feeds.push(NodePods {
                informer: informer.clone(),
                changes: rx,
            });
        }
        // Subscribed before any feed is read: the replay of what is cached comes
        // first, then every change, so no node misses one.
        let mut changes = informer.subscribe();
        let task = tokio::spawn(async move {
            while let Some(change) = changes.recv().await {
                let node = change
                    .object()
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .unwrap_or_default();
                if let Some(tx) = senders.get(node) {
                    // A node that stopped drops its feed; the others go on.
                    let _ = tx.send(change);
                }
            }
        });
        (Self { task }, feeds)
    }
}

impl Drop for PodDispatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs the pods' workers until `stopped`. Stopping leaves the containers running: a
/// restarted agent finds them again by their labels.
pub async fn run(ctx: Arc<Context>, feed: Option<NodePods>, stopped: Shutdown) {
    let shared = feed.is_some();
    let (informer, mut changes) = match feed {
        Some(feed) => (feed.informer, feed.changes),
        None => {
            let api: Api<Pod> = Api::all(ctx.client.clone());
            let selector = format!("spec.nodeName={}", ctx.config.node_name);
            let informer = ctx
                .informers
                .informer(api, watcher::Config::default().fields(&selector));
            let changes = informer.subscribe();
            (informer, changes)
        }
    };
    let mut workers: HashMap<String, Handle> = HashMap::new();
    let mut states: HashMap<String, (i32, String)> = HashMap::new();
    let mut relist = tokio::time::interval(ctx.config.relist_period);
    relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Pods waiting for the network start as soon as the runtime's network is ready.
    let mut network = ctx.network_ready.subscribe();
    loop {
        tokio::select! {
            change = changes.recv() => {
                let Some(change) = change else { break };
                let pod = change.object().clone();
                let Some(uid) = pod.metadata.uid.clone() else { continue };
                match change {
                    Change::Added(_) | Change::Updated { .. } => {
                        let handle = workers.entry(uid.clone()).or_insert_with(|| spawn(&ctx, &uid));
                        if handle.task.is_finished() {
                            // Its work is over (a finished pod deleted and cleaned up).
                            continue;
                        }
                        let _ = handle.pod.send(Some(pod));
                    }
                    Change::Deleted(_) => {
                        if let Some(handle) = workers.get(&uid) {
                            let _ = handle.pod.send(None);
                        }
                    }
                }
            }
            _ = relist.tick() => {
                let listed = relist_runtime(&ctx, &mut states, &workers).await;
                workers.retain(|_, h| !h.task.is_finished());
                // Only once the node's pods are listed: before, every pod would look
                // gone.
                if let Some(listed) = listed
                    && informer.has_synced()
                {
                    let pods = if shared {
                        informer.by_index(BY_NODE_NAME, &ctx.config.node_name)
                    } else {
                        informer.list()
                    };
                    let known: HashSet<String> =
                        pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
                    let live = |uid: &str| known.contains(uid) || workers.contains_key(uid);
                    gc::collect(&ctx, &live, &listed.sandboxes, &listed.containers).await;
                    ctx.cgroups.collect(&live, &listed.sandboxes).await;
                }
            }
            Ok(()) = network.changed() => {
                for handle in workers.values() {
                    handle.poke.notify_one();
                }
            }
            _ = stopped.wait() => break,
        }
    }
    // Dropping the senders ends the workers without touching their containers.
    for (_, handle) in workers.drain() {
        drop(handle.pod);
        let _ = handle.task.await;
    }
}

fn spawn(ctx: &Arc<Context>, uid: &str) -> Handle {
    let (tx, rx) = watch::channel(None);
    let poke = Arc::new(Notify::new());
    let task = tokio::spawn(worker::run(ctx.clone(), uid.to_owned(), rx, poke.clone()));
    Handle {
        pod: tx,
        poke,
        task,
    }
}

/// The runtime's containers and sandboxes, as one relist saw them.
struct Listed {
    containers: Vec<cri::Container>,
    sandboxes: Vec<cri::PodSandbox>,
}

/// Wakes the worker of each pod whose containers or sandboxes changed state since the
/// last relist (a sandbox the runtime stopped, or found gone after a restart, must be
/// made again even when no container of it changed); returns what it listed, none
/// when the runtime could not list it.
async fn relist_runtime(
    ctx: &Context,
    states: &mut HashMap<String, (i32, String)>,
    workers: &HashMap<String, Handle>,
) -> Option<Listed> {
    let mut runtime = ctx.cri.runtime.clone();
    let containers = match runtime
        .list_containers(cri::ListContainersRequest { filter: None })
        .await
    {
        Ok(r) => r.into_inner().containers,
        Err(e) => {
            warn!(error = %e.message(), "list the runtime's containers");
            return None;
        }
    };
    // Listed after the containers: a container listed has its sandbox listed too,
    // unless the sandbox was removed in between.
    let sandboxes = match runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
    {
        Ok(r) => r.into_inner().items,
        Err(e) => {
            warn!(error = %e.message(), "list the runtime's sandboxes");
            return None;
        }
    };
    let uid = |labels: &HashMap<String, String>| labels.get(POD_UID).cloned().unwrap_or_default();
    let mut now: HashMap<String, (i32, String)> =
        HashMap::with_capacity(containers.len() + sandboxes.len());
    for c in &containers {
        now.insert(c.id.clone(), (c.state, uid(&c.labels)));
    }
    for s in &sandboxes {
        now.insert(format!("sandbox/{}", s.id), (s.state, uid(&s.labels)));
    }
    let mut changed: Vec<&str> = Vec::new();
    for (id, (state, uid)) in &now {
        if states.get(id).map(|(s, _)| s) != Some(state) {
            changed.push(uid);
        }
    }
    for (id, (_, uid)) in states.iter() {
        if !now.contains_key(id) {
            changed.push(uid);
        }
    }
    for uid in changed {
        if let Some(handle) = workers.get(uid) {
            handle.poke.notify_one();
        }
    }
    *states = now;
    Some(Listed {
        containers,
        sandboxes,
    })
}
