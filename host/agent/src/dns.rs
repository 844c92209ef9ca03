//! A pod's DNS configuration, as the kubelet's `pkg/kubelet/network/dns` forms it
//! (`GetPodDNS`): by `dnsPolicy`, the cluster's DNS servers and search domains
//! (`ClusterFirst`, `ClusterFirstWithHostNet`), the node's `resolv.conf` (`Default`,
//! and `ClusterFirst` on the host network or while the node knows no cluster DNS
//! server, with a `MissingClusterDNS` warning) or nothing (`None`), then the pod's
//! `dnsConfig` merged in, and the result cut to what resolvers accept (3 nameservers,
//! 32 search domains of at most 253 characters, 2048 characters in all), with a
//! `DNSConfigForming` warning when it was cut. The runtime writes it as the pod's
//! `/etc/resolv.conf`. A node that serves cluster DNS itself ([`crate::services`]) is
//! its own cluster DNS server (`169.254.20.10`) unless `--cluster-dns` names another.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use k8s_cri::v1 as cri;
use k8s_openapi::api::core::v1::{Pod, PodDNSConfig};

/// What resolvers accept (the kubelet's `validation.MaxDNSNameservers`,
/// `MaxDNSSearchPaths`, `MaxDNSSearchListChars`, and a DNS-1123 subdomain's length).
const MAX_NAMESERVERS: usize = 3;
const MAX_SEARCHES: usize = 32;
const MAX_SEARCH_CHARS: usize = 2048;
const MAX_DOMAIN_CHARS: usize = 253;

/// The node's DNS settings (the kubelet's `--cluster-dns`, `--cluster-domain` and
/// `--resolv-conf`).
#[derive(Clone, Copy, Debug)]
pub struct Settings<'a> {
    pub cluster_dns: &'a [IpAddr],
    pub cluster_domain: &'a str,
    /// The node's resolver configuration; none: no upstream, lookups go to the node
    /// itself (the kubelet's `--resolv-conf=""`).
    pub resolv_conf: Option<&'a Path>,
    pub node_ip: IpAddr,
}

/// A warning about the pod's DNS, as an event's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    pub reason: &'static str,
    pub message: String,
}

/// The DNS configuration of `pod`'s sandbox, and what to warn about.
pub fn pod_dns(settings: &Settings, pod: &Pod) -> (cri::DnsConfig, Vec<Warning>) {
    let spec = pod.spec.clone().unwrap_or_default();
    let host_network = spec.host_network.unwrap_or(false);
    let mut warnings = Vec::new();
    let policy = spec.dns_policy.as_deref().unwrap_or("ClusterFirst");
    let mut dns = match policy {
        "None" => cri::DnsConfig::default(),
        "ClusterFirst" | "ClusterFirstWithHostNet"
            if (policy == "ClusterFirstWithHostNet" || !host_network)
                && !settings.cluster_dns.is_empty() =>
        {
            let host = node_dns(settings);
            let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
            cri::DnsConfig {
                // The cluster's servers only: they forward what they do not know.
                servers: settings.cluster_dns.iter().map(IpAddr::to_string).collect(),
                searches: cluster_searches(settings.cluster_domain, namespace, host.searches),
                options: vec!["ndots:5".into()],
            }
        }
        policy => {
            if (policy == "ClusterFirstWithHostNet" || (policy == "ClusterFirst" && !host_network))
                && settings.cluster_dns.is_empty()
            {
                warnings.push(Warning {
                    reason: "MissingClusterDNS",
                    message: format!(
                        "pod: {:?}. kubelet does not have ClusterDNS IP configured and cannot create Pod using {policy:?} policy. Falling back to \"Default\" policy.",
                        pod_name(pod)
                    ),
                });
            }
            node_dns(settings)
        }
    };
    if let Some(config) = &spec.dns_config {
        merge(&mut dns, config);
    }
    fit(&mut dns, &mut warnings);
    (dns, warnings)
}

/// The node's own configuration (`Default`): its `resolv.conf`, or the node itself
/// when it names none.
fn node_dns(settings: &Settings) -> cri::DnsConfig {
    match settings.resolv_conf {
        Some(path) => std::fs::read_to_string(path)
            .map(|text| parse_resolv_conf(&text))
            .unwrap_or_default(),
        None => cri::DnsConfig {
            servers: vec![
                if settings.node_ip.is_ipv6() {
                    "::1"
                } else {
                    "127.0.0.1"
                }
                .into(),
            ],
            searches: vec![".".into()],
            options: Vec::new(),
        },
    }
}

/// `<namespace>.svc.<domain>`, `svc.<domain>`, `<domain>`, then the node's searches,
/// without repeats; the node's alone without a cluster domain.
fn cluster_searches(domain: &str, namespace: &str, host: Vec<String>) -> Vec<String> {
    if domain.is_empty() {
        return host;
    }
    let cluster = [
        format!("{namespace}.svc.{domain}"),
        format!("svc.{domain}"),
        domain.to_owned(),
    ];
    dedup(cluster.into_iter().chain(host))
}

/// A `resolv.conf` as the kubelet reads it: every `nameserver`, the last `search`
/// line (without `.` and trailing dots), every `options` value (a later one with the
/// same name replaces the earlier).
pub fn parse_resolv_conf(text: &str) -> cri::DnsConfig {
    let mut dns = cri::DnsConfig::default();
    for line in text.lines() {
        if line.starts_with(['#', ';']) {
            continue;
        }
        let mut fields = line.split_whitespace();
        match fields.next() {
            Some("nameserver") => dns.servers.extend(fields.next().map(str::to_owned)),
            Some("search") => {
                dns.searches = fields
                    .filter(|s| *s != ".")
                    .map(|s| s.trim_end_matches('.').to_owned())
                    .collect();
            }
            Some("options") => {
                for option in fields {
                    let name = option.split(':').next().unwrap_or(option);
                    dns.options
                        .retain(|o| o.split(':').next().unwrap_or(o) != name);
                    dns.options.push(option.to_owned());
                }
            }
            _ => {}
        }
    }
    dns
}

/// The pod's `dnsConfig` added (the kubelet's `appendDNSConfig`): nameservers and
/// searches after the policy's, without repeats; options by name, the pod's winning.
fn merge(dns: &mut cri::DnsConfig, config: &PodDNSConfig) {
    let servers = std::mem::take(&mut dns.servers);
    dns.servers = dedup(
        servers
            .into_iter()
            .chain(config.nameservers.iter().flatten().cloned()),
    );
    let searches = std::mem::take(&mut dns.searches);
    dns.searches = dedup(
        searches
            .into_iter()
            .chain(config.searches.iter().flatten().cloned()),
    );
    // Sorted by name, where the kubelet's map gives no order.
    let mut options: BTreeMap<String, String> = dns
        .options
        .iter()
        .map(|o| match o.split_once(':') {
            Some((name, value)) => (name.to_owned(), value.to_owned()),
            None => (o.clone(), String::new()),
        })
        .collect();
    for option in config.options.iter().flatten() {
        if let Some(name) = &option.name {
            options.insert(name.clone(), option.value.clone().unwrap_or_default());
        }
    }
    dns.options = options
        .into_iter()
        .map(|(name, value)| {
            if value.is_empty() {
                name
            } else {
                format!("{name}:{value}")
            }
        })
        .collect();
}

/// Cuts the configuration to what resolvers accept (the kubelet's
/// `formDNSConfigFitsLimits`), warning of what was left out.
fn fit(dns: &mut cri::DnsConfig, warnings: &mut Vec<Warning>) {
    if dns.servers.len() > MAX_NAMESERVERS {
        dns.servers.truncate(MAX_NAMESERVERS);
        warnings.push(Warning {
            reason: "DNSConfigForming",
            message: format!(
                "Nameserver limits were exceeded, some nameservers have been omitted, the applied nameserver line is: {}",
                dns.servers.join(" ")
            ),
        });
    }
    let mut cut = false;
    if dns.searches.len() > MAX_SEARCHES {
        dns.searches.truncate(MAX_SEARCHES);
        cut = true;
    }
    // Some resolvers (glibc 2.28) abort on a longer search domain.
    let before = dns.searches.len();
    dns.searches.retain(|s| s.len() <= MAX_DOMAIN_CHARS);
    cut |= dns.searches.len() != before;
    while dns.searches.join(" ").len() > MAX_SEARCH_CHARS {
        dns.searches.pop();
        cut = true;
    }
    if cut {
        warnings.push(Warning {
            reason: "DNSConfigForming",
            message: format!(
                "Search Line limits were exceeded, some search paths have been omitted, the applied search line is: {}",
                dns.searches.join(" ")
            ),
        });
    }
}

fn dedup(items: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

fn pod_name(pod: &Pod) -> String {
    format!(
        "{}_{}",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.namespace.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "team", "uid": "u"},
            "spec": spec,
        }))
        .unwrap()
    }

    const NODE_RESOLV: &str = "# comment\nnameserver 192.168.1.1\nsearch old.example\nsearch corp.example. .\noptions ndots:2 edns0\noptions ndots:3\nnameserver 192.168.1.2\n";

    fn with_node_resolv<T>(cluster_dns: &[IpAddr], f: impl FnOnce(&Settings) -> T) -> T {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("resolv.conf");
        std::fs::write(&path, NODE_RESOLV).unwrap();
        f(&Settings {
            cluster_dns,
            cluster_domain: "cluster.local",
            resolv_conf: Some(&path),
            node_ip: "10.1.0.5".parse().unwrap(),
        })
    }

    #[test]
    fn the_nodes_resolv_conf_reads_as_the_kubelet_reads_it() {
        let dns = parse_resolv_conf(NODE_RESOLV);
        assert_eq!(dns.servers, ["192.168.1.1", "192.168.1.2"]);
        assert_eq!(dns.searches, ["corp.example"]);
        assert_eq!(dns.options, ["edns0", "ndots:3"]);
    }

    #[test]
    fn cluster_first_uses_the_cluster_dns_and_its_searches() {
        let cluster: [IpAddr; 1] = ["10.43.0.10".parse().unwrap()];
        let (dns, warnings) = with_node_resolv(&cluster, |s| {
            pod_dns(s, &pod(serde_json::json!({"containers": []})))
        });
        assert_eq!(dns.servers, ["10.43.0.10"]);
        assert_eq!(
            dns.searches,
            [
                "team.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local",
                "corp.example"
            ]
        );
        assert_eq!(dns.options, ["ndots:5"]);
        assert!(warnings.is_empty());
        // On the host network ClusterFirst is Default; ClusterFirstWithHostNet is not.
        let (dns, _) = with_node_resolv(&cluster, |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"hostNetwork": true, "containers": []})),
            )
        });
        assert_eq!(dns.servers, ["192.168.1.1", "192.168.1.2"]);
        let (dns, _) = with_node_resolv(&cluster, |s| {
            pod_dns(
                s,
                &pod(
                    serde_json::json!({"hostNetwork": true, "dnsPolicy": "ClusterFirstWithHostNet", "containers": []}),
                ),
            )
        });
        assert_eq!(dns.servers, ["10.43.0.10"]);
    }

    #[test]
    fn cluster_first_without_a_cluster_dns_falls_back_to_the_nodes_with_a_warning() {
        let (dns, warnings) = with_node_resolv(&[], |s| {
            pod_dns(s, &pod(serde_json::json!({"containers": []})))
        });
        assert_eq!(dns, parse_resolv_conf(NODE_RESOLV));
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].reason, "MissingClusterDNS");
        assert!(
            warnings[0]
                .message
                .contains("Falling back to \"Default\" policy")
        );
        // Default asks nothing of the cluster: no warning.
        let (_, warnings) = with_node_resolv(&[], |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"dnsPolicy": "Default", "containers": []})),
            )
        });
        assert!(warnings.is_empty());
        // No resolv.conf: the node itself.
        let settings = Settings {
            cluster_dns: &[],
            cluster_domain: "cluster.local",
            resolv_conf: None,
            node_ip: "10.1.0.5".parse().unwrap(),
        };
        let (dns, _) = pod_dns(
            &settings,
            &pod(serde_json::json!({"dnsPolicy": "Default", "containers": []})),
        );
        assert_eq!(
            (dns.servers, dns.searches),
            (vec!["127.0.0.1".to_owned()], vec![".".to_owned()])
        );
    }

    #[test]
    fn none_takes_the_pods_dns_config_alone_and_options_merge_by_name() {
        let (dns, warnings) = with_node_resolv(&[], |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"dnsPolicy": "None", "containers": [],
                    "dnsConfig": {"nameservers": ["1.2.3.4", "1.2.3.4"], "searches": ["a.example"],
                        "options": [{"name": "ndots", "value": "1"}, {"name": "edns0"}]}})),
            )
        });
        assert_eq!(dns.servers, ["1.2.3.4"]);
        assert_eq!(dns.searches, ["a.example"]);
        assert_eq!(dns.options, ["edns0", "ndots:1"]);
        assert!(warnings.is_empty());
        let cluster: [IpAddr; 1] = ["10.43.0.10".parse().unwrap()];
        let (dns, _) = with_node_resolv(&cluster, |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"containers": [],
                    "dnsConfig": {"nameservers": ["8.8.8.8"], "searches": ["svc.cluster.local", "x.example"],
                        "options": [{"name": "ndots", "value": "2"}, {"name": "timeout", "value": "1"}]}})),
            )
        });
        assert_eq!(dns.servers, ["10.43.0.10", "8.8.8.8"]);
        assert_eq!(
            dns.searches,
            [
                "team.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local",
                "corp.example",
                "x.example"
            ]
        );
        assert_eq!(dns.options, ["ndots:2", "timeout:1"]);
    }

    #[test]
    fn what_resolvers_cannot_take_is_cut_with_a_warning() {
        let long = "d".repeat(254);
        let searches: Vec<String> = std::iter::once(long)
            .chain((0..40).map(|i| format!("s{i}.example")))
            .collect();
        let (dns, warnings) = with_node_resolv(&[], |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"dnsPolicy": "None", "containers": [],
                    "dnsConfig": {"nameservers": ["1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"],
                        "searches": searches}})),
            )
        });
        assert_eq!(dns.servers, ["1.1.1.1", "2.2.2.2", "3.3.3.3"]);
        assert_eq!(dns.searches.len(), 31, "32 kept, then the long one dropped");
        assert!(dns.searches.iter().all(|s| s.len() <= MAX_DOMAIN_CHARS));
        let reasons: Vec<_> = warnings.iter().map(|w| w.reason).collect();
        assert_eq!(reasons, ["DNSConfigForming", "DNSConfigForming"]);
        assert!(warnings[0].message.ends_with("1.1.1.1 2.2.2.2 3.3.3.3"));
        // 2048 characters in all.
        let wide: Vec<String> = (0..20).map(|i| format!("{i:0>200}")).collect();
        let (dns, _) = with_node_resolv(&[], |s| {
            pod_dns(
                s,
                &pod(serde_json::json!({"dnsPolicy": "None", "containers": [],
                    "dnsConfig": {"nameservers": ["1.1.1.1"], "searches": wide}})),
            )
        });
        assert!(dns.searches.join(" ").len() <= MAX_SEARCH_CHARS);
        assert_eq!(dns.searches.len(), 10);
    }
}
