//! A `wasi:cli/run` component, run once as a program on an OS thread of its own with
//! a small executor, so a guest's work stays off the runtime's gRPC threads. In a pod
//! with a network of its own, that thread enters the pod's network first (`pod`), and
//! the program may use `wasi:sockets` there.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::watch;
use tonic::Status;
use wasmtime::{Engine, Store};
use wasmtime_wasi::I32Exit;
use wasmtime_wasi::p2::bindings::CommandPre;

use super::pod::PodNetwork;
use super::usage::{Limit, Registry, Usage};
use super::workload::{WasiConfig, Workload, memory_limit, new_store, trap_message};
use crate::log::LogFile;
use crate::record::ContainerRecord;
use crate::state::{Cancel, Exit, Live, State, Stopper};

/// Starts `record`'s program on a thread of its own, its usage in `usages`. Called
/// with the tables locked, so the thread cannot record its end before the start is
/// recorded.
pub(crate) fn start(
    engine: &Engine,
    usages: &Registry,
    state: &Arc<State>,
    record: &ContainerRecord,
    program: CommandPre<Workload>,
    log: Option<Arc<LogFile>>,
) -> Result<Live, Status> {
    let network = record
        .netns
        .as_deref()
        .map(|netns| PodNetwork::of(netns, &record.sandbox_id));
    let mut wasi = WasiConfig::of(record);
    if network.is_some() {
        wasi.grant_sockets();
    }
    let wasi = wasi.context(log.clone())?;
    let usage = Usage::new(Limit::of(record));
    usages.add(&usage);
    let memory = usage.memory.clone();
    let cancel = Arc::new(Cancel::default());
    // The store goes to the thread made below, whose CPU time is the program's.
    let store = new_store(engine, wasi, memory_limit(record), usage, cancel.clone());
    let (exited, _) = watch::channel(false);
    let id = record.id.clone();
    let state = state.clone();
    let thread_cancel = cancel.clone();
    // The thread says whether it is in the pod's network before the program runs, so
    // a failure to enter fails the start rather than the program.
    let (entered, inside) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(format!("wasm-{}", id.get(..12).unwrap_or(&id)))
        .spawn(move || {
            let ready = network.as_ref().map_or(Ok(()), PodNetwork::enter);
            let failed = ready.is_err();
            let _ = entered.send(ready);
            if failed {
                return;
            }
            let exit = run(store, program, &thread_cancel);
            state.finish(&id, exit);
        })
        .map_err(|e| Status::internal(format!("cannot start a thread: {e}")))?;
    match inside.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(Status::internal(format!(
                "container {}: cannot enter its pod's network: {e}",
                record.id
            )));
        }
        Err(_) => {
            return Err(Status::internal(format!(
                "container {}: its thread ended before it started",
                record.id
            )));
        }
    }
    Ok(Live {
        exited,
        stop: Stopper::Wasm(cancel),
        log,
        tasks: Vec::new(),
        memory: Some(memory),
    })
}

/// Runs the program to its end on this thread and says how it ended.
fn run(mut store: Store<Workload>, program: CommandPre<Workload>, cancel: &Cancel) -> Exit {
    // WASI's host side is async (Tokio): a small executor of this thread's own keeps
    // a guest's work off the runtime's gRPC threads.
    let executor = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(executor) => executor,
        Err(e) => {
            return Exit {
                code: 1,
                reason: "Error",
                message: format!("cannot start an executor: {e}"),
            };
        }
    };
    let outcome = executor.block_on(async {
        tokio::select! {
            // A guest waiting in a host call (a sleep) never reaches an epoch check.
            () = cancel.notify.notified() => None,
            result = async {
                let command = program.instantiate_async(&mut store).await?;
                command.wasi_cli_run().call_run(&mut store).await
            } => Some(result),
        }
    });
    let oom = store.data().limits.hit;
    let limit = store.data().limits.limit;
    // The output streams' tasks end with the executor: lines still buffered (a last
    // line without a newline) are written before the exit is recorded.
    drop(store);
    drop(executor);
    let stopped = || Exit {
        code: 137,
        reason: "Error",
        message: "stopped (a WebAssembly program has no signal handler: it is cancelled at once)"
            .into(),
    };
    match outcome {
        None => stopped(),
        Some(Ok(Ok(()))) => Exit::code(0),
        Some(Ok(Err(()))) => Exit::code(1),
        Some(Err(e)) => {
            if let Some(exit) = e.downcast_ref::<I32Exit>() {
                Exit::code(exit.0)
            } else if cancel.flag.load(Ordering::Relaxed) {
                stopped()
            } else if oom {
                Exit {
                    code: 137,
                    reason: "OOMKilled",
                    message: format!(
                        "linear memory would exceed the container's limit of {} bytes",
                        limit.unwrap_or_default()
                    ),
                }
            } else {
                Exit {
                    code: 1,
                    reason: "Error",
                    message: trap_message(&e),
                }
            }
        }
    }
}
