//! Resources through discovery: the one a controller names ([`resolve`]), every one a
//! controller of every resource reads ([`resolve_every`]), and those served later,
//! which join a running controller's caches and feed ([`follow_resources`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::api::{Api, DynamicObject};
use kube::core::GroupVersion;
use kube::discovery::verbs;
use kube::runtime::watcher;
use tokio::task::JoinSet;
use tracing::{info, warn};
use trellis_client::informer::SharedInformers;
use trellis_client::workqueue::WorkQueue;
use trellis_plugin_host::GroupVersionResource;

use crate::cache::{Caches, Resolved, SharedCaches};
use crate::config::Mapping;
use crate::handler::{MapTarget, feed_every, feed_mapped};
use crate::key::{Key, gvr_key, key_of};

/// The resource `gvr` names, as discovery describes it.
pub(crate) async fn resolve(
    lister: &kube::Client,
    gvr: &GroupVersionResource,
) -> anyhow::Result<Resolved> {
    let group = kube::discovery::pinned_group(lister, &GroupVersion::gv(&gvr.group, &gvr.version))
        .await
        .with_context(|| format!("discover {}", gvr_key(gvr)))?;
    group
        .versioned_resources(&gvr.version)
        .into_iter()
        .find(|(r, _)| r.plural == gvr.resource)
        .map(|(r, caps)| Resolved::new(r, &caps))
        .with_context(|| format!("the API server serves no {}", gvr_key(gvr)))
}

/// Every resource the API server serves that can be listed, watched and deleted,
/// events excepted: what a controller of every resource (the garbage collector)
/// reads.
pub(crate) async fn resolve_every(
    lister: &kube::Client,
) -> anyhow::Result<Vec<(GroupVersionResource, Resolved)>> {
    let discovery = kube::Discovery::new(lister.clone())
        .run()
        .await
        .context("discover the API server's resources")?;
    let mut resources = Vec::new();
    for group in discovery.groups() {
        for (resource, caps) in group.recommended_resources() {
            let usable = [verbs::LIST, verbs::WATCH, verbs::DELETE]
                .iter()
                .all(|v| caps.supports_operation(v));
            if !usable || resource.plural == "events" {
                continue;
            }
            let gvr = GroupVersionResource {
                group: resource.group.clone(),
                version: resource.version.clone(),
                resource: resource.plural.clone(),
            };
            resources.push((gvr, Resolved::new(resource, &caps)));
        }
    }
    Ok(resources)
}

/// How the changes of a resource found later feed the queue.
pub(crate) enum Feed {
    /// As a controller of every resource's ([`feed_every`]).
    Every,
    /// Through a mapping to primary keys, removals only (a watch of `*`).
    Mapped(Mapping, MapTarget),
}

/// How often a controller of every resource looks for resources served since it
/// started, when no CustomResourceDefinition change tells it sooner.
const DISCOVERY_RESYNC: Duration = Duration::from_secs(30);

/// For a controller of every resource: the resources served later (a new
/// CustomResourceDefinition) get informers and join its caches and its feed. Looks
/// again on every change of a CustomResourceDefinition (and a moment later, as
/// discovery may serve the resource after the change), and every
/// [`DISCOVERY_RESYNC`].
pub(crate) async fn follow_resources(
    informers: SharedInformers,
    lister: kube::Client,
    shared: SharedCaches,
    queue: WorkQueue<Key>,
    feed: Feed,
) {
    let crds = informers.informer::<DynamicObject>(
        Api::all_with(
            lister.clone(),
            &kube::api::ApiResource {
                group: "apiextensions.k8s.io".into(),
                version: "v1".into(),
                api_version: "apiextensions.k8s.io/v1".into(),
                kind: "CustomResourceDefinition".into(),
                plural: "customresourcedefinitions".into(),
            },
        ),
        watcher::Config::default(),
    );
    let mut changes = crds.subscribe();
    let mut feeds = JoinSet::new();
    let mut again: Option<tokio::time::Instant> = None;
    // After a CustomResourceDefinition changes, discovery may serve its resource a
    // moment later: looked at again after 1, 2, 4 and 8 s until it appears.
    let mut retry = Duration::ZERO;
    loop {
        let later = async {
            match again {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            change = changes.recv() => {
                if change.is_none() {
                    return;
                }
                while changes.try_recv().is_ok() {}
                retry = Duration::from_secs(1);
                again = Some(tokio::time::Instant::now() + retry);
            }
            () = later => {
                retry *= 2;
                again = (retry <= Duration::from_secs(8))
                    .then(|| tokio::time::Instant::now() + retry);
            }
            () = tokio::time::sleep(DISCOVERY_RESYNC) => {}
        }
        let found = match resolve_every(&lister).await {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %format!("{e:#}"), "discovering new resources failed; trying again later");
                continue;
            }
        };
        let mut caches = Caches::clone(&shared.current());
        let mut added = Vec::new();
        let mut new_kinds: Vec<(String, String)> = Vec::new();
        for (gvr, resolved) in found {
            let key = gvr_key(&gvr);
            if caches.by_resource.contains_key(&key) {
                continue;
            }
            let informer = informers.informer::<DynamicObject>(
                Api::all_with(lister.clone(), &resolved.resource),
                watcher::Config::default(),
            );
            // One that cannot be listed must not hold up the others.
            if tokio::time::timeout(DISCOVERY_RESYNC, informer.wait_synced())
                .await
                .is_err()
            {
                warn!(resource = %key, "a new resource did not sync; left out until the next look");
                continue;
            }
            new_kinds.push((
                resolved.resource.api_version.clone(),
                resolved.resource.kind.clone(),
            ));
            caches.insert(gvr, resolved, informer.clone());
            added.push((key, informer));
        }
        if added.is_empty() {
            continue;
        }
        again = None;
        shared.replace(caches);
        for (resource, informer) in added {
            info!(%resource, "a new resource joins the caches");
            match &feed {
                Feed::Every => feeds.spawn(feed_every(
                    resource.as_str().into(),
                    informer.subscribe(),
                    shared.clone(),
                    queue.clone(),
                )),
                Feed::Mapped(map, target) => feeds.spawn(feed_mapped(
                    informer.subscribe(),
                    *map,
                    true,
                    target.clone(),
                    queue.clone(),
                )),
            };
        }
        // Objects owned by one of the new kinds were judged while their owners'
        // kind was unknown: they are judged again.
        if matches!(feed, Feed::Every) {
            let caches = shared.current();
            for (resource, cached) in &caches.by_resource {
                let resource: Arc<str> = resource.as_str().into();
                for obj in cached.informer.list() {
                    let owned_by_new = obj.metadata.owner_references.iter().flatten().any(|r| {
                        new_kinds
                            .iter()
                            .any(|(v, k)| *v == r.api_version && *k == r.kind)
                    });
                    if owned_by_new {
                        queue.add(key_of(&resource, &obj));
                    }
                }
            }
        }
    }
}
