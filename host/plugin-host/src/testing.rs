//! What the crate's own tests share: hosts for tests, and the components
//! `plugins/build.sh` builds.

use std::path::PathBuf;
use std::sync::Arc;

use crate::{Compilers, HostConfig, PluginHost};

/// A host that compiles with Winch only (a fraction of Cranelift's time) and keeps no
/// cache.
pub(crate) fn host(config: HostConfig) -> Arc<PluginHost> {
    PluginHost::new(HostConfig {
        compilers: Compilers::Baseline,
        max_instances: 16,
        ..config
    })
    .unwrap()
}

/// `plugins/target/dist/NAME.wasm`, as `plugins/build.sh` leaves it (`NAME` may be
/// `plugin-0.1.0/pod-policy`).
pub(crate) fn built(name: &str) -> Arc<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../plugins/target/dist")
        .join(format!("{name}.wasm"));
    match std::fs::read(&path) {
        Ok(bytes) => Arc::new(bytes),
        Err(e) => panic!(
            "{}: {e}; build the plugins first with `make plugins` (plugins/build.sh)",
            path.display()
        ),
    }
}
