//! The API server's world of the follow loop: which declarations it serves (a
//! controller or scheduler Plugin runs elsewhere; a controller one is granted its
//! rules here), how a loaded plugin joins the chains in order, and the status each
//! outcome writes.

use std::collections::HashMap;
use std::sync::Arc;

use tracing::info;
use trellis_plugin_host::{ClusterReader, Tier};
use trellis_plugins::dir;
use trellis_plugins::follow::{Failure, World};

use super::status::{counters, set_counters, update_status, write_status};
use super::{Active, Bound, Declared, PluginManager};

/// The API server's world: admission and initializer plugins, keyed `object/NAME`
/// (Plugin objects) and `file/NAME` (the plugins directory).
pub(super) struct Chains {
    manager: Arc<PluginManager>,
    reader: Arc<dyn ClusterReader>,
    /// The version each declaration serves.
    serving: HashMap<String, Arc<Bound>>,
    /// Counters and tier last written to each object's status.
    reported: HashMap<String, ([u64; 4], Tier)>,
}

impl Chains {
    pub(super) fn new(manager: Arc<PluginManager>, reader: Arc<dyn ClusterReader>) -> Self {
        Self {
            manager,
            reader,
            serving: HashMap::new(),
            reported: HashMap::new(),
        }
    }

    /// Swaps in the serving set: in-flight calls finish on the plugins they started
    /// with, new requests see the new set.
    fn publish(&self) {
        let mut plugins: Vec<Arc<Bound>> = self.serving.values().cloned().collect();
        plugins.sort_by(|a, b| {
            (a.parsed.order, a.plugin.name(), &a.origin).cmp(&(
                b.parsed.order,
                b.plugin.name(),
                &b.origin,
            ))
        });
        *self
            .manager
            .active
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(Active { plugins });
    }
}

impl World for Chains {
    type Declaration = Declared;
    type Loaded = Arc<Bound>;

    fn takes(&self, _: &str, declared: &Declared) -> bool {
        match declared {
            // The scheduler and the controller manager run these.
            Declared::Object { spec, .. } => !spec["kind"].as_str().is_some_and(|k| {
                k.eq_ignore_ascii_case("scheduler") || k.eq_ignore_ascii_case("controller")
            }),
            Declared::File { .. } => true,
        }
    }

    async fn declined(&mut self, _: &str, declared: &Declared) {
        if let Declared::Object { name, meta, spec } = declared
            && spec["kind"]
                .as_str()
                .is_some_and(|k| k.eq_ignore_ascii_case("controller"))
        {
            // The controller manager runs it; the server grants it its rules.
            self.manager.grant_controller(name, meta, spec).await;
        }
    }

    fn load(
        &self,
        id: &str,
        declared: Arc<Declared>,
    ) -> impl Future<Output = Result<Arc<Bound>, Failure>> + Send + 'static {
        let previous = self.serving.get(id).cloned();
        let manager = self.manager.clone();
        let reader = self.reader.clone();
        async move {
            let previous = previous.as_deref();
            match &*declared {
                Declared::Object { name, spec, .. } => {
                    let origin = format!("Plugin {name}");
                    manager
                        .load(name, spec, None, origin, previous, &reader)
                        .await
                }
                Declared::File { entry, dir } => match dir::read_spec(entry).await {
                    Ok(spec) => {
                        let origin = format!("file {}", entry.spec_path.display());
                        manager
                            .load(&entry.name, &spec, Some(dir), origin, previous, &reader)
                            .await
                    }
                    Err(e) => Err(("InvalidSpec", e)),
                },
            }
        }
    }

    async fn install(&mut self, id: &str, declared: &Declared, bound: Arc<Bound>) -> String {
        let digest = bound.plugin.digest().to_owned();
        if let Declared::File { entry, .. } = declared {
            info!(plugin = %entry.name, %digest, "plugin loaded from the plugins directory");
        }
        self.serving.insert(id.to_owned(), bound);
        // Serving before the status says so: a client that sees `Loaded` for this
        // generation gets the new version.
        self.publish();
        digest
    }

    async fn remove(&mut self, id: &str) {
        self.reported.remove(id);
        if self.serving.remove(id).is_some() {
            self.publish();
        }
        match id.split_once('/') {
            Some(("file", name)) => info!(plugin = %name, "plugin file removed"),
            Some((_, name)) => info!(plugin = %name, "plugin removed"),
            None => {}
        }
    }

    fn keeps(&self, id: &str) -> Option<String> {
        self.serving.get(id).map(|b| {
            format!(
                "the last good version ({}) keeps serving",
                b.plugin.digest()
            )
        })
    }

    async fn report(&mut self, id: &str, declared: &Declared, result: Result<String, Failure>) {
        // A file's outcome is in the log (the follower's, and `install`'s).
        let Declared::Object { meta, .. } = declared else {
            return;
        };
        let serving = self.serving.get(id).cloned();
        match &serving {
            Some(bound) => {
                self.reported.insert(id.to_owned(), counters(&bound.plugin));
            }
            None => {
                self.reported.remove(id);
            }
        }
        write_status(
            self.manager.cluster(),
            meta,
            result.map(|_| ()),
            serving.as_deref(),
        )
        .await;
    }

    /// Copies changed call counters into the Plugin objects' statuses.
    async fn refresh(&mut self) {
        for (id, serving) in &self.serving {
            let Some(name) = id.strip_prefix("object/") else {
                continue;
            };
            let now = counters(&serving.plugin);
            if self.reported.get(id) == Some(&now) {
                continue;
            }
            self.reported.insert(id.clone(), now);
            let _ = update_status(self.manager.cluster(), name, None, |status| {
                set_counters(status, &serving.plugin);
            })
            .await;
        }
    }
}
