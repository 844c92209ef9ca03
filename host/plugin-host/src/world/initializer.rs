//! The `initializer` world: plugins that initialize an object after its create is
//! stored.
//!
//! Served in two versions, `trellis:initializer@0.1.0` and the frozen
//! `trellis:plugin@0.1.0`, as [`super::admission`] is.

use wasmtime::Store;

use super::{Call, handler_world};
use crate::InitializeRequest;
use crate::bindings::{initializer, plugin_0_1};
use crate::state::PluginState;

handler_world! {
    /// Plugins that initialize an object after its create is stored.
    Initializer = "initializer",
    versions: [
        V0_1: initializer::InitializerPre<PluginState>, initializer::Initializer,
            trellis_initializer_handler ("trellis:initializer/handler@0.1.0"),
        Plugin0_1: plugin_0_1::initializer::InitializerPre<PluginState>,
            plugin_0_1::initializer::Initializer,
            trellis_plugin_initializer_handler ("trellis:plugin/initializer-handler@0.1.0"),
    ],
}

/// `initialize`: `Ok(object)`, or `Err(reason)` when the plugin refuses.
pub(crate) struct Initialize(pub(crate) InitializeRequest);

impl Call<Initializer> for Initialize {
    type Output = Result<String, String>;

    async fn call<'a>(
        self,
        exports: &'a Exports,
        store: &'a mut Store<PluginState>,
    ) -> wasmtime::Result<Result<String, String>> {
        match exports {
            Exports::V0_1(e) => {
                e.trellis_initializer_handler()
                    .call_initialize(store, &self.0)
                    .await
            }
            Exports::Plugin0_1(e) => {
                // Same shapes as today's records, as for `admit`.
                let initialize = e
                    .trellis_plugin_initializer_handler()
                    .func_initialize()
                    .func()
                    .typed::<(&InitializeRequest,), (Result<String, String>,)>(&*store)?;
                let (answer,) = initialize.call_async(&mut *store, (&self.0,)).await?;
                Ok(answer)
            }
        }
    }
}
