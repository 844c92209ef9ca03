//! A CNI 1.0.0 runtime: connects a pod's network namespace by running the plugins of
//! the network configured in a directory, as libcni does for containerd and CRI-O.
//!
//! Every plugin call is a child process whose `CNI_*` variables are set for that child
//! only (the runtime's own environment is shared by its threads), with the plugin's
//! config on stdin: its object from the list plus the network's `name` and
//! `cniVersion`, the previous plugin's result (`prevResult`) and the runtime
//! arguments it declares in `capabilities` (`runtimeConfig.portMappings`). The result
//! of an ADD is cached under the runtime's root, with the config it was made with, so
//! that DEL runs the same plugins in reverse with that result even if the config
//! changed meanwhile; a DEL of what was never added is not an error.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;

/// The interface CNI makes in the pod's namespace.
const IFNAME: &str = "eth0";

/// What went wrong connecting or disconnecting a pod.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("read the CNI config in {dir}: {source}")]
    ReadConfig {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CNI config {file}: {why}")]
    BadConfig { file: PathBuf, why: String },
    #[error("CNI plugin {plugin} is not in {dirs}")]
    PluginNotFound { plugin: String, dirs: String },
    #[error("CNI plugin {plugin} {command}: {why}")]
    PluginFailed {
        plugin: String,
        command: &'static str,
        why: String,
    },
    #[error("CNI cache {file}: {source}")]
    Cache {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

/// A port of the node forwarded to the pod (`hostPort`), as the `portmap` plugin reads
/// `runtimeConfig.portMappings`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PortMapping {
    pub host_port: i32,
    pub container_port: i32,
    pub protocol: String,
    #[serde(rename = "hostIP", default, skip_serializing_if = "String::is_empty")]
    pub host_ip: String,
}

/// The pod a network is attached for.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pod {
    /// The sandbox's id: CNI's container id.
    pub id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The pinned network namespace.
    pub netns: PathBuf,
    pub port_mappings: Vec<PortMapping>,
}

/// A loaded network configuration: a `.conflist`, or a single plugin's `.conf`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Network {
    pub name: String,
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub plugins: Vec<Value>,
}

/// What libcni keeps of an ADD, and what a DEL needs.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CacheEntry {
    kind: String,
    container_id: String,
    if_name: String,
    network_name: String,
    netns: PathBuf,
    cni_args: String,
    capability_args: Value,
    config: Network,
    /// The last plugin's result; none while the ADD runs or after it failed.
    result: Option<Value>,
}

/// The default network: a bridge on the node with host-local IPAM on its pod CIDR,
/// and `portmap` for hostPorts.
#[derive(Clone, Debug)]
pub(crate) struct DefaultNetwork {
    /// The node's pod CIDRs: one, or an IPv4 and an IPv6 one.
    pub subnets: Vec<String>,
    pub bridge: String,
    /// Where host-local records the addresses it hands out.
    pub ipam_dir: PathBuf,
}

/// The name of the conflist written when the config dir holds none.
pub(crate) const DEFAULT_CONFLIST: &str = "10-trellis.conflist";

impl DefaultNetwork {
    pub(crate) fn conflist(&self) -> Value {
        let ranges: Vec<Value> = self
            .subnets
            .iter()
            .map(|subnet| json!([{ "subnet": subnet }]))
            .collect();
        let routes: Vec<Value> = self
            .subnets
            .iter()
            .map(|subnet| json!({ "dst": if subnet.contains(':') { "::/0" } else { "0.0.0.0/0" } }))
            .collect();
        // No `ipMasq`: the bridge would masquerade whatever leaves the node's own
        // range, pod-to-pod traffic to other nodes included. The node agent
        // masquerades only what leaves the cluster CIDR.
        json!({
            "cniVersion": "1.0.0",
            "name": "trellis",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "ranges": ranges,
                        "routes": routes,
                        "dataDir": self.ipam_dir,
                    }
                },
                {
                    "type": "portmap",
                    "capabilities": { "portMappings": true },
                    "snat": true
                }
            ]
        })
    }
}

/// Runs the plugins of the network configured in `conf_dir`.
#[derive(Clone, Debug)]
pub(crate) struct Cni {
    pub conf_dir: PathBuf,
    pub bin_dirs: Vec<PathBuf>,
    /// Where ADD results are cached.
    pub cache_dir: PathBuf,
}

impl Cni {
    /// Writes `network` as the default conflist unless the config dir already holds a
    /// network; returns whether it wrote it.
    pub(crate) fn write_default(&self, network: &DefaultNetwork) -> Result<bool> {
        let read = |source| Error::ReadConfig {
            dir: self.conf_dir.clone(),
            source,
        };
        if !config_files(&self.conf_dir).map_err(read)?.is_empty() {
            return Ok(false);
        }
        std::fs::create_dir_all(&self.conf_dir).map_err(read)?;
        let file = self.conf_dir.join(DEFAULT_CONFLIST);
        let text = serde_json::to_vec_pretty(&network.conflist()).unwrap_or_default();
        // Written aside and renamed, so a reader never sees half a config.
        let partial = file.with_extension("partial");
        std::fs::write(&partial, text)
            .and_then(|()| std::fs::rename(&partial, &file))
            .map_err(read)?;
        Ok(true)
    }

    /// The network configured: the first `*.conflist` in lexical order, else the first
    /// `*.conf` or `*.json`, as libcni picks; none when the directory has neither.
    pub(crate) fn load(&self) -> Result<Option<Network>> {
        let files = config_files(&self.conf_dir).map_err(|source| Error::ReadConfig {
            dir: self.conf_dir.clone(),
            source,
        })?;
        let Some(file) = files.into_iter().next() else {
            return Ok(None);
        };
        let bad = |why: String| Error::BadConfig {
            file: file.clone(),
            why,
        };
        let text = std::fs::read(&file).map_err(|e| bad(e.to_string()))?;
        let value: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        let string = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_string);
        let name = string("name").ok_or_else(|| bad("no name".into()))?;
        let cni_version = string("cniVersion").unwrap_or_else(|| "0.1.0".into());
        let plugins = match value.get("plugins") {
            Some(Value::Array(plugins)) if !plugins.is_empty() => plugins.clone(),
            Some(_) => return Err(bad("no plugins".into())),
            None => vec![value.clone()],
        };
        if let Some(i) = plugins
            .iter()
            .position(|p| p.get("type").and_then(Value::as_str).is_none())
        {
            return Err(bad(format!("plugin {i} has no type")));
        }
        Ok(Some(Network {
            name,
            cni_version,
            plugins,
        }))
    }

    /// Connects `pod` to `network`: runs each plugin's ADD in order and returns the
    /// pod's addresses. On a failure, what was added is deleted again.
    pub(crate) async fn add(&self, network: &Network, pod: &Pod) -> Result<Vec<IpAddr>> {
        let mut entry = CacheEntry {
            kind: "cniCacheV1".into(),
            container_id: pod.id.clone(),
            if_name: IFNAME.into(),
            network_name: network.name.clone(),
            netns: pod.netns.clone(),
            cni_args: cni_args(pod),
            capability_args: json!({ "portMappings": pod.port_mappings }),
            config: network.clone(),
            result: None,
        };
        // Cached before the plugins run, so a DEL after a crash mid-ADD knows them.
        self.save(&entry)?;
        let mut result: Option<Value> = None;
        for plugin in &network.plugins {
            match self.call("ADD", &entry, plugin, result.as_ref()).await {
                Ok(Some(next)) => result = Some(next),
                Ok(None) => {}
                Err(e) => {
                    entry.result = result;
                    // The sandbox is not made, so no DEL will come for it: what a
                    // failed DEL leaves stays cached, for an operator to find.
                    match self.delete(&entry).await {
                        Ok(()) => {
                            let _ = std::fs::remove_file(self.cache_file(&pod.id));
                        }
                        Err(del) => {
                            tracing::warn!(sandbox = %pod.id, "failed to clean up after a failed CNI ADD: {del}");
                        }
                    }
                    return Err(e);
                }
            }
        }
        entry.result = result;
        self.save(&entry)?;
        Ok(entry.result.as_ref().map(addresses).unwrap_or_default())
    }

    /// Disconnects the pod of sandbox `id`: each plugin's DEL in reverse order, with the
    /// cached ADD result, then the cache entry. Nothing cached: nothing to do.
    pub(crate) async fn del(&self, id: &str) -> Result<()> {
        let Some(entry) = self.cached(id)? else {
            return Ok(());
        };
        self.delete(&entry).await?;
        let file = self.cache_file(id);
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::Cache { file, source: e })
            }
            _ => Ok(()),
        }
    }

    async fn delete(&self, entry: &CacheEntry) -> Result<()> {
        for plugin in entry.config.plugins.iter().rev() {
            self.call("DEL", entry, plugin, entry.result.as_ref())
                .await?;
        }
        Ok(())
    }

    /// Runs one plugin's `command`; its result, if it printed one.
    async fn call(
        &self,
        command: &'static str,
        entry: &CacheEntry,
        plugin: &Value,
        prev_result: Option<&Value>,
    ) -> Result<Option<Value>> {
        let kind = plugin
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let failed = |why: String| Error::PluginFailed {
            plugin: kind.clone(),
            command,
            why,
        };
        let program = self
            .bin_dirs
            .iter()
            .map(|dir| dir.join(&kind))
            .find(|path| path.is_file())
            .ok_or_else(|| Error::PluginNotFound {
                plugin: kind.clone(),
                dirs: self.cni_path(),
            })?;
        let stdin = serde_json::to_vec(&plugin_config(
            &entry.config,
            plugin,
            prev_result,
            &entry.capability_args,
        ))
        .unwrap_or_default();
        let path =
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        let mut child = tokio::process::Command::new(&program)
            .env_clear()
            .env("PATH", path)
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &entry.container_id)
            .env("CNI_NETNS", &entry.netns)
            .env("CNI_IFNAME", &entry.if_name)
            .env("CNI_ARGS", &entry.cni_args)
            .env("CNI_PATH", self.cni_path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| failed(format!("cannot run {}: {e}", program.display())))?;
        if let Some(mut input) = child.stdin.take() {
            input
                .write_all(&stdin)
                .await
                .map_err(|e| failed(format!("cannot write its config: {e}")))?;
        }
        let output = child
            .wait_with_output()
            .await
            .map_err(|e| failed(format!("cannot wait for it: {e}")))?;
        if !output.status.success() {
            return Err(failed(plugin_error(&output)));
        }
        if output.stdout.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        serde_json::from_slice(&output.stdout)
            .map(Some)
            .map_err(|e| failed(format!("its result is not JSON: {e}")))
    }

    fn cni_path(&self) -> String {
        self.bin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    fn cache_file(&self, id: &str) -> PathBuf {
        self.cache_dir.join(format!("{id}-{IFNAME}"))
    }

    fn save(&self, entry: &CacheEntry) -> Result<()> {
        let file = self.cache_file(&entry.container_id);
        let text = serde_json::to_vec(entry).unwrap_or_default();
        let partial = file.with_extension("partial");
        std::fs::create_dir_all(&self.cache_dir)
            .and_then(|()| std::fs::write(&partial, text))
            .and_then(|()| std::fs::rename(&partial, &file))
            .map_err(|source| Error::Cache { file, source })
    }

    fn cached(&self, id: &str) -> Result<Option<CacheEntry>> {
        let file = self.cache_file(id);
        match std::fs::read(&file) {
            Ok(text) => serde_json::from_slice(&text)
                .map(Some)
                .map_err(|e| Error::Cache {
                    file,
                    source: std::io::Error::other(e),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Cache { file, source }),
        }
    }
}

/// The config files of `dir` libcni would consider, the one it picks first: the
/// `*.conflist` files in lexical order, then the `*.conf` and `*.json` ones. A
/// missing directory has none.
fn config_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut lists = Vec::new();
    let mut singles = Vec::new();
    for entry in entries {
        let path = entry?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("conflist") => lists.push(path),
            Some("conf" | "json") => singles.push(path),
            _ => {}
        }
    }
    lists.sort();
    singles.sort();
    lists.extend(singles);
    Ok(lists)
}

/// `CNI_ARGS`: the pod's identity, as the kubelet's runtimes pass it.
fn cni_args(pod: &Pod) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
        pod.namespace, pod.name, pod.id, pod.uid
    )
}

/// What a plugin reads on stdin: its own object with the network's name and version,
/// the previous result, and the runtime arguments it declares as capabilities.
fn plugin_config(
    network: &Network,
    plugin: &Value,
    prev_result: Option<&Value>,
    capability_args: &Value,
) -> Value {
    let mut config = plugin.clone();
    let Some(object) = config.as_object_mut() else {
        return config;
    };
    object.insert("name".into(), json!(network.name));
    object.insert("cniVersion".into(), json!(network.cni_version));
    if let Some(prev) = prev_result {
        object.insert("prevResult".into(), prev.clone());
    }
    let declared: BTreeMap<String, bool> = plugin
        .get("capabilities")
        .cloned()
        .and_then(|c| serde_json::from_value(c).ok())
        .unwrap_or_default();
    let runtime_config: serde_json::Map<String, Value> = declared
        .into_iter()
        .filter(|&(_, on)| on)
        .filter_map(|(name, _)| Some((name.clone(), capability_args.get(&name)?.clone())))
        .collect();
    if !runtime_config.is_empty() {
        object.insert("runtimeConfig".into(), Value::Object(runtime_config));
    }
    config
}

/// A failed plugin's error: CNI's error JSON on stdout (`code`, `msg`, `details`),
/// else what it wrote to stderr.
fn plugin_error(output: &std::process::Output) -> String {
    #[derive(Deserialize)]
    struct CniError {
        code: Option<u32>,
        msg: Option<String>,
        details: Option<String>,
    }
    match serde_json::from_slice::<CniError>(&output.stdout) {
        Ok(error) => {
            let mut why = error.msg.unwrap_or_else(|| "failed".into());
            if let Some(details) = error.details.filter(|d| !d.is_empty()) {
                why = format!("{why}: {details}");
            }
            match error.code {
                Some(code) => format!("{why} (CNI error {code})"),
                None => why,
            }
        }
        Err(_) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            format!("{} ({})", stderr.trim(), output.status)
        }
    }
}

/// The addresses of a result: CNI 0.3.0 and later list `ips`, 0.1 and 0.2 `ip4`/`ip6`;
/// IPv4 first.
fn addresses(result: &Value) -> Vec<IpAddr> {
    let mut found: Vec<IpAddr> = match result.get("ips").and_then(Value::as_array) {
        Some(ips) => ips
            .iter()
            .filter_map(|ip| ip.get("address").and_then(Value::as_str))
            .filter_map(address)
            .collect(),
        None => ["ip4", "ip6"]
            .iter()
            .filter_map(|key| result.get(key)?.get("ip")?.as_str())
            .filter_map(address)
            .collect(),
    };
    found.sort_by_key(|ip| ip.is_ipv6());
    found
}

/// The address of a CIDR (`10.42.0.5/24`).
fn address(cidr: &str) -> Option<IpAddr> {
    cidr.split('/').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::netns;

    #[test]
    fn picks_as_libcni() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "20-b.conf",
            "10-a.json",
            "30-c.conflist",
            "40-d.conflist",
            "x.txt",
        ] {
            std::fs::write(dir.path().join(name), "{}").unwrap();
        }
        let files = config_files(dir.path()).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["30-c.conflist", "40-d.conflist", "10-a.json", "20-b.conf"]
        );
        assert!(
            config_files(&dir.path().join("missing"))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn stdin_of_a_plugin() {
        let network = Network {
            name: "net".into(),
            cni_version: "1.0.0".into(),
            plugins: vec![],
        };
        let plugin =
            json!({"type": "portmap", "capabilities": {"portMappings": true, "bandwidth": true}});
        let args =
            json!({"portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]});
        let prev = json!({"ips": [{"address": "10.0.0.2/24"}]});
        let config = plugin_config(&network, &plugin, Some(&prev), &args);
        assert_eq!(config["name"], "net");
        assert_eq!(config["cniVersion"], "1.0.0");
        assert_eq!(config["prevResult"], prev);
        assert_eq!(config["runtimeConfig"], args);
        let bridge = plugin_config(&network, &json!({"type": "bridge"}), None, &args);
        assert!(bridge.get("runtimeConfig").is_none() && bridge.get("prevResult").is_none());
    }

    #[test]
    fn results_and_errors() {
        let v1 = json!({"ips": [{"address": "fd00::5/64"}, {"address": "10.1.0.5/24", "gateway": "10.1.0.1"}]});
        assert_eq!(
            addresses(&v1),
            [
                "10.1.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        let v02 = json!({"ip4": {"ip": "10.2.0.3/16"}});
        assert_eq!(addresses(&v02), ["10.2.0.3".parse::<IpAddr>().unwrap()]);
        use std::os::unix::process::ExitStatusExt as _;
        let output = std::process::Output {
            status: std::process::ExitStatus::from_raw(256),
            stdout:
                br#"{"cniVersion":"1.0.0","code":7,"msg":"invalid config","details":"no subnet"}"#
                    .to_vec(),
            stderr: Vec::new(),
        };
        assert_eq!(
            plugin_error(&output),
            "invalid config: no subnet (CNI error 7)"
        );
    }

    /// A plugin that records its command, name and environment in `log` and fails its
    /// ADD with a CNI error when its name says so.
    fn fake_plugin(bin: &Path, name: &str, log: &Path) {
        use std::os::unix::fs::PermissionsExt as _;
        let fail = if name.starts_with("fail") {
            r#"[ "$CNI_COMMAND" = ADD ] && { echo '{"cniVersion":"1.0.0","code":11,"msg":"no luck","details":"by design"}'; exit 1; }"#
        } else {
            ""
        };
        let script = format!(
            "#!/bin/sh\nconfig=$(cat)\necho \"$CNI_COMMAND {name} $(env | grep -c .) $CNI_ARGS $config\" >> {log}\n{fail}\n\
             [ \"$CNI_COMMAND\" = ADD ] && echo '{{\"cniVersion\":\"1.0.0\",\"ips\":[{{\"address\":\"10.9.0.7/24\"}}]}}'\nexit 0\n",
            log = log.display()
        );
        let path = bin.join(name);
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[tokio::test]
    async fn a_failed_add_is_deleted_in_reverse_and_names_the_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let log = dir.path().join("calls");
        for name in ["first", "second", "failing"] {
            fake_plugin(&bin, name, &log);
        }
        let cni = Cni {
            conf_dir: dir.path().join("net.d"),
            bin_dirs: vec![bin],
            cache_dir: dir.path().join("cache"),
        };
        let pod = Pod {
            id: "sandbox-1".into(),
            namespace: "ns".into(),
            name: "pod".into(),
            uid: "u1".into(),
            netns: dir.path().join("netns"),
            port_mappings: vec![PortMapping {
                host_port: 8080,
                container_port: 80,
                protocol: "tcp".into(),
                host_ip: String::new(),
            }],
        };
        let network = |plugins: &[&str]| Network {
            name: "fake".into(),
            cni_version: "1.0.0".into(),
            plugins: plugins
                .iter()
                .map(|p| json!({"type": p, "capabilities": {"portMappings": *p == "second"}}))
                .collect(),
        };
        let calls = || -> Vec<String> {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect()
        };

        let err = cni
            .add(&network(&["first", "second", "failing"]), &pod)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "CNI plugin failing ADD: no luck: by design (CNI error 11)"
        );
        let order: Vec<_> = calls()
            .iter()
            .map(|c| c.split(' ').take(2).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            order,
            [
                "ADD first",
                "ADD second",
                "ADD failing",
                "DEL failing",
                "DEL second",
                "DEL first"
            ]
        );
        let all = calls();
        // Only PATH and the six CNI_* variables (and what sh sets itself: PWD).
        assert!(
            all.iter().all(|c| c.split(' ').nth(2) == Some("8")),
            "{all:?}"
        );
        assert!(all[0].contains(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;K8S_POD_INFRA_CONTAINER_ID=sandbox-1;K8S_POD_UID=u1"
        ));
        assert!(all[1].contains(r#""prevResult":{"#) && all[1].contains(r#""runtimeConfig":{"portMappings":[{"containerPort":80,"hostPort":8080,"protocol":"tcp"}]}"#), "{}", all[1]);
        assert!(!all[0].contains("runtimeConfig"));
        assert_eq!(std::fs::read_dir(&cni.cache_dir).unwrap().count(), 0);

        std::fs::remove_file(&log).unwrap();
        let ips = cni.add(&network(&["first", "second"]), &pod).await.unwrap();
        assert_eq!(ips, ["10.9.0.7".parse::<IpAddr>().unwrap()]);
        cni.del(&pod.id).await.unwrap();
        cni.del(&pod.id).await.unwrap();
        let order: Vec<_> = calls()
            .iter()
            .map(|c| c.split(' ').take(2).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            order,
            ["ADD first", "ADD second", "DEL second", "DEL first"]
        );
        assert!(calls()[2].contains(r#""prevResult":{"cniVersion":"1.0.0","ips""#));
    }

    /// The pod's side of a TCP connection to `ip:port` from inside `pin`.
    fn reach(pin: &Path, ip: IpAddr, port: u16) -> bool {
        netns::run_in(pin, move || {
            std::net::TcpStream::connect_timeout(
                &(ip, port).into(),
                std::time::Duration::from_secs(2),
            )
        })
        .is_ok()
    }

    #[tokio::test]
    async fn bridge_network_as_root() {
        if !rustix::process::geteuid().is_root() || !Path::new("/usr/lib/cni/bridge").exists() {
            eprintln!("skipped: needs root and the CNI plugins (make deps)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cni = Cni {
            conf_dir: dir.path().join("net.d"),
            bin_dirs: vec![dir.path().join("nothing"), PathBuf::from("/usr/lib/cni")],
            cache_dir: dir.path().join("cache"),
        };
        let ipam_dir = dir.path().join("ipam");
        let default = DefaultNetwork {
            subnets: vec!["10.244.77.0/24".into()],
            bridge: "trellisut0".into(),
            ipam_dir: ipam_dir.clone(),
        };
        assert!(cni.write_default(&default).unwrap());
        assert!(!cni.write_default(&default).unwrap(), "written once");
        let network = cni.load().unwrap().unwrap();
        assert_eq!(network.name, "trellis");
        let mut pods = Vec::new();
        for name in ["a", "b"] {
            let pod = Pod {
                id: format!("unit-{name}-{}", std::process::id()),
                namespace: "default".into(),
                name: name.into(),
                uid: format!("uid-{name}"),
                netns: netns::pin_path(dir.path(), name),
                port_mappings: Vec::new(),
            };
            netns::create(&pod.netns).unwrap();
            let ips = cni.add(&network, &pod).await.unwrap();
            assert_eq!(ips.len(), 1, "{ips:?}");
            pods.push((pod, ips[0]));
        }
        let (a, a_ip) = &pods[0];
        let (b, b_ip) = &pods[1];
        assert_ne!(a_ip, b_ip);
        for ip in [a_ip, b_ip] {
            let IpAddr::V4(v4) = ip else { panic!("{ip}") };
            assert_eq!(v4.octets()[..3], [10, 244, 77]);
        }
        // A listener in a, reached from b and from the host.
        let listener =
            netns::run_in(&a.netns, || std::net::TcpListener::bind("0.0.0.0:8080")).unwrap();
        assert!(reach(&b.netns, *a_ip, 8080), "b reaches a");
        let from_host = std::net::TcpStream::connect_timeout(
            &(*a_ip, 8080).into(),
            std::time::Duration::from_secs(2),
        );
        assert!(from_host.is_ok(), "the host reaches a: {from_host:?}");
        drop(listener);
        let veth_count = || {
            std::fs::read_dir("/sys/class/net/trellisut0/brif")
                .map(|d| d.count())
                .unwrap_or(0)
        };
        assert_eq!(veth_count(), 2);
        for (pod, ip) in &pods {
            cni.del(&pod.id).await.unwrap();
            cni.del(&pod.id).await.unwrap();
            assert!(!ipam_dir.join("trellis").join(ip.to_string()).exists());
            netns::remove(&pod.netns).unwrap();
        }
        assert_eq!(veth_count(), 0, "DEL removed the veths");
        assert!(cni.del("never-added").await.is_ok());
        assert_eq!(std::fs::read_dir(&cni.cache_dir).unwrap().count(), 0);
        let _ = std::process::Command::new("ip")
            .args(["link", "del", "trellisut0"])
            .status();
    }
}
