//! The `process` handler: a container is a host process in a process group of its
//! own, with only the container's environment, in its pod's network, UTS and IPC
//! namespaces. Unless it is privileged, it starts through the init (`sandbox`) in a
//! PID namespace and a root file system of its own, as the user the pod asks for
//! (nobody by default) with the container runtime's default capabilities; an exec
//! goes through the same init and takes on what the container has. A privileged
//! container is the node's process, in a mount namespace of its own where its mounts
//! and the pod's /etc files appear over the node's root (`namespaces`, `pod_files`).
//!
//! Its stdout and stderr are named pipes (FIFOs) in the container's directory that
//! the process holds open for reading and writing: output never fails for want of a
//! reader while the runtime restarts (up to a pipe's buffer; then the process waits),
//! and the next run reopens them to carry on copying into the log.

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::io::AsyncReadExt as _;
use tokio::net::unix::pipe;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::Status;

use crate::handler::{self, Handler, Prepared};
use crate::log::{Lines, LogFile, Stream};
use crate::namespaces::{self, Enter};
use crate::pod_files;
use crate::record::{ContainerRecord, ImageKind, state_name};
use crate::sandbox;
use crate::state::{Exit, Live, State, Stopper};

/// How often an adopted process (not our child: no exit notification) is checked.
const ADOPTED_POLL: Duration = Duration::from_millis(150);
/// How long output still in the pipes is copied after the process ended (a child
/// it left behind may hold them open).
const DRAIN: Duration = Duration::from_millis(500);
/// How long a SIGKILLed process may take to be gone before a stop gives up.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// A started process: its pid and /proc start time, and its live part.
#[derive(Debug)]
pub(crate) struct Started {
    pub pid: i32,
    pub start: Option<u64>,
    pub live: Live,
}

/// Starts `record`'s process. Called with the tables locked, so the task that
/// reports its exit cannot record it before the start is recorded.
pub(crate) fn start(
    state: &Arc<State>,
    record: &ContainerRecord,
    log: Option<Arc<LogFile>>,
    init: Option<&Path>,
) -> Result<Started, Status> {
    let dir = state.store().container_dir(&record.id).ok_or_else(|| {
        Status::failed_precondition("this runtime keeps no files: it cannot run a process")
    })?;
    let internal = |what: &str, e: std::io::Error| {
        Status::internal(format!("container {}: cannot {what}: {e}", record.id))
    };
    std::fs::create_dir_all(&dir).map_err(|e| internal("create its directory", e))?;
    let mut readers = Vec::new();
    let mut writers = Vec::new();
    for name in ["stdout", "stderr"] {
        let fifo = dir.join(name);
        let _ = std::fs::remove_file(&fifo);
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .map_err(|e| internal("make its output pipe", e.into()))?;
        // The read end first: opening the write end read-write never blocks, and the
        // reader must exist before the process writes.
        readers.push(
            pipe::OpenOptions::new()
                .open_receiver(&fifo)
                .map_err(|e| internal("open its output pipe", e))?,
        );
        writers.push(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&fifo)
                .map_err(|e| internal("open its output pipe", e))?,
        );
    }
    let root = state.store().root().ok_or_else(|| {
        Status::failed_precondition("this runtime keeps no files: it cannot run a process")
    })?;
    let precondition = |message: String| {
        Status::failed_precondition(format!("container {}: {message}", record.id))
    };
    let privileged = record
        .config
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .is_some_and(|s| s.privileged);
    let mut writers = writers.into_iter();
    let (Some(out), Some(err)) = (writers.next(), writers.next()) else {
        return Err(Status::internal("no output pipes"));
    };
    let mut report = None;
    let mut command = match init {
        Some(init) => {
            // Made by the container runtime before the start: the init joins it
            // before the program runs.
            let cgroup_procs =
                crate::cgroup::container(&state.cgroup_parent(&record.sandbox_id), &record.id)
                    .map(|cgroup| cgroup.procs_files())
                    .unwrap_or_default();
            let mounts = if privileged {
                Vec::new()
            } else {
                let files = pod_files::sandbox_dir(root, &record.sandbox_id);
                let files = files.exists().then_some(files);
                pod_files::binds_in(
                    &record.config.mounts,
                    files.as_deref(),
                    pod_files::Root::Own,
                )
                .map_err(precondition)?
                .into_iter()
                .map(|b| sandbox::Mount {
                    source: b.source,
                    target: b.target,
                    readonly: b.readonly,
                })
                .collect()
            };
            let spec =
                sandbox::Spec::new(record, &dir, mounts, cgroup_procs).map_err(precondition)?;
            let path = dir.join("init.json");
            spec.write(&path)
                .map_err(|e| internal("write its sandbox spec", e))?;
            let (read, write) = sandbox::report_pipe().map_err(|e| internal("make a pipe", e))?;
            report =
                Some(pipe::Receiver::from_owned_fd(read).map_err(|e| internal("make a pipe", e))?);
            let mut command = sandbox::run_command(init, &path);
            command.stdin(Stdio::from(write));
            command
        }
        None if privileged => {
            let mut argv = record
                .config
                .command
                .iter()
                .chain(&record.config.args)
                .cloned();
            let arg0 = if record.config.command.is_empty() {
                record.program.display().to_string()
            } else {
                argv.next().unwrap_or_default()
            };
            let mut command = tokio::process::Command::new(&record.program);
            command
                .arg0(arg0)
                .args(argv)
                .env_clear()
                .envs(crate::environment(&record.config)?)
                .current_dir(working_dir(record))
                .stdin(Stdio::null());
            command
        }
        None => {
            return Err(precondition(
                "this node has no init program to build a sandbox with: only a privileged container (securityContext.privileged) can run here".into(),
            ));
        }
    };
    command.stdout(out).stderr(err).process_group(0);
    let enter = enter(root, record, !privileged).map_err(precondition)?;
    // Moved into the spawn, so the runtime keeps no write end: the readers see the
    // end of the output when the process's last copy closes.
    let spawned = namespaces::spawn_in_pod(command, enter);
    drop(writers);
    let mut child = spawned.map_err(|e| {
        Status::failed_precondition(format!(
            "container {}: cannot run {}: {e}",
            record.id,
            record.program.display()
        ))
    })?;
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| {
            Status::internal(format!("container {}: its process has no pid", record.id))
        })?;
    let (exited, _) = watch::channel(false);
    let copies = copy_output(readers, &log);
    let mut tasks: Vec<_> = copies.iter().map(JoinHandle::abort_handle).collect();
    let waiter = {
        let state = state.clone();
        let id = record.id.clone();
        tokio::spawn(async move {
            // The init's word on a start that failed before the program ran.
            let mut failed = String::new();
            if let Some(mut report) = report {
                let mut bytes = Vec::new();
                let _ = report.read_to_end(&mut bytes).await;
                failed = String::from_utf8_lossy(&bytes).into_owned();
            }
            let exit = match child.wait().await {
                _ if !failed.is_empty() => Exit {
                    code: 128,
                    reason: "StartError",
                    message: failed,
                },
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => Exit::code(code),
                    (None, Some(signal)) => Exit {
                        code: 128 + signal,
                        reason: "Error",
                        message: format!("killed by signal {signal}"),
                    },
                    (None, None) => Exit::code(1),
                },
                Err(e) => Exit {
                    code: 1,
                    reason: "Error",
                    message: format!("cannot wait for the process: {e}"),
                },
            };
            drain(copies).await;
            state.finish(&id, exit);
        })
    };
    tasks.push(waiter.abort_handle());
    Ok(Started {
        pid,
        start: crate::pid::start_time(pid),
        live: Live {
            exited,
            stop: Stopper::Process { pid },
            log,
            tasks,
            memory: None,
        },
    })
}

/// Takes over a process a previous run started and left running: copies its output
/// again and watches /proc for its end, whose exit status is then lost.
pub(crate) fn adopt(state: &Arc<State>, id: &str, pid: i32, start: u64) {
    let mut tables = state.tables();
    let Some(container) = tables.containers.get_mut(id) else {
        return;
    };
    let log = container
        .record
        .log_path
        .as_deref()
        .and_then(|path| match LogFile::open(path) {
            Ok(log) => Some(log),
            Err(e) => {
                tracing::warn!(container = %id, error = %e, "cannot reopen a container log");
                None
            }
        });
    let Some(dir) = state.store().container_dir(id) else {
        return;
    };
    let readers: Vec<_> = ["stdout", "stderr"]
        .iter()
        .filter_map(|name| pipe::OpenOptions::new().open_receiver(dir.join(name)).ok())
        .collect();
    let copies = if readers.len() == 2 {
        copy_output(readers, &log)
    } else {
        tracing::warn!(container = %id, "its output pipes are gone: output is lost from now on");
        Vec::new()
    };
    let mut tasks: Vec<_> = copies.iter().map(JoinHandle::abort_handle).collect();
    let watcher = {
        let state = state.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            while crate::pid::start_time(pid) == Some(start) {
                tokio::time::sleep(ADOPTED_POLL).await;
            }
            drain(copies).await;
            state.finish(
                &id,
                Exit {
                    code: 137,
                    reason: "Error",
                    message: "exit status lost across a runtime restart".into(),
                },
            );
        })
    };
    tasks.push(watcher.abort_handle());
    container.live = Some(Live {
        exited: watch::channel(false).0,
        stop: Stopper::Process { pid },
        log,
        tasks,
        memory: None,
    });
}

/// Stops the process group `pid` leads: SIGTERM, `timeout` for it to end, then
/// SIGKILL (at once for a zero timeout); returns when it has ended.
pub(crate) async fn stop(
    pid: i32,
    timeout: Duration,
    mut exited: watch::Receiver<bool>,
) -> Result<(), Status> {
    if !timeout.is_zero() {
        signal(pid, Signal::TERM);
        if tokio::time::timeout(timeout, exited.wait_for(|e| *e))
            .await
            .is_ok()
        {
            // What the process left behind in its group goes with it.
            signal(pid, Signal::KILL);
            return Ok(());
        }
    }
    signal(pid, Signal::KILL);
    match tokio::time::timeout(KILL_WAIT, exited.wait_for(|e| *e)).await {
        Ok(_) => Ok(()),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "process {pid} has not ended {KILL_WAIT:?} after SIGKILL"
        ))),
    }
}

fn signal(pid: i32, signal: Signal) {
    let Some(pid) = Pid::from_raw(pid) else {
        return;
    };
    if let Err(e) = rustix::process::kill_process_group(pid, signal)
        && e != rustix::io::Errno::SRCH
    {
        tracing::warn!(pid = pid.as_raw_nonzero().get(), error = %e, "cannot signal a container's processes");
    }
}

/// The namespaces container `record` starts in: its pod's pinned ones under the
/// runtime's `root`; a sandboxed one (`sandboxed`) a new PID namespace, where its
/// init makes its mounts; a privileged one its mounts with the pod's /etc files over
/// the node's root.
fn enter(root: &Path, record: &ContainerRecord, sandboxed: bool) -> Result<Enter, String> {
    let pinned = |pin: PathBuf| pin.exists().then_some(pin);
    let files = pod_files::sandbox_dir(root, &record.sandbox_id);
    let files = files.exists().then_some(files);
    Ok(Enter {
        netns: record.netns.clone(),
        uts: pinned(namespaces::uts_pin(root, &record.sandbox_id)),
        ipc: pinned(namespaces::ipc_pin(root, &record.sandbox_id)),
        binds: if sandboxed {
            Vec::new()
        } else {
            pod_files::binds_in(
                &record.config.mounts,
                files.as_deref(),
                pod_files::Root::Node,
            )?
        },
        new_pid: sandboxed,
    })
}

/// Runs `cmd` in `record`'s namespaces (its process's), with its environment and
/// working directory, so that an exec sees what the container sees.
pub(crate) async fn exec_sync(
    record: &ContainerRecord,
    cmd: &[String],
    timeout: Duration,
) -> Result<k8s_cri::v1::ExecSyncResponse, Status> {
    let Some((program, args)) = cmd.split_first() else {
        return Err(Status::invalid_argument("exec needs a command"));
    };
    let pid = record.pid.ok_or_else(|| {
        Status::failed_precondition(format!("container {} has no process", record.id))
    })?;
    let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    let mut command = namespaces::container_command(
        pid,
        record.pid_start,
        program.as_ref(),
        &args,
        working_dir(record).as_os_str(),
    )
    .map_err(|e| Status::failed_precondition(format!("cannot run {program:?}: {e}")))?;
    command
        .env_clear()
        .envs(crate::environment(&record.config)?)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = command
        .spawn()
        .map_err(|e| Status::failed_precondition(format!("cannot run {program:?}: {e}")))?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok());
    let output = child.wait_with_output();
    let output = if timeout.is_zero() {
        output.await
    } else {
        match tokio::time::timeout(timeout, output).await {
            Ok(output) => output,
            Err(_) => {
                if let Some(pid) = pid {
                    signal(pid, Signal::KILL);
                }
                return Err(Status::deadline_exceeded(format!(
                    "command {program:?} timed out after {timeout:?}"
                )));
            }
        }
    };
    let output = output.map_err(|e| Status::internal(format!("cannot run {program:?}: {e}")))?;
    let exit_code = match (output.status.code(), output.status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    };
    Ok(k8s_cri::v1::ExecSyncResponse {
        stdout: output.stdout,
        stderr: output.stderr,
        exit_code,
    })
}

fn working_dir(record: &ContainerRecord) -> &Path {
    match record.config.working_dir.as_str() {
        "" => Path::new("/"),
        dir => Path::new(dir),
    }
}

/// One task per pipe, copying lines into the log until the pipe ends.
fn copy_output(readers: Vec<pipe::Receiver>, log: &Option<Arc<LogFile>>) -> Vec<JoinHandle<()>> {
    readers
        .into_iter()
        .zip([Stream::Stdout, Stream::Stderr])
        .map(|(mut reader, stream)| {
            let mut lines = Lines::new(stream, log.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                loop {
                    match reader.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => lines.push(&buf[..n]),
                    }
                }
                lines.finish();
            })
        })
        .collect()
}

async fn drain(copies: Vec<JoinHandle<()>>) {
    for copy in copies {
        let abort = copy.abort_handle();
        if tokio::time::timeout(DRAIN, copy).await.is_err() {
            abort.abort();
        }
    }
}

/// The `process` handler.
pub(crate) struct Process {
    /// The program sandboxed containers start through (`RuntimeConfig::init_program`).
    init: Option<PathBuf>,
}

impl Process {
    pub(crate) fn new(init: Option<PathBuf>) -> Self {
        Self { init }
    }
}

#[tonic::async_trait]
impl Handler for Process {
    fn runs(&self, kind: ImageKind) -> bool {
        kind == ImageKind::Process
    }

    async fn prepare(&self, record: &ContainerRecord) -> Result<Prepared, Status> {
        Ok(Prepared {
            readied: None,
            log: handler::open_log(record)?,
        })
    }

    fn start(
        &self,
        state: &Arc<State>,
        record: &ContainerRecord,
        prepared: Prepared,
    ) -> Result<handler::Started, Status> {
        let started = start(state, record, prepared.log, self.init.as_deref())?;
        Ok(handler::Started {
            live: started.live,
            pid: Some(started.pid),
            pid_start: started.start,
        })
    }

    async fn stop(
        &self,
        _: &Arc<State>,
        _: &str,
        how: Stopper,
        timeout: Duration,
        exited: watch::Receiver<bool>,
    ) -> Result<(), Status> {
        match how {
            Stopper::Process { pid } => stop(pid, timeout, exited).await,
            _ => Ok(()),
        }
    }

    fn usage(&self, live: &Live) -> (Option<u64>, Option<u64>) {
        match live.stop {
            Stopper::Process { pid } => {
                usage(pid).map_or((None, None), |(cpu, rss)| (Some(cpu), Some(rss)))
            }
            _ => (None, None),
        }
    }

    async fn exec_sync(
        &self,
        record: &ContainerRecord,
        cmd: &[String],
        timeout: Duration,
    ) -> Result<k8s_cri::v1::ExecSyncResponse, Status> {
        if record.state != k8s_cri::v1::ContainerState::ContainerRunning as i32 {
            return Err(Status::failed_precondition(format!(
                "container {} is {}, not running",
                record.id,
                state_name(record.state)
            )));
        }
        exec_sync(record, cmd, timeout).await
    }
}

/// CPU time (ns) and resident bytes of process `pid` and those it started that are
/// still running (a sandboxed container's process is its init; the program is its
/// child).
fn usage(pid: i32) -> Option<(u64, u64)> {
    let mut total = own_usage(pid)?;
    let mut pending = children(pid);
    // Bounded: a fork bomb does not make a stats call walk for ever.
    let mut seen = 0;
    while let Some(child) = pending.pop()
        && seen < 4096
    {
        seen += 1;
        if let Some((cpu, rss)) = own_usage(child) {
            total.0 += cpu;
            total.1 += rss;
        }
        pending.extend(children(child));
    }
    Some(total)
}

/// The children of process `pid` (of its main thread: a container's processes do
/// not start others from other threads, and an approximation is enough here).
fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|list| {
            list.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// CPU time (ns) and resident bytes of process `pid` (its own, not its children's).
fn own_usage(pid: i32) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    // utime and stime (fields 14 and 15 of stat(5)) in USER_HZ, 100 on Linux.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Some((ticks * 10_000_000, rss_kib * 1024))
}
