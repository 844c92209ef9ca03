//! The `scheduler` world: plugins of the scheduling framework's extension points
//! (`trellis:scheduler@0.1.0`). Unlike the other worlds' calls, which may land on any
//! idle instance, a scheduler plugin keeps state between calls (its view of the
//! cluster, the pod of the cycle), so the scheduler holds one instance of its own
//! through a [`crate::SchedulerSession`].

use wasmtime::Store;
use wasmtime::component::InstancePre;

use super::World;
use crate::bindings::scheduler;
use crate::state::PluginState;

pub(crate) struct Scheduler;

pub(crate) enum Pre {
    V0_1(scheduler::SchedulerPre<PluginState>),
}

pub(crate) enum Exports {
    V0_1(scheduler::Scheduler),
}

impl Exports {
    pub(crate) fn handler(&self) -> &scheduler::exports::trellis::scheduler::handler::Guest {
        match self {
            Self::V0_1(e) => e.trellis_scheduler_handler(),
        }
    }
}

impl World for Scheduler {
    const NAME: &'static str = "scheduler";
    const EXPORTS: &'static [&'static str] = &["trellis:scheduler/handler@0.1.0"];
    type Pre = Pre;
    type Exports = Exports;

    fn pre(instance_pre: InstancePre<PluginState>) -> wasmtime::Result<Pre> {
        scheduler::SchedulerPre::new(instance_pre).map(Pre::V0_1)
    }

    async fn instantiate(pre: &Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Exports> {
        Ok(match pre {
            Pre::V0_1(pre) => Exports::V0_1(pre.instantiate_async(store).await?),
        })
    }

    /// `plugins`, which checks the configuration; what it lists is asked again by
    /// each session.
    async fn validate_configuration<'a>(
        exports: &'a Exports,
        store: &'a mut Store<PluginState>,
        configuration: &'a str,
    ) -> wasmtime::Result<Result<(), String>> {
        Ok(exports
            .handler()
            .call_plugins(store, configuration)
            .await?
            .map(|_| ()))
    }
}
