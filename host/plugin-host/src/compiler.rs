//! The compilers: an [`Engine`] per [`Tier`] with a linker per world, and the disk
//! cache of optimized code, named by content digest and engine.

use std::any::TypeId;
use std::collections::HashMap;
use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use trellis_oci::write_whole;

use crate::error::{LoadError, LoadErrorReason, first_line};
use crate::state::PluginState;
use crate::world::World;

/// The compiler that produced the code a plugin runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Winch's code: compiled fast, runs slower.
    Baseline,
    /// Cranelift's code, as cached on disk.
    Optimized,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Baseline => "baseline",
            Self::Optimized => "optimized",
        }
    }
}
/// An engine and the linkers that bind components compiled by it.
pub(crate) struct Compiler {
    pub(crate) engine: Engine,
    /// One linker per world, made on its first load: WASI with nothing granted, the
    /// shared imports, and the world's own, so a plugin can link only its world's.
    linkers: Mutex<HashMap<TypeId, Arc<Linker<PluginState>>>>,
    pub(crate) tier: Tier,
}

impl Compiler {
    pub(crate) fn new(wasm: &Config, tier: Tier) -> anyhow::Result<Self> {
        let engine = Engine::new(wasm).map_err(|e| anyhow::anyhow!("wasm engine: {e}"))?;
        Ok(Self {
            engine,
            linkers: Mutex::default(),
            tier,
        })
    }

    /// The linker of world `W`.
    pub(crate) fn linker<W: World>(&self) -> wasmtime::Result<Arc<Linker<PluginState>>> {
        let mut linkers = self.linkers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(linker) = linkers.get(&TypeId::of::<W>()) {
            return Ok(linker.clone());
        }
        let mut linker = Linker::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        crate::imports::add_to_linker(&mut linker)?;
        W::add_to_linker(&mut linker)?;
        let linker = Arc::new(linker);
        linkers.insert(TypeId::of::<W>(), linker.clone());
        Ok(linker)
    }
}
pub(crate) fn compile_error(e: wasmtime::Error) -> LoadError {
    LoadError {
        reason: LoadErrorReason::CompileFailed,
        message: format!("not a valid component: {}", first_line(&format!("{e:#}"))),
    }
}
/// `engine`'s code from the cache file at `path`, if it is there and sound (a bad one
/// is logged, to be compiled again).
pub(crate) fn cached(engine: &Engine, path: &Path) -> Option<Component> {
    if !path.exists() {
        return None;
    }
    match deserialize_cached(engine, path) {
        Ok(component) => Some(component),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "recompiling a bad cached component");
            None
        }
    }
}

/// `engine`'s code for the component `wasm`: from the cache file at `path` when there
/// (another load of the same module may have compiled it meanwhile), else compiled and
/// written there.
pub(crate) fn cached_or_compiled(
    engine: &Engine,
    wasm: &[u8],
    path: &Path,
) -> wasmtime::Result<Component> {
    if let Some(component) = cached(engine, path) {
        return Ok(component);
    }
    let compiled = engine.precompile_component(wasm)?;
    match write_whole(path, &compiled) {
        Ok(()) => deserialize_cached(engine, path),
        Err(e) => {
            // The cache only saves time: a full or read-only disk must not stop a load.
            tracing::warn!(path = %path.display(), error = %e, "cannot cache a compiled component");
            Component::new(engine, wasm)
        }
    }
}

#[allow(unsafe_code)]
fn deserialize_cached(engine: &Engine, path: &std::path::Path) -> wasmtime::Result<Component> {
    // SAFETY: `deserialize_file` trusts the file to be wasmtime's own output for this
    // engine. The cache directory lies inside the server's data directory, which only
    // the server writes; files are written whole under a temporary name and renamed,
    // and their names carry the engine's compatibility hash, so a file from another
    // wasmtime build or configuration is never opened.
    unsafe { Component::deserialize_file(engine, path) }
}

/// Where `engine`'s code of the module `digest` names is cached in `dir`.
pub(crate) fn cache_file(engine: &Engine, dir: &Path, digest: &str) -> PathBuf {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let hex = digest.trim_start_matches("sha256:");
    dir.join(format!("{hex}-{:016x}.cwasm", hasher.finish()))
}
