//! [`LocalCluster`]: an API server started in this process for a benchmark, on an
//! embedded store in a temporary directory, which the benchmarks that need a cluster
//! but do not measure its start share.

use std::sync::Arc;

use anyhow::Context as _;
use trellis_store::{RedbConfig, RedbStore};

/// A server started in this process on an embedded store in a temporary directory.
#[derive(Debug)]
pub(crate) struct LocalCluster {
    pub(crate) server: trellis_apiserver::Server,
    redb: Arc<RedbStore>,
    /// The data directory. Dropped last: the store and the server's credentials live in
    /// it.
    pub(crate) dir: tempfile::TempDir,
}

impl LocalCluster {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        Self::start_with(|_| Ok(())).await
    }

    /// Starts a server whose configuration `configure` may change first.
    pub(crate) async fn start_with(
        configure: impl FnOnce(&mut trellis_apiserver::Config) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("trellis-bench-")
            .tempdir()
            .context("create a temporary data directory")?;
        let path = dir.path().join("store.redb");
        let redb = Arc::new(
            RedbStore::open(RedbConfig::new(&path))
                .with_context(|| format!("open the redb store {}", path.display()))?,
        );
        let mut config = trellis_apiserver::Config {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            ..trellis_apiserver::Config::new(dir.path())
        };
        configure(&mut config)?;
        // Stopped through `Server::stop`, never by this signal.
        let started =
            trellis_apiserver::start(config, redb.clone(), std::future::pending::<()>()).await;
        let server = match started {
            Ok(server) => server,
            Err(e) => {
                if let Err(close) = redb.close().await {
                    tracing::warn!(error = %format!("{close:#}"), "failed to close the redb store");
                }
                return Err(e.context("start the API server"));
            }
        };
        tracing::info!(url = %server.url, "started an API server in this process");
        Ok(Self { server, redb, dir })
    }

    /// Stops the server, then closes the store under it.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        let stopped = self.server.stop().await.context("stop the API server");
        self.redb.close().await.context("close the redb store")?;
        stopped
    }
}
