//! The scheduler component's command: `trellis scheduler`, the framework's settings
//! and the component runtime it runs in ([`crate::components`]); its work while it
//! leads is [`crate::scheduling`].

use std::path::PathBuf;

use clap::Args;
use trellis_plugin_host::{HostConfig, PluginHost};

use crate::components::{Component, ComponentArgs, run_remote};
use crate::setup::{SchedulerFlags, SchedulerSetup};

/// `trellis scheduler`: the component's flags and the framework's settings.
#[derive(Debug, Args)]
pub struct SchedulerArgs {
    #[command(flatten)]
    pub component: ComponentArgs,

    #[command(flatten)]
    pub settings: SchedulerFlags,

    /// Where compiled plugins are kept between runs (none: compiled at each start).
    #[arg(long, value_name = "DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
}

/// `trellis scheduler --kubeconfig FILE`.
pub async fn run_scheduler(
    args: SchedulerArgs,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let plugins = PluginHost::new(HostConfig {
        cache_dir: args.plugin_cache_dir.clone(),
        ..HostConfig::default()
    })?;
    let setup = SchedulerSetup {
        plugins,
        flags: args.settings,
        metrics: Default::default(),
    };
    run_remote(
        Component::Scheduler,
        args.component,
        None,
        Some(setup),
        shutdown,
    )
    .await
}
