//! A sandbox's files, as containerd's CRI plugin keeps them: `hostname`, `resolv.conf`
//! and `hosts` in `<root>/sandboxes/<sandbox id>/`, written by `RunPodSandbox` from
//! its config and bind-mounted over `/etc/hostname`, `/etc/resolv.conf` and
//! `/etc/hosts` in each `process` container, unless the container mounts something
//! there itself (the kubelet mounts its managed `etc-hosts`). Whatever else runs a
//! pod's code (a WebAssembly program's name lookups) reads the pod's `resolv.conf`
//! at [`resolv_conf`].
//!
//! Also the bind mounts of a container's mount namespace ([`binds_in`]). A sandboxed
//! container has a root of its own where its init makes any mount point (as runc
//! makes them in a container's root). A privileged `process` container keeps the
//! node's root, so a mount's `container_path` must exist there, or lie in a mount of
//! the same container made before it (where the runtime makes it); making it on the
//! node's own file system would change the node for every process on it, and a tmpfs
//! over its nearest parent would hide the node's files the process needs. Such a
//! path is refused with the reason when it starts.

use std::path::{Component, Path, PathBuf};

use k8s_cri::v1::{DnsConfig, Mount, PodSandboxConfig};

use crate::namespaces::Bind;

/// The node's own files a sandbox's start from.
const NODE_RESOLV_CONF: &str = "/etc/resolv.conf";
const NODE_HOSTS: &str = "/etc/hosts";

/// The directory of sandbox `id`'s files, under the runtime's root.
pub(crate) fn sandbox_dir(root: &Path, id: &str) -> PathBuf {
    root.join("sandboxes").join(id)
}

/// Where the pod of sandbox `id` finds its `resolv.conf`, under the runtime's root.
pub fn resolv_conf(root: &Path, id: &str) -> PathBuf {
    sandbox_dir(root, id).join("resolv.conf")
}

/// Writes the files of a sandbox of `config` into `dir` (made if missing): its
/// hostname (the node's on the node's UTS namespace), `resolv.conf` from its DNS
/// config (the node's when it has none) and a copy of the node's `hosts`.
pub(crate) fn write(dir: &Path, config: &PodSandboxConfig, own_uts: bool) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let hostname = match config.hostname.as_str() {
        name if own_uts && !name.is_empty() => name.to_owned(),
        _ => node_hostname(),
    };
    write_whole(&dir.join("hostname"), format!("{hostname}\n").as_bytes())?;
    let resolv = match config.dns_config.as_ref().map(resolv_content) {
        Some(text) if !text.is_empty() => text.into_bytes(),
        _ => read_or_empty(NODE_RESOLV_CONF)?,
    };
    write_whole(&dir.join("resolv.conf"), &resolv)?;
    write_whole(&dir.join("hosts"), &read_or_empty(NODE_HOSTS)?)?;
    Ok(())
}

/// Removes the sandbox's files; gone already is not an error.
pub(crate) fn remove(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// `resolv.conf` as containerd writes it from CRI's DNS config: search, nameservers,
/// options; empty when the config has none of them.
fn resolv_content(dns: &DnsConfig) -> String {
    let mut text = String::new();
    if !dns.searches.is_empty() {
        text += &format!("search {}\n", dns.searches.join(" "));
    }
    for server in &dns.servers {
        text += &format!("nameserver {server}\n");
    }
    if !dns.options.is_empty() {
        text += &format!("options {}\n", dns.options.join(" "));
    }
    text
}

fn node_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

fn read_or_empty(path: &str) -> std::io::Result<Vec<u8>> {
    match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        read => read,
    }
}

/// Written under a temporary name and renamed, so a reader never sees half of it;
/// readable by all, as a container's user may be anyone.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes)?;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o644))?;
    std::fs::rename(&partial, path)
}

/// Which root a container's mounts are made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Root {
    /// The node's (a privileged container's): a mount point must be there already.
    Node,
    /// Its own (a sandboxed container's), where any mount point is made.
    Own,
}

/// The bind mounts of a container with `mounts`, checked when it is created: those
/// of a sandboxed container, whose root is its own ([`binds_in`]).
pub(crate) fn binds(mounts: &[Mount], files: Option<&Path>) -> Result<Vec<Bind>, String> {
    binds_in(mounts, files, Root::Own)
}

/// The bind mounts of a container with `mounts` in a sandbox whose files are in
/// `files` (none: the node's /etc files stay), made in `root`, parents before
/// children; the error names a `container_path` that cannot be mounted, and why.
pub(crate) fn binds_in(
    mounts: &[Mount],
    files: Option<&Path>,
    root: Root,
) -> Result<Vec<Bind>, String> {
    let mut wanted: Vec<(PathBuf, PathBuf, bool)> = Vec::new();
    for mount in mounts {
        let target = Path::new(&mount.container_path);
        if !target.is_absolute() || target.components().any(|c| c == Component::ParentDir) {
            return Err(format!(
                "mount path {:?} must be an absolute path without \"..\"",
                mount.container_path
            ));
        }
        wanted.push((
            PathBuf::from(&mount.host_path),
            clean(target),
            mount.readonly,
        ));
    }
    if let Some(files) = files {
        for (name, at) in [
            ("hosts", "/etc/hosts"),
            ("hostname", "/etc/hostname"),
            ("resolv.conf", "/etc/resolv.conf"),
        ] {
            let at = PathBuf::from(at);
            // Where the node has no such file, a privileged process finds none
            // either (it cannot be made on the node); a container's own mount there
            // wins.
            if !wanted.iter().any(|(_, t, _)| *t == at) && (root == Root::Own || at.exists()) {
                wanted.push((files.join(name), at, false));
            }
        }
    }
    // Parents first, as containerd sorts them: a volume inside another is mounted in it.
    wanted.sort_by_key(|(_, target, _)| target.components().count());
    let mut out: Vec<Bind> = Vec::with_capacity(wanted.len());
    for (source, target, readonly) in wanted {
        let source_meta = std::fs::metadata(&source).map_err(|e| {
            format!(
                "mount path {}: its source {} cannot be read: {e}",
                target.display(),
                source.display()
            )
        })?;
        let make_target = match std::fs::metadata(&target) {
            _ if root == Root::Own => true,
            Ok(meta) => {
                if meta.is_dir() != source_meta.is_dir() {
                    return Err(format!(
                        "mount path {}: the node has a {} there and the source {} is a {}",
                        target.display(),
                        kind(meta.is_dir()),
                        source.display(),
                        kind(source_meta.is_dir())
                    ));
                }
                false
            }
            Err(_)
                if out
                    .iter()
                    .any(|b| target.starts_with(&b.target) && b.target != target) =>
            {
                true
            }
            Err(_) => {
                return Err(format!(
                    "mount path {} does not exist on this node: a process container shares the node's root file system, where the runtime makes no directory; mount the volume at a path that exists (or inside another of the container's volumes)",
                    target.display()
                ));
            }
        };
        out.push(Bind {
            source,
            target,
            readonly,
            make_target,
        });
    }
    Ok(out)
}

fn kind(dir: bool) -> &'static str {
    if dir { "directory" } else { "file" }
}

/// `path` without `.` components or a trailing slash, so that paths compare.
fn clean(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| *c != Component::CurDir)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(host: &Path, at: &str, readonly: bool) -> Mount {
        Mount {
            container_path: at.into(),
            host_path: host.display().to_string(),
            readonly,
            ..Default::default()
        }
    }

    #[test]
    fn resolv_conf_is_written_as_containerd_writes_it() {
        let dns = DnsConfig {
            servers: vec!["10.0.0.10".into(), "1.1.1.1".into()],
            searches: vec!["ns.svc.cluster.local".into(), "svc.cluster.local".into()],
            options: vec!["ndots:5".into(), "edns0".into()],
        };
        assert_eq!(
            resolv_content(&dns),
            "search ns.svc.cluster.local svc.cluster.local\nnameserver 10.0.0.10\nnameserver 1.1.1.1\noptions ndots:5 edns0\n"
        );
        assert_eq!(resolv_content(&DnsConfig::default()), "");
        let dir = tempfile::tempdir().unwrap();
        let config = PodSandboxConfig {
            hostname: "web-0".into(),
            dns_config: Some(dns),
            ..Default::default()
        };
        write(dir.path(), &config, true).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("hostname")).unwrap(),
            "web-0\n"
        );
        assert!(
            std::fs::read_to_string(dir.path().join("resolv.conf"))
                .unwrap()
                .starts_with("search ns.svc")
        );
        // On the node's UTS namespace the hostname is the node's; no DNS config is the node's.
        write(dir.path(), &PodSandboxConfig::default(), false).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("hostname")).unwrap(),
            format!("{}\n", node_hostname())
        );
        assert_eq!(
            std::fs::read(dir.path().join("resolv.conf")).unwrap(),
            read_or_empty(NODE_RESOLV_CONF).unwrap()
        );
        remove(dir.path()).unwrap();
        remove(dir.path()).unwrap();
    }

    #[test]
    fn binds_go_parents_first_and_refuse_paths_the_node_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let volume = dir.path().join("v");
        let file = dir.path().join("f");
        std::fs::create_dir(&volume).unwrap();
        std::fs::write(&file, "x").unwrap();
        let node_dir = dir.path().join("node");
        std::fs::create_dir(&node_dir).unwrap();
        let at = node_dir.display().to_string();
        let files = dir.path().join("sandbox");
        write(&files, &PodSandboxConfig::default(), false).unwrap();
        let binds = binds_in(
            &[
                mount(&volume, &format!("{at}/inner/deeper"), true),
                mount(&volume, &at, false),
                mount(&file, "/etc/hosts", true),
            ],
            Some(&files),
            Root::Node,
        )
        .unwrap();
        let targets: Vec<_> = binds
            .iter()
            .map(|b| b.target.display().to_string())
            .collect();
        assert_eq!(targets[0], "/etc/hosts");
        assert_eq!(binds[0].source, file, "the container's own /etc/hosts wins");
        assert_eq!(targets.last().unwrap(), &format!("{at}/inner/deeper"));
        let nested = binds.last().unwrap();
        assert!(nested.make_target && nested.readonly, "{nested:?}");
        assert!(!binds.iter().any(|b| b.source == files.join("hosts")));
        if Path::new("/etc/resolv.conf").exists() {
            assert!(binds.iter().any(|b| b.source == files.join("resolv.conf")));
        }
        let missing = [mount(&volume, "/no-such-dir-on-the-node/data", false)];
        let error = binds_in(&missing, None, Root::Node).unwrap_err();
        assert!(
            error.contains("/no-such-dir-on-the-node/data does not exist"),
            "{error}"
        );
        let error = binds_in(&[mount(&volume, "/etc/hosts", false)], None, Root::Node).unwrap_err();
        assert!(error.contains("the node has a file there"), "{error}");
        // A sandboxed container's root is its own: any path can be made there.
        let own = super::binds(&missing, Some(&files)).unwrap();
        assert!(
            own.iter()
                .any(|b| b.target == Path::new("/no-such-dir-on-the-node/data"))
        );
        assert!(own.iter().any(|b| b.target == Path::new("/etc/hostname")));
        let error = super::binds(&[mount(&volume, "data", false)], None).unwrap_err();
        assert!(error.contains("absolute"), "{error}");
    }
}
