//! `trellis`: the Trellis control plane, node agent, container runtime and
//! command-line client in one binary.
//!
//! - `trellis up`: the whole cluster in one process on the embedded store (redb, or
//!   etcd with `--store`): the API server, the controllers, the scheduler and a local
//!   node (and `--hollow-nodes N` simulated ones).
//! - `trellis server`: the API server on its store, alone.
//! - `trellis controllers|scheduler --kubeconfig FILE`: the controller manager and the
//!   scheduler against any API server, leader-elected.
//! - `trellis node`: a node (the agent and its runtime) joined to a cluster, by a
//!   kubeconfig or by a bootstrap token (`--server`, `--token`,
//!   `--discovery-token-ca-cert-hash`); `--hollow N` runs N simulated nodes instead.
//! - `trellis runtime`: the container runtime alone, serving CRI on a Unix socket.
//! - `trellis token create|list|delete`: the bootstrap tokens nodes join with.
//! - `trellis metrics-server --kubeconfig FILE`: the resource metrics API
//!   (`metrics.k8s.io`, `kubectl top`) of a cluster, as metrics-server.
//! - `trellis plugin run|bench|list|describe|install|uninstall`: plugins offline, and
//!   Plugin objects in a cluster.
//! - `trellis bench store|watch|compaction|api|admission|plugin-reload|informer|
//!   controller|controllers|scheduler|pod-start|up|flow`: the figures of
//!   `docs/benchmarks.md`.
//! - `trellis version`: the version of this binary.
//!
//! # Layout
//! - [`up`]: `trellis up` and `trellis server`, and how they shut down (Ctrl-C or
//!   SIGTERM).
//! - [`components`]: `trellis controllers|scheduler`, and the same components in `up`
//!   (with [`plugin_controllers`], [`scheduler`] and [`flags`], in the package's
//!   library, `src/lib.rs`).
//! - [`node`]: `trellis node`, `trellis runtime` and the local node of `up`;
//!   [`hollow`]: hollow nodes (`trellis node --hollow N`, `trellis up --hollow-nodes N`).
//! - [`token`]: `trellis token`, bootstrap tokens; [`join`]: a node joining with one
//!   (TLS bootstrap) and rotating its certificate.
//! - [`plugin`]: `trellis plugin`.
//! - [`rest`]: the bare HTTPS client of the API server that `plugin` and the
//!   benchmarks use.
//! - [`bench`]: the benchmarks, one module per benchmark, and what they share
//!   (opening a backend, a server in this process, percentiles, bounded store calls).
//!
//! Logs go to stderr (`RUST_LOG` filters them), so stdout holds only the results:
//! with `--json`, exactly one JSON object a script can parse.

mod bench;
mod hollow;
mod join;
mod node;
mod plugin;
mod rest;
mod token;
mod up;

// The components, from this package's library (`src/lib.rs`), which the end-to-end
// tests run too.
use trellis::{components, flags, metrics_server, plugin_controllers, plugins, scheduler, setup};

/// mimalloc rather than the system's malloc: see `mimalloc` in the workspace manifest.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(name = "trellis", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the control plane on its embedded default.
    Up(up::UpArgs),
    /// Start the API server (with its store).
    Server(up::UpArgs),
    /// Run the controllers against an API server (leader-elected).
    Controllers(components::ControllerArgs),
    /// Run the scheduler against an API server (leader-elected).
    Scheduler(scheduler::SchedulerArgs),
    /// Run a node: its agent and container runtime, joined to a cluster.
    Node(node::NodeArgs),
    /// Create, list and delete bootstrap tokens that join nodes.
    Token(token::TokenArgs),
    /// Serve the container runtime alone over CRI.
    Runtime(node::RuntimeArgs),
    /// Measure the store backends, the API server and plugins in it.
    Bench(bench::BenchArgs),
    /// Run plugins offline; manage Plugin objects.
    Plugin(plugin::PluginArgs),
    /// Serve the resource metrics API (`metrics.k8s.io`) of a cluster's nodes.
    MetricsServer(metrics_server::MetricsServerArgs),
    /// Print the version of this binary.
    Version,
}

fn main() -> ExitCode {
    // `trellis __init …`: the init of a sandboxed container, which must be a
    // single-threaded process (nothing started yet: no tracing, no runtime).
    if let Some(code) = trellis_runtime::sandbox::dispatch() {
        std::process::exit(code);
    }
    init_tracing();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Every top-level context is a verb phrase, so this reads as a sentence.
            eprintln!("error: failed to {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    // Warnings from every crate, progress from ours; RUST_LOG overrides both.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,trellis=info,trellis_store=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => {
            println!("trellis {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Bench(args) => runtime()?.block_on(bench::run(args)),
        Command::Plugin(args) => runtime()?.block_on(plugin::run(args)),
        Command::MetricsServer(args) => {
            runtime()?.block_on(metrics_server::run(args, shutdown_signal()))
        }
        Command::Up(args) => runtime()?.block_on(up::run(args, true, shutdown_signal())),
        Command::Server(args) => runtime()?.block_on(up::run(args, false, shutdown_signal())),
        Command::Controllers(args) => {
            runtime()?.block_on(components::run_controllers(args, shutdown_signal()))
        }
        Command::Scheduler(args) => {
            runtime()?.block_on(scheduler::run_scheduler(args, shutdown_signal()))
        }
        Command::Node(args) => runtime()?.block_on(node::run_node(args, shutdown_signal())),
        Command::Runtime(args) => runtime()?.block_on(node::run_runtime(args, shutdown_signal())),
        Command::Token(args) => runtime()?.block_on(token::run(args)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the tokio runtime")
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; stop with Ctrl-C");
            let _ = ctrl_c.await;
        }
    }
}
