//! A pod's UTS and IPC namespaces, pinned as its network namespace is
//! (`network::netns`), and how a `process` container and the commands exec'd into it
//! enter its namespaces.
//!
//! A container's process is spawned from a thread of its own that entered its pod's
//! network, UTS and IPC namespaces. For a sandboxed container the thread makes a new
//! PID namespace for its children, and the container's init (`sandbox`) makes the
//! rest. For a privileged one it makes a mount namespace: a copy of the node's whose
//! mounts are made slaves first, so that nothing mounted in it reaches the node, where
//! the container's mounts and the pod's `/etc/hosts`, `/etc/hostname` and
//! `/etc/resolv.conf` are bind-mounted. The process inherits all of them; the mount
//! namespace lives as long as it does. The node's root stays the root.
//!
//! An exec ([`container_command`]) into a sandboxed container goes through its init,
//! which takes on what the container has; into a privileged one it enters the
//! namespaces of the container's process through a pidfd: one `setns` for all of
//! them, and no other process that was given the same pid.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, MountPropagationFlags};
use rustix::process::{Pid, PidfdFlags};
use rustix::thread::{ThreadNameSpaceType, UnshareFlags};

use crate::network::netns;

/// Where the UTS namespace of sandbox `id` is pinned, under the runtime's root.
pub(crate) fn uts_pin(root: &Path, id: &str) -> PathBuf {
    root.join("utsns").join(id)
}

/// Where the IPC namespace of sandbox `id` is pinned, under the runtime's root.
pub(crate) fn ipc_pin(root: &Path, id: &str) -> PathBuf {
    root.join("ipcns").join(id)
}

/// Makes a pod's UTS namespace with `hostname` pinned at `uts`, and its IPC namespace
/// pinned at `ipc`, each when asked for, on one thread; on a failure nothing is left.
pub(crate) fn create(uts: Option<(&Path, &str)>, ipc: Option<&Path>) -> std::io::Result<()> {
    let mut flags = UnshareFlags::empty();
    let mut pins = Vec::new();
    if let Some((pin, _)) = uts {
        flags |= UnshareFlags::NEWUTS;
        pins.push((pin.to_path_buf(), "uts"));
    }
    if let Some(pin) = ipc {
        flags |= UnshareFlags::NEWIPC;
        pins.push((pin.to_path_buf(), "ipc"));
    }
    if pins.is_empty() {
        return Ok(());
    }
    let made = (|| {
        for (pin, _) in &pins {
            if let Some(dir) = pin.parent() {
                std::fs::create_dir_all(dir)?;
            }
            File::create(pin)?;
        }
        let hostname = uts.map(|(_, name)| name.to_owned());
        let targets = pins.clone();
        netns::on_thread(move || {
            // Deprecated only because other flags (CLONE_FILES) can invalidate other
            // threads' descriptors; new UTS and IPC namespaces cannot.
            #[allow(deprecated)]
            rustix::thread::unshare(flags)?;
            if let Some(name) = hostname {
                // The hostname of the writer's UTS namespace: this thread's new one.
                std::fs::write("/proc/sys/kernel/hostname", name)?;
            }
            for (pin, kind) in &targets {
                rustix::mount::mount_bind(format!("/proc/thread-self/ns/{kind}"), pin)?;
            }
            Ok(())
        })
    })();
    if made.is_err() {
        for (pin, _) in &pins {
            let _ = netns::remove(pin);
        }
    }
    made
}

/// A bind mount in a container's mount namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bind {
    pub source: PathBuf,
    pub target: PathBuf,
    pub readonly: bool,
    /// The target may be made (a directory, or an empty file for a file) when missing:
    /// it lies in a mount made before it, a volume of the pod, never the node's own
    /// file system.
    pub make_target: bool,
}

/// What a container's process starts in: the pinned namespaces of its pod it joins
/// (none: the node's), and either a new PID namespace (`new_pid`: the process makes
/// its own mount namespace) or the bind mounts of a mount namespace made for it,
/// parents first.
#[derive(Clone, Debug, Default)]
pub(crate) struct Enter {
    pub netns: Option<PathBuf>,
    pub uts: Option<PathBuf>,
    pub ipc: Option<PathBuf>,
    pub binds: Vec<Bind>,
    pub new_pid: bool,
}

/// Spawns `command` in the pod's namespaces `enter` names and a mount namespace of its
/// own with `enter.binds` made: from a thread that entered and made them, whose
/// children start in them (nothing runs between the fork and the exec).
pub(crate) fn spawn_in_pod(
    mut command: tokio::process::Command,
    enter: Enter,
) -> std::io::Result<tokio::process::Child> {
    // The child is reaped by this runtime's tasks, whichever thread spawns it.
    let tokio = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
    let pins = [&enter.netns, &enter.uts, &enter.ipc]
        .into_iter()
        .flatten()
        .map(|pin| {
            File::open(pin)
                .map_err(|e| std::io::Error::new(e.kind(), format!("open {}: {e}", pin.display())))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    netns::on_thread(move || {
        for pin in &pins {
            rustix::thread::move_into_link_name_space(pin.as_fd(), None)?;
        }
        drop(pins);
        if enter.new_pid {
            // This thread's children only: the process spawned next is PID 1 of it.
            #[allow(deprecated)]
            rustix::thread::unshare(UnshareFlags::NEWPID)?;
            let _entered = tokio.enter();
            return command.spawn();
        }
        new_mount_namespace()?;
        for bind in &enter.binds {
            mount(bind).map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "mount {} at {}: {e}",
                        bind.source.display(),
                        bind.target.display()
                    ),
                )
            })?;
        }
        let _entered = tokio.enter();
        command.spawn()
    })
}

/// Gives the calling thread a mount namespace of its own, a copy of its current one
/// whose mounts receive the node's mounts and unmounts but send none back.
fn new_mount_namespace() -> std::io::Result<()> {
    // CLONE_FS too: a thread that shares its root and working directory with others
    // may not change mount namespace.
    #[allow(deprecated)]
    rustix::thread::unshare(UnshareFlags::NEWNS | UnshareFlags::FS)?;
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::DOWNSTREAM,
    )?;
    Ok(())
}

fn mount(bind: &Bind) -> std::io::Result<()> {
    if bind.make_target && std::fs::symlink_metadata(&bind.target).is_err() {
        if std::fs::metadata(&bind.source)?.is_dir() {
            std::fs::create_dir_all(&bind.target)?;
        } else {
            if let Some(dir) = bind.target.parent() {
                std::fs::create_dir_all(dir)?;
            }
            File::create(&bind.target)?;
        }
    }
    rustix::mount::mount_bind_recursive(&bind.source, &bind.target)?;
    if bind.readonly {
        rustix::mount::mount_remount(&bind.target, MountFlags::BIND | MountFlags::RDONLY, "")?;
    }
    Ok(())
}

/// A command to run in a running container whose process is `pid` (whose /proc start
/// time is `start`, when known), in directory `dir`, seeing what the container sees:
/// through the container's init for a sandboxed one (which takes on its user,
/// capabilities and seccomp profile), in the namespaces of the process for a
/// privileged one. Give it its environment (cleared first) and its standard streams,
/// then [`ContainerCommand::spawn`] it. Fails when that process has ended.
pub fn container_command(
    pid: i32,
    start: Option<u64>,
    program: &OsStr,
    args: &[OsString],
    dir: &OsStr,
) -> std::io::Result<ContainerCommand> {
    let gone = || {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("process {pid} has ended"),
        )
    };
    let raw = Pid::from_raw(pid).ok_or_else(gone)?;
    let pidfd = rustix::process::pidfd_open(raw, PidfdFlags::empty())?;
    // Opened before the check: the pidfd names this process, whatever reuses its pid.
    let alive = crate::pid::start_time(pid);
    if alive.is_none() || (start.is_some() && alive != start) {
        return Err(gone());
    }
    let namespace = |path: String| std::fs::metadata(path).map(|m| (m.dev(), m.ino()));
    if namespace(format!("/proc/{pid}/ns/pid"))? != namespace("/proc/self/ns/pid".into())? {
        return Ok(ContainerCommand {
            command: crate::sandbox::exec_command(pid, alive, dir, program, args),
            enter: None,
        });
    }
    let mut command = tokio::process::Command::new(program);
    command.args(args).current_dir(dir);
    Ok(ContainerCommand {
        command,
        enter: Some(pidfd),
    })
}

/// A command to run in a container ([`container_command`]): a
/// `tokio::process::Command` to give its environment and streams to.
#[derive(Debug)]
pub struct ContainerCommand {
    command: tokio::process::Command,
    /// The pidfd of a privileged container's process, whose namespaces the command
    /// is spawned in; none when the command is the container's init.
    enter: Option<OwnedFd>,
}

impl std::ops::Deref for ContainerCommand {
    type Target = tokio::process::Command;

    fn deref(&self) -> &Self::Target {
        &self.command
    }
}

impl std::ops::DerefMut for ContainerCommand {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.command
    }
}

impl ContainerCommand {
    pub fn spawn(self) -> std::io::Result<tokio::process::Child> {
        let Self { mut command, enter } = self;
        let Some(pidfd) = enter else {
            return command.spawn();
        };
        let tokio = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
        netns::on_thread(move || {
            #[allow(deprecated)]
            rustix::thread::unshare(UnshareFlags::FS)?;
            rustix::thread::move_into_thread_name_spaces(
                pidfd.as_fd(),
                ThreadNameSpaceType::MOUNT
                    | ThreadNameSpaceType::HOST_NAME_AND_NIS_DOMAIN_NAME
                    | ThreadNameSpaceType::INTER_PROCESS_COMMUNICATION
                    | ThreadNameSpaceType::NETWORK,
            )?;
            drop(pidfd);
            let _entered = tokio.enter();
            command.spawn()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inode(path: &str) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0)
    }

    /// Unpins what a test pinned, also when it fails.
    struct Unpin(Vec<PathBuf>);

    impl Drop for Unpin {
        fn drop(&mut self) {
            for pin in &self.0 {
                let _ = netns::remove(pin);
            }
        }
    }

    #[tokio::test]
    async fn a_process_starts_in_the_pods_namespaces_with_its_mounts_and_an_exec_joins_it() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: namespaces need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (uts, ipc) = (uts_pin(dir.path(), "s"), ipc_pin(dir.path(), "s"));
        let _unpin = Unpin(vec![uts.clone(), ipc.clone()]);
        create(Some((&uts, "pod-a")), Some(&ipc)).unwrap();
        assert_ne!(inode(uts.to_str().unwrap()), inode("/proc/self/ns/uts"));
        assert_ne!(inode(ipc.to_str().unwrap()), inode("/proc/self/ns/ipc"));
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, "10.0.0.1\tpod-a\n").unwrap();
        let node_hosts = std::fs::read("/etc/hosts").unwrap();
        let mut command = tokio::process::Command::new("/bin/sh");
        command
            .args([
                "-c",
                "cat /proc/sys/kernel/hostname /etc/hosts; exec sleep 30",
            ])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        let enter = Enter {
            uts: Some(uts.clone()),
            ipc: Some(ipc.clone()),
            binds: vec![Bind {
                source: hosts,
                target: "/etc/hosts".into(),
                readonly: true,
                make_target: false,
            }],
            ..Default::default()
        };
        let mut child = spawn_in_pod(command, enter).unwrap();
        let pid = child.id().unwrap() as i32;
        let mut out = child.stdout.take().unwrap();
        let mut seen = String::new();
        while !seen.contains("pod-a\n") || !seen.contains("10.0.0.1") {
            let mut buf = [0u8; 256];
            let n = tokio::io::AsyncReadExt::read(&mut out, &mut buf)
                .await
                .unwrap();
            assert!(n > 0, "{seen}");
            seen += &String::from_utf8_lossy(&buf[..n]);
        }
        assert_eq!(seen, "pod-a\n10.0.0.1\tpod-a\n");
        assert_eq!(
            std::fs::read("/etc/hosts").unwrap(),
            node_hosts,
            "the node's file is unchanged"
        );
        let mut exec = container_command(
            pid,
            crate::pid::start_time(pid),
            "/bin/sh".as_ref(),
            &[
                "-c".into(),
                "cat /proc/sys/kernel/hostname; echo x >> /etc/hosts".into(),
            ],
            "/".as_ref(),
        )
        .unwrap();
        exec.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let output = exec.spawn().unwrap().wait_with_output().await.unwrap();
        assert_eq!(String::from_utf8_lossy(&output.stdout), "pod-a\n");
        assert!(
            !output.status.success(),
            "the mount is read-only in the exec too"
        );
        assert!(container_command(pid, Some(1), "true".as_ref(), &[], "/".as_ref()).is_err());
        child.kill().await.unwrap();
        netns::remove(&uts).unwrap();
        netns::remove(&ipc).unwrap();
        assert!(!uts.exists() && !ipc.exists());
    }
}
