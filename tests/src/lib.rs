//! Helpers shared by the cross-crate tests in `all/`: stores on both backends, started
//! the way a user would start them (a real redb file, a real etcd process).

use std::sync::Arc;

use trellis_store::local_etcd::LocalEtcd;
use trellis_store::{EtcdStore, RedbConfig, RedbStore, Store};

/// Settings the conformance suite varies on both backends alike.
#[derive(Clone, Debug)]
pub struct StoreSettings {
    pub watch_buffer: usize,
    pub max_value_size: usize,
}

impl Default for StoreSettings {
    fn default() -> Self {
        Self {
            watch_buffer: 1024,
            max_value_size: trellis_store::DEFAULT_MAX_VALUE_SIZE,
        }
    }
}

/// A store and whatever keeps it alive (its directory or its etcd process).
#[allow(missing_debug_implementations)]
pub struct TestStore {
    pub store: Arc<dyn Store>,
    _redb_dir: Option<tempfile::TempDir>,
    _etcd: Option<LocalEtcd>,
}

impl TestStore {
    /// An embedded store in a fresh temporary directory.
    pub fn redb(settings: StoreSettings) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut config = RedbConfig::new(dir.path().join("store.redb"));
        config.watch_buffer = settings.watch_buffer;
        config.max_value_size = settings.max_value_size;
        let store = RedbStore::open(config)?;
        Ok(Self {
            store: Arc::new(store),
            _redb_dir: Some(dir),
            _etcd: None,
        })
    }

    /// An etcd store on a fresh etcd process of its own.
    pub async fn etcd(settings: StoreSettings) -> anyhow::Result<Self> {
        let etcd = LocalEtcd::start().await?;
        let mut config = etcd.config();
        config.watch_buffer = settings.watch_buffer;
        config.max_value_size = settings.max_value_size;
        let store = EtcdStore::connect(config).await?;
        Ok(Self {
            store: Arc::new(store),
            _redb_dir: None,
            _etcd: Some(etcd),
        })
    }
}
