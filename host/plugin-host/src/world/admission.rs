//! The `admission` world: mutating and validating plugins.
//!
//! Served in two versions: `trellis:admission@0.1.0` and the frozen
//! `trellis:plugin@0.1.0`. Their records have the same shapes, so a request is
//! today's Rust type either way; a call into an old component lowers it under the
//! old export's name.

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::{Call, World};
use crate::bindings::{admission, plugin_0_1};
use crate::state::PluginState;
use crate::{AdmissionRequest, AdmissionResponse};

pub(crate) struct Admission;

pub(crate) enum Pre {
    V0_1(admission::AdmissionPre<PluginState>),
    Plugin0_1(plugin_0_1::admission::AdmissionPre<PluginState>),
}

pub(crate) enum Exports {
    V0_1(admission::Admission),
    Plugin0_1(plugin_0_1::admission::Admission),
}

impl World for Admission {
    const NAME: &'static str = "admission";
    const EXPORTS: &'static [&'static str] = &[
        "trellis:admission/handler@0.1.0",
        "trellis:plugin/admission-handler@0.1.0",
    ];
    type Pre = Pre;
    type Exports = Exports;

    fn pre(instance_pre: InstancePre<PluginState>) -> wasmtime::Result<Pre> {
        match admission::AdmissionPre::new(instance_pre.clone()) {
            Ok(pre) => Ok(Pre::V0_1(pre)),
            Err(e) => plugin_0_1::admission::AdmissionPre::new(instance_pre)
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
                e.trellis_admission_handler()
                    .call_validate_configuration(store, configuration)
                    .await
            }
            Exports::Plugin0_1(e) => {
                e.trellis_plugin_admission_handler()
                    .call_validate_configuration(store, configuration)
                    .await
            }
        }
    }
}

/// `admit`.
pub(crate) struct Admit(pub(crate) AdmissionRequest);

impl Call<Admission> for Admit {
    type Output = AdmissionResponse;

    async fn call<'a>(
        self,
        exports: &'a Exports,
        store: &'a mut Store<PluginState>,
    ) -> wasmtime::Result<AdmissionResponse> {
        match exports {
            Exports::V0_1(e) => {
                e.trellis_admission_handler()
                    .call_admit(store, &self.0)
                    .await
            }
            Exports::Plugin0_1(e) => {
                // The old export's records are the same shapes as today's: its
                // function takes today's types once checked against them.
                let admit = e
                    .trellis_plugin_admission_handler()
                    .func_admit()
                    .func()
                    .typed::<(&AdmissionRequest,), (AdmissionResponse,)>(&*store)?;
                let (response,) = admit.call_async(&mut *store, (&self.0,)).await?;
                Ok(response)
            }
        }
    }
}
