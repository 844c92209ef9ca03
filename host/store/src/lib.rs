//! The control plane's persistent state: a revisioned key-value store with watch.
//!
//! Everything else in Trellis (API server, informers, controllers, scheduler) reads
//! and watches through the [`Store`] trait, whose semantics are etcd's v3 semantics:
//!
//! - one global revision, +1 per committed write; every key carries its create
//!   revision, its modification revision and a per-key version;
//! - `create` fails if the key exists, `update` and `delete` may compare-and-swap on
//!   the key's modification revision;
//! - `list` reads a key prefix at the latest revision or at any revision still in
//!   history, with `limit` and continuation;
//! - `watch` delivers every change under a prefix from a start revision, in revision
//!   order, exactly once; a start revision below the compacted one is [`Error::Compacted`];
//! - `compact` drops history below a revision;
//! - `txn` applies several conditional writes to distinct keys all together or not at
//!   all (etcd's `Txn`), for an object stored with keys that record what it holds.
//!
//! Newcomers should start with [`Store`], then [`RedbStore`] (the embedded default)
//! and [`EtcdStore`] (for several control-plane processes on one shared store).
//!
//! # Layout
//! - [`error`]: the [`Error`] every backend returns.
//! - [`redb_backend`]: the embedded backend: group commit on a committer thread,
//!   history log, watch fan-out, background purge of compacted history.
//! - [`etcd_backend`]: the same trait over etcd v3.
//! - [`compactor`]: keeps a time window of history on any backend.
//! - [`local_etcd`]: starts a throwaway etcd process on loopback (tests, benchmarks).

pub mod compactor;
pub mod error;
pub mod etcd_backend;
pub mod local_etcd;
pub mod redb_backend;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;

pub use compactor::{Compactor, CompactorConfig};
pub use error::{Error, Result};
pub use etcd_backend::{EtcdConfig, EtcdStore};
pub use redb_backend::{DEFAULT_CACHE_BYTES, RedbConfig, RedbStore};

/// A store revision. Revision 0 never names a write; an empty store is at revision 1,
/// as etcd is, so the first write is revision 2.
pub type Revision = u64;

/// The default size limit of one value: 1.5 MiB, as etcd's `--max-request-bytes`.
pub const DEFAULT_MAX_VALUE_SIZE: usize = 1536 * 1024;

/// A key with its value and revisions, as of some revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Bytes,
    /// Revision of the write that created the key (since its last deletion).
    pub create_revision: Revision,
    /// Revision of the last write to the key; becomes `metadata.resourceVersion`.
    pub mod_revision: Revision,
    /// Number of writes since creation: 1 after create, +1 per update.
    pub version: u64,
}

/// What a watch event records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One committed change.
///
/// For a `Put`, `kv` is the new state. For a `Delete`, `kv` carries the key and the
/// deleting revision only (empty value, zero create revision and version), as etcd
/// reports it. `prev` is the key's state just before this change, if it existed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub kv: KeyValue,
    pub prev: Option<KeyValue>,
}

impl Event {
    /// The revision of the write that produced this event.
    pub fn revision(&self) -> Revision {
        self.kv.mod_revision
    }
}

/// What a successful [`Store::delete`] removed, and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deleted {
    /// The revision of the deletion.
    pub revision: Revision,
    /// The key's value just before it was deleted.
    pub prev: KeyValue,
}

/// A prefix read, at the latest revision or at a past one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListRequest {
    /// Keys that start with this prefix.
    pub prefix: String,
    /// Continuation: only keys strictly greater than this one.
    pub start_after: Option<String>,
    /// Read as of this revision; `None` reads the latest. A continued list passes the
    /// revision of its first page so that every page shows the same snapshot.
    pub revision: Option<Revision>,
    /// At most this many keys; `None` or `Some(0)` means no limit.
    pub limit: Option<usize>,
}

impl ListRequest {
    pub fn prefix(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            ..Self::default()
        }
    }
}

/// The result of a [`ListRequest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListResponse {
    /// Keys in ascending order.
    pub kvs: Vec<KeyValue>,
    /// The revision the list was read at.
    pub revision: Revision,
    /// Whether more keys match beyond `limit`; continue with `start_after` set to the
    /// last key and `revision` set to [`ListResponse::revision`].
    pub more: bool,
}

/// One write of a [`Store::txn`]. Every operation of a transaction names a key of its
/// own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Writes `key` if it does not exist; the transaction fails with
    /// [`Error::AlreadyExists`] otherwise.
    Create { key: String, value: Bytes },
    /// Replaces an existing key, at `expected` if given; the transaction fails with
    /// [`Error::NotFound`] or [`Error::Conflict`] otherwise.
    Update {
        key: String,
        value: Bytes,
        expected: Option<Revision>,
    },
    /// With `expected`, deletes the key at that modification revision (the transaction
    /// fails with [`Error::NotFound`] or [`Error::Conflict`] otherwise). Without it,
    /// deletes the key if it exists, and does nothing if it does not.
    Delete {
        key: String,
        expected: Option<Revision>,
    },
}

impl TxnOp {
    pub fn key(&self) -> &str {
        match self {
            TxnOp::Create { key, .. } | TxnOp::Update { key, .. } | TxnOp::Delete { key, .. } => {
                key
            }
        }
    }
}

/// What one [`TxnOp`] of a committed transaction did, in the order of the operations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnResult {
    /// A create or update: the key as written.
    Put(KeyValue),
    /// A delete: what it removed, or `None` for an unconditional delete of a missing key.
    Deleted(Option<Deleted>),
}

/// Checks what every backend refuses before writing: no operations, a key twice, an
/// empty key or a value over `max_value_size`.
pub(crate) fn check_txn(ops: &[TxnOp], max_value_size: usize) -> Result<()> {
    if ops.is_empty() {
        return Err(Error::backend(
            "check transaction",
            "a transaction needs an operation",
        ));
    }
    let mut keys = std::collections::BTreeSet::new();
    for op in ops {
        let key = op.key();
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if !keys.insert(key) {
            return Err(Error::backend(
                "check transaction",
                format!("key {key:?} is written twice in one transaction"),
            ));
        }
        if let TxnOp::Create { value, .. } | TxnOp::Update { value, .. } = op
            && value.len() > max_value_size
        {
            return Err(Error::ValueTooLarge {
                key: key.to_owned(),
                size: value.len(),
                limit: max_value_size,
            });
        }
    }
    Ok(())
}

/// A stream of committed changes in revision order. Each item holds the events of one
/// or more revisions. The stream ends with an error item if the watcher fell behind
/// ([`Error::WatcherLagged`]) or its history was compacted away; it ends without one
/// when the store closes.
pub type WatchStream = BoxStream<'static, Result<Vec<Event>>>;

/// The store every control-plane component reads, writes and watches through.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// The latest value of `key`, if it exists.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;

    /// Keys under a prefix; see [`ListRequest`].
    async fn list(&self, request: ListRequest) -> Result<ListResponse>;

    /// Writes `key` if it does not exist; [`Error::AlreadyExists`] otherwise.
    async fn create(&self, key: &str, value: Bytes) -> Result<KeyValue>;

    /// Replaces the value of an existing key. With `expected`, the write happens only
    /// if the key's modification revision equals it ([`Error::Conflict`] otherwise,
    /// carrying the current value so the caller can retry).
    async fn update(&self, key: &str, value: Bytes, expected: Option<Revision>)
    -> Result<KeyValue>;

    /// Deletes an existing key, optionally only at the expected modification
    /// revision ([`Error::Conflict`] otherwise).
    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<Deleted>;

    /// Applies `ops` atomically: every condition holds and every write commits, or the
    /// first failed condition is the error and nothing is written. On etcd the writes
    /// share one revision; the embedded store gives each its own consecutive revision,
    /// in the order of `ops`, committed and published together.
    /// Backends that cannot apply several writes atomically refuse it (the default).
    async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>> {
        let _ = ops;
        Err(Error::backend(
            "apply transaction",
            "this store does not support transactions",
        ))
    }

    /// Every change under `prefix` with revision >= `start` (0: changes after now).
    async fn watch(&self, prefix: &str, start: Revision) -> Result<WatchStream>;

    /// The revision of the last committed write (1 for an empty store).
    async fn current_revision(&self) -> Result<Revision>;

    /// How many keys `request` would list (`limit` ignored). Backends that can count
    /// without reading values do; the default lists.
    async fn count(&self, request: ListRequest) -> Result<u64> {
        let listed = self
            .list(ListRequest {
                limit: None,
                ..request
            })
            .await?;
        Ok(listed.kvs.len() as u64)
    }

    /// Drops history below `revision`: reads and watches below it fail with
    /// [`Error::Compacted`]; the latest value of every key is kept.
    async fn compact(&self, revision: Revision) -> Result<()>;
}

/// The smallest key greater than every key starting with `prefix`, for range ends.
/// `None` means "to the end of the keyspace".
pub(crate) fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_last_byte() {
        assert_eq!(
            prefix_end(b"/registry/pods/"),
            Some(b"/registry/pods0".to_vec())
        );
        assert_eq!(prefix_end(b"a\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff\xff"), None);
        assert_eq!(prefix_end(b""), None);
    }
}
