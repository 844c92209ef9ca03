//! The root file system of a sandboxed process, built in a mount namespace of its
//! own on a tmpfs: the node's programs and libraries read-only, an allowlisted
//! `/etc` read-only with the pod's `hosts`, `hostname` and `resolv.conf`, its own
//! `/tmp`, a minimal `/dev`, a `/proc` of its PID namespace with the node-wide files
//! masked or read-only (as runc does), a read-only `/sys`, and its volumes; then
//! `pivot_root` into it, the node's root detached. Setuid bits and file capabilities
//! of the node's programs do nothing there (`nosuid`): `su` or `ping` cannot raise
//! a user's privileges.

use std::ffi::CStr;
use std::fs::File;
use std::io::{Error, ErrorKind};
use std::path::{Component, Path, PathBuf};

use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};
use rustix::thread::UnshareFlags;

use super::{Mount, Spec};

/// The node's directories of programs and libraries (where they exist; where they
/// are symlinks into `/usr`, as on Debian, the symlinks are made again).
const SYSTEM_DIRS: &[&str] = &["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// What of the node's `/etc` a program may need and may read: users and groups (no
/// passwords: those are in `shadow`), name service, the dynamic linker's cache,
/// certificates, time zone, well-known ports and types, the OS release. Not `shadow`,
/// `sudoers`, `ssh`, `kubernetes`, `trellis` or anything else.
const ETC_ALLOWED: &[&str] = &[
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "ssl",
    "pki",
    "ca-certificates",
    "ca-certificates.conf",
    "crypto-policies",
    "alternatives",
    "localtime",
    "timezone",
    "mime.types",
    "protocols",
    "services",
    "networks",
    "rpc",
    "os-release",
    "lsb-release",
    "debian_version",
    "terminfo",
    "inputrc",
    "shells",
    "login.defs",
    "bash.bashrc",
    "profile",
    "environment",
];

/// Node-wide files of `/proc` hidden (an empty file or directory over them), as runc
/// hides them.
const PROC_MASKED: &[&str] = &[
    "acpi",
    "asound",
    "interrupts",
    "kcore",
    "keys",
    "latency_stats",
    "sched_debug",
    "scsi",
    "timer_list",
    "timer_stats",
];

/// Parts of `/proc` that change the node when written: read-only.
const PROC_READONLY: &[&str] = &["bus", "fs", "irq", "sys", "sysrq-trigger"];

/// Parts of `/sys` hidden.
const SYS_MASKED: &[&str] = &["firmware", "devices/virtual/powercap"];

/// The device files of `/dev`, the node's own bind-mounted.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

fn context(what: String) -> impl FnOnce(Error) -> Error {
    move |e| Error::new(e.kind(), format!("{what}: {e}"))
}

fn flags() -> MountFlags {
    MountFlags::NOSUID | MountFlags::NODEV
}

/// `path` (absolute) under `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(
        path.components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect::<PathBuf>(),
    )
}

/// Makes the calling (single-threaded) process's mount namespace its own, builds the
/// root of `spec` and moves into it.
pub(crate) fn enter(spec: &Spec) -> std::io::Result<()> {
    #[allow(deprecated)]
    rustix::thread::unshare(UnshareFlags::NEWNS)?;
    // Nothing mounted here reaches the node; the node's mounts and unmounts still
    // reach the binds made from it.
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::DOWNSTREAM,
    )?;
    let root = &spec.root;
    std::fs::create_dir_all(root).map_err(context(format!("make {}", root.display())))?;
    rustix::mount::mount("tmpfs", root, "tmpfs", flags(), Some(c"mode=755"))
        .map_err(|e| context(format!("mount a tmpfs at {}", root.display()))(e.into()))?;

    for dir in SYSTEM_DIRS {
        let node = Path::new("/").join(dir);
        copy_or_bind(&node, &root.join(dir), true)?;
    }
    if !is_system(&spec.program) && spec.program.is_absolute() {
        // A program outside the node's program directories (a build's output, say):
        // itself alone, read-only.
        bind(&spec.program, &under(root, &spec.program), true, false)?;
    }

    let etc = root.join("etc");
    std::fs::create_dir(&etc)?;
    for name in ETC_ALLOWED {
        copy_or_bind(&Path::new("/etc").join(name), &etc.join(name), true)?;
    }

    let tmp = root.join("tmp");
    std::fs::create_dir(&tmp)?;
    if !spec.readonly_rootfs {
        // Its own: what one container writes there no other sees.
        mount_fs("tmpfs", &tmp, flags(), c"mode=1777")?;
    }

    dev(&root.join("dev"))?;
    proc(root, spec)?;
    sys(root)?;

    for mount in &spec.mounts {
        volume(root, mount)?;
    }

    if spec.readonly_rootfs {
        rustix::mount::mount_remount(root, MountFlags::RDONLY | flags(), "")
            .map_err(|e| context("make the root read-only".into())(e.into()))?;
    }

    // The old root goes on top of the new one and is detached at once: no path
    // leads to the node's file system any more.
    rustix::process::chdir(root)?;
    rustix::process::pivot_root(".", ".").map_err(|e| context("pivot_root".into())(e.into()))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH)
        .map_err(|e| context("detach the node's root".into())(e.into()))?;
    rustix::process::chdir("/")?;
    Ok(())
}

fn is_system(path: &Path) -> bool {
    let first = path.components().find_map(|c| match c {
        Component::Normal(name) => Some(name),
        _ => None,
    });
    first.is_some_and(|name| SYSTEM_DIRS.iter().any(|d| name == *d))
}

/// The node's `node` at `target`: a symlink made again, a directory or file
/// bind-mounted; nothing when the node has none.
fn copy_or_bind(node: &Path, target: &Path, readonly: bool) -> std::io::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(node) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        let to = std::fs::read_link(node)?;
        return std::os::unix::fs::symlink(&to, target)
            .map_err(context(format!("link {}", target.display())));
    }
    bind(node, target, readonly, false)
}

/// Bind-mounts `source` at `target`, made first (a directory or an empty file).
fn bind(source: &Path, target: &Path, readonly: bool, recursive: bool) -> std::io::Result<()> {
    let what = || format!("mount {} at {}", source.display(), target.display());
    let is_dir = std::fs::metadata(source).map_err(context(what()))?.is_dir();
    make(target, is_dir).map_err(context(what()))?;
    if recursive {
        rustix::mount::mount_bind_recursive(source, target)
    } else {
        rustix::mount::mount_bind(source, target)
    }
    .map_err(|e| context(what())(e.into()))?;
    if readonly {
        rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY | flags(), "")
            .map_err(|e| context(format!("make {} read-only", target.display()))(e.into()))?;
    }
    Ok(())
}

fn make(target: &Path, dir: bool) -> std::io::Result<()> {
    if std::fs::symlink_metadata(target).is_ok() {
        return Ok(());
    }
    if dir {
        std::fs::create_dir_all(target)
    } else {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        File::create(target).map(drop)
    }
}

fn mount_fs(kind: &str, target: &Path, flags: MountFlags, data: &CStr) -> std::io::Result<()> {
    rustix::mount::mount(kind, target, kind, flags, Some(data))
        .map_err(|e| context(format!("mount {kind} at {}", target.display()))(e.into()))
}

fn dev(dev: &Path) -> std::io::Result<()> {
    std::fs::create_dir(dev)?;
    mount_fs("tmpfs", dev, MountFlags::NOSUID, c"mode=755")?;
    for name in DEVICES {
        let node = Path::new("/dev").join(name);
        if node.exists() {
            bind(&node, &dev.join(name), false, false)?;
        }
    }
    let pts = dev.join("pts");
    std::fs::create_dir(&pts)?;
    mount_fs(
        "devpts",
        &pts,
        MountFlags::NOSUID | MountFlags::NOEXEC,
        c"newinstance,ptmxmode=0666,mode=0620",
    )?;
    let shm = dev.join("shm");
    std::fs::create_dir(&shm)?;
    mount_fs("tmpfs", &shm, flags() | MountFlags::NOEXEC, c"mode=1777")?;
    for (name, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(name))?;
    }
    Ok(())
}

fn proc(root: &Path, spec: &Spec) -> std::io::Result<()> {
    let proc = root.join("proc");
    std::fs::create_dir(&proc)?;
    // Of this process's PID namespace: the pod's processes alone.
    mount_fs("proc", &proc, flags() | MountFlags::NOEXEC, c"")?;
    let masked = PROC_MASKED
        .iter()
        .map(|p| proc.join(p))
        .chain(spec.masked_paths.iter().map(|p| under(root, p)));
    for path in masked {
        mask(root, &path)?;
    }
    let readonly = PROC_READONLY
        .iter()
        .map(|p| proc.join(p))
        .chain(spec.readonly_paths.iter().map(|p| under(root, p)));
    for path in readonly {
        if path.exists() {
            bind(&path, &path, true, true)?;
        }
    }
    Ok(())
}

/// Hides `path`: an empty read-only tmpfs over a directory, `/dev/null` over a file.
fn mask(root: &Path, path: &Path) -> std::io::Result<()> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    if meta.is_dir() {
        mount_fs("tmpfs", path, flags() | MountFlags::RDONLY, c"mode=555")
    } else {
        rustix::mount::mount_bind(root.join("dev/null"), path)
            .map_err(|e| context(format!("mask {}", path.display()))(e.into()))
    }
}

fn sys(root: &Path) -> std::io::Result<()> {
    let sys = root.join("sys");
    std::fs::create_dir(&sys)?;
    let readonly = flags() | MountFlags::NOEXEC | MountFlags::RDONLY;
    // A sysfs of its own shows the pod's network devices; where the kernel refuses
    // one, the node's, read-only and without what is mounted in it.
    if rustix::mount::mount("sysfs", &sys, "sysfs", readonly, None).is_err() {
        bind(Path::new("/sys"), &sys, true, false)?;
    }
    for path in SYS_MASKED {
        mask(root, &sys.join(path))?;
    }
    Ok(())
}

/// A volume: its source bind-mounted at its path, made in the new root (a path in
/// the node's read-only directories that they lack cannot be made).
fn volume(root: &Path, mount: &Mount) -> std::io::Result<()> {
    let target = under(root, &mount.target);
    // A symlink on the way (one a volume holds, which the pod wrote) would lead the
    // mount, or the file made for it, out of the new root onto the node's.
    let mut at = root.to_path_buf();
    for (i, part) in mount.target.components().skip(1).enumerate() {
        at.push(part);
        let made_here = i == 0 && SYSTEM_DIRS.iter().any(|d| part.as_os_str() == *d);
        if !made_here && std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "mount path {}: {} is a symlink",
                    mount.target.display(),
                    at.strip_prefix(root).unwrap_or(&at).display()
                ),
            ));
        }
    }
    bind(&mount.source, &target, mount.readonly, true).map_err(|e| {
        if e.kind() == ErrorKind::ReadOnlyFilesystem {
            Error::new(
                e.kind(),
                format!(
                    "mount path {} lies in a read-only directory of the node's that has no such path: {e}",
                    mount.target.display()
                ),
            )
        } else {
            e
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_go_under_the_new_root() {
        assert_eq!(
            under(Path::new("/r"), Path::new("/etc/../x/./y")),
            PathBuf::from("/r/etc/x/y")
        );
        assert!(is_system(Path::new("/usr/bin/env")));
        assert!(is_system(Path::new("/bin/sh")));
        assert!(!is_system(Path::new("/work/target/debug/app")));
    }
}
