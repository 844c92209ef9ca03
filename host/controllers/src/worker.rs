//! A controller's workers: each takes a key from the work queue, waits for the key's
//! expectations, calls the plugin's `reconcile` and acts on its answer (client-go's
//! `processNextWorkItem`). The queue never hands one key to two workers at once.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};
use trellis_client::workqueue::WorkQueue;
use trellis_plugin_host::{Action, ObjectKey, Plugin, PluginHost};

use crate::cache::SharedCaches;
use crate::expectations::Expectations;
use crate::key::Key;

/// How often a key waiting for its writes to reach the caches is looked at again
/// when no change brings it back sooner.
const EXPECTATIONS_RECHECK: Duration = Duration::from_secs(10);

/// One worker: takes keys until the queue shuts down.
pub(crate) async fn work(
    queue: WorkQueue<Key>,
    plugin: Arc<Plugin>,
    host: Arc<PluginHost>,
    shared: SharedCaches,
    expectations: Arc<Expectations>,
) {
    while let Some(key) = queue.get().await {
        if let Err(timeout) = expectations.check(&key) {
            // The change that meets the expectation brings the key back; the timeout
            // is the backstop.
            debug!(controller = plugin.name(), %key, "waiting for the cache to show the last writes");
            queue.done(&key);
            queue.add_after(key, timeout.min(EXPECTATIONS_RECHECK));
            continue;
        }
        let caches = shared.current();
        let Some(cached) = caches.by_resource.get(&*key.resource) else {
            queue.done(&key);
            continue;
        };
        let object = ObjectKey {
            resource: cached.gvr.clone(),
            namespace: key.namespace.clone(),
            name: key.name.clone(),
        };
        match plugin.reconcile(&host, &object).await {
            Ok(Ok(Action::Done)) => {
                debug!(controller = plugin.name(), %key, "reconciled");
                queue.forget(&key);
            }
            Ok(Ok(Action::RequeueAfter(ms))) => {
                debug!(controller = plugin.name(), %key, ms, "reconciled; again later");
                queue.forget(&key);
                queue.add_after(key.clone(), Duration::from_millis(ms));
            }
            Ok(Err(reason)) => {
                warn!(controller = plugin.name(), %key, retries = queue.num_requeues(&key), %reason, "reconcile failed; retrying with back-off");
                queue.add_rate_limited(key.clone());
            }
            Err(e) => {
                warn!(controller = plugin.name(), %key, error = %e, "reconcile failed in the plugin; retrying with back-off");
                queue.add_rate_limited(key.clone());
            }
        }
        if cached.informer.get(&key.cache_key()).is_none() {
            expectations.forget(&key);
        }
        queue.done(&key);
    }
}
