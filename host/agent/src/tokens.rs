//! Projected ServiceAccount tokens kept fresh, as the kubelet's token manager keeps
//! them: a token is asked for again once [`AgentConfig::token_refresh_fraction`] of its
//! lifetime has passed (80 %) or it is older than [`AgentConfig::token_max_age`]
//! (24 h), and its file is replaced whole (written under another name in the same
//! directory and renamed, as every volume file is), so an in-cluster client that
//! reads the file again never sees part of a token or an expired one. A pod's tokens
//! are dropped once its directory is gone (the pod was torn down) or the agent stops.
//!
//! [`AgentConfig::token_refresh_fraction`]: crate::AgentConfig::token_refresh_fraction
//! [`AgentConfig::token_max_age`]: crate::AgentConfig::token_max_age

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Pod, ServiceAccountTokenProjection};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, warn};
use trellis_api::Shutdown;

use crate::Context;

/// A token file being kept fresh.
struct Tracked {
    pod: Pod,
    source: ServiceAccountTokenProjection,
    /// When it is asked for again.
    due: Instant,
}

/// One node's files being kept fresh, by path, and a wake-up for its refresher when
/// one is added.
#[derive(Default)]
struct NodeFiles {
    files: Mutex<HashMap<PathBuf, Tracked>>,
    added: Notify,
}

/// Each node's files by its pods' directory (`ROOT/pods`): many nodes of one process
/// (hollow nodes, tests) each refresh only their own, and the spec code that writes a
/// token reaches the refresher without a handle of its own in the agent's context.
static NODES: LazyLock<Mutex<HashMap<PathBuf, Arc<NodeFiles>>>> = LazyLock::new(Default::default);

fn node(pods: &Path) -> Arc<NodeFiles> {
    NODES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(pods.to_owned())
        .or_default()
        .clone()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A token as a TokenRequest answered it.
#[derive(Debug, Clone)]
pub struct Issued {
    pub token: String,
    /// The answer's `status.expirationTimestamp`; `None` when it gave none.
    pub expires: Option<SystemTime>,
}

/// When a token issued at `issued` that expires at `expires` is asked for again: once
/// `fraction` of its lifetime passed or it is `max_age` old, whichever comes first
/// (the kubelet's `requiresRefresh`). A token without an expiry lives an hour, the
/// TokenRequest default.
pub fn refresh_after(
    issued: SystemTime,
    expires: Option<SystemTime>,
    fraction: f64,
    max_age: Duration,
) -> Duration {
    let ttl = match expires {
        // Already expired (a clock that moved): at once.
        Some(e) => e.duration_since(issued).unwrap_or(Duration::ZERO),
        None => Duration::from_secs(3600),
    };
    ttl.mul_f64(fraction.clamp(0.0, 1.0)).min(max_age)
}

/// Keeps the token written at `path` fresh from now on (replacing what was kept there).
pub fn track(
    ctx: &Context,
    path: &Path,
    pod: &Pod,
    source: &ServiceAccountTokenProjection,
    issued_at: SystemTime,
    issued: &Issued,
) {
    let after = refresh_after(
        issued_at,
        issued.expires,
        ctx.config.token_refresh_fraction,
        ctx.config.token_max_age,
    );
    let tracked = Tracked {
        pod: pod.clone(),
        source: source.clone(),
        due: Instant::now() + after,
    };
    let node = node(&ctx.config.root.join("pods"));
    lock(&node.files).insert(path.to_owned(), tracked);
    node.added.notify_waiters();
}

/// The token files kept fresh under `root` (a node's [`crate::AgentConfig::root`]):
/// those tracked whose file is still there, since the refresher drops the others
/// before it refreshes anything.
pub fn tracked(root: &Path) -> Vec<PathBuf> {
    let Some(node) = lock(&NODES).get(&root.join("pods")).cloned() else {
        return Vec::new();
    };
    lock(&node.files)
        .keys()
        .filter(|path| path.exists())
        .cloned()
        .collect()
}

/// Writes `content` to `target` whole: under another name in the same directory, then
/// renamed over it, so a reader sees the old token or the new one.
pub fn write_whole(target: &Path, content: &[u8]) -> std::io::Result<()> {
    let temp = target.with_extension("trellis-tmp");
    std::fs::write(&temp, content)?;
    std::fs::rename(&temp, target)
}

/// Refreshes this node's tracked tokens as they come due, until `stopped`.
pub async fn run(ctx: Arc<Context>, stopped: Shutdown) {
    let pods = ctx.config.root.join("pods");
    let node = node(&pods);
    loop {
        // Asked before the map is read, so an addition while refreshing wakes the wait.
        let added = node.added.notified();
        tokio::pin!(added);
        added.as_mut().enable();
        let now = Instant::now();
        let (due, next) = {
            let mut files = lock(&node.files);
            // A file whose pod was torn down (its directory removed) is not kept.
            files.retain(|path, _| path.exists());
            let mine = files.iter();
            let due: Vec<(PathBuf, Pod, ServiceAccountTokenProjection)> = mine
                .clone()
                .filter(|(_, t)| t.due <= now)
                .map(|(p, t)| (p.clone(), t.pod.clone(), t.source.clone()))
                .collect();
            let next = mine.filter(|(_, t)| t.due > now).map(|(_, t)| t.due).min();
            (due, next)
        };
        for (path, pod, source) in due {
            let issued_at = SystemTime::now();
            match refresh(&ctx, &path, &pod, &source).await {
                Ok(issued) => {
                    debug!(file = %path.display(), "refreshed a projected token");
                    track(&ctx, &path, &pod, &source, issued_at, &issued);
                }
                Err(e) => {
                    warn!(file = %path.display(), error = %e, "refresh a projected token");
                    if let Some(t) = lock(&node.files).get_mut(&path) {
                        t.due = Instant::now() + ctx.config.token_retry;
                    }
                }
            }
        }
        let wait = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stopped.wait() => break,
            _ = added => {}
            _ = wait => {}
        }
    }
    // Stopped: this node's files are no longer kept.
    lock(&NODES).remove(&pods);
}

/// A token of the pod's ServiceAccount (a TokenRequest bound to the pod), as a
/// projected `serviceAccountToken` source asks: its audience and lifetime (Kubernetes'
/// default an hour), with its expiry, which tells when it is asked for again.
pub async fn service_account_token(
    ctx: &Context,
    pod: &Pod,
    source: &k8s_openapi::api::core::v1::ServiceAccountTokenProjection,
) -> Result<Issued, String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let api: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
        kube::Api::namespaced(ctx.client.clone(), ns);
    let request = serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {
            "audiences": source.audience.iter().cloned().collect::<Vec<_>>(),
            "expirationSeconds": source.expiration_seconds.unwrap_or(3600),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                "name": pod.metadata.name, "uid": pod.metadata.uid},
        }
    });
    let answer: serde_json::Value = api
        .create_subresource(
            "token",
            &account,
            &kube::api::PostParams::default(),
            &request,
        )
        .await
        .map_err(|e| format!("request a token of serviceaccount {ns}/{account}: {e}"))?;
    let token = answer["status"]["token"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no token for serviceaccount {ns}/{account}"))?;
    let expires = answer["status"]["expirationTimestamp"]
        .as_str()
        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        .map(std::time::SystemTime::from);
    Ok(Issued { token, expires })
}

async fn refresh(
    ctx: &Context,
    path: &Path,
    pod: &Pod,
    source: &ServiceAccountTokenProjection,
) -> Result<Issued, String> {
    let issued = service_account_token(ctx, pod, source).await?;
    // Gone while the request ran: not written back.
    if !path.exists() {
        return Err(format!("{} is gone", path.display()));
    }
    write_whole(path, issued.token.as_bytes())
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(issued)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refresh_after_follows_the_kubelet() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let day = Duration::from_secs(24 * 3600);
        // 80 % of an hour.
        let hour = Some(t0 + Duration::from_secs(3600));
        assert_eq!(refresh_after(t0, hour, 0.8, day), Duration::from_secs(2880));
        // A week-long token is refreshed after a day.
        let week = Some(t0 + 7 * day);
        assert_eq!(refresh_after(t0, week, 0.8, day), day);
        // No expiry: the default hour.
        assert_eq!(refresh_after(t0, None, 0.5, day), Duration::from_secs(1800));
        // An expiry in the past: at once.
        let past = Some(t0 - Duration::from_secs(1));
        assert_eq!(refresh_after(t0, past, 0.8, day), Duration::ZERO);
    }
}
