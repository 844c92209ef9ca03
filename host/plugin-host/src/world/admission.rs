//! The `admission` world: mutating and validating plugins.
//!
//! Served in two versions: `trellis:admission@0.1.0` and the frozen
//! `trellis:plugin@0.1.0`. Their records have the same shapes, so a request is
//! today's Rust type either way; a call into an old component lowers it under the
//! old export's name.

use wasmtime::Store;

use super::{Call, handler_world};
use crate::bindings::{admission, plugin_0_1};
use crate::state::PluginState;
use crate::{AdmissionRequest, AdmissionResponse};

handler_world! {
    /// Mutating and validating plugins.
    Admission = "admission",
    versions: [
        V0_1: admission::AdmissionPre<PluginState>, admission::Admission,
            trellis_admission_handler ("trellis:admission/handler@0.1.0"),
        Plugin0_1: plugin_0_1::admission::AdmissionPre<PluginState>, plugin_0_1::admission::Admission,
            trellis_plugin_admission_handler ("trellis:plugin/admission-handler@0.1.0"),
    ],
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
