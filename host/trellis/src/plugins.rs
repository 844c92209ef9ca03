//! What the controller manager and the scheduler share about Plugin objects: following
//! them through an informer into a [`Follower`], and where fetched modules are kept.

use std::path::{Path, PathBuf};
use std::time::Duration;
use trellis_api::Shutdown;

use kube::api::DynamicObject;
use trellis_client::informer::{Change, Informer};
use trellis_plugins::follow::{Follower, World};
use trellis_plugins::object;

/// Feeds the Plugin objects `informer` holds to `follower` until `stopped` (or the
/// informer ends), installing each load as it finishes; every `refresh`, the world
/// copies its counters into the statuses. Returns the world, for it to stop what runs.
pub(crate) async fn follow_informer<W: World<Declaration = DynamicObject>>(
    mut follower: Follower<W>,
    informer: &Informer<DynamicObject>,
    stopped: Shutdown,
    refresh: Option<Duration>,
) -> W {
    enum Next<L> {
        Change(Option<Change<DynamicObject>>),
        Loaded(trellis_plugins::follow::Finished<L>),
        Refresh,
        Stopped,
    }
    let mut changes = informer.subscribe();
    let mut tick = tokio::time::interval(refresh.unwrap_or(Duration::from_secs(3600)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            change = changes.recv() => Next::Change(change),
            Some(done) = follower.join_next() => Next::Loaded(done),
            _ = tick.tick(), if refresh.is_some() => Next::Refresh,
            _ = stopped.wait() => Next::Stopped,
        };
        match next {
            Next::Change(Some(change)) => {
                let deleted = matches!(change, Change::Deleted(_));
                let obj = DynamicObject::clone(change.object());
                follower.apply(object::change(obj, deleted)).await;
            }
            Next::Loaded(done) => follower.finish(done).await,
            Next::Refresh => follower.world_mut().refresh().await,
            Next::Change(None) | Next::Stopped => break,
        }
    }
    follower.into_world()
}

/// Where fetched modules are kept: the plugin cache's `modules`, or a directory of
/// the process's own.
pub fn modules_dir(cache: Option<&Path>) -> PathBuf {
    match cache {
        Some(dir) => dir.join("modules"),
        None => std::env::temp_dir().join(format!("trellis-modules-{}", std::process::id())),
    }
}
