//! The service proxy: the semantics of kube-proxy's nftables mode (ClusterIP, NodePort,
//! session affinity, traffic policies, hairpin masquerade, reject on no endpoints) kept
//! in one nftables table of its own from the Services and EndpointSlices the node's
//! informers hold. [`rules`] says what the table holds; [`Proxier`] keeps it, one
//! `nft -f -` transaction per sync.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::watcher;
use tokio::io::AsyncWriteExt as _;
use tracing::{debug, info, warn};
use trellis_api::Shutdown;
use trellis_client::informer::{BY_LABEL, SharedInformers};

mod conntrack;
pub mod rules;

use rules::{Part, RenderConfig, Transaction};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// What the proxy serves and how often it resyncs.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub node_name: String,
    /// Addresses NodePorts answer on (the node's InternalIPs); empty: every local address.
    pub node_ips: Vec<IpAddr>,
    /// The cluster's pod CIDRs: traffic from outside them to a ClusterIP is masqueraded
    /// (kube-proxy's --cluster-cidr); empty: masquerade only hairpin and NodePort traffic.
    pub cluster_cidrs: Vec<String>,
    /// The ClusterIP ranges (`--service-cluster-ip-range`): a new connection to an
    /// address in them that no Service holds is dropped, as kube-proxy does once it
    /// knows them; empty: only unserved ports of allocated ClusterIPs are refused.
    pub service_cidrs: Vec<String>,
    /// Service IPs served on this node itself (the kube-dns ClusterIP): never DNATed.
    pub local_service_ips: Vec<IpAddr>,
    /// Period of the drift check (the table read back and compared; repaired by a full
    /// sync when it differs).
    pub sync_period: Duration,
    /// The shortest time between two syncs, which batches changes.
    pub min_sync_interval: Duration,
    /// The table's name (`trellis-proxy`).
    pub table: String,
    /// Whether the table is deleted when the proxy stops (off: a restarted proxy finds
    /// the rules still serving, and replaces them in one transaction, as kube-proxy
    /// leaves them).
    pub remove_on_stop: bool,
}

impl ProxyConfig {
    pub fn new(node_name: &str, node_ips: Vec<IpAddr>) -> Self {
        Self {
            node_name: node_name.to_owned(),
            node_ips,
            cluster_cidrs: Vec::new(),
            service_cidrs: Vec::new(),
            local_service_ips: Vec::new(),
            sync_period: Duration::from_secs(30),
            min_sync_interval: Duration::from_secs(1),
            table: "trellis-proxy".to_owned(),
            remove_on_stop: false,
        }
    }

    fn node_ipv4s(&self) -> Vec<Ipv4Addr> {
        self.node_ips
            .iter()
            .filter_map(|ip| match ip {
                IpAddr::V4(ip) => Some(*ip),
                IpAddr::V6(_) => None,
            })
            .collect()
    }

    fn render_config(&self) -> RenderConfig {
        RenderConfig {
            node_name: self.node_name.clone(),
            local_service_ips: self
                .local_service_ips
                .iter()
                .filter_map(|ip| match ip {
                    IpAddr::V4(ip) => Some(*ip),
                    IpAddr::V6(_) => None,
                })
                .collect(),
        }
    }

    fn cluster_cidrs_v4(&self) -> Vec<String> {
        v4_only(&self.cluster_cidrs)
    }

    fn service_cidrs_v4(&self) -> Vec<String> {
        v4_only(&self.service_cidrs)
    }
}

fn v4_only(cidrs: &[String]) -> Vec<String> {
    cidrs.iter().filter(|c| !c.contains(':')).cloned().collect()
}

/// Runs `nft -f -` with `text` as one transaction, in the calling thread's network
/// namespace.
pub async fn nft_apply(text: &str) -> anyhow::Result<()> {
    let mut child = tokio::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("running nft (the nftables package)")?;
    let mut stdin = child.stdin.take().context("nft's stdin")?;
    let input = text.as_bytes().to_vec();
    let write = tokio::spawn(async move {
        let r = stdin.write_all(&input).await;
        drop(stdin);
        r
    });
    let out = child.wait_with_output().await?;
    write.await??;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        bail!(
            "nft -f failed ({}): {}",
            out.status,
            stderr.lines().take(12).collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// A long-lived `nft -i`, for small transactions: a new `nft` process pays for its
/// start and for reading the table's declarations (about 15 ms per transaction that
/// deletes elements, with nft 1.0.6), this one only for what changed since its last
/// transaction (about 2 ms). Each transaction is one line; the error of a command that
/// cannot succeed (listing a table that does not exist) marks its end on stderr.
#[derive(Debug)]
struct NftSession {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stderr: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
    marker: u64,
}

impl NftSession {
    fn start() -> anyhow::Result<Self> {
        let mut child = tokio::process::Command::new("nft")
            .arg("-i")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("running nft -i (the nftables package)")?;
        let stdin = child.stdin.take().context("nft's stdin")?;
        let stderr = child.stderr.take().context("nft's stderr")?;
        Ok(Self {
            child,
            stdin,
            stderr: tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stderr)),
            marker: 0,
        })
    }

    async fn apply(&mut self, text: &str) -> anyhow::Result<()> {
        self.marker += 1;
        let marker = format!("trellis-proxy-end-{}-{}", std::process::id(), self.marker);
        let mut line: String = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
        line.push('\n');
        line.push_str(&format!("list table ip {marker}\n"));
        self.stdin.write_all(line.as_bytes()).await?;
        self.stdin.flush().await?;
        let mut before = Vec::new();
        loop {
            let Some(l) = self.stderr.next_line().await? else {
                let status = self.child.wait().await?;
                bail!("nft -i ended ({status}): {}", before.join("\n"));
            };
            if l.contains(&marker) {
                // The caret line under the echoed command.
                let _ = self.stderr.next_line().await?;
                // The marker's own error line.
                before.pop();
                break;
            }
            before.push(l);
        }
        if before.iter().any(|l| !l.trim().is_empty()) {
            bail!(
                "nft transaction failed: {}",
                before
                    .iter()
                    .take(12)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        Ok(())
    }
}

/// Runs `nft args…` and returns its output.
async fn nft_output(args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new("nft")
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .context("running nft (the nftables package)")?;
    if !out.status.success() {
        bail!(
            "nft {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The table's chains and their rule counts, and its sets and maps, as `nft -j -t`
/// lists them (no elements: the read-back stays cheap with 100,000 of them).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Shape {
    pub chains: HashMap<String, usize>,
    pub sets: BTreeSet<String>,
}

/// Up to this many Services, the drift check reads rules back too: listing rules makes
/// nft 1.0.6 read every set element (3.5 s with 100,000 endpoints), while chains, sets
/// and maps alone come back in milliseconds at any size.
pub const RULE_CHECK_MAX_SERVICES: usize = 1000;

/// Reads the table back; `None` when there is none. `rules`: the rules of each chain
/// counted too (else every count is 0).
pub async fn read_shape(table: &str, rules: bool) -> anyhow::Result<Option<Shape>> {
    let listings: Vec<Vec<&str>> = if rules {
        vec![vec!["-j", "-t", "list", "table", "ip", table]]
    } else {
        vec![
            vec!["-j", "list", "chains", "ip"],
            vec!["-j", "-t", "list", "sets", "ip"],
            vec!["-j", "-t", "list", "maps", "ip"],
        ]
    };
    let mut shape = Shape::default();
    let mut found = false;
    for args in listings {
        let text = match nft_output(&args).await {
            Ok(text) => text,
            Err(e) if e.to_string().contains("No such file") => return Ok(None),
            Err(e) => return Err(e),
        };
        let json: serde_json::Value = serde_json::from_str(&text)?;
        for item in json["nftables"].as_array().into_iter().flatten() {
            let Some((kind, object)) = item.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            if object["table"].as_str() != Some(table) {
                continue;
            }
            match kind.as_str() {
                "chain" => {
                    found = true;
                    if let Some(name) = object["name"].as_str() {
                        shape.chains.entry(name.to_owned()).or_default();
                    }
                }
                "rule" => {
                    if let Some(chain) = object["chain"].as_str() {
                        *shape.chains.entry(chain.to_owned()).or_default() += 1;
                    }
                }
                "set" | "map" => {
                    if let Some(name) = object["name"].as_str() {
                        shape.sets.insert(name.to_owned());
                    }
                }
                _ => {}
            }
        }
    }
    Ok(found.then_some(shape))
}

/// The proxy's state: what the table holds for each Service, and the commands that keep
/// it so.
#[derive(Debug)]
pub struct Proxier {
    config: ProxyConfig,
    render: RenderConfig,
    /// `namespace/name` → what the table holds of it.
    parts: HashMap<String, Part>,
    /// Endpoint IP → how many frontends use it (the hairpin set holds those above 0).
    hairpin: HashMap<Ipv4Addr, usize>,
    /// Shared chains in the table.
    shared: BTreeSet<String>,
    /// Changes not yet in the kernel.
    pending: Transaction,
    /// UDP frontends whose endpoint went (`Some`), or that got their first (`None`):
    /// their conntrack entries to flush after the sync. A NodePort's address is
    /// `0.0.0.0`: its entries to any address of the node.
    udp_gone: Vec<(Ipv4Addr, u16, Option<Ipv4Addr>)>,
    /// Whether the next sync writes the whole table.
    full_needed: bool,
    /// The `nft -i` of incremental syncs, started at the first.
    session: Option<NftSession>,
}

impl Proxier {
    pub fn new(config: ProxyConfig) -> Self {
        Self {
            render: config.render_config(),
            config,
            parts: HashMap::new(),
            hairpin: HashMap::new(),
            shared: BTreeSet::new(),
            pending: Transaction::default(),
            udp_gone: Vec::new(),
            full_needed: true,
            session: None,
        }
    }

    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// Records Service `key` (`namespace/name`) as it is now (`None`: deleted), with its
    /// EndpointSlices.
    pub fn update(&mut self, key: &str, service: Option<&Service>, slices: &[&EndpointSlice]) {
        let old = self.parts.remove(key).unwrap_or_default();
        let new = service
            .map(|s| rules::render_service(s, slices, &self.render, Some(&old)))
            .unwrap_or_default();
        if old == new {
            if !new.elements.is_empty() || !new.chains.is_empty() {
                self.parts.insert(key.to_owned(), new);
            }
            return;
        }
        if !new.shared_chains.is_subset(&self.shared) {
            // Only a full sync can add a shared chain (rules::PRESET_ENDPOINTS).
            self.full_needed = true;
        }
        let table = self.config.table.clone();
        self.pending.diff(&table, &old, &new, &mut self.shared);
        let mut added = Vec::new();
        let mut removed = Vec::new();
        for ip in new.endpoint_ips.difference(&old.endpoint_ips) {
            let count = self.hairpin.entry(*ip).or_default();
            *count += 1;
            if *count == 1 {
                added.push(*ip);
            }
        }
        for ip in old.endpoint_ips.difference(&new.endpoint_ips) {
            if let Some(count) = self.hairpin.get_mut(ip) {
                *count -= 1;
                if *count == 0 {
                    self.hairpin.remove(ip);
                    removed.push(*ip);
                }
            }
        }
        self.pending.hairpin(&table, &added, &removed);
        for (frontend, endpoints) in &old.udp_frontends {
            let kept = new.udp_frontends.get(frontend);
            for ip in endpoints {
                if kept.is_none_or(|k| !k.contains(ip)) {
                    self.udp_gone.push((frontend.0, frontend.1, Some(*ip)));
                }
            }
        }
        // A UDP Service that gains its first endpoint: datagrams sent while it had none
        // left entries without translation, which would keep its clients from the new
        // endpoint until they expire (kube-proxy clears them too).
        for (frontend, endpoints) in &new.udp_frontends {
            let had = old
                .udp_frontends
                .get(frontend)
                .is_some_and(|e| !e.is_empty());
            if !had && !endpoints.is_empty() {
                self.udp_gone.push((frontend.0, frontend.1, None));
            }
        }
        if !new.elements.is_empty() || !new.chains.is_empty() {
            self.parts.insert(key.to_owned(), new);
        }
    }

    /// Forces the next sync to write the whole table.
    pub fn need_full_sync(&mut self) {
        self.full_needed = true;
    }

    /// The commands of the next sync; `None` when there is nothing to do.
    pub fn sync_text(&mut self) -> Option<String> {
        if self.full_needed {
            self.shared = rules::preset_shared_chains()
                .chain(
                    self.parts
                        .values()
                        .flat_map(|p| p.shared_chains.iter().cloned()),
                )
                .collect();
            return Some(rules::full_text(
                &self.config.table,
                &self.config.node_ipv4s(),
                &self.config.cluster_cidrs_v4(),
                &self.config.service_cidrs_v4(),
                &self.parts,
            ));
        }
        (!self.pending.is_empty()).then(|| self.pending.text())
    }

    /// Records that the text of [`Self::sync_text`] is in the kernel (`ok`), or that the
    /// next sync must write everything.
    pub fn synced(&mut self, ok: bool) {
        self.pending = Transaction::default();
        self.full_needed = !ok;
    }

    /// Applies the pending changes (or the whole table) in one transaction.
    pub async fn sync(&mut self) -> anyhow::Result<()> {
        let Some(text) = self.sync_text() else {
            return Ok(());
        };
        let result = if self.full_needed {
            // Megabytes: a process of its own, fed through a pipe.
            nft_apply(&text).await
        } else {
            self.apply_in_session(&text).await
        };
        self.synced(result.is_ok());
        result?;
        for (ip, port, endpoint) in std::mem::take(&mut self.udp_gone) {
            if let Err(e) =
                conntrack::flush_udp(IpAddr::V4(ip), Some(port), endpoint.map(IpAddr::V4)).await
            {
                debug!(error = %e, "flushing UDP conntrack entries");
            }
        }
        Ok(())
    }

    /// Applies `text` through the long-lived `nft -i`, or, when that cannot run or
    /// fails, through an `nft -f` of its own (whose error is the one that counts).
    async fn apply_in_session(&mut self, text: &str) -> anyhow::Result<()> {
        if self.session.is_none() {
            match NftSession::start() {
                Ok(session) => self.session = Some(session),
                Err(e) => debug!(error = %e, "no nft -i; one nft -f per sync"),
            }
        }
        if let Some(session) = self.session.as_mut() {
            match session.apply(text).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // A fresh one next time, whatever state this one is in.
                    debug!(error = %e, "nft -i failed; retrying with nft -f");
                    self.session = None;
                }
            }
        }
        nft_apply(text).await
    }

    /// The chains and sets the table should have (rule counts of the chains).
    pub fn expected_shape(&self) -> Shape {
        let mut shape = Shape::default();
        let probe = rules::skeleton(
            &self.config.table,
            &self.config.node_ipv4s(),
            &self.config.cluster_cidrs_v4(),
            &self.config.service_cidrs_v4(),
        );
        // The skeleton's chains and sets, from its text.
        let mut current: Option<String> = None;
        for line in probe.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("chain ") {
                let name = rest.trim_end_matches(" {").to_owned();
                shape.chains.insert(name.clone(), 0);
                current = Some(name);
            } else if let Some(rest) = line.strip_prefix("set ").or(line.strip_prefix("map ")) {
                shape.sets.insert(
                    rest.split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                );
            } else if line == "}" {
                current = None;
            } else if let Some(chain) = &current
                && !line.starts_with("type ")
            {
                *shape.chains.entry(chain.clone()).or_default() += 1;
            }
        }
        for chain in &self.shared {
            let rules = rules::shared_chain_rules(chain).unwrap_or_default();
            shape.chains.insert(chain.clone(), rules.len());
        }
        for part in self.parts.values() {
            for (chain, rules) in &part.chains {
                shape.chains.insert(chain.clone(), rules.len());
            }
            shape.sets.extend(part.sets.keys().cloned());
        }
        shape
    }

    /// Reads the table back and, when it is not what was written, writes it whole.
    pub async fn repair_drift(&mut self) -> anyhow::Result<bool> {
        let rules = self.parts.len() <= RULE_CHECK_MAX_SERVICES;
        let mut expected = self.expected_shape();
        if !rules {
            expected.chains.values_mut().for_each(|count| *count = 0);
        }
        let drifted = match read_shape(&self.config.table, rules).await? {
            None => true,
            Some(found) => found != expected,
        };
        if drifted || self.full_needed {
            warn!(table = %self.config.table, "the service proxy's table differs from what it wrote; rewriting it");
            self.need_full_sync();
            self.sync().await?;
        }
        Ok(drifted)
    }

    /// Deletes the table.
    pub async fn remove(&self) -> anyhow::Result<()> {
        let table = &self.config.table;
        nft_apply(&format!("add table ip {table}\ndelete table ip {table}\n")).await
    }
}

/// The EndpointSlices of Service `namespace/name` in `slices`.
fn slices_of(
    slices: &trellis_client::informer::Informer<EndpointSlice>,
    key: &str,
) -> Vec<std::sync::Arc<EndpointSlice>> {
    let (namespace, name) = key.split_once('/').unwrap_or(("", key));
    slices
        .by_index(BY_LABEL, &format!("{SERVICE_NAME_LABEL}={name}"))
        .into_iter()
        .filter(|s| s.metadata.namespace.as_deref() == Some(namespace))
        .collect()
}

fn service_key_of_slice(slice: &EndpointSlice) -> Option<String> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    Some(format!(
        "{}/{name}",
        slice.metadata.namespace.as_deref().unwrap_or_default()
    ))
}

fn service_key(service: &Service) -> String {
    format!(
        "{}/{}",
        service.metadata.namespace.as_deref().unwrap_or_default(),
        service.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Runs until `stopped`: Services and EndpointSlices from `informers` (shared with the
/// agent), the table kept in step with them. The first sync waits for both informers'
/// lists, so that a restarted proxy never replaces a serving table with an empty one.
pub async fn run(
    config: ProxyConfig,
    client: kube::Client,
    informers: SharedInformers,
    stopped: Shutdown,
) -> anyhow::Result<()> {
    let services = informers.informer(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    );
    let slices = informers.informer(
        Api::<EndpointSlice>::all(client),
        watcher::Config::default(),
    );
    let mut service_changes = services.subscribe();
    let mut slice_changes = slices.subscribe();
    tokio::select! {
        _ = async { services.wait_synced().await; slices.wait_synced().await } => {}
        _ = stopped.wait() => return Ok(()),
    }
    let mut proxier = Proxier::new(config.clone());
    let mut dirty: HashSet<String> = HashSet::new();
    for service in services.list() {
        dirty.insert(service_key(&service));
    }
    let mut check = tokio::time::interval(config.sync_period);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    check.tick().await;
    let mut last_sync: Option<tokio::time::Instant> = None;
    loop {
        if !dirty.is_empty() || last_sync.is_none() {
            if let Some(last) = last_sync {
                let next = last + config.min_sync_interval;
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => {}
                    _ = stopped.wait() => break,
                }
            }
            // Whatever else changed meanwhile goes in the same sync.
            while let Ok(change) = service_changes.try_recv() {
                dirty.insert(service_key(change.object()));
            }
            while let Ok(change) = slice_changes.try_recv() {
                dirty.extend(service_key_of_slice(change.object()));
            }
            for key in dirty.drain() {
                let service = services.get(&key);
                let owned = slices_of(&slices, &key);
                let refs: Vec<&EndpointSlice> = owned.iter().map(|s| s.as_ref()).collect();
                proxier.update(&key, service.as_deref(), &refs);
            }
            let full = proxier.full_needed;
            let started = std::time::Instant::now();
            match proxier.sync().await {
                Ok(()) => debug!(full, elapsed = ?started.elapsed(), "service proxy synced"),
                Err(e) => {
                    warn!(error = %e, "service proxy sync failed; the next writes the whole table")
                }
            }
            if full && last_sync.is_none() {
                info!(table = %config.table, services = proxier.parts.len(), "service proxy table written");
            }
            last_sync = Some(tokio::time::Instant::now());
            continue;
        }
        tokio::select! {
            change = service_changes.recv() => match change {
                Some(change) => { dirty.insert(service_key(change.object())); }
                None => bail!("the Service informer ended"),
            },
            change = slice_changes.recv() => match change {
                Some(change) => { dirty.extend(service_key_of_slice(change.object())); }
                None => bail!("the EndpointSlice informer ended"),
            },
            _ = check.tick() => {
                if let Err(e) = proxier.repair_drift().await {
                    warn!(error = %e, "checking the service proxy's table");
                }
            }
            _ = stopped.wait() => break,
        }
    }
    if config.remove_on_stop {
        proxier.remove().await?;
    }
    Ok(())
}

/// Runs `f` on a thread of its own in a new network namespace (with `lo` down), with a
/// current-thread runtime: the processes it spawns (`nft`) start in that namespace,
/// which goes with the thread. For benchmarks and tests, which must never touch the
/// machine's own table.
pub fn in_new_netns<T: Send + 'static>(
    f: impl AsyncFnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    std::thread::Builder::new()
        .name("proxy-netns".into())
        .spawn(move || {
            // Deprecated only because other flags (CLONE_FILES) can invalidate other
            // threads' descriptors; a new network namespace cannot.
            #[allow(deprecated)]
            rustix::thread::unshare(rustix::thread::UnshareFlags::NEWNET)
                .context("a network namespace of its own (root needed)")?;
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(f())
        })?
        .join()
        .unwrap_or_else(|_| bail!("the namespace thread panicked"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rules::tests::{service, slice};

    fn root() -> bool {
        rustix::process::geteuid().is_root()
    }

    #[test]
    fn a_gone_udp_endpoint_flushes_its_cluster_ip_and_node_port_entries() {
        let mut proxier = Proxier::new(ProxyConfig::new("here", vec![]));
        let dns = service("dns", "10.43.0.5", &[("", 53, "UDP", Some(30053))]);
        let ports = [("", 5353, "UDP")];
        let two = slice(
            &ports,
            &[
                ("10.244.1.1", true, true, false, "here"),
                ("10.244.1.2", true, true, false, "here"),
            ],
        );
        proxier.update("ns/dns", Some(&dns), &[&two]);
        let any = Ipv4Addr::UNSPECIFIED;
        let cluster_ip: Ipv4Addr = "10.43.0.5".parse().unwrap();
        // The first endpoints: what was sent while there was none goes.
        assert_eq!(
            BTreeSet::from_iter(proxier.udp_gone.drain(..)),
            BTreeSet::from([(any, 30053, None), (cluster_ip, 53, None)])
        );
        let one = slice(&ports, &[("10.244.1.2", true, true, false, "here")]);
        proxier.update("ns/dns", Some(&dns), &[&one]);
        let gone = Some("10.244.1.1".parse().unwrap());
        assert_eq!(
            BTreeSet::from_iter(proxier.udp_gone.drain(..)),
            BTreeSet::from([(any, 30053, gone), (cluster_ip, 53, gone)])
        );
    }

    #[test]
    fn the_kernel_takes_a_full_sync_changes_and_a_repair() {
        if !root()
            || std::process::Command::new("nft")
                .arg("--version")
                .output()
                .is_err()
        {
            eprintln!("skipped: needs root and nft");
            return;
        }
        in_new_netns(async || {
            let mut config = ProxyConfig::new("here", vec![]);
            config.cluster_cidrs = vec!["10.244.0.0/16".into()];
            config.table = "proxy-test".into();
            let mut proxier = Proxier::new(config);
            let web = service(
                "web",
                "10.43.0.5",
                &[("http", 80, "TCP", Some(30080)), ("dns", 53, "UDP", None)],
            );
            let mut sticky = service("sticky", "10.43.0.6", &[("", 80, "TCP", Some(30081))]);
            sticky.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
            let empty = service("empty", "10.43.0.7", &[("", 80, "TCP", Some(30082))]);
            let two = slice(
                &[("http", 8080, "TCP"), ("dns", 53, "UDP"), ("", 8080, "TCP")],
                &[
                    ("10.244.1.1", true, true, false, "here"),
                    ("10.244.1.2", true, true, false, "there"),
                ],
            );
            proxier.update("ns/web", Some(&web), &[&two]);
            proxier.update("ns/sticky", Some(&sticky), &[&two]);
            proxier.update("ns/empty", Some(&empty), &[]);
            proxier.sync().await?;
            assert!(!proxier.repair_drift().await?, "no drift after a full sync");
            // One endpoint goes, one comes: elements and the affinity chain change.
            let one = slice(
                &[("http", 8080, "TCP"), ("dns", 53, "UDP"), ("", 8080, "TCP")],
                &[("10.244.1.3", true, true, false, "here")],
            );
            proxier.update("ns/web", Some(&web), &[&one]);
            proxier.update("ns/sticky", Some(&sticky), &[&one]);
            proxier.update("ns/empty", None, &[]);
            // External IPs of both policies come as elements only.
            for (name, ip, policy) in [
                ("ext", "10.43.0.8", "Cluster"),
                ("ext-local", "10.43.0.9", "Local"),
            ] {
                let mut ext = service(
                    name,
                    ip,
                    &[("http", 80, "TCP", None), ("dns", 53, "UDP", None)],
                );
                let spec = ext.spec.as_mut().unwrap();
                spec.external_ips = Some(vec![ip.replace("10.43", "192.168")]);
                spec.external_traffic_policy = Some(policy.into());
                proxier.update(&format!("ns/{name}"), Some(&ext), &[&one]);
            }
            let text = proxier.sync_text().unwrap();
            assert!(
                !text.contains("delete table"),
                "an incremental sync: {text}"
            );
            proxier.sync().await?;
            assert!(
                !proxier.repair_drift().await?,
                "no drift after an incremental sync"
            );
            let backends = nft_output(&["list", "map", "ip", "proxy-test", "backends"]).await?;
            assert!(
                backends.contains("10.244.1.3 . 8080") && !backends.contains("10.244.1.1"),
                "{backends}"
            );
            // A frontend of a size no other has finds its shared chain in the table: an
            // incremental sync, which UDP goes through too; one past the preset sizes
            // is written by a full sync.
            let ports = [("http", 8080, "TCP"), ("dns", 53, "UDP"), ("", 8080, "TCP")];
            let ips: Vec<String> = (1..=130).map(|i| format!("10.244.2.{i}")).collect();
            let three: Vec<_> = ips[..3]
                .iter()
                .map(|ip| (ip.as_str(), true, true, false, "here"))
                .collect();
            proxier.update("ns/web", Some(&web), &[&slice(&ports, &three)]);
            let text = proxier.sync_text().unwrap();
            assert!(
                !text.contains("delete table"),
                "an incremental sync: {text}"
            );
            proxier.sync().await?;
            let chain = nft_output(&["list", "chain", "ip", "proxy-test", "spread-3"]).await?;
            assert!(!chain.contains("tcp"), "spread-3 is for UDP too: {chain}");
            let many: Vec<_> = ips
                .iter()
                .map(|ip| (ip.as_str(), true, true, false, "here"))
                .collect();
            proxier.update("ns/web", Some(&web), &[&slice(&ports, &many)]);
            assert!(proxier.sync_text().unwrap().contains("delete table"));
            proxier.sync().await?;
            assert!(!proxier.repair_drift().await?, "no drift after it");
            // A chain deleted by hand comes back.
            let chain = proxier.parts["ns/sticky"]
                .chains
                .keys()
                .next()
                .unwrap()
                .clone();
            nft_apply(&format!("flush chain ip proxy-test {chain}\n")).await?;
            assert!(proxier.repair_drift().await?, "a flushed chain is drift");
            assert!(!proxier.repair_drift().await?, "repaired");
            Ok(())
        })
        .unwrap();
    }
}
