//! A pod's hostname and its managed `/etc/hosts`, as the kubelet makes them
//! (`GeneratePodHostNameAndDomain`, `ensureHostsFile`): the hostname is the pod's
//! name or `spec.hostname`, with `spec.subdomain` its FQDN
//! `<hostname>.<subdomain>.<namespace>.svc.<cluster domain>`; the hosts file, written
//! in the pod's directory (`etc-hosts`) once the pod has its IPs and mounted over each
//! container's `/etc/hosts`, holds the localhost lines, each pod IP with the FQDN and
//! hostname, and the pod's `hostAliases`. A pod on the node's network gets the node's
//! hosts file with its `hostAliases` added.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{HostAlias, Pod};

/// The first line of a hosts file the kubelet manages.
const MANAGED_HOSTS_HEADER: &str = "# Kubernetes-managed hosts file.\n";
const MANAGED_HOSTS_HEADER_HOST_NETWORK: &str = "# Kubernetes-managed hosts file (host network).\n";
/// A hostname's length the kernel takes.
const MAX_HOSTNAME: usize = 63;

/// The pod's hostname and its domain (empty without a subdomain).
pub fn hostname_and_domain(pod: &Pod, cluster_domain: &str) -> (String, String) {
    let spec = pod.spec.as_ref();
    let hostname = match spec
        .and_then(|s| s.hostname.as_deref())
        .filter(|h| !h.is_empty())
    {
        Some(name) => name.to_owned(),
        // As the kubelet: a longer name is cut, without a trailing '-' or '.'.
        None => {
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            let cut = &name[..name.len().min(MAX_HOSTNAME)];
            cut.trim_end_matches(['-', '.']).to_owned()
        }
    };
    let domain = match spec
        .and_then(|s| s.subdomain.as_deref())
        .filter(|s| !s.is_empty())
    {
        Some(subdomain) => format!(
            "{subdomain}.{}.svc.{cluster_domain}",
            pod.metadata.namespace.as_deref().unwrap_or("default")
        ),
        None => String::new(),
    };
    (hostname, domain)
}

/// The hostname the pod's UTS namespace is given: its FQDN when it asks for it
/// (`setHostnameAsFQDN`) and has one, as long as the kernel takes it.
pub fn kernel_hostname(pod: &Pod, cluster_domain: &str) -> Result<String, String> {
    let (hostname, domain) = hostname_and_domain(pod, cluster_domain);
    let fqdn = pod
        .spec
        .as_ref()
        .and_then(|s| s.set_hostname_as_fqdn)
        .unwrap_or(false);
    if !fqdn || domain.is_empty() {
        return Ok(hostname);
    }
    let full = format!("{hostname}.{domain}");
    if full.len() > 64 {
        return Err(format!(
            "failed to construct FQDN from pod hostname and cluster domain, FQDN {full} is too long (64 characters is the max, {} characters requested)",
            full.len()
        ));
    }
    Ok(full)
}

/// Where the pod's managed hosts file is, in its directory.
pub fn hosts_path(pod_dir: &Path) -> PathBuf {
    pod_dir.join("etc-hosts")
}

/// The managed hosts file of a pod with `ips`, `hostname` and `domain` and
/// `aliases` (the kubelet's `managedHostsFileContent`).
pub fn managed_hosts(
    ips: &[String],
    hostname: &str,
    domain: &str,
    aliases: &[HostAlias],
) -> String {
    let mut text = String::from(MANAGED_HOSTS_HEADER);
    text += "127.0.0.1\tlocalhost\n";
    text += "::1\tlocalhost ip6-localhost ip6-loopback\n";
    text += "fe00::0\tip6-localnet\n";
    text += "fe00::0\tip6-mcastprefix\n";
    text += "fe00::1\tip6-allnodes\n";
    text += "fe00::2\tip6-allrouters\n";
    for ip in ips {
        if domain.is_empty() {
            text += &format!("{ip}\t{hostname}\n");
        } else {
            text += &format!("{ip}\t{hostname}.{domain}\t{hostname}\n");
        }
    }
    text + &alias_lines(aliases)
}

/// The node's hosts file with the pod's aliases (the kubelet's `nodeHostsFileContent`).
pub fn node_hosts(node_hosts: &str, aliases: &[HostAlias]) -> String {
    let mut text = String::from(MANAGED_HOSTS_HEADER_HOST_NETWORK);
    text += node_hosts;
    text + &alias_lines(aliases)
}

fn alias_lines(aliases: &[HostAlias]) -> String {
    if aliases.is_empty() {
        return String::new();
    }
    let mut text = String::from("\n# Entries added by HostAliases.\n");
    for alias in aliases {
        let names = alias.hostnames.clone().unwrap_or_default();
        text += &format!("{}\t{}\n", alias.ip, names.join("\t"));
    }
    text
}

/// Writes the pod's hosts file at `path` (whole, then renamed into place): managed
/// with `ips` on its own network, else the node's (`node_file`) with its aliases.
pub fn ensure_hosts_file(
    path: &Path,
    pod: &Pod,
    ips: &[String],
    own_network: bool,
    cluster_domain: &str,
    node_file: &Path,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let aliases = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_aliases.clone())
        .unwrap_or_default();
    let text = if own_network {
        let (hostname, domain) = hostname_and_domain(pod, cluster_domain);
        managed_hosts(ips, &hostname, &domain, &aliases)
    } else {
        node_hosts(&std::fs::read_to_string(node_file)?, &aliases)
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)?;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o644))?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "team", "uid": "u"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn the_hostname_is_the_pods_name_or_its_own_with_the_subdomains_fqdn() {
        let plain = pod("web-0", serde_json::json!({"containers": []}));
        assert_eq!(
            hostname_and_domain(&plain, "cluster.local"),
            ("web-0".into(), String::new())
        );
        let named = pod(
            "web-0",
            serde_json::json!({"hostname": "db", "subdomain": "backend", "containers": []}),
        );
        assert_eq!(
            hostname_and_domain(&named, "cluster.local"),
            ("db".into(), "backend.team.svc.cluster.local".into())
        );
        assert_eq!(kernel_hostname(&named, "cluster.local").unwrap(), "db");
        let fqdn = pod(
            "web-0",
            serde_json::json!({"hostname": "db", "subdomain": "backend", "setHostnameAsFQDN": true, "containers": []}),
        );
        assert_eq!(
            kernel_hostname(&fqdn, "cluster.local").unwrap(),
            "db.backend.team.svc.cluster.local"
        );
        let long = pod(
            &format!("{}-x", "a".repeat(62)),
            serde_json::json!({"containers": []}),
        );
        assert_eq!(hostname_and_domain(&long, "").0, "a".repeat(62));
    }

    #[test]
    fn the_managed_hosts_file_reads_as_the_kubelets() {
        let aliases: Vec<HostAlias> = serde_json::from_value(serde_json::json!([
            {"ip": "10.1.2.3", "hostnames": ["foo.local", "bar.local"]},
            {"ip": "10.1.2.4", "hostnames": ["baz.local"]},
        ]))
        .unwrap();
        assert_eq!(
            managed_hosts(
                &["10.244.0.7".into(), "fd00::7".into()],
                "db",
                "backend.team.svc.cluster.local",
                &aliases
            ),
            "# Kubernetes-managed hosts file.\n\
             127.0.0.1\tlocalhost\n\
             ::1\tlocalhost ip6-localhost ip6-loopback\n\
             fe00::0\tip6-localnet\n\
             fe00::0\tip6-mcastprefix\n\
             fe00::1\tip6-allnodes\n\
             fe00::2\tip6-allrouters\n\
             10.244.0.7\tdb.backend.team.svc.cluster.local\tdb\n\
             fd00::7\tdb.backend.team.svc.cluster.local\tdb\n\
             \n\
             # Entries added by HostAliases.\n\
             10.1.2.3\tfoo.local\tbar.local\n\
             10.1.2.4\tbaz.local\n"
        );
        assert!(
            managed_hosts(&["10.0.0.1".into()], "web", "", &[])
                .ends_with("fe00::2\tip6-allrouters\n10.0.0.1\tweb\n")
        );
        assert_eq!(
            node_hosts("127.0.0.1 localhost\n", &aliases[1..]),
            "# Kubernetes-managed hosts file (host network).\n127.0.0.1 localhost\n\n# Entries added by HostAliases.\n10.1.2.4\tbaz.local\n"
        );
    }

    #[test]
    fn the_hosts_file_is_written_in_the_pods_directory() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node-hosts");
        std::fs::write(&node, "127.0.0.1 localhost node\n").unwrap();
        let path = hosts_path(&dir.path().join("pod"));
        let web = pod("web", serde_json::json!({"containers": []}));
        ensure_hosts_file(
            &path,
            &web,
            &["10.244.0.9".into()],
            true,
            "cluster.local",
            &node,
        )
        .unwrap();
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .ends_with("10.244.0.9\tweb\n")
        );
        ensure_hosts_file(&path, &web, &[], false, "cluster.local", &node).unwrap();
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .ends_with("127.0.0.1 localhost node\n")
        );
    }
}
