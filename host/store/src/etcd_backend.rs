//! The etcd v3 backend: the [`Store`] trait over etcd's own revisions, transactions
//! and watch. Pick it to run several control-plane processes on one shared store.
//!
//! Each conditional write is one etcd transaction: compare (absence, existence or the
//! expected modification revision), then put or delete with the previous value, else
//! read the current value so a conflict can report it. Revisions are etcd's, so a key
//! namespace (`EtcdConfig::prefix`) shares the global revision with the whole cluster.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Txn, TxnOp as TxnOp_,
    TxnOpResponse, TxnResponse, WatchOptions,
};
use futures::stream;
use tokio::sync::mpsc;
use tracing::debug;

use crate::{
    DEFAULT_MAX_VALUE_SIZE, Deleted, Error, Event, EventKind, KeyValue, ListRequest, ListResponse,
    Result, Revision, Store, TxnOp, TxnResult, WatchStream, prefix_end,
};

/// Settings of an [`EtcdStore`].
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Prepended to every key, so one etcd can hold several stores.
    pub prefix: String,
    pub max_value_size: usize,
    /// How many responses a watcher may fall behind before it is ended, as in the
    /// embedded backend.
    pub watch_buffer: usize,
    /// Deadline of each unary request.
    pub request_timeout: Duration,
}

impl EtcdConfig {
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: String::new(),
            max_value_size: DEFAULT_MAX_VALUE_SIZE,
            watch_buffer: 1024,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// The etcd backend. Cheap to share: the client multiplexes over one HTTP/2 connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    config: EtcdConfig,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn etcd_err(step: &'static str) -> impl Fn(etcd_client::Error) -> Error {
    move |e| {
        let message = e.to_string();
        if message.contains("required revision has been compacted") {
            Error::Compacted {
                requested: 0,
                compacted: None,
            }
        } else if message.contains("required revision is a future revision") {
            Error::FutureRevision {
                requested: 0,
                current: 0,
            }
        } else {
            Error::backend(step, e)
        }
    }
}

/// Fills in the requested revision that etcd's error text leaves out.
fn with_requested(e: Error, requested: Revision) -> Error {
    match e {
        Error::Compacted { compacted, .. } => Error::Compacted {
            requested,
            compacted,
        },
        Error::FutureRevision { current, .. } => Error::FutureRevision { requested, current },
        e => e,
    }
}

fn rev(r: i64) -> Revision {
    u64::try_from(r).unwrap_or(0)
}

fn signed(r: Revision) -> i64 {
    i64::try_from(r).unwrap_or(i64::MAX)
}

impl EtcdStore {
    /// Connects to etcd and checks that it answers.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        let client = tokio::time::timeout(
            config.request_timeout,
            Client::connect(&config.endpoints, Some(options)),
        )
        .await
        .map_err(|e| Error::backend("connect to etcd", e))?
        .map_err(etcd_err("connect to etcd"))?;
        let store = Self { client, config };
        store.current_revision().await?;
        Ok(store)
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.config.prefix)
    }

    fn convert_kv(&self, kv: &etcd_client::KeyValue) -> Result<KeyValue> {
        let key = std::str::from_utf8(kv.key())
            .map_err(|e| Error::backend("decode etcd key", e))?
            .strip_prefix(self.config.prefix.as_str())
            .ok_or_else(|| Error::backend("decode etcd key", "key outside the store prefix"))?
            .to_owned();
        Ok(KeyValue {
            key,
            value: Bytes::copy_from_slice(kv.value()),
            create_revision: rev(kv.create_revision()),
            mod_revision: rev(kv.mod_revision()),
            version: rev(kv.version()),
        })
    }

    async fn call<T>(
        &self,
        step: &'static str,
        f: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        tokio::time::timeout(self.config.request_timeout, f)
            .await
            .map_err(|e| Error::backend(step, e))?
            .map_err(etcd_err(step))
    }

    async fn txn(&self, step: &'static str, txn: Txn) -> Result<TxnResponse> {
        let mut kv = self.client.kv_client();
        self.call(step, kv.txn(txn)).await
    }

    fn check_write(&self, key: &str, value: &Bytes) -> Result<()> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if value.len() > self.config.max_value_size {
            return Err(Error::ValueTooLarge {
                key: key.to_owned(),
                size: value.len(),
                limit: self.config.max_value_size,
            });
        }
        Ok(())
    }

    /// The compare that guards an update or delete: the expected modification
    /// revision, or merely that the key exists.
    fn guard(&self, key: &str, expected: Option<Revision>) -> Compare {
        let full = self.full_key(key);
        match expected {
            Some(e) => Compare::mod_revision(full, CompareOp::Equal, signed(e)),
            None => Compare::create_revision(full, CompareOp::Greater, 0),
        }
    }

    /// Explains a failed guarded transaction from its `or_else` read.
    fn guard_failed(&self, key: &str, expected: Option<Revision>, resp: &TxnResponse) -> Error {
        let current = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| self.convert_kv(kv)),
            _ => None,
        });
        match (current, expected) {
            (None, _) => Error::NotFound {
                key: key.to_owned(),
            },
            (Some(Err(e)), _) => e,
            (Some(Ok(current)), Some(expected)) => Error::Conflict {
                key: key.to_owned(),
                expected,
                current: Box::new(current),
            },
            // Existence was the only condition and the key exists: etcd raced a delete
            // and a re-create between compare and read; report it as a conflict.
            (Some(Ok(current)), None) => Error::Conflict {
                key: key.to_owned(),
                expected: 0,
                current: Box::new(current),
            },
        }
    }

    fn header_revision(resp: &TxnResponse) -> Result<Revision> {
        resp.header()
            .map(|h| rev(h.revision()))
            .ok_or_else(|| Error::backend("read etcd response", "response has no header"))
    }

    fn prev_of(&self, resp: &TxnResponse) -> Result<Option<KeyValue>> {
        for op in resp.op_responses() {
            match op {
                TxnOpResponse::Put(put) => {
                    return put.prev_key().map(|kv| self.convert_kv(kv)).transpose();
                }
                TxnOpResponse::Delete(del) => {
                    return del
                        .prev_kvs()
                        .first()
                        .map(|kv| self.convert_kv(kv))
                        .transpose();
                }
                _ => {}
            }
        }
        Ok(None)
    }
}

#[async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let mut kv = self.client.kv_client();
        let resp = self
            .call("get key", kv.get(self.full_key(key), None))
            .await?;
        resp.kvs().first().map(|kv| self.convert_kv(kv)).transpose()
    }

    async fn list(&self, request: ListRequest) -> Result<ListResponse> {
        let prefix = self.full_key(&request.prefix);
        let start = match &request.start_after {
            Some(after) if after.as_str() >= request.prefix.as_str() => {
                let mut k = self.full_key(after).into_bytes();
                k.push(0);
                k
            }
            _ => prefix.clone().into_bytes(),
        };
        let mut options = GetOptions::new()
            .with_range(prefix_end(prefix.as_bytes()).unwrap_or_else(|| vec![0]))
            .with_revision(request.revision.map_or(0, signed));
        if let Some(limit) = request.limit.filter(|l| *l > 0) {
            options = options.with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        let mut kv = self.client.kv_client();
        let resp = self
            .call("list keys", kv.get(start, Some(options)))
            .await
            .map_err(|e| with_requested(e, request.revision.unwrap_or(0)))?;
        let kvs = resp
            .kvs()
            .iter()
            .map(|kv| self.convert_kv(kv))
            .collect::<Result<Vec<_>>>()?;
        let revision = match request.revision.filter(|r| *r > 0) {
            Some(r) => r,
            None => resp.header().map(|h| rev(h.revision())).unwrap_or(0),
        };
        Ok(ListResponse {
            kvs,
            revision,
            more: resp.more(),
        })
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<KeyValue> {
        self.check_write(key, &value)?;
        let full = self.full_key(key);
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp_::put(full, value.to_vec(), None)]);
        let resp = self.txn("create key", txn).await?;
        if !resp.succeeded() {
            return Err(Error::AlreadyExists {
                key: key.to_owned(),
            });
        }
        let revision = Self::header_revision(&resp)?;
        Ok(KeyValue {
            key: key.to_owned(),
            value,
            create_revision: revision,
            mod_revision: revision,
            version: 1,
        })
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: Option<Revision>,
    ) -> Result<KeyValue> {
        self.check_write(key, &value)?;
        let full = self.full_key(key);
        let txn = Txn::new()
            .when([self.guard(key, expected)])
            .and_then([TxnOp_::put(
                full.clone(),
                value.to_vec(),
                Some(etcd_client::PutOptions::new().with_prev_key()),
            )])
            .or_else([TxnOp_::get(full, None)]);
        let resp = self.txn("update key", txn).await?;
        if !resp.succeeded() {
            return Err(self.guard_failed(key, expected, &resp));
        }
        let revision = Self::header_revision(&resp)?;
        let prev = self
            .prev_of(&resp)?
            .ok_or_else(|| Error::backend("update key", "etcd returned no previous value"))?;
        Ok(KeyValue {
            key: key.to_owned(),
            value,
            create_revision: prev.create_revision,
            mod_revision: revision,
            version: prev.version + 1,
        })
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<Deleted> {
        let full = self.full_key(key);
        let txn = Txn::new()
            .when([self.guard(key, expected)])
            .and_then([TxnOp_::delete(
                full.clone(),
                Some(etcd_client::DeleteOptions::new().with_prev_key()),
            )])
            .or_else([TxnOp_::get(full, None)]);
        let resp = self.txn("delete key", txn).await?;
        if !resp.succeeded() {
            return Err(self.guard_failed(key, expected, &resp));
        }
        let revision = Self::header_revision(&resp)?;
        let prev = self
            .prev_of(&resp)?
            .ok_or_else(|| Error::backend("delete key", "etcd returned no previous value"))?;
        Ok(Deleted { revision, prev })
    }

    async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>> {
        crate::check_txn(&ops, self.config.max_value_size)?;
        let mut compares = Vec::new();
        let mut writes = Vec::with_capacity(ops.len());
        for op in &ops {
            let full = self.full_key(op.key());
            match op {
                TxnOp::Create { value, .. } => {
                    compares.push(Compare::create_revision(full.clone(), CompareOp::Equal, 0));
                    writes.push(TxnOp_::put(full, value.to_vec(), None));
                }
                TxnOp::Update {
                    key,
                    value,
                    expected,
                } => {
                    compares.push(self.guard(key, *expected));
                    writes.push(TxnOp_::put(
                        full,
                        value.to_vec(),
                        Some(etcd_client::PutOptions::new().with_prev_key()),
                    ));
                }
                TxnOp::Delete { key, expected } => {
                    if expected.is_some() {
                        compares.push(self.guard(key, *expected));
                    }
                    writes.push(TxnOp_::delete(
                        full,
                        Some(etcd_client::DeleteOptions::new().with_prev_key()),
                    ));
                }
            }
        }
        // On failure, every key read back, to name the condition that failed.
        let reads: Vec<TxnOp_> = ops
            .iter()
            .map(|op| TxnOp_::get(self.full_key(op.key()), None))
            .collect();
        let txn = Txn::new().when(compares).and_then(writes).or_else(reads);
        let resp = self.txn("apply transaction", txn).await?;
        let responses = resp.op_responses();
        if !resp.succeeded() {
            for (op, read) in ops.iter().zip(responses) {
                let TxnOpResponse::Get(get) = read else {
                    continue;
                };
                let current = get
                    .kvs()
                    .first()
                    .map(|kv| self.convert_kv(kv))
                    .transpose()?;
                let key = op.key().to_owned();
                let failed = match (op, current) {
                    (TxnOp::Create { .. }, Some(_)) => Some(Error::AlreadyExists { key }),
                    (TxnOp::Create { .. }, None) => None,
                    (TxnOp::Delete { expected: None, .. }, _) => None,
                    (TxnOp::Update { .. } | TxnOp::Delete { .. }, None) => {
                        Some(Error::NotFound { key })
                    }
                    (
                        TxnOp::Update { expected, .. } | TxnOp::Delete { expected, .. },
                        Some(current),
                    ) => match expected {
                        Some(e) if *e != current.mod_revision => Some(Error::Conflict {
                            key,
                            expected: *e,
                            current: Box::new(current),
                        }),
                        _ => None,
                    },
                };
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            // Raced between the compare and the reads: a conflict on the first key.
            return Err(Error::backend(
                "apply transaction",
                "a condition failed and then held again; retry",
            ));
        }
        let revision = Self::header_revision(&resp)?;
        let mut results = Vec::with_capacity(ops.len());
        for (op, written) in ops.into_iter().zip(responses) {
            results.push(match (op, written) {
                (TxnOp::Create { key, value }, _) => TxnResult::Put(KeyValue {
                    key,
                    value,
                    create_revision: revision,
                    mod_revision: revision,
                    version: 1,
                }),
                (TxnOp::Update { key, value, .. }, TxnOpResponse::Put(put)) => {
                    let prev = put
                        .prev_key()
                        .map(|kv| self.convert_kv(kv))
                        .transpose()?
                        .ok_or_else(|| {
                            Error::backend("apply transaction", "etcd returned no previous value")
                        })?;
                    TxnResult::Put(KeyValue {
                        key,
                        value,
                        create_revision: prev.create_revision,
                        mod_revision: revision,
                        version: prev.version + 1,
                    })
                }
                (TxnOp::Delete { .. }, TxnOpResponse::Delete(del)) => TxnResult::Deleted(
                    del.prev_kvs()
                        .first()
                        .map(|kv| self.convert_kv(kv))
                        .transpose()?
                        .map(|prev| Deleted { revision, prev }),
                ),
                _ => {
                    return Err(Error::backend(
                        "apply transaction",
                        "etcd's responses do not match the operations",
                    ));
                }
            });
        }
        Ok(results)
    }

    async fn watch(&self, prefix: &str, start: Revision) -> Result<WatchStream> {
        let full = self.full_key(prefix);
        if start > 0 {
            // Refuse a compacted start here, as the embedded backend does, rather than
            // as the first item of the stream.
            let mut kv = self.client.kv_client();
            let probe = GetOptions::new()
                .with_revision(signed(start))
                .with_count_only();
            match self
                .call("check watch start", kv.get(full.clone(), Some(probe)))
                .await
            {
                Err(Error::Compacted { compacted, .. }) => {
                    return Err(Error::Compacted {
                        requested: start,
                        compacted,
                    });
                }
                Ok(_) | Err(Error::FutureRevision { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let mut options = WatchOptions::new().with_prev_key();
        options = match prefix_end(full.as_bytes()) {
            Some(end) => options.with_range(end),
            None => options.with_range(vec![0]),
        };
        if start > 0 {
            options = options.with_start_revision(signed(start));
        }
        let mut client = self.client.watch_client();
        let mut watch = self
            .call("start watch", client.watch(full, Some(options)))
            .await?;

        let (tx, rx) = mpsc::channel::<Result<Vec<Event>>>(self.config.watch_buffer.max(1));
        let store = self.clone();
        tokio::spawn(async move {
            let mut next = start;
            // The watch stream lives as long as this task; dropping it cancels the watch.
            loop {
                let resp = tokio::select! {
                    resp = watch.message() => resp,
                    () = tx.closed() => return,
                };
                let resp = match resp {
                    Ok(Some(resp)) => resp,
                    Ok(None) => return,
                    Err(e) => {
                        let _ = tx.try_send(Err(Error::backend("receive watch response", e)));
                        return;
                    }
                };
                if resp.compact_revision() > 0 {
                    let _ = tx.try_send(Err(Error::Compacted {
                        requested: next,
                        compacted: Some(rev(resp.compact_revision())),
                    }));
                    return;
                }
                if resp.canceled() {
                    let reason = resp.cancel_reason().to_owned();
                    let _ = tx.try_send(Err(Error::backend("watch canceled by etcd", reason)));
                    return;
                }
                let events = match resp
                    .events()
                    .iter()
                    .map(|e| store.convert_event(e))
                    .collect::<Result<Vec<_>>>()
                {
                    Ok(events) => events,
                    Err(e) => {
                        let _ = tx.try_send(Err(e));
                        return;
                    }
                };
                let Some(first) = events.first().map(Event::revision) else {
                    continue;
                };
                let last = events.last().map_or(first, Event::revision);
                match tx.try_send(Ok(events)) {
                    Ok(()) => next = last + 1,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        debug!(resume_from = first, "etcd watcher fell behind");
                        // Delivered once the consumer drains what it already holds.
                        let _ = tx
                            .send(Err(Error::WatcherLagged { resume_from: first }))
                            .await;
                        return;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        });
        Ok(Box::pin(stream::unfold(rx, |mut rx| async move {
            let item = rx.recv().await?;
            Some((item, rx))
        })))
    }

    async fn current_revision(&self) -> Result<Revision> {
        let mut kv = self.client.kv_client();
        let options = GetOptions::new().with_count_only();
        let resp = self
            .call("read revision", kv.get(self.full_key("/"), Some(options)))
            .await?;
        resp.header()
            .map(|h| rev(h.revision()))
            .ok_or_else(|| Error::backend("read revision", "response has no header"))
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let mut kv = self.client.kv_client();
        self.call("compact", kv.compact(signed(revision), None))
            .await
            .map_err(|e| with_requested(e, revision))?;
        Ok(())
    }
}

impl EtcdStore {
    fn convert_event(&self, e: &etcd_client::Event) -> Result<Event> {
        let kv = e
            .kv()
            .ok_or_else(|| Error::backend("decode watch event", "event without key"))?;
        let mut kv = self.convert_kv(kv)?;
        let kind = match e.event_type() {
            EventType::Put => EventKind::Put,
            EventType::Delete => {
                kv.value = Bytes::new();
                EventKind::Delete
            }
        };
        let prev = e.prev_kv().map(|p| self.convert_kv(p)).transpose()?;
        Ok(Event { kind, kv, prev })
    }
}
