//! The follow loop every world uses: declarations in, loaded versions out.
//!
//! A source (the API server's store and plugins directory, or a watch of Plugin
//! objects) reports each declaration as [`Change`]s; a [`Follower`] keeps, per plugin,
//! the declaration last seen (its fingerprint: uid and generation, or file times and
//! sizes) and the load of it in flight. Each load runs in a task of its own, so a
//! module fetched slowly delays only its own plugin, and a newer declaration of the
//! same plugin stops the older one's load, whose outcome is never used. A loaded
//! version is handed to the [`World`] to install in place of the running one; a
//! failed load leaves the running version (the last good one) in place, and both
//! outcomes are reported (the `Loaded` condition) through [`World::report`].
//!
//! What differs between worlds — which declarations a world takes, how a version is
//! loaded, installed and removed, where the status goes — is the [`World`]'s.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use tokio::task::{AbortHandle, JoinSet};
use tracing::warn;

/// Why a load failed: the `Loaded` condition's reason (`FetchFailed`, `InvalidSpec`,
/// `LoadFailed`, ...) and message.
pub type Failure = (&'static str, String);

/// A declaration as its source reports it.
#[derive(Debug)]
pub enum Change<D> {
    /// Added or changed; nothing is loaded again while `fingerprint` stays the same.
    Applied {
        name: String,
        fingerprint: String,
        declaration: D,
    },
    /// Gone (or being deleted).
    Deleted { name: String },
}

/// What one world (admission and initializers, controllers, the scheduler) does with
/// the declarations a [`Follower`] follows.
pub trait World: Send {
    /// A declaration as the source gives it.
    type Declaration: Send + Sync + 'static;
    /// A version loaded and ready to install.
    type Loaded: Send + 'static;

    /// Whether this world runs `declaration` (its kind). One it does not is followed
    /// as if deleted, then handed to [`World::declined`].
    fn takes(&self, name: &str, declaration: &Self::Declaration) -> bool;

    /// Loads `declaration` beside the running version; the future runs in a task of
    /// its own and may be stopped at any await.
    fn load(
        &self,
        name: &str,
        declaration: Arc<Self::Declaration>,
    ) -> impl Future<Output = Result<Self::Loaded, Failure>> + Send + 'static;

    /// Puts a loaded version in place of the running one; returns its digest.
    fn install(
        &mut self,
        name: &str,
        declaration: &Self::Declaration,
        loaded: Self::Loaded,
    ) -> impl Future<Output = String> + Send;

    /// Stops the running version of a declaration that is gone, or that this world
    /// no longer takes (nothing, if none runs).
    fn remove(&mut self, name: &str) -> impl Future<Output = ()> + Send;

    /// A declaration of a kind this world does not run.
    fn declined(
        &mut self,
        _name: &str,
        _declaration: &Self::Declaration,
    ) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// What keeps running when a load of `name` fails (`the last good version (DIGEST)
    /// keeps running`), if anything does.
    fn keeps(&self, name: &str) -> Option<String>;

    /// Copies what the running versions counted into their statuses; called now and
    /// then by the loop that drives the follower.
    fn refresh(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Reports a load's outcome: the digest now running, or why it failed (its message
    /// already says what keeps running).
    fn report(
        &mut self,
        name: &str,
        declaration: &Self::Declaration,
        result: Result<String, Failure>,
    ) -> impl Future<Output = ()> + Send;
}

/// One declaration as it is followed.
struct Followed<D> {
    /// Changes when the declaration does.
    fingerprint: String,
    /// Whether the world took it (a version of it may be running).
    taken: bool,
    declaration: Option<Arc<D>>,
    /// The load of the current declaration, while it runs.
    loading: Option<InFlight>,
}

impl<D> Default for Followed<D> {
    fn default() -> Self {
        Self {
            fingerprint: String::new(),
            taken: false,
            declaration: None,
            loading: None,
        }
    }
}

/// A load running in its own task.
struct InFlight {
    /// Matches [`Finished::ticket`] of this load's outcome, and no other's.
    ticket: u64,
    abort: AbortHandle,
}

impl<D> Followed<D> {
    /// Stops the load in flight, if any: a newer declaration replaces it, or the
    /// declaration is gone.
    fn stop_loading(&mut self) {
        if let Some(load) = self.loading.take() {
            load.abort.abort();
        }
    }
}

/// A load's outcome, for [`Follower::finish`].
pub struct Finished<L> {
    name: String,
    ticket: u64,
    outcome: Result<L, Failure>,
}

impl<L> std::fmt::Debug for Finished<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finished")
            .field("name", &self.name)
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

/// Follows the declarations of one world (see the module's docs). Dropped, it stops
/// the loads in flight.
pub struct Follower<W: World> {
    world: W,
    followed: HashMap<String, Followed<W::Declaration>>,
    loads: JoinSet<Finished<W::Loaded>>,
    /// Numbers the loads. A load stopped for a newer one may have finished before it
    /// could be stopped: its outcome, with an older ticket than the declaration's, is
    /// dropped rather than let replace the newer version.
    tickets: u64,
}

impl<W: World> std::fmt::Debug for Follower<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follower")
            .field("followed", &self.followed.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<W: World> Follower<W> {
    pub fn new(world: W) -> Self {
        Self {
            world,
            followed: HashMap::new(),
            loads: JoinSet::new(),
            tickets: 0,
        }
    }

    pub fn world(&self) -> &W {
        &self.world
    }

    pub fn world_mut(&mut self) -> &mut W {
        &mut self.world
    }

    /// The world, once nothing is followed any more.
    pub fn into_world(self) -> W {
        self.world
    }

    /// The names followed now.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.followed.keys().map(String::as_str)
    }

    /// Takes one change: starts loading a new declaration, or removes a gone one.
    pub async fn apply(&mut self, change: Change<W::Declaration>) {
        match change {
            Change::Deleted { name } => {
                if let Some(mut followed) = self.followed.remove(&name) {
                    followed.stop_loading();
                    self.world.remove(&name).await;
                }
            }
            Change::Applied {
                name,
                fingerprint,
                declaration,
            } => {
                let followed = self.followed.entry(name.clone()).or_default();
                if followed.fingerprint == fingerprint {
                    return;
                }
                followed.fingerprint = fingerprint;
                followed.stop_loading();
                if !self.world.takes(&name, &declaration) {
                    followed.declaration = None;
                    if std::mem::take(&mut followed.taken) {
                        self.world.remove(&name).await;
                    }
                    self.world.declined(&name, &declaration).await;
                    return;
                }
                followed.taken = true;
                let declaration = Arc::new(declaration);
                followed.declaration = Some(declaration.clone());
                self.tickets += 1;
                let ticket = self.tickets;
                let load = self.world.load(&name, declaration);
                let abort = self.loads.spawn(async move {
                    Finished {
                        name,
                        ticket,
                        outcome: load.await,
                    }
                });
                followed.loading = Some(InFlight { ticket, abort });
            }
        }
    }

    /// The next load to finish; `None` when none is in flight. Cancel-safe.
    pub async fn join_next(&mut self) -> Option<Finished<W::Loaded>> {
        loop {
            match self.loads.join_next().await? {
                Ok(done) => return Some(done),
                // Stopped for a newer declaration, or for none.
                Err(e) if e.is_cancelled() => {}
                Err(e) => warn!(error = %e, "a plugin load stopped"),
            }
        }
    }

    /// Installs what a load produced, or keeps the running version if it failed, and
    /// reports which; unless a newer declaration replaced the one it loaded.
    pub async fn finish(&mut self, done: Finished<W::Loaded>) {
        let Some(followed) = self.followed.get_mut(&done.name) else {
            // Deleted while it loaded.
            return;
        };
        if followed.loading.as_ref().map(|l| l.ticket) != Some(done.ticket) {
            // Superseded, and finished before it could be stopped.
            return;
        }
        followed.loading = None;
        let Some(declaration) = followed.declaration.clone() else {
            return;
        };
        let result = match done.outcome {
            Ok(loaded) => Ok(self.world.install(&done.name, &declaration, loaded).await),
            Err((reason, message)) => {
                let message = match self.world.keeps(&done.name) {
                    Some(keeps) => format!("{message}; {keeps}"),
                    None => message,
                };
                warn!(plugin = %done.name, reason, "{message}");
                Err((reason, message))
            }
        };
        self.world.report(&done.name, &declaration, result).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A world that records what it installs and reports.
    #[derive(Default)]
    struct Recorder {
        running: HashMap<String, String>,
        reports: Vec<(String, Result<String, Failure>)>,
        /// Declarations whose load never ends.
        stuck: std::collections::HashSet<String>,
    }

    impl World for Recorder {
        type Declaration = String;
        type Loaded = String;

        fn takes(&self, _: &str, declaration: &String) -> bool {
            declaration != "other"
        }

        fn load(
            &self,
            _: &str,
            declaration: Arc<String>,
        ) -> impl Future<Output = Result<String, Failure>> + Send + 'static {
            let stuck = self.stuck.contains(declaration.as_str());
            let declaration = declaration.to_string();
            async move {
                if declaration.starts_with("bad") {
                    return Err(("FetchFailed", format!("{declaration} failed")));
                }
                if stuck {
                    std::future::pending::<()>().await;
                }
                Ok(format!("digest-{declaration}"))
            }
        }

        async fn install(&mut self, name: &str, _: &String, loaded: String) -> String {
            self.running.insert(name.to_owned(), loaded.clone());
            loaded
        }

        async fn remove(&mut self, name: &str) {
            self.running.remove(name);
        }

        fn keeps(&self, name: &str) -> Option<String> {
            self.running
                .get(name)
                .map(|d| format!("the last good version ({d}) keeps running"))
        }

        async fn report(&mut self, name: &str, _: &String, result: Result<String, Failure>) {
            self.reports.push((name.to_owned(), result));
        }
    }

    fn applied(name: &str, fingerprint: &str, declaration: &str) -> Change<String> {
        Change::Applied {
            name: name.into(),
            fingerprint: fingerprint.into(),
            declaration: declaration.into(),
        }
    }

    async fn settle(follower: &mut Follower<Recorder>) {
        while let Some(done) = follower.join_next().await {
            follower.finish(done).await;
        }
    }

    #[tokio::test]
    async fn a_failed_load_keeps_the_last_good_version() {
        let mut follower = Follower::new(Recorder::default());
        follower.apply(applied("p", "1", "v1")).await;
        settle(&mut follower).await;
        follower.apply(applied("p", "2", "bad")).await;
        settle(&mut follower).await;
        let world = follower.world();
        assert_eq!(world.running["p"], "digest-v1");
        assert_eq!(world.reports[0], ("p".into(), Ok("digest-v1".into())));
        assert_eq!(
            world.reports[1],
            (
                "p".into(),
                Err((
                    "FetchFailed",
                    "bad failed; the last good version (digest-v1) keeps running".into()
                ))
            )
        );
    }

    #[tokio::test]
    async fn a_newer_declaration_stops_the_older_load() {
        let mut follower = Follower::new(Recorder::default());
        follower.world_mut().stuck.insert("slow".into());
        follower.apply(applied("p", "1", "slow")).await;
        follower.apply(applied("p", "2", "fast")).await;
        // The same fingerprint again loads nothing.
        follower.apply(applied("p", "2", "fast")).await;
        settle(&mut follower).await;
        let world = follower.world();
        assert_eq!(world.running["p"], "digest-fast");
        assert_eq!(world.reports.len(), 1);
    }

    #[tokio::test]
    async fn a_declaration_of_another_kind_is_removed() {
        let mut follower = Follower::new(Recorder::default());
        follower.apply(applied("p", "1", "v1")).await;
        settle(&mut follower).await;
        follower.apply(applied("p", "2", "other")).await;
        assert!(follower.world().running.is_empty());
        follower.apply(applied("q", "1", "v1")).await;
        settle(&mut follower).await;
        follower.apply(Change::Deleted { name: "q".into() }).await;
        assert!(follower.world().running.is_empty());
    }
}
