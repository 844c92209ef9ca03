//! The `initializer` world: plugins that initialize an object after its create is
//! stored.
//!
//! Served in two versions, `trellis:initializer@0.1.0` and the frozen
//! `trellis:plugin@0.1.0`, as [`super::admission`] is.

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::{Call, World};
use crate::InitializeRequest;
use crate::bindings::{initializer, plugin_0_1};
use crate::state::PluginState;

pub(crate) struct Initializer;

pub(crate) enum Pre {
    V0_1(initializer::InitializerPre<PluginState>),
    Plugin0_1(plugin_0_1::initializer::InitializerPre<PluginState>),
}

pub(crate) enum Exports {
    V0_1(initializer::Initializer),
    Plugin0_1(plugin_0_1::initializer::Initializer),
}

impl World for Initializer {
    const NAME: &'static str = "initializer";
    const EXPORTS: &'static [&'static str] = &[
        "trellis:initializer/handler@0.1.0",
        "trellis:plugin/initializer-handler@0.1.0",
    ];
    type Pre = Pre;
    type Exports = Exports;

    fn pre(instance_pre: InstancePre<PluginState>) -> wasmtime::Result<Pre> {
        match initializer::InitializerPre::new(instance_pre.clone()) {
            Ok(pre) => Ok(Pre::V0_1(pre)),
            Err(e) => plugin_0_1::initializer::InitializerPre::new(instance_pre)
                .map(Pre::Plugin0_1)
                .map_err(|_| e),
        }
    }

    async fn instantiate(pre: &Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Exports> {
        Ok(match pre {
            Pre::V0_1(pre) => Exports::V0_1(pre.instantiate_async(store).await?),
            Pre::Plugin0_1(pre) => Exports::Plugin0_1(pre.instantiate_async(store).await?),
        })
    }

    async fn validate_configuration<'a>(
        exports: &'a Exports,
        store: &'a mut Store<PluginState>,
        configuration: &'a str,
    ) -> wasmtime::Result<Result<(), String>> {
        match exports {
            Exports::V0_1(e) => {
                e.trellis_initializer_handler()
                    .call_validate_configuration(store, configuration)
                    .await
            }
            Exports::Plugin0_1(e) => {
                e.trellis_plugin_initializer_handler()
                    .call_validate_configuration(store, configuration)
                    .await
            }
        }
    }
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
