//! The calls into a plugin of the admission, initializer and controller worlds: each
//! takes an instance of the plugin, runs on the host's call threads within the
//! plugin's deadline, and is counted in the plugin's metrics. (A scheduler plugin is
//! called through a [`crate::SchedulerSession`] instead.)

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::bindings::admission::exports::trellis::admission::handler::{
    AdmissionRequest, AdmissionResponse,
};
use crate::bindings::controller::trellis::controller::types::{Action, ObjectKey};
use crate::bindings::initializer::exports::trellis::initializer::handler::InitializeRequest;
use crate::engine::PluginHost;
use crate::error::{PluginError, PluginErrorKind};
use crate::plugin::Plugin;
use crate::world::admission::Admit;
use crate::world::controller::Reconcile;
use crate::world::initializer::Initialize;
use crate::world::{Call, PluginKind, World};

impl Plugin {
    /// Calls `admit`. A validating plugin's patch is refused here; the caller checks
    /// and applies a mutating plugin's patch.
    pub async fn admit(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        request: &AdmissionRequest,
    ) -> Result<AdmissionResponse, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        // The call runs on the host's call threads, so it owns its request.
        let result = self.call(host, Admit(request.clone())).await;
        match &result {
            Ok(response) if self.kind() == PluginKind::Validating && response.patch.is_some() => {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
                return Err(self.error(PluginErrorKind::BadAnswer(
                    "a patch, but validating plugins may not change objects".into(),
                )));
            }
            Ok(response) if !response.allowed => {
                self.metrics.denials.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
            Err(_) => {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// Calls `initialize`: `Ok(Ok(object))`, `Ok(Err(reason))` when the plugin
    /// refuses, `Err` when it fails.
    pub async fn initialize(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        request: &InitializeRequest,
    ) -> Result<Result<String, String>, PluginError> {
        self.call_counted(host, Initialize(request.clone())).await
    }

    /// Calls `reconcile` for `key`: `Ok(Ok(action))`, `Ok(Err(reason))` when the
    /// plugin reports a failure, `Err` when it fails (trap, deadline, memory).
    pub async fn reconcile(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        key: &ObjectKey,
    ) -> Result<Result<Action, String>, PluginError> {
        let call = Reconcile {
            key: key.clone(),
            configuration: self.spec().configuration.clone(),
        };
        self.call_counted(host, call).await
    }

    /// Makes a call whose answer is `Ok(value)` or the plugin's own `Err(reason)`,
    /// counting it: a reason as a denial, a failure as an error.
    async fn call_counted<W: World, T, C: Call<W, Output = Result<T, String>>>(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        call: C,
    ) -> Result<Result<T, String>, PluginError> {
        self.metrics.calls.fetch_add(1, Ordering::Relaxed);
        let result = self.call(host, call).await;
        match &result {
            Ok(Err(_)) => {
                self.metrics.denials.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Ok(_)) => {}
            Err(_) => {
                self.metrics.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// Runs `call` in an instance of the plugin, on the host's call threads, within
    /// the plugin's deadline; the caller only awaits the answer.
    async fn call<W: World, C: Call<W>>(
        self: &Arc<Self>,
        host: &Arc<PluginHost>,
        call: C,
    ) -> Result<C::Output, PluginError> {
        if self.runner::<W>().is_none() {
            return Err(self.not_of::<W>());
        }
        let plugin = self.clone();
        let running = host.calls.run(async move {
            let Some(runner) = plugin.runner::<W>() else {
                return Err(plugin.not_of::<W>());
            };
            plugin
                .bounded(async {
                    let started = Instant::now();
                    let mut instance = runner.take(&plugin).await?;
                    let _running = Running::new(&plugin.metrics.in_flight);
                    // What waiting for an instance took counts against the deadline.
                    instance.arm(started + plugin.spec().timeout);
                    let answer = call.call(&instance.exports, &mut instance.store).await;
                    runner.finish(&plugin, instance, answer, started)
                })
                .await
        });
        match running.await {
            Ok(answer) => answer,
            Err(e) => Err(self.error(PluginErrorKind::Trapped(format!("the call stopped: {e}")))),
        }
    }
}

/// A call that holds an instance, counted in [`crate::PluginMetrics::in_flight`]
/// until it is dropped (the call returned, failed or was stopped).
struct Running<'a>(&'a std::sync::atomic::AtomicU64);

impl<'a> Running<'a> {
    fn new(count: &'a std::sync::atomic::AtomicU64) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
