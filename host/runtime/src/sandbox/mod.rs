//! The sandbox of a `process` container, built by an init: a fresh process of the
//! runtime's own program (`trellis __init …`, [`dispatch`]), single-threaded, which
//! can do what a threaded runtime cannot between a fork and an exec without `unsafe`.
//!
//! - **run** (`__init run <spec file>`): spawned by the runtime from a thread that
//!   entered the pod's network, UTS and IPC namespaces and made a new PID namespace
//!   for its children, so the init is PID 1 of the container. It joins the
//!   container's cgroups, sets the pod network's sysctls, builds the container's
//!   root in a mount namespace of its own (`root`), takes on its user, groups and
//!   capabilities (`creds`), `no_new_privs` and the seccomp profile (`seccomp`), and
//!   spawns the program. It stays as PID 1: it reaps what the program leaves and ends
//!   with the program's exit status, ending the rest of the PID namespace with it.
//!   A privileged container's init only joins the cgroups and becomes the program
//!   (the runtime's thread made its mount namespace, as before sandboxes).
//!   What failed before the program ran is written to the init's standard input,
//!   the write end of a pipe whose other end the runtime reads (an end without a
//!   word: the program runs).
//! - **exec** (`__init exec <pid> <start> <dir> <program> [args…]`): a command run in
//!   a running container. It joins the cgroups and all the namespaces of the
//!   container's init (through a pidfd, checked against its start time), takes on
//!   what that process's `/proc/<pid>/status` shows (user, groups, bounding and
//!   effective capabilities, `no_new_privs`, the seccomp profile: a command run in
//!   the container has what the container has, no more), runs the command in the
//!   container's PID namespace and ends with its exit status.
//!
//! The spec is JSON in the container's directory, readable by root alone (it holds
//! the container's environment).

mod creds;
mod root;
mod seccomp;

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};

use k8s_cri::v1::security_profile::ProfileType;
use serde::{Deserialize, Serialize};

use crate::record::ContainerRecord;

pub(crate) use creds::NOBODY;

/// The first argument that makes the runtime's program an init.
pub const INIT_ARG: &str = "__init";

/// The name an init's process shows.
const INIT_NAME: &str = "trellis-init";

/// The sysctls of a pod's own network namespace, as containerd sets them: a non-root
/// program may listen on any port and ping.
const POD_NETWORK_SYSCTLS: &[(&str, &str)] = &[
    ("net/ipv4/ip_unprivileged_port_start", "0"),
    ("net/ipv4/ping_group_range", "0 2147483647"),
];

/// A bind mount of the container's root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Mount {
    pub source: PathBuf,
    pub target: PathBuf,
    pub readonly: bool,
}

/// What the init of a container makes and runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Spec {
    pub program: PathBuf,
    /// With `argv[0]` first.
    pub argv: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub cwd: PathBuf,
    /// The `cgroup.procs` files of the container's cgroup, one per hierarchy.
    pub cgroup_procs: Vec<PathBuf>,
    /// The pod has a network namespace of its own, whose sysctls the init sets.
    pub pod_network: bool,
    /// The node's process as it is: no root, user, capabilities or seccomp of its own.
    pub privileged: bool,
    /// Where the new root is mounted (a directory of the container's).
    pub root: PathBuf,
    /// The container's volumes and the pod's /etc files, parents first.
    pub mounts: Vec<Mount>,
    pub creds: creds::Creds,
    pub no_new_privs: bool,
    pub seccomp: bool,
    pub readonly_rootfs: bool,
    /// Masked and read-only paths the container config asks for, besides runc's.
    pub masked_paths: Vec<PathBuf>,
    pub readonly_paths: Vec<PathBuf>,
}

impl Spec {
    /// The spec of container `record` whose directory is `dir`, with its `mounts`
    /// and the `cgroup.procs` files of its cgroup.
    pub(crate) fn new(
        record: &ContainerRecord,
        dir: &Path,
        mounts: Vec<Mount>,
        cgroup_procs: Vec<PathBuf>,
    ) -> Result<Spec, String> {
        let config = &record.config;
        let security = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.clone())
            .unwrap_or_default();
        let mut argv: Vec<OsString> = config
            .command
            .iter()
            .chain(&config.args)
            .map(OsString::from)
            .collect();
        if config.command.is_empty() {
            argv.insert(0, record.program.clone().into_os_string());
        }
        let env = crate::environment(config).map_err(|s| s.message().to_string())?;
        let cwd = match config.working_dir.as_str() {
            "" => PathBuf::from("/"),
            dir => PathBuf::from(dir),
        };
        let mut spec = Spec {
            program: record.program.clone(),
            argv,
            env,
            cwd,
            cgroup_procs,
            pod_network: record.netns.is_some(),
            privileged: security.privileged,
            root: dir.join("rootfs"),
            mounts,
            readonly_rootfs: security.readonly_rootfs,
            no_new_privs: security.no_new_privs,
            masked_paths: security.masked_paths.iter().map(PathBuf::from).collect(),
            readonly_paths: security.readonly_paths.iter().map(PathBuf::from).collect(),
            ..Spec::default()
        };
        if spec.privileged {
            return Ok(spec);
        }
        let named = match security.run_as_username.as_str() {
            "" => None,
            name => Some(
                passwd_entry(|fields| fields[0] == name)
                    .ok_or_else(|| format!("user {name:?} is not known on this node"))?,
            ),
        };
        let uid = security
            .run_as_user
            .map(|u| u.value)
            .map(id)
            .transpose()?
            .or(named.map(|(uid, _)| uid));
        let gid = match (security.run_as_group.map(|g| g.value), uid) {
            (Some(gid), _) => id(gid)?,
            // A user's primary group where the node knows it; root's group otherwise.
            (None, Some(uid)) => passwd_entry(|fields| fields[2] == uid.to_string())
                .map(|(_, gid)| gid)
                .unwrap_or(0),
            (None, None) => NOBODY,
        };
        let capabilities = security.capabilities.unwrap_or_default();
        spec.creds = creds::Creds {
            uid: uid.unwrap_or(NOBODY),
            gid,
            groups: security
                .supplemental_groups
                .iter()
                .map(|g| id(*g))
                .collect::<Result<_, _>>()?,
            capabilities: creds::capability_set(
                &capabilities.add_capabilities,
                &capabilities.drop_capabilities,
            )?,
            effective: None,
        };
        spec.seccomp = match security.seccomp {
            Some(profile) => match ProfileType::try_from(profile.profile_type) {
                Ok(ProfileType::RuntimeDefault) => true,
                Ok(ProfileType::Unconfined) => false,
                _ => {
                    return Err(format!(
                        "seccomp profile {:?} is not supported: RuntimeDefault or Unconfined",
                        profile.localhost_ref
                    ));
                }
            },
            // The field older kubelets set.
            #[allow(deprecated)]
            None => match security.seccomp_profile_path.as_str() {
                "runtime/default" | "docker/default" => true,
                "" | "unconfined" => false,
                other => return Err(format!("seccomp profile {other:?} is not supported")),
            },
        };
        Ok(spec)
    }

    /// Writes the spec where only root reads it.
    pub(crate) fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let _ = std::fs::remove_file(path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.write_all(&serde_json::to_vec(self).map_err(std::io::Error::other)?)
    }
}

fn id(value: i64) -> Result<u32, String> {
    u32::try_from(value).map_err(|_| format!("{value} is not a user or group id"))
}

/// The uid and gid of the node's first `/etc/passwd` entry whose fields match.
fn passwd_entry(matches: impl Fn(&[&str]) -> bool) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 4 || !matches(&fields) {
            return None;
        }
        Some((fields[2].parse().ok()?, fields[3].parse().ok()?))
    })
}

/// The init's command line for the spec at `spec`.
pub(crate) fn run_command(init: &Path, spec: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(init);
    command
        .arg0(INIT_NAME)
        .arg(INIT_ARG)
        .arg("run")
        .arg(spec)
        .env_clear();
    command
}

/// The init's command line that runs `program` with `args` in directory `dir` of the
/// container whose init is process `pid` (started at `start`); its own program is
/// that init's, the one file a running sandbox certainly has.
pub(crate) fn exec_command(
    pid: i32,
    start: Option<u64>,
    dir: &OsStr,
    program: &OsStr,
    args: &[OsString],
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(format!("/proc/{pid}/exe"));
    command
        .arg0(INIT_NAME)
        .arg(INIT_ARG)
        .arg("exec")
        .arg(pid.to_string())
        .arg(start.map_or_else(|| "-".to_owned(), |s| s.to_string()))
        .arg(dir)
        .arg(program)
        .args(args)
        .current_dir("/");
    command
}

/// Runs the init when the program was started as one (`<program> __init …`): call
/// it first thing in `main`, before any thread starts, and exit with the code.
pub fn dispatch() -> Option<i32> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != INIT_ARG {
        return None;
    }
    Some(init_main(args.collect()))
}

/// The init, given its arguments after [`INIT_ARG`]; returns its exit code.
pub fn init_main(args: Vec<OsString>) -> i32 {
    match args.first().and_then(|a| a.to_str()) {
        Some("run") if args.len() == 2 => run(Path::new(&args[1])),
        Some("exec") if args.len() >= 5 => exec(&args[1..]),
        _ => {
            eprintln!(
                "usage: {INIT_ARG} run <spec> | {INIT_ARG} exec <pid> <start> <dir> <program> [args…]"
            );
            2
        }
    }
}

/// The exit code of a child's end: its code, or 128 + the signal that ended it.
fn code(status: std::process::ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

fn run(spec: &Path) -> i32 {
    // The pipe to the runtime, kept off the program's descriptors.
    let report = rustix::io::fcntl_dupfd_cloexec(std::io::stdin().as_fd(), 3).ok();
    let fail = |message: String| {
        match &report {
            Some(fd) => {
                let _ = rustix::io::write(fd, message.as_bytes());
            }
            None => eprintln!("{INIT_NAME}: {message}"),
        }
        128
    };
    let spec: Spec = match std::fs::read(spec)
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()))
    {
        Ok(spec) => spec,
        Err(e) => {
            return fail(format!(
                "cannot read the sandbox spec {}: {e}",
                spec.display()
            ));
        }
    };
    let child = match start(&spec) {
        Ok(child) => child,
        Err(message) => return fail(message),
    };
    drop(report);
    reap(child)
}

/// Builds the sandbox of `spec` and starts its program: returns its pid, or (for a
/// privileged container, which this process becomes) only on a failure.
fn start(spec: &Spec) -> Result<u32, String> {
    join_cgroups(&spec.cgroup_procs)?;
    let mut command = std::process::Command::new(&spec.program);
    let mut argv = spec.argv.iter();
    if let Some(arg0) = argv.next() {
        command.arg0(arg0);
    }
    command
        .args(argv)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd);
    let running = |e: std::io::Error| format!("cannot run {}: {e}", spec.program.display());
    if spec.privileged {
        null_stdin()?;
        return Err(running(command.exec()));
    }
    if spec.pod_network {
        for (name, value) in POD_NETWORK_SYSCTLS {
            std::fs::write(Path::new("/proc/sys").join(name), value)
                .map_err(|e| format!("cannot set sysctl {name}: {e}"))?;
        }
    }
    root::enter(spec).map_err(|e| format!("cannot build the container's root: {e}"))?;
    // Made when missing, as runc makes it (where the root is writable).
    if !spec.cwd.is_dir() {
        std::fs::create_dir_all(&spec.cwd).map_err(|e| {
            format!(
                "cannot make the working directory {}: {e}",
                spec.cwd.display()
            )
        })?;
    }
    null_stdin()?;
    creds::apply(&spec.creds).map_err(|e| format!("cannot take on the container's user: {e}"))?;
    if spec.no_new_privs {
        rustix::thread::set_no_new_privs(true).map_err(|e| format!("no_new_privs: {e}"))?;
    }
    if spec.seccomp {
        seccomp::apply_runtime_default()?;
    }
    let child = command.spawn().map_err(running)?;
    Ok(child.id())
}

fn null_stdin() -> Result<(), String> {
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("open /dev/null: {e}"))?;
    rustix::stdio::dup2_stdin(&null).map_err(|e| format!("replace the standard input: {e}"))
}

/// Waits for `child`, reaping whatever else ends meanwhile (PID 1 inherits the
/// orphans of its namespace), and returns its exit code.
fn reap(child: u32) -> i32 {
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid.as_raw_nonzero().get() as u32 == child => {
                return code(std::process::ExitStatus::from_raw(status.as_raw()));
            }
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                eprintln!("{INIT_NAME}: cannot wait for the program: {e}");
                return 1;
            }
        }
    }
}

/// Writes this process's pid ("0") into each `cgroup.procs` file.
fn join_cgroups(files: &[PathBuf]) -> Result<(), String> {
    for file in files {
        std::fs::write(file, "0")
            .map_err(|e| format!("cannot join the cgroup {}: {e}", file.display()))?;
    }
    Ok(())
}

/// The `cgroup.procs` files of the cgroups process `pid` is in, on this mount
/// namespace's cgroup file systems (a hierarchy not mounted here is left out).
fn cgroup_procs_of(pid: i32) -> Result<Vec<PathBuf>, String> {
    let read = |path: String| std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"));
    let mountinfo = read("/proc/self/mountinfo".into())?;
    // (root, mount point, type, super options) of each cgroup mount.
    let mounts: Vec<(&str, &str, &str, Vec<&str>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let kind = *right.first()?;
            (kind == "cgroup" || kind == "cgroup2").then(|| {
                (
                    *left.get(3).unwrap_or(&"/"),
                    *left.get(4).unwrap_or(&""),
                    kind,
                    right
                        .get(2)
                        .map(|o| o.split(',').collect())
                        .unwrap_or_default(),
                )
            })
        })
        .collect();
    let mut files = Vec::new();
    for line in read(format!("/proc/{pid}/cgroup"))?.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let found = mounts.iter().find(|(_, _, kind, options)| {
            if controllers.is_empty() {
                *kind == "cgroup2"
            } else {
                *kind == "cgroup" && controllers.split(',').all(|c| options.contains(&c))
            }
        });
        let Some((root, at, _, _)) = found else {
            continue;
        };
        let relative = path
            .strip_prefix(root)
            .unwrap_or(path)
            .trim_start_matches('/');
        files.push(Path::new(at).join(relative).join("cgroup.procs"));
    }
    Ok(files)
}

fn exec(args: &[OsString]) -> i32 {
    let fail = |message: String| {
        eprintln!("{message}");
        126
    };
    let (Some(pid), Some(start)) = (
        args[0].to_str().and_then(|p| p.parse::<i32>().ok()),
        args[1].to_str(),
    ) else {
        return fail("bad pid or start time".into());
    };
    let (dir, program, rest) = (&args[2], &args[3], &args[4..]);
    let entered = (|| -> Result<(), String> {
        let gone = || format!("the container's process {pid} has ended");
        let raw = rustix::process::Pid::from_raw(pid).ok_or_else(gone)?;
        let pidfd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty())
            .map_err(|_| gone())?;
        // Checked after the pidfd is open: it names this process, whatever reuses its pid.
        let alive = crate::pid::start_time(pid);
        if alive.is_none()
            || (start != "-" && alive.map(|s| s.to_string()).as_deref() != Some(start))
        {
            return Err(gone());
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("cannot read the container's process status: {e}"))?;
        let mirrored = creds::mirror(&status)?;
        join_cgroups(&cgroup_procs_of(pid)?)?;
        use rustix::thread::ThreadNameSpaceType as Ns;
        rustix::thread::move_into_thread_name_spaces(
            pidfd.as_fd(),
            Ns::MOUNT
                | Ns::HOST_NAME_AND_NIS_DOMAIN_NAME
                | Ns::INTER_PROCESS_COMMUNICATION
                | Ns::NETWORK
                | Ns::PROCESS_ID,
        )
        .map_err(|e| format!("cannot enter the container's namespaces: {e}"))?;
        creds::apply(&mirrored.creds)
            .map_err(|e| format!("cannot take on the container's user: {e}"))?;
        if mirrored.no_new_privs {
            rustix::thread::set_no_new_privs(true).map_err(|e| format!("no_new_privs: {e}"))?;
        }
        if mirrored.seccomp {
            seccomp::apply_runtime_default()?;
        }
        Ok(())
    })();
    if let Err(message) = entered {
        return fail(message);
    }
    // Its environment is this process's, which the runtime gave it.
    let spawned = std::process::Command::new(program)
        .args(rest)
        .current_dir(dir)
        .spawn();
    match spawned {
        Ok(mut child) => match child.wait() {
            Ok(status) => code(status),
            Err(e) => fail(format!("cannot wait for {program:?}: {e}")),
        },
        Err(e) => {
            eprintln!("cannot run {program:?}: {e}");
            if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            }
        }
    }
}

/// Where the init of container `record` reports a failure to start it, and what an
/// owned pipe end becomes for the init's standard input.
pub(crate) fn report_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1::{
        Capability, ContainerConfig, Int64Value, LinuxContainerConfig,
        LinuxContainerSecurityContext, SecurityProfile,
    };

    fn record(security: LinuxContainerSecurityContext) -> ContainerRecord {
        ContainerRecord {
            id: "c".into(),
            sandbox_id: "s".into(),
            config: ContainerConfig {
                args: vec!["600".into()],
                linux: Some(LinuxContainerConfig {
                    security_context: Some(security),
                    ..Default::default()
                }),
                ..Default::default()
            },
            image_id: String::new(),
            kind: crate::record::ImageKind::Process,
            handler: String::new(),
            program: "/bin/sleep".into(),
            log_path: None,
            state: 0,
            created_at: 0,
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            pid: None,
            pid_start: None,
            netns: Some("/run/netns/x".into()),
        }
    }

    fn spec(security: LinuxContainerSecurityContext) -> Result<Spec, String> {
        Spec::new(&record(security), Path::new("/c"), Vec::new(), Vec::new())
    }

    #[test]
    fn a_container_runs_as_nobody_unless_the_pod_names_a_user() {
        let default = spec(Default::default()).unwrap();
        assert_eq!(
            (
                default.creds.uid,
                default.creds.gid,
                default.creds.groups.len()
            ),
            (NOBODY, NOBODY, 0)
        );
        assert_eq!(default.argv, [OsString::from("/bin/sleep"), "600".into()]);
        assert_eq!(default.root, Path::new("/c/rootfs"));
        assert!(default.pod_network && !default.privileged && !default.seccomp);
        assert_eq!(
            default.creds.capabilities,
            creds::DEFAULT_CAPABILITIES.bits()
        );

        let root = spec(LinuxContainerSecurityContext {
            run_as_user: Some(Int64Value { value: 0 }),
            supplemental_groups: vec![5, 6],
            capabilities: Some(Capability {
                drop_capabilities: vec!["ALL".into()],
                ..Default::default()
            }),
            seccomp: Some(SecurityProfile {
                profile_type: ProfileType::RuntimeDefault as i32,
                ..Default::default()
            }),
            readonly_rootfs: true,
            ..Default::default()
        })
        .unwrap();
        // Root's primary group, from the node's /etc/passwd.
        assert_eq!(
            (root.creds.uid, root.creds.gid, root.creds.groups),
            (0, 0, vec![5, 6])
        );
        assert_eq!(root.creds.capabilities, 0);
        assert!(root.seccomp && root.readonly_rootfs);

        let with_group = spec(LinuxContainerSecurityContext {
            run_as_user: Some(Int64Value { value: 1234 }),
            run_as_group: Some(Int64Value { value: 4321 }),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((with_group.creds.uid, with_group.creds.gid), (1234, 4321));

        let privileged = spec(LinuxContainerSecurityContext {
            privileged: true,
            run_as_user: Some(Int64Value { value: 1234 }),
            ..Default::default()
        })
        .unwrap();
        assert!(privileged.privileged && privileged.creds == creds::Creds::default());
    }

    #[test]
    fn what_the_sandbox_cannot_honour_is_refused() {
        let localhost = spec(LinuxContainerSecurityContext {
            seccomp: Some(SecurityProfile {
                profile_type: ProfileType::Localhost as i32,
                localhost_ref: "profiles/x.json".into(),
            }),
            ..Default::default()
        });
        assert!(localhost.is_err_and(|e| e.contains("profiles/x.json")));
        let unknown = spec(LinuxContainerSecurityContext {
            run_as_username: "no-such-user-here".into(),
            ..Default::default()
        });
        assert!(unknown.is_err_and(|e| e.contains("no-such-user-here")));
        let negative = spec(LinuxContainerSecurityContext {
            run_as_user: Some(Int64Value { value: -1 }),
            ..Default::default()
        });
        assert!(negative.is_err());
    }
}
