//! `trellis`: the Trellis control plane, node agent and command-line client in one
//! binary.
//!
//! For now it carries the benchmarks of the store backends, the figures that decide
//! which backend a deployment picks:
//!
//! - `trellis bench store`: durable write throughput and latency of concurrent writers.
//! - `trellis bench watch`: how long a committed write takes to reach every watcher.
//! - `trellis version`: the version of this binary.
//!
//! # Layout
//! - [`bench`]: the benchmarks, one module per benchmark, and what they share
//!   (opening a backend, percentiles, bounded store calls).
//!
//! Logs go to stderr (`RUST_LOG` filters them), so stdout holds only the results:
//! with `--json`, exactly one JSON object a script can parse.

mod bench;

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
    /// Measure the store backends.
    Bench(bench::BenchArgs),
    /// Print the version of this binary.
    Version,
}

fn main() -> ExitCode {
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
        Command::Bench(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("start the tokio runtime")?;
            runtime.block_on(bench::run(args))
        }
    }
}
