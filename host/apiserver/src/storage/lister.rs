//! Listers: the built-in admission steps' reads of one resource (the LimitRanges a pod
//! is held to, the ResourceQuotas a create is charged to, the namespace a create goes
//! into), served from the watch cache's current state rather than the store.
//!
//! The cache follows the store by the time an event takes to arrive, and a write
//! acknowledged to a client must apply to every request that client sends next (a
//! quota created just before pods limits them). So each write of the lister's
//! resource through this server raises a fence to the store's revision after that
//! write ([`Lister::written`], run before the write's response is sent), and a read
//! comes from the cache only once the cache has seen the fence; until then it lists
//! the store, as every read did before. Reads between a write and its
//! acknowledgement may see either state, as any concurrent read may.
//!
//! Only this server's writes raise the fence: the embedded store is opened by one
//! server. Writes that bypass the API (namespace cleanup, quota status) either make
//! creates fail anyway (a terminating namespace) or change nothing a lister's reader
//! decides on without reading the store again (quota charges read the quotas from the
//! store under the namespace's lock).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use trellis_api::registry::ResourceInfo;
use trellis_store::{ListRequest, Revision, Store};

use crate::object::Object;
use crate::storage::watch_cache::{WatchCache, decode_stored};

/// Reads of one namespaced resource for an admission step.
#[derive(Debug)]
pub struct Lister {
    group: &'static str,
    plural: &'static str,
    store: OnceLock<Arc<dyn Store>>,
    cache: OnceLock<Arc<WatchCache>>,
    /// The store's revision after the last write of the resource through this server;
    /// the cache serves reads once it has seen this revision. Shared with the task
    /// that lowers it from [`STORE_ONLY`] once the store answers again.
    fence: Arc<AtomicU64>,
    /// Whether that task runs.
    recovering: Arc<AtomicBool>,
}

/// The fence when the store could not tell its revision: every read lists the store
/// until it can again (see [`Lister::recover`]).
const STORE_ONLY: Revision = Revision::MAX;

/// How long the recovery from [`STORE_ONLY`] waits between tries, first and at most.
const RECOVERY_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(5));

impl Lister {
    /// A lister of `plural` in `group` (`""` for the core group).
    pub fn new(group: &'static str, plural: &'static str) -> Self {
        Self {
            group,
            plural,
            store: OnceLock::new(),
            cache: OnceLock::new(),
            fence: Arc::new(AtomicU64::new(0)),
            recovering: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Hands the lister the store and the cache; see [`crate::admission::Admission::init`].
    pub fn init(&self, store: &Arc<dyn Store>, cache: &Arc<WatchCache>) {
        let _ = self.store.set(store.clone());
        let _ = self.cache.set(cache.clone());
    }

    /// Whether `resource` is the one this lister reads.
    pub fn lists(&self, resource: &ResourceInfo) -> bool {
        resource.group == self.group && resource.plural == self.plural
    }

    fn prefix(&self, namespace: &str) -> String {
        let group = if self.group.is_empty() {
            "core"
        } else {
            self.group
        };
        format!("/registry/{group}/{}/{namespace}/", self.plural)
    }

    /// Records that a write of the resource through this server succeeded: reads go to
    /// the store until the cache has seen it.
    pub async fn written(&self) {
        let Some(store) = self.store.get() else {
            return;
        };
        // The write was acknowledged before this runs, so the store's revision now is
        // at least the write's.
        match store.current_revision().await {
            Ok(revision) => raise(&self.fence, revision),
            Err(e) => {
                tracing::warn!(resource = self.plural, error = %e, "cannot read the store's revision; admission reads go to the store until it answers");
                self.fence.store(STORE_ONLY, Ordering::Release);
                self.recover(store.clone());
            }
        }
    }

    /// Lowers the fence from [`STORE_ONLY`] to the store's revision once the store can
    /// tell it: the cache serves reads again when it has seen every write up to then.
    fn recover(&self, store: Arc<dyn Store>) {
        if self.recovering.swap(true, Ordering::AcqRel) {
            return;
        }
        let fence = self.fence.clone();
        let recovering = self.recovering.clone();
        let resource = self.plural;
        tokio::spawn(async move {
            let mut wait = RECOVERY_BACKOFF.0;
            loop {
                match store.current_revision().await {
                    Ok(revision) => {
                        // A later write that read the revision has lowered it already.
                        let _ = fence.compare_exchange(
                            STORE_ONLY,
                            revision,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                        tracing::info!(
                            resource,
                            "the store answers again; admission reads use the cache"
                        );
                        break;
                    }
                    Err(_) => {
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(RECOVERY_BACKOFF.1);
                    }
                }
            }
            recovering.store(false, Ordering::Release);
        });
    }

    /// The objects of the resource in `namespace`, in key order.
    pub async fn list(&self, namespace: &str) -> trellis_store::Result<Vec<Arc<Object>>> {
        self.list_under(self.prefix(namespace)).await
    }

    /// Every object of the resource (a cluster-scoped one's, or all namespaces'), in
    /// key order.
    pub async fn list_all(&self) -> trellis_store::Result<Vec<Arc<Object>>> {
        self.list_under(self.resource_prefix()).await
    }

    /// The object at `key`: from the cache when it has seen the fence and holds it,
    /// else from the store.
    pub async fn get(&self, key: &str) -> trellis_store::Result<Option<Arc<Object>>> {
        if let Some(found) = self.cached(key) {
            return Ok(Some(found));
        }
        let Some(store) = self.store.get() else {
            return Ok(None);
        };
        Ok(store
            .get(key)
            .await?
            .and_then(|kv| decode_stored(&kv.value, kv.mod_revision).map(Arc::new)))
    }

    async fn list_under(&self, prefix: String) -> trellis_store::Result<Vec<Arc<Object>>> {
        if let Some(cache) = self.cache.get() {
            // The snapshot's own revision is held to the fence: a fence raised while
            // it was read sends the read to the store.
            let listed = cache.list(&prefix);
            if listed.revision >= self.fence.load(Ordering::Acquire) {
                return Ok(listed.objects);
            }
        }
        let Some(store) = self.store.get() else {
            return Ok(Vec::new());
        };
        let page = store.list(ListRequest::prefix(prefix)).await?;
        Ok(page
            .kvs
            .iter()
            .filter_map(|kv| decode_stored(&kv.value, kv.mod_revision).map(Arc::new))
            .collect())
    }

    /// The object at `key` when the cache has it and has seen the fence; `None`
    /// sends the caller to the store. A miss is not an answer: the object may be newer
    /// than the cache in a store other servers write to.
    pub fn cached(&self, key: &str) -> Option<Arc<Object>> {
        let cache = self.cache.get()?;
        // Read the revision first: the object read after it is at least that new.
        if cache.revision() < self.fence.load(Ordering::Acquire) {
            return None;
        }
        cache.get(key)
    }

    /// Whether the cache has seen every write of the resource through this server, so
    /// that what it holds is what a read must see.
    pub fn cache_current(&self) -> bool {
        self.cache
            .get()
            .is_some_and(|cache| cache.revision() >= self.fence.load(Ordering::Acquire))
    }

    /// `/registry/GROUP/PLURAL/`: where the resource's objects are stored.
    pub fn resource_prefix(&self) -> String {
        let group = if self.group.is_empty() {
            "core"
        } else {
            self.group
        };
        format!("/registry/{group}/{}/", self.plural)
    }

    /// Whether reads go to the store because its revision could not be read.
    pub fn store_only(&self) -> bool {
        self.fence.load(Ordering::Acquire) == STORE_ONLY
    }

    /// Whether the resource has no object in `namespace`, as [`Lister::list`] reads it.
    pub async fn is_empty(&self, namespace: &str) -> trellis_store::Result<bool> {
        Ok(self.list(namespace).await?.is_empty())
    }
}

/// Raises the fence to `revision`; a fence at [`STORE_ONLY`] comes down to it, since
/// the store's revision now covers every write before.
fn raise(fence: &AtomicU64, revision: Revision) {
    let _ = fence.fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
        Some(if f == STORE_ONLY {
            revision
        } else {
            f.max(revision)
        })
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use async_trait::async_trait;
    use bytes::Bytes;
    use serde_json::json;
    use trellis_store::{RedbConfig, RedbStore};

    use super::*;

    fn quota(name: &str) -> Bytes {
        Bytes::from(
            json!({"apiVersion": "v1", "kind": "ResourceQuota",
                   "metadata": {"name": name, "namespace": "a"},
                   "spec": {"hard": {"pods": "1"}}})
            .to_string(),
        )
    }

    fn open() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> =
            Arc::new(RedbStore::open(RedbConfig::new(dir.path().join("s.redb"))).unwrap());
        (dir, store)
    }

    fn names(objects: &[Arc<Object>]) -> Vec<String> {
        objects
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    }

    #[tokio::test]
    async fn a_write_through_the_server_is_read_even_before_the_cache_has_it() {
        let (_dir, store) = open();
        // A cache whose feed has stopped: it never sees a write after its start.
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::ready(()))
            .await
            .unwrap();
        // Lets the feeder task meet its (already finished) shutdown.
        tokio::task::yield_now().await;
        let lister = Lister::new("", "resourcequotas");
        lister.init(&store, &cache);
        let kv = store
            .create("/registry/core/resourcequotas/a/q", quota("q"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(cache.revision() < kv.mod_revision, "the cache did not stop");
        // Not written through the server: only the cache is read, and it lags.
        assert!(lister.is_empty("a").await.unwrap());
        lister.written().await;
        assert!(!lister.is_empty("a").await.unwrap());
        assert_eq!(names(&lister.list("a").await.unwrap()), ["q"]);
        assert!(lister.list("b").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn reads_follow_the_store_through_the_cache() {
        let (_dir, store) = open();
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        let lister = Lister::new("", "resourcequotas");
        lister.init(&store, &cache);
        let kv = store
            .create("/registry/core/resourcequotas/a/q", quota("q"))
            .await
            .unwrap();
        lister.written().await;
        assert!(
            cache
                .wait_for(kv.mod_revision, Duration::from_secs(5))
                .await
        );
        assert_eq!(names(&lister.list("a").await.unwrap()), ["q"]);
        // Removed behind the server's back: the cache still answers (and will follow).
        let gone = store
            .delete("/registry/core/resourcequotas/a/q", None)
            .await
            .unwrap();
        assert!(cache.wait_for(gone.revision, Duration::from_secs(5)).await);
        assert!(lister.is_empty("a").await.unwrap());
        assert!(
            lister.lists(
                &trellis_api::registry::builtins()
                    .into_iter()
                    .find(|r| r.plural == "resourcequotas")
                    .unwrap()
            )
        );
    }

    /// A store whose `current_revision` fails while `failing` is set, and that counts
    /// its lists.
    #[derive(Debug)]
    struct Flaky {
        inner: Arc<dyn Store>,
        failing: AtomicBool,
        lists: AtomicUsize,
    }

    #[async_trait]
    impl Store for Flaky {
        async fn get(&self, key: &str) -> trellis_store::Result<Option<trellis_store::KeyValue>> {
            self.inner.get(key).await
        }
        async fn list(&self, r: ListRequest) -> trellis_store::Result<trellis_store::ListResponse> {
            self.lists.fetch_add(1, Ordering::SeqCst);
            self.inner.list(r).await
        }
        async fn create(
            &self,
            key: &str,
            value: Bytes,
        ) -> trellis_store::Result<trellis_store::KeyValue> {
            self.inner.create(key, value).await
        }
        async fn update(
            &self,
            key: &str,
            value: Bytes,
            expected: Option<Revision>,
        ) -> trellis_store::Result<trellis_store::KeyValue> {
            self.inner.update(key, value, expected).await
        }
        async fn delete(
            &self,
            key: &str,
            expected: Option<Revision>,
        ) -> trellis_store::Result<trellis_store::Deleted> {
            self.inner.delete(key, expected).await
        }
        async fn watch(
            &self,
            prefix: &str,
            start: Revision,
        ) -> trellis_store::Result<trellis_store::WatchStream> {
            self.inner.watch(prefix, start).await
        }
        async fn current_revision(&self) -> trellis_store::Result<Revision> {
            if self.failing.load(Ordering::SeqCst) {
                return Err(trellis_store::Error::Closed);
            }
            self.inner.current_revision().await
        }
        async fn compact(&self, revision: Revision) -> trellis_store::Result<()> {
            self.inner.compact(revision).await
        }
    }

    /// Regression: one failed revision read set the fence to `Revision::MAX` for good,
    /// and every admission read after it listed the store.
    #[tokio::test]
    async fn a_transient_store_error_sends_reads_to_the_store_only_until_it_answers() {
        let (_dir, inner) = open();
        let flaky = Arc::new(Flaky {
            inner,
            failing: AtomicBool::new(true),
            lists: AtomicUsize::new(0),
        });
        let store: Arc<dyn Store> = flaky.clone();
        let cache = WatchCache::start(store.clone(), 16, 16, std::future::pending())
            .await
            .unwrap();
        let lister = Lister::new("", "resourcequotas");
        lister.init(&store, &cache);
        let kv = store
            .create("/registry/core/resourcequotas/a/q", quota("q"))
            .await
            .unwrap();
        lister.written().await;
        assert!(lister.store_only());
        flaky.lists.store(0, Ordering::SeqCst);
        assert_eq!(names(&lister.list("a").await.unwrap()), ["q"]);
        assert_eq!(flaky.lists.load(Ordering::SeqCst), 1, "read from the store");

        flaky.failing.store(false, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while lister.store_only() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the fence never came down"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            cache
                .wait_for(kv.mod_revision, Duration::from_secs(5))
                .await
        );
        flaky.lists.store(0, Ordering::SeqCst);
        assert_eq!(names(&lister.list("a").await.unwrap()), ["q"]);
        assert!(lister.cached("/registry/core/resourcequotas/a/q").is_some());
        assert_eq!(flaky.lists.load(Ordering::SeqCst), 0, "read from the cache");
    }
}
