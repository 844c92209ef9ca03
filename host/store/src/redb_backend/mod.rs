//! The embedded backend: one redb file, etcd's semantics.
//!
//! # How it works
//! - Three tables: `log` (revision → what the write of that revision did, with its
//!   value and a pointer to the key's previous entry), `kv` (key → the revisions of its
//!   latest entry), `meta` (format version, current and compacted revision, purge
//!   cursor). Each value is written once ([`codec`]).
//! - Writes go to one committer thread ([`committer`]) that drains every request
//!   waiting, applies them in order in one write transaction, fsyncs once, publishes
//!   the events, then acknowledges. Concurrent writers therefore share an fsync:
//!   that is where the throughput comes from.
//! - Reads open their own read transaction (redb is MVCC): they never wait for writers.
//!   A list at a past revision reads the latest `kv` and undoes the log entries after
//!   that revision (each entry points at the key's previous one).
//! - Watches ([`watch`]) replay the log from their start revision, then receive the
//!   committed batches that match their prefix through the [`hub`], each on its own
//!   bounded channel. A watcher that falls too far behind is ended with
//!   [`Error::WatcherLagged`] rather than buffering without bound.
//! - `compact` records the compacted revision at once; the committer drops the log
//!   entries nobody can read any more afterwards, in small steps between write batches,
//!   so writers never wait for a whole purge. Like etcd, it keeps the newest entry of
//!   each key below the compacted revision: it is still the key's value, or the
//!   previous value of a later event.

mod codec;
mod committer;
mod hub;
mod watch;

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};
use tokio::sync::{mpsc, oneshot};

use crate::{
    DEFAULT_MAX_VALUE_SIZE, Deleted, Error, Event, KeyValue, ListRequest, ListResponse, Result,
    Revision, Store, TxnOp, TxnResult, WatchStream,
};
use codec::{Entry, decode_entry, decode_meta};
use committer::{Committer, Op, Reply, Request};
use hub::Hub;

const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

const META_FORMAT: &str = "format";
const META_REVISION: &str = "revision";
const META_COMPACTED: &str = "compacted";
/// Log entries below this revision have been through the purge.
const META_PURGED_TO: &str = "purged_to";
/// Bumped on any incompatible change of the tables or their encodings.
const FORMAT_VERSION: u64 = 1;

/// [`RedbConfig::cache_bytes`] unless set.
pub const DEFAULT_CACHE_BYTES: usize = 32 << 20;

/// Settings of a [`RedbStore`].
#[derive(Clone, Debug)]
pub struct RedbConfig {
    /// The store file; created (with its directory) if missing.
    pub path: PathBuf,
    /// Largest value accepted, in bytes.
    pub max_value_size: usize,
    /// How many commits a watcher may fall behind before it is ended. Bounds the
    /// memory a slow watcher can hold.
    pub watch_buffer: usize,
    /// Most write requests applied in one transaction. Larger batches amortise the
    /// fsync further but hold every writer in the batch for longer.
    pub max_batch: usize,
    /// History entries examined per purge step after a compaction. Bounds how long a
    /// purge step can hold up the next write batch.
    pub purge_chunk: usize,
    /// Bytes of pages redb keeps in memory. Reads past it go to the file (the
    /// operating system's page cache), so this trades the server's resident memory
    /// against read latency; redb's own default, 1 GiB, would let a store of a few
    /// hundred MiB sit in the heap whole.
    pub cache_bytes: usize,
}

impl RedbConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            max_value_size: DEFAULT_MAX_VALUE_SIZE,
            watch_buffer: 1024,
            max_batch: 4096,
            purge_chunk: 1024,
            cache_bytes: DEFAULT_CACHE_BYTES,
        }
    }
}

/// The embedded store. See the module docs for how it works.
#[derive(Debug)]
pub struct RedbStore {
    shared: Arc<Shared>,
    requests: mpsc::Sender<Request>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    max_value_size: usize,
}

/// What the committer thread and the watch streams share with the store handle.
#[derive(Debug)]
struct Shared {
    db: Database,
    path: PathBuf,
    hub: Hub,
    /// Mirrors `meta.compacted`, so watch and list can refuse without a read.
    compacted: AtomicU64,
    /// Whether history below `compacted` is still being purged.
    purging: AtomicBool,
}

/// Poisoning only follows a panic elsewhere; the guarded data stays consistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Creates `dir` (and its parents) as the owner's alone, 0700, when it is missing.
fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

impl RedbStore {
    /// Opens (or creates) the store file and starts its committer thread.
    pub fn open(config: RedbConfig) -> Result<Self> {
        let path = config.path.clone();
        let open_err = |source: Box<dyn std::error::Error + Send + Sync>| Error::Open {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            private_dir(dir).map_err(|e| open_err(e.into()))?;
        }
        // redb validates its header and checksums; a foreign or damaged file must be an
        // error that names the file, so a panic deep in a decoder is caught here too.
        let cache_bytes = config.cache_bytes;
        let db = std::panic::catch_unwind(|| {
            Database::builder()
                .set_cache_size(cache_bytes)
                .create(&path)
        })
        .map_err(|_| open_err("the file is not a readable redb database".into()))?
        .map_err(|e| open_err(e.into()))?;
        // The store holds Secrets: readable by its owner alone.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| open_err(e.into()))?;
        }
        let (revision, compacted) = init_tables(&db, &path)?;

        let shared = Arc::new(Shared {
            db,
            path,
            hub: Hub::new(revision, config.watch_buffer),
            compacted: AtomicU64::new(compacted),
            purging: AtomicBool::new(false),
        });
        let (requests, rx) = mpsc::channel(config.max_batch.max(1) * 4);
        let committer = Committer::new(shared.clone(), rx, revision, compacted, &config)?;
        let handle = std::thread::Builder::new()
            .name("trellis-store-commit".into())
            .spawn(move || committer.run())
            .map_err(|e| Error::backend("start committer thread", e))?;
        Ok(Self {
            shared,
            requests,
            committer: Mutex::new(Some(handle)),
            max_value_size: config.max_value_size,
        })
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Whether the committer is still dropping history below the compacted revision.
    /// Benchmarks use it to measure writes while a purge runs.
    pub fn is_purging(&self) -> bool {
        self.shared.purging.load(Ordering::Acquire)
    }

    /// Stops accepting writes, finishes the ones already queued, and waits for the
    /// committer thread. The file closes when the last open watch stream is dropped.
    pub async fn close(&self) -> Result<()> {
        let (reply, _) = oneshot::channel();
        // An error means the committer is already gone.
        let _ = self
            .requests
            .send(Request {
                op: Op::Shutdown,
                reply,
            })
            .await;
        let handle = lock(&self.committer).take();
        if let Some(handle) = handle {
            tokio::task::spawn_blocking(move || handle.join())
                .await
                .map_err(|e| Error::backend("join committer thread", e))?
                .map_err(|_| {
                    Error::backend("join committer thread", "committer thread panicked")
                })?;
        }
        Ok(())
    }

    async fn submit(&self, op: Op) -> Result<Reply> {
        let (reply, rx) = oneshot::channel();
        self.requests
            .send(Request { op, reply })
            .await
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    fn check_write(&self, key: &str, value: &Bytes) -> Result<()> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if value.len() > self.max_value_size {
            return Err(Error::ValueTooLarge {
                key: key.to_owned(),
                size: value.len(),
                limit: self.max_value_size,
            });
        }
        Ok(())
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        let (reply, _) = oneshot::channel();
        // Without a close() the committer still stops once the queue drains; a full
        // queue means it is busy and will see the channel close instead.
        let _ = self.requests.try_send(Request {
            op: Op::Shutdown,
            reply,
        });
    }
}

/// Creates the tables of a new file, or checks that an existing one is a Trellis store.
/// Returns the current and the compacted revision.
fn init_tables(db: &Database, path: &Path) -> Result<(Revision, Revision)> {
    let corrupt = |detail: String| Error::Corrupt {
        path: path.to_owned(),
        detail,
    };
    let backend = |e: redb::Error| Error::Open {
        path: path.to_owned(),
        source: e.into(),
    };
    let txn = db.begin_write().map_err(|e| backend(e.into()))?;
    let tables: Vec<String> = txn
        .list_tables()
        .map_err(|e| backend(e.into()))?
        .map(|t| t.name().to_owned())
        .collect();
    let ours = [KV.name(), LOG.name(), META.name()];
    if let Some(foreign) = tables.iter().find(|t| !ours.contains(&t.as_str())) {
        return Err(corrupt(format!(
            "not a Trellis store: it holds a table {foreign:?} that Trellis does not write"
        )));
    }
    let fresh = tables.is_empty();
    let (revision, compacted) = {
        let mut meta = txn.open_table(META).map_err(|e| backend(e.into()))?;
        txn.open_table(KV).map_err(|e| backend(e.into()))?;
        txn.open_table(LOG).map_err(|e| backend(e.into()))?;
        let get = |meta: &redb::Table<&str, u64>, name: &str| -> Result<Option<u64>> {
            Ok(meta
                .get(name)
                .map_err(|e| backend(e.into()))?
                .map(|v| v.value()))
        };
        if fresh {
            meta.insert(META_FORMAT, FORMAT_VERSION)
                .map_err(|e| backend(e.into()))?;
            meta.insert(META_REVISION, 1)
                .map_err(|e| backend(e.into()))?;
            meta.insert(META_COMPACTED, 0)
                .map_err(|e| backend(e.into()))?;
            (1, 0)
        } else {
            match get(&meta, META_FORMAT)? {
                Some(FORMAT_VERSION) => {}
                Some(other) => {
                    return Err(corrupt(format!(
                        "store format {other} is not the supported format {FORMAT_VERSION}"
                    )));
                }
                None => return Err(corrupt("not a Trellis store: no format marker".into())),
            }
            let revision =
                get(&meta, META_REVISION)?.ok_or_else(|| corrupt("no current revision".into()))?;
            let compacted = get(&meta, META_COMPACTED)?.unwrap_or(0);
            (revision, compacted)
        }
    };
    if fresh {
        txn.commit().map_err(|e| backend(e.into()))?;
    } else {
        txn.abort().map_err(|e| backend(e.into()))?;
    }
    Ok((revision, compacted))
}

fn read_err(step: &'static str) -> impl Fn(redb::Error) -> Error {
    move |e| Error::backend(step, e)
}

/// Lookups in the history log of one transaction, read or write.
pub(crate) struct History<'a, L> {
    pub log: &'a L,
    pub path: &'a Path,
}

impl<L: ReadableTable<u64, &'static [u8]>> History<'_, L> {
    fn corrupt(&self, detail: String) -> Error {
        Error::Corrupt {
            path: self.path.to_owned(),
            detail,
        }
    }

    pub fn entry(&self, revision: Revision) -> Result<Option<Entry>> {
        let Some(bytes) = self
            .log
            .get(revision)
            .map_err(|e| Error::backend("read history", e))?
        else {
            return Ok(None);
        };
        decode_entry(revision, bytes.value())
            .map(Some)
            .map_err(|d| self.corrupt(d))
    }

    /// The key-value written at `revision`, which must still be in the log.
    pub fn kv_at(&self, revision: Revision, referenced_by: &str) -> Result<KeyValue> {
        match self.entry(revision)? {
            Some(entry) => Ok(entry.into_kv(revision)),
            None => Err(self.corrupt(format!(
                "history entry {revision} is missing, but {referenced_by} refers to it"
            ))),
        }
    }

    /// The event of the entry at `revision`, with the key's previous value.
    pub fn event(&self, revision: Revision, entry: Entry) -> Result<Event> {
        let prev = match entry.prev_mod {
            0 => None,
            p => Some(self.kv_at(p, &format!("the entry at {revision}"))?),
        };
        let kind = entry.kind;
        Ok(Event {
            kind,
            kv: entry.into_kv(revision),
            prev,
        })
    }

    /// The latest value of `key`, through the `kv` table.
    pub fn latest(
        &self,
        kv: &impl ReadableTable<&'static str, &'static [u8]>,
        key: &str,
    ) -> Result<Option<KeyValue>> {
        let Some(bytes) = kv.get(key).map_err(|e| Error::backend("read key", e))? else {
            return Ok(None);
        };
        let meta = decode_meta(bytes.value()).map_err(|d| self.corrupt(d))?;
        self.kv_at(meta.mod_revision, key).map(Some)
    }
}

/// Where a list's keys start: after `start_after` when it is within the prefix.
fn start_bound(request: &ListRequest) -> Bound<&str> {
    match &request.start_after {
        Some(after) if after.as_str() >= request.prefix.as_str() => Bound::Excluded(after.as_str()),
        _ => Bound::Included(request.prefix.as_str()),
    }
}

/// Whether `key` is one `request` lists.
fn in_range(request: &ListRequest, key: &str) -> bool {
    key.starts_with(&request.prefix)
        && request
            .start_after
            .as_deref()
            .is_none_or(|after| key > after)
}

impl Shared {
    /// The keys `request` lists that were written after `at`, each with the revision
    /// of its entry as of `at` (0: it did not exist then), read from the earliest of its
    /// later log entries.
    fn undo_after(
        &self,
        log: &impl ReadableTable<u64, &'static [u8]>,
        at: Revision,
        request: &ListRequest,
    ) -> Result<BTreeMap<String, Revision>> {
        let err = read_err("read history");
        let mut undo = BTreeMap::new();
        for item in log.range(at + 1..).map_err(|e| err(e.into()))? {
            let (rev, bytes) = item.map_err(|e| err(e.into()))?;
            let entry = decode_entry(rev.value(), bytes.value()).map_err(|d| self.corrupt(d))?;
            if in_range(request, &entry.key) && !undo.contains_key(&entry.key) {
                undo.insert(entry.key, entry.prev_mod);
            }
        }
        Ok(undo)
    }

    /// The number of keys [`Shared::list_at`] would return without its limit, read
    /// from keys and history entries only: no value is read.
    fn count_at(&self, request: &ListRequest) -> Result<u64> {
        let err = read_err("count keys");
        let txn = self.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let current = meta
            .get(META_REVISION)
            .map_err(|e| err(e.into()))?
            .map(|v| v.value())
            .unwrap_or(0);
        let at = match request.revision {
            None | Some(0) => current,
            Some(r) => r.min(current),
        };
        // Keys written after `at`: whether each existed at `at`.
        let undo = if at < current {
            let log = txn.open_table(LOG).map_err(|e| err(e.into()))?;
            self.undo_after(&log, at, request)?
        } else {
            BTreeMap::new()
        };
        let start = start_bound(request);
        let kv = txn.open_table(KV).map_err(|e| err(e.into()))?;
        let mut count = undo.values().filter(|prev| **prev != 0).count() as u64;
        for item in kv
            .range::<&str>((start, Bound::Unbounded))
            .map_err(|e| err(e.into()))?
        {
            let (key, _) = item.map_err(|e| err(e.into()))?;
            let key = key.value();
            if !key.starts_with(&request.prefix) {
                break;
            }
            if !undo.contains_key(key) {
                count += 1;
            }
        }
        Ok(count)
    }

    fn list_at(&self, request: &ListRequest) -> Result<ListResponse> {
        let err = read_err("read list");
        let txn = self.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let meta_get = |name| -> Result<u64> {
            Ok(meta
                .get(name)
                .map_err(|e| err(e.into()))?
                .map(|v| v.value())
                .unwrap_or(0))
        };
        let current = meta_get(META_REVISION)?;
        let compacted = meta_get(META_COMPACTED)?;
        let at = match request.revision {
            None | Some(0) => current,
            Some(r) if r > current => {
                return Err(Error::FutureRevision {
                    requested: r,
                    current,
                });
            }
            Some(r) if r < compacted => {
                return Err(Error::Compacted {
                    requested: r,
                    compacted: Some(compacted),
                });
            }
            Some(r) => r,
        };
        let limit = request.limit.filter(|l| *l > 0).unwrap_or(usize::MAX);
        let kv = txn.open_table(KV).map_err(|e| err(e.into()))?;
        let log = txn.open_table(LOG).map_err(|e| err(e.into()))?;
        let history = History {
            log: &log,
            path: &self.path,
        };
        let start = start_bound(request);
        // The state at `at` differs from the latest only for keys written after `at`:
        // for each, the earliest later entry points at its entry as of `at` (0: absent).
        let undo = if at < current {
            self.undo_after(&log, at, request)?
        } else {
            BTreeMap::new()
        };
        let value_at = |key: &str, rev: Revision| -> Result<Option<KeyValue>> {
            match rev {
                0 => Ok(None),
                r => history.kv_at(r, key).map(Some),
            }
        };

        // Collect one key past the limit to learn whether there are more.
        let want = limit.saturating_add(1);
        let mut kvs = Vec::new();
        let mut pending = undo.into_iter().peekable();
        for item in kv
            .range::<&str>((start, Bound::Unbounded))
            .map_err(|e| err(e.into()))?
        {
            let (key, bytes) = item.map_err(|e| err(e.into()))?;
            let key = key.value();
            if !key.starts_with(&request.prefix) || kvs.len() >= want {
                break;
            }
            // Keys deleted after `at` sort between the live ones.
            while let Some((k, _)) = pending.peek() {
                if k.as_str() >= key || kvs.len() >= want {
                    break;
                }
                if let Some((k, rev)) = pending.next()
                    && let Some(old) = value_at(&k, rev)?
                {
                    kvs.push(old);
                }
            }
            let rev = match pending.peek() {
                Some((k, _)) if k == key => pending.next().map_or(0, |(_, rev)| rev),
                _ => {
                    decode_meta(bytes.value())
                        .map_err(|d| self.corrupt(d))?
                        .mod_revision
                }
            };
            if kvs.len() < want
                && let Some(item) = value_at(key, rev)?
            {
                kvs.push(item);
            }
        }
        for (k, rev) in pending {
            if kvs.len() >= want {
                break;
            }
            kvs.extend(value_at(&k, rev)?);
        }
        let more = kvs.len() > limit;
        kvs.truncate(limit);
        Ok(ListResponse {
            kvs,
            revision: at,
            more,
        })
    }

    /// Events with revisions in `from..=to` whose key starts with `prefix`.
    fn read_log(&self, prefix: &str, from: Revision, to: Revision) -> Result<Vec<Event>> {
        let err = read_err("read history");
        let txn = self.db.begin_read().map_err(|e| err(e.into()))?;
        let meta = txn.open_table(META).map_err(|e| err(e.into()))?;
        let compacted = meta
            .get(META_COMPACTED)
            .map_err(|e| err(e.into()))?
            .map(|v| v.value())
            .unwrap_or(0);
        if from < compacted {
            return Err(Error::Compacted {
                requested: from,
                compacted: Some(compacted),
            });
        }
        let log = txn.open_table(LOG).map_err(|e| err(e.into()))?;
        let history = History {
            log: &log,
            path: &self.path,
        };
        let mut events = Vec::new();
        for item in log.range(from..=to).map_err(|e| err(e.into()))? {
            let (rev, bytes) = item.map_err(|e| err(e.into()))?;
            let entry = decode_entry(rev.value(), bytes.value()).map_err(|d| self.corrupt(d))?;
            if entry.key.starts_with(prefix) {
                events.push(history.event(rev.value(), entry)?);
            }
        }
        Ok(events)
    }

    fn corrupt(&self, detail: String) -> Error {
        Error::Corrupt {
            path: self.path.clone(),
            detail,
        }
    }
}

#[async_trait]
impl Store for RedbStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let err = read_err("read key");
        let txn = self.shared.db.begin_read().map_err(|e| err(e.into()))?;
        let kv = txn.open_table(KV).map_err(|e| err(e.into()))?;
        let log = txn.open_table(LOG).map_err(|e| err(e.into()))?;
        History {
            log: &log,
            path: &self.shared.path,
        }
        .latest(&kv, key)
    }

    async fn list(&self, request: ListRequest) -> Result<ListResponse> {
        // A list reads as many values as it asks for: off the async workers, so a large
        // one cannot stall every other request on the same thread.
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.list_at(&request))
            .await
            .map_err(|e| Error::backend("read list", e))?
    }

    async fn count(&self, request: ListRequest) -> Result<u64> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.count_at(&request))
            .await
            .map_err(|e| Error::backend("count keys", e))?
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<KeyValue> {
        self.check_write(key, &value)?;
        match self
            .submit(Op::Create {
                key: key.to_owned(),
                value,
            })
            .await?
        {
            Reply::Kv(kv) => Ok(kv),
            other => Err(other.unexpected()),
        }
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: Option<Revision>,
    ) -> Result<KeyValue> {
        self.check_write(key, &value)?;
        match self
            .submit(Op::Update {
                key: key.to_owned(),
                value,
                expected,
            })
            .await?
        {
            Reply::Kv(kv) => Ok(kv),
            other => Err(other.unexpected()),
        }
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<Deleted> {
        match self
            .submit(Op::Delete {
                key: key.to_owned(),
                expected,
            })
            .await?
        {
            Reply::Deleted(d) => Ok(d),
            other => Err(other.unexpected()),
        }
    }

    async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>> {
        crate::check_txn(&ops, self.max_value_size)?;
        match self.submit(Op::Txn { ops }).await? {
            Reply::Txn(results) => Ok(results),
            other => Err(other.unexpected()),
        }
    }

    async fn watch(&self, prefix: &str, start: Revision) -> Result<WatchStream> {
        watch::watch(self.shared.clone(), prefix.to_owned(), start)
    }

    async fn current_revision(&self) -> Result<Revision> {
        Ok(self.shared.hub.published())
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        match self.submit(Op::Compact { revision }).await? {
            Reply::Done => Ok(()),
            other => Err(other.unexpected()),
        }
    }
}
