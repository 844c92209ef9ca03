//! The store as the server's requests reach it: every call timed into
//! [`StoreLatency`] for `/metrics`.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use trellis_store::{
    Deleted, KeyValue, ListRequest, ListResponse, Result, Revision, Store, TxnOp, TxnResult,
    WatchStream,
};

use crate::observability::metrics::StoreLatency;

/// A store that times every call into [`StoreLatency`] (a watch: until it is open).
#[derive(Debug)]
pub struct MeteredStore {
    inner: Arc<dyn Store>,
    latency: Arc<StoreLatency>,
}

impl MeteredStore {
    pub fn new(inner: Arc<dyn Store>, latency: Arc<StoreLatency>) -> Self {
        Self { inner, latency }
    }
}

#[async_trait]
impl Store for MeteredStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let start = Instant::now();
        let result = self.inner.get(key).await;
        self.latency.observe("get", start);
        result
    }

    async fn list(&self, request: ListRequest) -> Result<ListResponse> {
        let start = Instant::now();
        let result = self.inner.list(request).await;
        self.latency.observe("list", start);
        result
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<KeyValue> {
        let start = Instant::now();
        let result = self.inner.create(key, value).await;
        self.latency.observe("create", start);
        result
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: Option<Revision>,
    ) -> Result<KeyValue> {
        let start = Instant::now();
        let result = self.inner.update(key, value, expected).await;
        self.latency.observe("update", start);
        result
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<Deleted> {
        let start = Instant::now();
        let result = self.inner.delete(key, expected).await;
        self.latency.observe("delete", start);
        result
    }

    async fn txn(&self, ops: Vec<TxnOp>) -> Result<Vec<TxnResult>> {
        let start = Instant::now();
        let result = self.inner.txn(ops).await;
        self.latency.observe("txn", start);
        result
    }

    async fn watch(&self, prefix: &str, start_at: Revision) -> Result<WatchStream> {
        let start = Instant::now();
        let result = self.inner.watch(prefix, start_at).await;
        self.latency.observe("watch", start);
        result
    }

    async fn current_revision(&self) -> Result<Revision> {
        let start = Instant::now();
        let result = self.inner.current_revision().await;
        self.latency.observe("current_revision", start);
        result
    }

    async fn count(&self, request: ListRequest) -> Result<u64> {
        let start = Instant::now();
        let result = self.inner.count(request).await;
        self.latency.observe("count", start);
        result
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let start = Instant::now();
        let result = self.inner.compact(revision).await;
        self.latency.observe("compact", start);
        result
    }
}
