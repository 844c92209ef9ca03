//! The cluster's names: every record the Kubernetes DNS specification gives Services
//! and their endpoints, built when a Service or one of its EndpointSlices changes and
//! kept in one map by name, so that a query is a map lookup.
//!
//! Each Service owns the names built from it and its slices ([`Zone::set_service`]
//! replaces them all at once); a name two Services build (the PTR of an address in
//! both) answers with the records of both. Every ancestor of a name, up to the cluster
//! domain, is an empty non-terminal: it exists (NOERROR, no data) without records.
//! Pod names (`a-b-c-d.ns.pod.<domain>`) are answered from the name itself, as
//! CoreDNS' `pods insecure` mode does.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use hickory_proto::rr::rdata::{A, AAAA, CNAME, PTR, SOA, SRV, TXT};
use hickory_proto::rr::{LowerName, Name, RData, Record, RecordType};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

/// The label that ties an EndpointSlice to its Service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The version of the DNS specification the records follow, served as
/// `dns-version.<domain>` TXT.
const SPEC_VERSION: &str = "1.1.0";

/// The records of one name, by type.
#[derive(Debug, Default)]
pub(crate) struct RecordSets {
    a: Vec<Record>,
    aaaa: Vec<Record>,
    srv: Vec<Record>,
    /// The addresses of the SRV targets, for the additional section.
    srv_targets: Vec<Record>,
    cname: Vec<Record>,
    ptr: Vec<Record>,
    txt: Vec<Record>,
    soa: Vec<Record>,
    /// An ExternalName's target: its records come from wherever it lives.
    pub(crate) cname_target: Option<Name>,
}

impl RecordSets {
    /// The answer and additional records for a query of `qtype`; a CNAME answers every
    /// type.
    pub(crate) fn get(&self, qtype: RecordType) -> (&[Record], &[Record]) {
        if !self.cname.is_empty() {
            return (&self.cname, &[]);
        }
        match qtype {
            RecordType::A => (&self.a, &[]),
            RecordType::AAAA => (&self.aaaa, &[]),
            RecordType::SRV => (&self.srv, &self.srv_targets),
            RecordType::PTR => (&self.ptr, &[]),
            RecordType::TXT => (&self.txt, &[]),
            RecordType::SOA => (&self.soa, &[]),
            _ => (&[], &[]),
        }
    }

    fn extend(&mut self, other: &RecordSets) {
        self.a.extend(other.a.iter().cloned());
        self.aaaa.extend(other.aaaa.iter().cloned());
        self.srv.extend(other.srv.iter().cloned());
        self.srv_targets.extend(other.srv_targets.iter().cloned());
        self.cname.extend(other.cname.iter().cloned());
        self.ptr.extend(other.ptr.iter().cloned());
        self.txt.extend(other.txt.iter().cloned());
        self.soa.extend(other.soa.iter().cloned());
        if self.cname_target.is_none() {
            self.cname_target.clone_from(&other.cname_target);
        }
    }
}

/// What the zone says of a name.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The name's records (those of the query's type may be none: NOERROR, no data).
    Found(Arc<RecordSets>),
    /// A pod's name: its address, read from the name.
    Pod(IpAddr),
    /// A name under the zone that exists without records (NOERROR, no data).
    Empty,
    /// A name under the zone that does not exist.
    NxDomain,
    /// Not the cluster's: forward it.
    Elsewhere,
}

/// One name: its records by owner, and their union.
#[derive(Debug, Default)]
struct Node {
    owners: BTreeMap<Arc<str>, Arc<RecordSets>>,
    merged: Arc<RecordSets>,
}

impl Node {
    fn merge(&mut self) {
        self.merged = if self.owners.len() == 1 {
            self.owners.values().next().cloned().unwrap_or_default()
        } else {
            let mut all = RecordSets::default();
            for sets in self.owners.values() {
                all.extend(sets);
            }
            Arc::new(all)
        };
    }
}

/// An IPv4 range, for the reverse names of the service CIDRs.
#[derive(Clone, Copy, Debug)]
struct Ipv4Net {
    addr: u32,
    mask: u32,
}

impl Ipv4Net {
    fn parse(cidr: &str) -> Option<Self> {
        let (addr, len) = cidr.split_once('/')?;
        let addr: Ipv4Addr = addr.trim().parse().ok()?;
        let len: u32 = len.trim().parse().ok()?;
        if len > 32 {
            return None;
        }
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        Some(Self {
            addr: u32::from(addr) & mask,
            mask,
        })
    }

    fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask == self.addr
    }
}

/// The cluster domain's records.
#[derive(Debug)]
pub(crate) struct Zone {
    domain: Name,
    domain_lower: LowerName,
    reverse_v4: LowerName,
    ttl: u32,
    service_cidrs: Vec<Ipv4Net>,
    names: HashMap<LowerName, Node>,
    /// Empty non-terminals: how many names lie under each.
    parents: HashMap<LowerName, usize>,
    /// The names each owner built, to take them back.
    owned: HashMap<Arc<str>, Vec<LowerName>>,
    services: HashMap<Arc<str>, Arc<Service>>,
    slices: HashMap<String, Arc<EndpointSlice>>,
    /// The slices of each Service (`ns/name`), by the slice's key.
    slices_of: HashMap<Arc<str>, BTreeSet<String>>,
    soa: Arc<[Record]>,
    reverse_soa: Arc<[Record]>,
}

/// The key of a namespaced object: `namespace/name`.
fn key(namespace: &str, name: &str) -> Arc<str> {
    format!("{namespace}/{name}").into()
}

fn slice_service(slice: &EndpointSlice) -> Option<(String, String)> {
    let namespace = slice.metadata.namespace.clone()?;
    let service = slice
        .metadata
        .labels
        .as_ref()?
        .get(SERVICE_NAME_LABEL)?
        .clone();
    Some((namespace, service))
}

fn slice_key(slice: &EndpointSlice) -> String {
    format!(
        "{}/{}",
        slice.metadata.namespace.as_deref().unwrap_or_default(),
        slice.metadata.name.as_deref().unwrap_or_default()
    )
}

/// `a.b.c.d` → `d.c.b.a.in-addr.arpa.`; an IPv6 address by nibbles under `ip6.arpa.`.
pub(crate) fn reverse_name(ip: IpAddr) -> Option<Name> {
    let text = match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, d] = v4.octets();
            format!("{d}.{c}.{b}.{a}.in-addr.arpa.")
        }
        IpAddr::V6(v6) => {
            let mut text = String::with_capacity(72);
            for byte in v6.octets().iter().rev() {
                text.push_str(&format!("{:x}.{:x}.", byte & 0xf, byte >> 4));
            }
            text.push_str("ip6.arpa.");
            text
        }
    };
    Name::from_ascii(text).ok()
}

/// The dashed form of an address (`10-244-1-5`, `fd00--1`), CoreDNS' name for an
/// endpoint without a hostname.
fn dashed(ip: IpAddr) -> String {
    ip.to_string().replace(['.', ':'], "-")
}

impl Zone {
    pub(crate) fn new(domain: &str, ttl: u32, service_cidrs: &[String]) -> anyhow::Result<Self> {
        let domain = Name::from_ascii(format!("{}.", domain.trim_end_matches('.')))?;
        let reverse = Name::from_ascii("in-addr.arpa.")?;
        let soa = |zone: &Name| -> anyhow::Result<Arc<[Record]>> {
            // As CoreDNS' kubernetes plugin: the negative TTL is the records' TTL.
            let data = SOA::new(
                Name::from_ascii("ns.dns.")?.append_domain(&domain)?,
                Name::from_ascii("hostmaster.")?.append_domain(&domain)?,
                1,
                7200,
                1800,
                86400,
                ttl,
            );
            Ok(Arc::from(vec![Record::from_rdata(
                zone.clone(),
                ttl,
                RData::SOA(data),
            )]))
        };
        let mut zone = Self {
            domain_lower: LowerName::new(&domain),
            reverse_v4: LowerName::new(&reverse),
            ttl,
            service_cidrs: service_cidrs
                .iter()
                .filter_map(|c| Ipv4Net::parse(c))
                .collect(),
            names: HashMap::new(),
            parents: HashMap::new(),
            owned: HashMap::new(),
            services: HashMap::new(),
            slices: HashMap::new(),
            slices_of: HashMap::new(),
            soa: soa(&domain)?,
            reverse_soa: soa(&reverse)?,
            domain,
        };
        let mut fixed = Vec::new();
        let apex = RecordSets {
            soa: zone.soa.to_vec(),
            ..RecordSets::default()
        };
        fixed.push((zone.domain.clone(), apex));
        let version = Name::from_ascii("dns-version.")?.append_domain(&zone.domain)?;
        fixed.push((
            version.clone(),
            RecordSets {
                txt: vec![Record::from_rdata(
                    version,
                    ttl,
                    RData::TXT(TXT::new(vec![SPEC_VERSION.to_owned()])),
                )],
                ..RecordSets::default()
            },
        ));
        for label in ["svc.", "pod."] {
            fixed.push((
                Name::from_ascii(label)?.append_domain(&zone.domain)?,
                RecordSets::default(),
            ));
        }
        zone.replace_owner(Arc::from(""), fixed);
        Ok(zone)
    }

    /// The SOA for a negative answer about `name`.
    pub(crate) fn soa_for(&self, name: &LowerName) -> Arc<[Record]> {
        if self.reverse_v4.zone_of(name) {
            self.reverse_soa.clone()
        } else {
            self.soa.clone()
        }
    }

    /// Whether `name` is the cluster domain or under it.
    pub(crate) fn holds(&self, name: &LowerName) -> bool {
        self.domain_lower.zone_of(name)
    }

    /// What the zone says of `name`.
    pub(crate) fn lookup(&self, name: &LowerName) -> Lookup {
        if let Some(node) = self.names.get(name) {
            return Lookup::Found(node.merged.clone());
        }
        if self.parents.contains_key(name) {
            return Lookup::Empty;
        }
        if self.domain_lower.zone_of(name) {
            return match self.pod_address(name) {
                Some(ip) => Lookup::Pod(ip),
                None => Lookup::NxDomain,
            };
        }
        if self.reverse_v4.zone_of(name) {
            // The service CIDRs' reverse names are the cluster's; other addresses (pods,
            // nodes, the world) are the upstream's.
            if let Some(ip) = reverse_v4_address(name)
                && self.service_cidrs.iter().any(|net| net.contains(ip))
            {
                return Lookup::NxDomain;
            }
        }
        Lookup::Elsewhere
    }

    /// `a-b-c-d.<ns>.pod.<domain>` → `a.b.c.d`.
    fn pod_address(&self, name: &LowerName) -> Option<IpAddr> {
        let labels = usize::from(name.num_labels()) - usize::from(self.domain_lower.num_labels());
        if labels != 3 {
            return None;
        }
        let name = Name::from(name.clone());
        let mut iter = name.iter();
        let first = std::str::from_utf8(iter.next()?).ok()?;
        let _namespace = iter.next()?;
        if !iter.next()?.eq_ignore_ascii_case(b"pod") {
            return None;
        }
        if let Ok(v4) = first.replace('-', ".").parse::<Ipv4Addr>() {
            return Some(IpAddr::V4(v4));
        }
        first
            .replace('-', ":")
            .parse::<Ipv6Addr>()
            .ok()
            .map(IpAddr::V6)
    }

    /// The A or AAAA record of a pod's name, as asked.
    pub(crate) fn pod_record(&self, name: &LowerName, ip: IpAddr) -> Record {
        let name = Name::from(name.clone());
        match ip {
            IpAddr::V4(v4) => Record::from_rdata(name, self.ttl, RData::A(A(v4))),
            IpAddr::V6(v6) => Record::from_rdata(name, self.ttl, RData::AAAA(AAAA(v6))),
        }
    }

    /// Takes in a Service, new or changed.
    pub(crate) fn set_service(&mut self, service: Arc<Service>) {
        let namespace = service.metadata.namespace.as_deref().unwrap_or_default();
        let name = service.metadata.name.as_deref().unwrap_or_default();
        let owner = key(namespace, name);
        self.services.insert(owner.clone(), service);
        self.rebuild(owner);
    }

    pub(crate) fn delete_service(&mut self, service: &Service) {
        let owner = key(
            service.metadata.namespace.as_deref().unwrap_or_default(),
            service.metadata.name.as_deref().unwrap_or_default(),
        );
        self.services.remove(&owner);
        self.replace_owner(owner, Vec::new());
    }

    /// Takes in an EndpointSlice, new or changed.
    pub(crate) fn set_slice(&mut self, slice: Arc<EndpointSlice>) {
        let slice_key = slice_key(&slice);
        // A slice whose label changed leaves its former Service.
        if let Some(old) = self.slices.get(&slice_key).cloned()
            && slice_service(&old) != slice_service(&slice)
        {
            self.delete_slice(&old);
        }
        let Some((namespace, service)) = slice_service(&slice) else {
            return;
        };
        let owner = key(&namespace, &service);
        self.slices_of
            .entry(owner.clone())
            .or_default()
            .insert(slice_key.clone());
        self.slices.insert(slice_key, slice);
        self.rebuild(owner);
    }

    pub(crate) fn delete_slice(&mut self, slice: &EndpointSlice) {
        let slice_key = slice_key(slice);
        let Some(old) = self.slices.remove(&slice_key) else {
            return;
        };
        if let Some((namespace, service)) = slice_service(&old) {
            let owner = key(&namespace, &service);
            if let Some(set) = self.slices_of.get_mut(&owner) {
                set.remove(&slice_key);
                if set.is_empty() {
                    self.slices_of.remove(&owner);
                }
            }
            self.rebuild(owner);
        }
    }

    /// Builds a Service's names again from it and its slices.
    fn rebuild(&mut self, owner: Arc<str>) {
        let names = match self.services.get(&owner) {
            Some(service) => {
                let slices: Vec<&EndpointSlice> = self
                    .slices_of
                    .get(&owner)
                    .into_iter()
                    .flatten()
                    .filter_map(|k| self.slices.get(k).map(|s| s.as_ref()))
                    .collect();
                self.service_names(service, &slices)
            }
            None => Vec::new(),
        };
        self.replace_owner(owner, names);
    }

    /// Replaces every name `owner` built by `names`.
    fn replace_owner(&mut self, owner: Arc<str>, names: Vec<(Name, RecordSets)>) {
        for name in self.owned.remove(&owner).unwrap_or_default() {
            if let Some(node) = self.names.get_mut(&name) {
                node.owners.remove(&owner);
                if node.owners.is_empty() {
                    self.names.remove(&name);
                } else {
                    node.merge();
                }
            }
            self.unparent(&name);
        }
        let mut owned = Vec::with_capacity(names.len());
        let mut grouped: BTreeMap<LowerName, RecordSets> = BTreeMap::new();
        for (name, sets) in names {
            grouped
                .entry(LowerName::new(&name))
                .or_default()
                .extend(&sets);
        }
        for (name, sets) in grouped {
            let node = self.names.entry(name.clone()).or_default();
            node.owners.insert(owner.clone(), Arc::new(sets));
            node.merge();
            self.parent(&name);
            owned.push(name);
        }
        if !owned.is_empty() {
            self.owned.insert(owner, owned);
        }
    }

    /// Counts `name` under each of its ancestors inside its zone.
    fn parent(&mut self, name: &LowerName) {
        let top = self.top_of(name);
        let mut at = name.base_name();
        while at.num_labels() >= top {
            *self.parents.entry(at.clone()).or_default() += 1;
            if at.num_labels() == 0 {
                break;
            }
            at = at.base_name();
        }
    }

    fn unparent(&mut self, name: &LowerName) {
        let top = self.top_of(name);
        let mut at = name.base_name();
        while at.num_labels() >= top {
            if let Some(count) = self.parents.get_mut(&at) {
                *count -= 1;
                if *count == 0 {
                    self.parents.remove(&at);
                }
            }
            if at.num_labels() == 0 {
                break;
            }
            at = at.base_name();
        }
    }

    /// The number of labels of the zone `name` is in (the cluster domain or
    /// `in-addr.arpa`).
    fn top_of(&self, name: &LowerName) -> u8 {
        if self.domain_lower.zone_of(name) {
            self.domain_lower.num_labels()
        } else {
            self.reverse_v4.num_labels().max(1)
        }
    }

    fn name(&self, relative: &str) -> Option<Name> {
        Name::from_ascii(relative)
            .ok()?
            .append_domain(&self.domain)
            .ok()
    }

    fn address_record(&self, name: &Name, ip: IpAddr) -> Record {
        match ip {
            IpAddr::V4(v4) => Record::from_rdata(name.clone(), self.ttl, RData::A(A(v4))),
            IpAddr::V6(v6) => Record::from_rdata(name.clone(), self.ttl, RData::AAAA(AAAA(v6))),
        }
    }

    fn add_address(&self, sets: &mut RecordSets, name: &Name, ip: IpAddr) {
        let record = self.address_record(name, ip);
        match ip {
            IpAddr::V4(_) => sets.a.push(record),
            IpAddr::V6(_) => sets.aaaa.push(record),
        }
    }

    /// Every name of a Service, from the specification: its own name (A/AAAA of the
    /// ClusterIP, or of each endpoint when headless; CNAME when ExternalName), SRV per
    /// named port, each headless endpoint's own name and the PTRs.
    fn service_names(
        &self,
        service: &Service,
        slices: &[&EndpointSlice],
    ) -> Vec<(Name, RecordSets)> {
        let Some(spec) = service.spec.as_ref() else {
            return Vec::new();
        };
        let (Some(namespace), Some(name)) = (
            service.metadata.namespace.as_deref(),
            service.metadata.name.as_deref(),
        ) else {
            return Vec::new();
        };
        let Some(service_name) = self.name(&format!("{name}.{namespace}.svc.")) else {
            return Vec::new();
        };
        let ttl = self.ttl;
        let mut names = Vec::new();

        if spec.type_.as_deref() == Some("ExternalName") {
            let Some(target) = spec
                .external_name
                .as_deref()
                .and_then(|t| Name::from_ascii(format!("{}.", t.trim_end_matches('.'))).ok())
            else {
                return Vec::new();
            };
            let sets = RecordSets {
                cname: vec![Record::from_rdata(
                    service_name.clone(),
                    ttl,
                    RData::CNAME(CNAME(target.clone())),
                )],
                cname_target: Some(target),
                ..RecordSets::default()
            };
            names.push((service_name, sets));
            return names;
        }

        let cluster_ips: Vec<IpAddr> = match spec.cluster_ips.as_ref() {
            Some(ips) if !ips.is_empty() => ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
            _ => spec
                .cluster_ip
                .as_deref()
                .and_then(|ip| ip.parse().ok())
                .into_iter()
                .collect(),
        };
        let headless = spec.cluster_ip.as_deref() == Some("None");

        if !headless {
            if cluster_ips.is_empty() {
                return Vec::new();
            }
            let mut own = RecordSets::default();
            for ip in &cluster_ips {
                self.add_address(&mut own, &service_name, *ip);
            }
            for ip in &cluster_ips {
                if let Some(reverse) = reverse_name(*ip) {
                    names.push((
                        reverse.clone(),
                        RecordSets {
                            ptr: vec![Record::from_rdata(
                                reverse,
                                ttl,
                                RData::PTR(PTR(service_name.clone())),
                            )],
                            ..RecordSets::default()
                        },
                    ));
                }
            }
            // SRV of each named port: one target, the Service's own name.
            for port in spec.ports.iter().flatten() {
                let Some(port_name) = port.name.as_deref().filter(|n| !n.is_empty()) else {
                    continue;
                };
                let protocol = port
                    .protocol
                    .as_deref()
                    .unwrap_or("TCP")
                    .to_ascii_lowercase();
                let Some(srv_name) = Name::from_ascii(format!("_{port_name}._{protocol}."))
                    .ok()
                    .and_then(|n| n.append_domain(&service_name).ok())
                else {
                    continue;
                };
                let mut sets = RecordSets::default();
                sets.srv.push(Record::from_rdata(
                    srv_name.clone(),
                    ttl,
                    RData::SRV(SRV::new(0, 100, port.port as u16, service_name.clone())),
                ));
                sets.srv_targets.extend(own.a.iter().cloned());
                sets.srv_targets.extend(own.aaaa.iter().cloned());
                names.push((srv_name, sets));
            }
            names.push((service_name, own));
            return names;
        }

        // Headless: the endpoints themselves.
        let publish_not_ready = spec.publish_not_ready_addresses.unwrap_or(false);
        // Endpoint name → its addresses, in a stable order.
        let mut endpoints: BTreeMap<String, (Name, BTreeSet<IpAddr>, bool)> = BTreeMap::new();
        // (port name, protocol) → (port, endpoint names).
        let mut ports: BTreeMap<(String, String), BTreeSet<(u16, String)>> = BTreeMap::new();
        for slice in slices {
            for endpoint in &slice.endpoints {
                // A missing `ready` is unknown, which consumers take as ready.
                let ready = endpoint
                    .conditions
                    .as_ref()
                    .and_then(|c| c.ready)
                    .unwrap_or(true);
                if !ready && !publish_not_ready {
                    continue;
                }
                let hostname = endpoint.hostname.as_deref().filter(|h| !h.is_empty());
                for address in &endpoint.addresses {
                    let Ok(ip) = address.parse::<IpAddr>() else {
                        continue;
                    };
                    let label = hostname.map(str::to_owned).unwrap_or_else(|| dashed(ip));
                    let Some(endpoint_name) = Name::from_ascii(format!("{label}."))
                        .ok()
                        .and_then(|n| n.append_domain(&service_name).ok())
                    else {
                        continue;
                    };
                    endpoints
                        .entry(label.clone())
                        .or_insert_with(|| (endpoint_name, BTreeSet::new(), hostname.is_some()))
                        .1
                        .insert(ip);
                    for port in slice.ports.iter().flatten() {
                        let (Some(port_name), Some(number)) =
                            (port.name.as_deref().filter(|n| !n.is_empty()), port.port)
                        else {
                            continue;
                        };
                        let protocol = port
                            .protocol
                            .as_deref()
                            .unwrap_or("TCP")
                            .to_ascii_lowercase();
                        ports
                            .entry((port_name.to_owned(), protocol))
                            .or_default()
                            .insert((number as u16, label.clone()));
                    }
                }
            }
        }
        let mut own = RecordSets::default();
        let mut seen = BTreeSet::new();
        for (endpoint_name, ips, has_hostname) in endpoints.values() {
            let mut sets = RecordSets::default();
            for ip in ips {
                self.add_address(&mut sets, endpoint_name, *ip);
                if seen.insert(*ip) {
                    self.add_address(&mut own, &service_name, *ip);
                }
                if *has_hostname && let Some(reverse) = reverse_name(*ip) {
                    names.push((
                        reverse.clone(),
                        RecordSets {
                            ptr: vec![Record::from_rdata(
                                reverse,
                                ttl,
                                RData::PTR(PTR(endpoint_name.clone())),
                            )],
                            ..RecordSets::default()
                        },
                    ));
                }
            }
            names.push((endpoint_name.clone(), sets));
        }
        for ((port_name, protocol), targets) in ports {
            let Some(srv_name) = Name::from_ascii(format!("_{port_name}._{protocol}."))
                .ok()
                .and_then(|n| n.append_domain(&service_name).ok())
            else {
                continue;
            };
            let weight = (100 / targets.len().max(1)).max(1) as u16;
            let mut sets = RecordSets::default();
            for (port, label) in &targets {
                let Some((endpoint_name, ips, _)) = endpoints.get(label) else {
                    continue;
                };
                sets.srv.push(Record::from_rdata(
                    srv_name.clone(),
                    ttl,
                    RData::SRV(SRV::new(0, weight, *port, endpoint_name.clone())),
                ));
                for ip in ips {
                    sets.srv_targets
                        .push(self.address_record(endpoint_name, *ip));
                }
            }
            names.push((srv_name, sets));
        }
        // A headless Service with no ready endpoint still exists: no data, not NXDOMAIN.
        names.push((service_name, own));
        names
    }

    /// How many names the zone holds (for tests and the benchmark).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }
}

/// `d.c.b.a.in-addr.arpa.` → `a.b.c.d`.
fn reverse_v4_address(name: &LowerName) -> Option<Ipv4Addr> {
    if name.num_labels() != 6 {
        return None;
    }
    let name = Name::from(name.clone());
    let mut octets = [0u8; 4];
    for (i, label) in name.iter().take(4).enumerate() {
        octets[3 - i] = std::str::from_utf8(label).ok()?.parse().ok()?;
    }
    Some(Ipv4Addr::from(octets))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn zone() -> Zone {
        Zone::new("cluster.local", 5, &["10.43.0.0/16".to_owned()]).unwrap()
    }

    fn lower(name: &str) -> LowerName {
        LowerName::new(&Name::from_ascii(name).unwrap())
    }

    fn service(name: &str, cluster_ip: &str, ports: &[(&str, i32, &str)]) -> Arc<Service> {
        Arc::new(Service {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(cluster_ip.to_owned()),
                cluster_ips: (cluster_ip != "None").then(|| vec![cluster_ip.to_owned()]),
                ports: Some(
                    ports
                        .iter()
                        .map(|(n, p, proto)| ServicePort {
                            name: Some((*n).to_owned()),
                            port: *p,
                            protocol: Some((*proto).to_owned()),
                            ..ServicePort::default()
                        })
                        .collect(),
                ),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        })
    }

    fn slice(
        name: &str,
        service: &str,
        endpoints: &[(&str, Option<&str>, bool)],
        port: (&str, i32),
    ) -> Arc<EndpointSlice> {
        Arc::new(EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                labels: Some([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())].into()),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".to_owned(),
            endpoints: endpoints
                .iter()
                .map(|(ip, hostname, ready)| Endpoint {
                    addresses: vec![(*ip).to_owned()],
                    hostname: hostname.map(str::to_owned),
                    conditions: Some(EndpointConditions {
                        ready: Some(*ready),
                        ..EndpointConditions::default()
                    }),
                    ..Endpoint::default()
                })
                .collect(),
            ports: Some(vec![EndpointPort {
                name: Some(port.0.to_owned()),
                port: Some(port.1),
                protocol: Some("TCP".to_owned()),
                ..EndpointPort::default()
            }]),
        })
    }

    /// The answers' data as text, sorted.
    fn answers(zone: &Zone, name: &str, qtype: RecordType) -> Vec<String> {
        match zone.lookup(&lower(name)) {
            Lookup::Found(sets) => {
                let mut out: Vec<String> = sets
                    .get(qtype)
                    .0
                    .iter()
                    .map(|r| r.data.to_string())
                    .collect();
                out.sort();
                out
            }
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn cluster_ip_service_has_a_srv_and_ptr() {
        let mut zone = zone();
        zone.set_service(service(
            "web",
            "10.43.0.20",
            &[("http", 80, "TCP"), ("", 81, "TCP")],
        ));
        let name = "web.ns.svc.cluster.local.";
        assert_eq!(answers(&zone, name, RecordType::A), ["10.43.0.20"]);
        let Lookup::Found(sets) = zone.lookup(&lower(name)) else {
            panic!()
        };
        assert_eq!(sets.get(RecordType::A).0[0].ttl, 5);
        // IPv4 only: the name exists with no AAAA.
        assert!(sets.get(RecordType::AAAA).0.is_empty());
        assert_eq!(
            answers(
                &zone,
                "_http._tcp.web.ns.svc.cluster.local.",
                RecordType::SRV
            ),
            ["0 100 80 web.ns.svc.cluster.local."]
        );
        assert_eq!(
            answers(&zone, "20.0.43.10.in-addr.arpa.", RecordType::PTR),
            ["web.ns.svc.cluster.local."]
        );
        // The ancestors exist without records; unknown names in the zone do not.
        assert!(matches!(
            zone.lookup(&lower("ns.svc.cluster.local.")),
            Lookup::Empty
        ));
        assert!(matches!(
            zone.lookup(&lower("_tcp.web.ns.svc.cluster.local.")),
            Lookup::Empty
        ));
        assert!(matches!(
            zone.lookup(&lower("nope.ns.svc.cluster.local.")),
            Lookup::NxDomain
        ));
        assert!(matches!(
            zone.lookup(&lower("21.0.43.10.in-addr.arpa.")),
            Lookup::NxDomain
        ));
        // Outside the zone and the service CIDR: someone else's.
        assert!(matches!(
            zone.lookup(&lower("example.com.")),
            Lookup::Elsewhere
        ));
        assert!(matches!(
            zone.lookup(&lower("1.1.168.192.in-addr.arpa.")),
            Lookup::Elsewhere
        ));
    }

    #[test]
    fn deleting_a_service_takes_its_names_back() {
        let mut zone = zone();
        let before = zone.len();
        let web = service("web", "10.43.0.20", &[("http", 80, "TCP")]);
        zone.set_service(web.clone());
        zone.delete_service(&web);
        assert_eq!(zone.len(), before);
        assert!(matches!(
            zone.lookup(&lower("web.ns.svc.cluster.local.")),
            Lookup::NxDomain
        ));
        assert!(matches!(
            zone.lookup(&lower("20.0.43.10.in-addr.arpa.")),
            Lookup::NxDomain
        ));
        assert!(
            zone.parents
                .keys()
                .all(|k| !k.to_string().contains("ns.svc"))
        );
    }

    #[test]
    fn headless_service_has_its_ready_endpoints() {
        let mut zone = zone();
        zone.set_service(service("db", "None", &[("sql", 5432, "TCP")]));
        zone.set_slice(slice(
            "db-abcde",
            "db",
            &[
                ("10.244.1.5", Some("db-0"), true),
                ("10.244.1.6", None, true),
                ("10.244.1.7", Some("db-2"), false),
            ],
            ("sql", 5432),
        ));
        assert_eq!(
            answers(&zone, "db.ns.svc.cluster.local.", RecordType::A),
            ["10.244.1.5", "10.244.1.6"]
        );
        assert_eq!(
            answers(&zone, "db-0.db.ns.svc.cluster.local.", RecordType::A),
            ["10.244.1.5"]
        );
        assert_eq!(
            answers(&zone, "10-244-1-6.db.ns.svc.cluster.local.", RecordType::A),
            ["10.244.1.6"]
        );
        assert_eq!(
            answers(&zone, "_sql._tcp.db.ns.svc.cluster.local.", RecordType::SRV),
            [
                "0 50 5432 10-244-1-6.db.ns.svc.cluster.local.",
                "0 50 5432 db-0.db.ns.svc.cluster.local."
            ]
        );
        // Only endpoints with a hostname have a PTR.
        assert_eq!(
            answers(&zone, "5.1.244.10.in-addr.arpa.", RecordType::PTR),
            ["db-0.db.ns.svc.cluster.local."]
        );
        assert!(matches!(
            zone.lookup(&lower("6.1.244.10.in-addr.arpa.")),
            Lookup::Elsewhere
        ));
        // Not ready: not served.
        assert!(matches!(
            zone.lookup(&lower("db-2.db.ns.svc.cluster.local.")),
            Lookup::NxDomain
        ));

        // publishNotReadyAddresses serves it.
        let mut published = (*service("db", "None", &[])).clone();
        if let Some(spec) = published.spec.as_mut() {
            spec.publish_not_ready_addresses = Some(true);
        }
        zone.set_service(Arc::new(published));
        assert_eq!(
            answers(&zone, "db-2.db.ns.svc.cluster.local.", RecordType::A),
            ["10.244.1.7"]
        );

        // The slice going leaves the Service with no address, but still a name.
        let gone = slice("db-abcde", "db", &[], ("sql", 5432));
        zone.delete_slice(&gone);
        assert!(answers(&zone, "db.ns.svc.cluster.local.", RecordType::A).is_empty());
        assert!(matches!(
            zone.lookup(&lower("db-0.db.ns.svc.cluster.local.")),
            Lookup::NxDomain
        ));
    }

    #[test]
    fn slice_before_its_service_is_served_once_the_service_comes() {
        let mut zone = zone();
        zone.set_slice(slice(
            "db-x",
            "db",
            &[("10.244.1.5", None, true)],
            ("sql", 1),
        ));
        assert!(matches!(
            zone.lookup(&lower("db.ns.svc.cluster.local.")),
            Lookup::NxDomain
        ));
        zone.set_service(service("db", "None", &[]));
        assert_eq!(
            answers(&zone, "db.ns.svc.cluster.local.", RecordType::A),
            ["10.244.1.5"]
        );
    }

    #[test]
    fn external_name_is_a_cname() {
        let mut zone = zone();
        let mut ext = (*service("ext", "", &[])).clone();
        if let Some(spec) = ext.spec.as_mut() {
            spec.type_ = Some("ExternalName".to_owned());
            spec.external_name = Some("www.example.com".to_owned());
            spec.cluster_ip = None;
            spec.cluster_ips = None;
        }
        zone.set_service(Arc::new(ext));
        let Lookup::Found(sets) = zone.lookup(&lower("ext.ns.svc.cluster.local.")) else {
            panic!()
        };
        // A CNAME answers every type.
        for qtype in [RecordType::A, RecordType::AAAA, RecordType::CNAME] {
            let (records, _) = sets.get(qtype);
            assert_eq!(records.len(), 1);
            assert_eq!(records[0].data.to_string(), "www.example.com.");
        }
        assert_eq!(
            sets.cname_target.as_ref().map(|n| n.to_string()).as_deref(),
            Some("www.example.com.")
        );
    }

    #[test]
    fn pod_names_answer_from_the_name() {
        let zone = zone();
        let Lookup::Pod(ip) = zone.lookup(&lower("10-244-3-4.any.pod.cluster.local.")) else {
            panic!()
        };
        assert_eq!(ip, IpAddr::from([10, 244, 3, 4]));
        assert!(matches!(
            zone.lookup(&lower("not-an-ip.any.pod.cluster.local.")),
            Lookup::NxDomain
        ));
        assert!(answers(&zone, "pod.cluster.local.", RecordType::A).is_empty());
    }

    #[test]
    fn the_apex_has_its_soa_and_version() {
        let zone = zone();
        assert_eq!(
            answers(&zone, "cluster.local.", RecordType::SOA),
            ["ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 5"]
        );
        assert_eq!(
            answers(&zone, "dns-version.cluster.local.", RecordType::TXT),
            ["1.1.0"]
        );
    }

    #[test]
    fn two_services_with_one_address_share_its_ptr() {
        let mut zone = zone();
        zone.set_service(service("a", "None", &[]));
        zone.set_service(service("b", "None", &[]));
        zone.set_slice(slice(
            "a-1",
            "a",
            &[("10.244.1.5", Some("h"), true)],
            ("p", 1),
        ));
        zone.set_slice(slice(
            "b-1",
            "b",
            &[("10.244.1.5", Some("h"), true)],
            ("p", 1),
        ));
        assert_eq!(
            answers(&zone, "5.1.244.10.in-addr.arpa.", RecordType::PTR),
            ["h.a.ns.svc.cluster.local.", "h.b.ns.svc.cluster.local."]
        );
        zone.delete_service(&service("a", "None", &[]));
        assert_eq!(
            answers(&zone, "5.1.244.10.in-addr.arpa.", RecordType::PTR),
            ["h.b.ns.svc.cluster.local."]
        );
    }
}
