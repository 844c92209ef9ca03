//! What each instance's store holds: WASI with nothing granted, the memory cap, the
//! plugin's name and cluster reader, and the current call's deadline.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::grants::{ClusterReader, ControllerHost};

pub struct PluginState {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    pub(crate) limits: Limiter,
    pub(crate) plugin: Arc<str>,
    pub(crate) cluster: Option<Arc<dyn ClusterReader>>,
    /// What a controller plugin reads, writes and records through.
    pub(crate) controller: Option<Arc<dyn ControllerHost>>,
    /// When the current call must stop.
    pub(crate) deadline: Instant,
}

impl std::fmt::Debug for PluginState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginState")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// The plugin's memory cap, remembering whether it was hit and how far memory grew.
pub(crate) struct Limiter {
    pub(crate) inner: StoreLimits,
    pub(crate) peak: usize,
    pub(crate) denied: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.inner.memory_growing(current, desired, maximum)?;
        if allowed {
            self.peak = self.peak.max(desired);
        } else {
            self.denied = true;
        }
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}
