//! The committer thread: group commit and history purge.
//!
//! Every write request goes through one channel to this thread. It takes all the
//! requests waiting (up to `max_batch`), applies them in arrival order in a single
//! durable write transaction, and only after the commit returns publishes their events
//! and acknowledges them. An fsync costs the same for one write or a thousand, so under
//! load each writer waits for roughly one fsync while throughput grows with the batch.
//!
//! A request that fails its condition (exists, missing, conflict) uses no revision and
//! does not fail the others. If the commit itself fails (disk full, I/O error), every
//! request of the batch gets the error, no revision is used, and the thread goes on.

use std::sync::Arc;

use bytes::Bytes;
use redb::{Durability, ReadableDatabase, ReadableTable, Table};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::codec::{self, Entry, KeyMeta};
use super::{
    History, KV, LOG, META, META_COMPACTED, META_PURGED_TO, META_REVISION, RedbConfig, Shared,
};
use crate::{Deleted, Error, Event, EventKind, KeyValue, Result, Revision, TxnOp, TxnResult};

pub(super) enum Op {
    Create {
        key: String,
        value: Bytes,
    },
    Update {
        key: String,
        value: Bytes,
        expected: Option<Revision>,
    },
    Delete {
        key: String,
        expected: Option<Revision>,
    },
    /// Several writes to distinct keys, all or none.
    Txn {
        ops: Vec<TxnOp>,
    },
    Compact {
        revision: Revision,
    },
    /// Finish the requests already taken, then stop.
    Shutdown,
}

pub(super) enum Reply {
    Kv(KeyValue),
    Deleted(Deleted),
    Txn(Vec<TxnResult>),
    Done,
}

impl Reply {
    pub fn unexpected(&self) -> Error {
        Error::backend("committer reply", "reply does not match the request")
    }
}

pub(super) struct Request {
    pub op: Op,
    pub reply: oneshot::Sender<Result<Reply>>,
}

pub(super) struct Committer {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Request>,
    /// Last committed revision.
    revision: Revision,
    /// Log entries below this are dropped by purge steps.
    compacted: Revision,
    /// Entries below this have been through the purge.
    purged_to: Revision,
    /// Whether entries between `purged_to` and `compacted` remain to be examined.
    purge_pending: bool,
    max_batch: usize,
    purge_chunk: usize,
    buf: Vec<u8>,
}

/// The effects of a batch, kept aside until its commit succeeds.
struct Pending {
    revision: Revision,
    compacted: Revision,
    events: Vec<Event>,
}

impl Committer {
    pub fn new(
        shared: Arc<Shared>,
        rx: mpsc::Receiver<Request>,
        revision: Revision,
        compacted: Revision,
        config: &RedbConfig,
    ) -> Result<Self> {
        let purged_to = {
            let txn = shared
                .db
                .begin_read()
                .map_err(|e| Error::backend("read purge cursor", e))?;
            let meta = txn
                .open_table(META)
                .map_err(|e| Error::backend("read purge cursor", e))?;
            meta.get(META_PURGED_TO)
                .map_err(|e| Error::backend("read purge cursor", e))?
                .map_or(0, |v| v.value())
        };
        Ok(Self {
            shared,
            rx,
            revision,
            compacted,
            purged_to,
            // A crash may have cut a purge short: it goes on from the cursor.
            purge_pending: purged_to < compacted,
            max_batch: config.max_batch.max(1),
            purge_chunk: config.purge_chunk.max(1),
            buf: Vec::new(),
        })
    }

    fn set_purge_pending(&mut self, pending: bool) {
        self.purge_pending = pending;
        self.shared
            .purging
            .store(pending, std::sync::atomic::Ordering::Release);
    }

    pub fn run(mut self) {
        self.set_purge_pending(self.purge_pending);
        let mut batch = Vec::with_capacity(self.max_batch);
        loop {
            // While a purge is pending, don't sleep on the channel: purge between batches.
            let first = if self.purge_pending {
                match self.rx.try_recv() {
                    Ok(r) => Some(r),
                    Err(mpsc::error::TryRecvError::Empty) => None,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            } else {
                match self.rx.blocking_recv() {
                    Some(r) => Some(r),
                    None => break,
                }
            };
            if let Some(first) = first {
                batch.push(first);
                while batch.len() < self.max_batch {
                    match self.rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                if self.commit_batch(&mut batch) {
                    break;
                }
            }
            if self.purge_pending {
                self.purge_step();
            }
        }
        self.shared.hub.close();
        debug!(revision = self.revision, "store committer stopped");
    }

    /// Applies and commits one batch; returns whether a shutdown was requested.
    fn commit_batch(&mut self, batch: &mut Vec<Request>) -> bool {
        let mut shutdown = false;
        let mut pending = Pending {
            revision: self.revision,
            compacted: self.compacted,
            events: Vec::new(),
        };
        let mut outcomes: Vec<(oneshot::Sender<Result<Reply>>, Result<Reply>)> =
            Vec::with_capacity(batch.len());

        let started = std::time::Instant::now();
        let mut applied = started;
        let committed = (|| -> Result<()> {
            let mut txn = self
                .shared
                .db
                .begin_write()
                .map_err(|e| Error::backend("begin write transaction", e))?;
            txn.set_durability(Durability::Immediate)
                .map_err(|e| Error::backend("set durability", e))?;
            {
                let mut kv = txn
                    .open_table(KV)
                    .map_err(|e| Error::backend("open kv", e))?;
                let mut log = txn
                    .open_table(LOG)
                    .map_err(|e| Error::backend("open log", e))?;
                let mut meta = txn
                    .open_table(META)
                    .map_err(|e| Error::backend("open meta", e))?;
                for req in batch.drain(..) {
                    let outcome = match req.op {
                        Op::Shutdown => {
                            shutdown = true;
                            continue;
                        }
                        op => self.apply(op, &mut pending, &mut kv, &mut log, &mut meta)?,
                    };
                    outcomes.push((req.reply, outcome));
                }
                if pending.revision != self.revision {
                    meta.insert(META_REVISION, pending.revision)
                        .map_err(|e| Error::backend("write revision", e))?;
                }
            }
            applied = std::time::Instant::now();
            if pending.revision == self.revision && pending.compacted == self.compacted {
                // Nothing changed (every request failed its condition): no fsync.
                txn.abort().map_err(|e| Error::backend("abort", e))?;
            } else {
                txn.commit().map_err(|e| Error::Commit(e.into()))?;
            }
            Ok(())
        })();

        tracing::trace!(
            requests = outcomes.len(),
            apply_us = (applied - started).as_micros() as u64,
            commit_us = applied.elapsed().as_micros() as u64,
            "batch"
        );
        match committed {
            Ok(()) => {
                if pending.compacted != self.compacted {
                    self.compacted = pending.compacted;
                    self.set_purge_pending(true);
                    self.shared
                        .compacted
                        .store(self.compacted, std::sync::atomic::Ordering::Release);
                }
                if pending.revision != self.revision {
                    self.revision = pending.revision;
                    self.shared
                        .hub
                        .publish(pending.events.into(), self.revision);
                }
                for (reply, outcome) in outcomes {
                    let _ = reply.send(outcome);
                }
            }
            Err(e) => {
                warn!(error = %e, requests = outcomes.len() + batch.len(), "store write batch failed");
                // Every request gets the same cause, without repeating the step.
                let message = match &e {
                    Error::Commit(source) => error_chain(source.as_ref()),
                    other => error_chain(other),
                };
                // Requests not yet applied when the error struck are still in `batch`.
                let unapplied = batch.drain(..).map(|r| r.reply);
                for reply in outcomes.into_iter().map(|(r, _)| r).chain(unapplied) {
                    let _ = reply.send(Err(Error::Commit(message.clone().into())));
                }
            }
        }
        shutdown
    }

    /// Applies one request inside the batch transaction. The outer `Err` aborts the
    /// whole batch (a storage failure); the inner one is this request's own answer.
    fn apply(
        &mut self,
        op: Op,
        p: &mut Pending,
        kv: &mut Table<&str, &[u8]>,
        log: &mut Table<u64, &[u8]>,
        meta: &mut Table<&str, u64>,
    ) -> Result<Result<Reply>> {
        let current = |kv: &Table<&str, &[u8]>, log: &Table<u64, &[u8]>, key: &str| {
            History {
                log,
                path: &self.shared.path,
            }
            .latest(kv, key)
        };
        let conflict = |key: &str, expected: Option<Revision>, cur: &KeyValue| match expected {
            Some(e) if e != cur.mod_revision => Some(Error::Conflict {
                key: key.to_owned(),
                expected: e,
                current: Box::new(cur.clone()),
            }),
            _ => None,
        };
        match op {
            Op::Create { key, value } => {
                if kv
                    .get(key.as_str())
                    .map_err(|e| Error::backend("read key", e))?
                    .is_some()
                {
                    return Ok(Err(Error::AlreadyExists { key }));
                }
                p.revision += 1;
                let entry = Entry {
                    kind: EventKind::Put,
                    key,
                    create_revision: p.revision,
                    version: 1,
                    prev_mod: 0,
                    value,
                };
                let event = self.write(kv, log, p, entry, None)?;
                Ok(Ok(Reply::Kv(event.kv.clone())))
            }
            Op::Update {
                key,
                value,
                expected,
            } => {
                let Some(cur) = current(kv, log, &key)? else {
                    return Ok(Err(Error::NotFound { key }));
                };
                if let Some(e) = conflict(&key, expected, &cur) {
                    return Ok(Err(e));
                }
                p.revision += 1;
                let entry = Entry {
                    kind: EventKind::Put,
                    key,
                    create_revision: cur.create_revision,
                    version: cur.version + 1,
                    prev_mod: cur.mod_revision,
                    value,
                };
                let event = self.write(kv, log, p, entry, Some(cur))?;
                Ok(Ok(Reply::Kv(event.kv.clone())))
            }
            Op::Delete { key, expected } => {
                let Some(cur) = current(kv, log, &key)? else {
                    return Ok(Err(Error::NotFound { key }));
                };
                if let Some(e) = conflict(&key, expected, &cur) {
                    return Ok(Err(e));
                }
                p.revision += 1;
                let entry = Entry {
                    kind: EventKind::Delete,
                    key,
                    create_revision: 0,
                    version: 0,
                    prev_mod: cur.mod_revision,
                    value: Bytes::new(),
                };
                let deleted = Deleted {
                    revision: p.revision,
                    prev: cur.clone(),
                };
                self.write(kv, log, p, entry, Some(cur))?;
                Ok(Ok(Reply::Deleted(deleted)))
            }
            Op::Txn { ops } => {
                // Every condition first: the keys are distinct, so no write of this
                // transaction changes what a later condition reads.
                let mut currents = Vec::with_capacity(ops.len());
                for op in &ops {
                    let cur = current(kv, log, op.key())?;
                    let failed = match (op, &cur) {
                        (TxnOp::Create { key, .. }, Some(_)) => {
                            Some(Error::AlreadyExists { key: key.clone() })
                        }
                        (TxnOp::Create { .. }, None) => None,
                        (
                            TxnOp::Update { key, .. }
                            | TxnOp::Delete {
                                key,
                                expected: Some(_),
                            },
                            None,
                        ) => Some(Error::NotFound { key: key.clone() }),
                        (TxnOp::Update { key, expected, .. }, Some(cur))
                        | (TxnOp::Delete { key, expected }, Some(cur)) => {
                            conflict(key, *expected, cur)
                        }
                        (TxnOp::Delete { expected: None, .. }, None) => None,
                    };
                    if let Some(e) = failed {
                        return Ok(Err(e));
                    }
                    currents.push(cur);
                }
                let mut results = Vec::with_capacity(ops.len());
                for (op, cur) in ops.into_iter().zip(currents) {
                    let result = match op {
                        TxnOp::Create { key, value } | TxnOp::Update { key, value, .. } => {
                            p.revision += 1;
                            let entry = Entry {
                                kind: EventKind::Put,
                                key,
                                create_revision: cur
                                    .as_ref()
                                    .map_or(p.revision, |c| c.create_revision),
                                version: cur.as_ref().map_or(1, |c| c.version + 1),
                                prev_mod: cur.as_ref().map_or(0, |c| c.mod_revision),
                                value,
                            };
                            let event = self.write(kv, log, p, entry, cur)?;
                            TxnResult::Put(event.kv.clone())
                        }
                        TxnOp::Delete { key, .. } => match cur {
                            None => TxnResult::Deleted(None),
                            Some(cur) => {
                                p.revision += 1;
                                let entry = Entry {
                                    kind: EventKind::Delete,
                                    key,
                                    create_revision: 0,
                                    version: 0,
                                    prev_mod: cur.mod_revision,
                                    value: Bytes::new(),
                                };
                                let deleted = Deleted {
                                    revision: p.revision,
                                    prev: cur.clone(),
                                };
                                self.write(kv, log, p, entry, Some(cur))?;
                                TxnResult::Deleted(Some(deleted))
                            }
                        },
                    };
                    results.push(result);
                }
                Ok(Ok(Reply::Txn(results)))
            }
            Op::Compact { revision } => {
                if revision <= p.compacted {
                    return Ok(Err(Error::Compacted {
                        requested: revision,
                        compacted: Some(p.compacted),
                    }));
                }
                if revision > p.revision {
                    return Ok(Err(Error::FutureRevision {
                        requested: revision,
                        current: p.revision,
                    }));
                }
                p.compacted = revision;
                meta.insert(META_COMPACTED, revision)
                    .map_err(|e| Error::backend("write compacted revision", e))?;
                Ok(Ok(Reply::Done))
            }
            Op::Shutdown => Ok(Ok(Reply::Done)),
        }
    }

    /// Writes the entry of revision `p.revision` and points the key at it; returns the
    /// event, kept for the watchers.
    fn write<'p>(
        &mut self,
        kv: &mut Table<&str, &[u8]>,
        log: &mut Table<u64, &[u8]>,
        p: &'p mut Pending,
        entry: Entry,
        prev: Option<KeyValue>,
    ) -> Result<&'p Event> {
        let revision = p.revision;
        match entry.kind {
            EventKind::Put => {
                let meta = KeyMeta {
                    create_revision: entry.create_revision,
                    mod_revision: revision,
                    version: entry.version,
                };
                kv.insert(entry.key.as_str(), codec::encode_meta(&meta).as_slice())
                    .map_err(|e| Error::backend("write key", e))?;
            }
            EventKind::Delete => {
                kv.remove(entry.key.as_str())
                    .map_err(|e| Error::backend("remove key", e))?;
            }
        }
        codec::encode_entry(&mut self.buf, &entry);
        log.insert(revision, self.buf.as_slice())
            .map_err(|e| Error::backend("write history", e))?;
        let kind = entry.kind;
        p.events.push(Event {
            kind,
            kv: entry.into_kv(revision),
            prev,
        });
        Ok(p.events
            .last()
            .unwrap_or_else(|| unreachable!("an event was just pushed")))
    }

    /// Examines up to `purge_chunk` log entries from the purge cursor towards the
    /// compacted revision and drops what no read can reach any more: a delete entry,
    /// and the previous entry of any entry below the compacted revision. What stays
    /// below it is the newest entry of each key, as etcd keeps it.
    ///
    /// Not fsynced: a crash at worst brings back entries that are already unreadable
    /// and a cursor that is behind; the purge redoes that part after reopening.
    fn purge_step(&mut self) {
        let result = (|| -> Result<(usize, Revision)> {
            let mut txn = self
                .shared
                .db
                .begin_write()
                .map_err(|e| Error::backend("begin purge", e))?;
            txn.set_durability(Durability::None)
                .map_err(|e| Error::backend("set durability", e))?;
            let (examined, cursor) = {
                let mut log = txn
                    .open_table(LOG)
                    .map_err(|e| Error::backend("open log", e))?;
                let mut meta = txn
                    .open_table(META)
                    .map_err(|e| Error::backend("open meta", e))?;
                let mut doomed = Vec::new();
                let mut examined = 0;
                let mut cursor = self.compacted;
                for item in log
                    .range(self.purged_to..self.compacted)
                    .map_err(|e| Error::backend("scan history", e))?
                    .take(self.purge_chunk)
                {
                    let (rev, bytes) = item.map_err(|e| Error::backend("scan history", e))?;
                    let entry = codec::decode_entry(rev.value(), bytes.value())
                        .map_err(|d| self.shared.corrupt(d))?;
                    examined += 1;
                    cursor = rev.value() + 1;
                    // This entry superseded its previous one before the compacted revision.
                    if entry.prev_mod > 0 {
                        doomed.push(entry.prev_mod);
                    }
                    if entry.kind == EventKind::Delete {
                        doomed.push(rev.value());
                    }
                }
                if examined < self.purge_chunk {
                    cursor = self.compacted;
                }
                for rev in doomed {
                    log.remove(rev)
                        .map_err(|e| Error::backend("purge history", e))?;
                }
                meta.insert(META_PURGED_TO, cursor)
                    .map_err(|e| Error::backend("write purge cursor", e))?;
                (examined, cursor)
            };
            txn.commit().map_err(|e| Error::Commit(e.into()))?;
            Ok((examined, cursor))
        })();
        match result {
            Ok((examined, cursor)) => {
                self.purged_to = cursor;
                if cursor >= self.compacted {
                    self.set_purge_pending(false);
                    debug!(
                        compacted = self.compacted,
                        examined, "history purge finished"
                    );
                }
            }
            Err(e) => {
                // Retried at the next compaction or reopen; reads below `compacted` already
                // fail, so leftover entries are only space.
                warn!(error = %error_chain(&e), "history purge step failed");
                self.set_purge_pending(false);
            }
        }
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
