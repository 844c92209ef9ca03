//! The subject alternative names of the API server's serving certificate: the ones
//! wanted (loopback, `localhost`, the hostname and the configured hosts) and the ones a
//! certificate on disk carries, compared as sets.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, anyhow};
use rcgen::SanType;
use rustls::pki_types::DnsName;
use trellis_pki::hostname;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;

/// The SANs of a serving certificate, normalised so that sets compare equal regardless
/// of order, case and trailing dots.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Sans {
    pub(super) ips: BTreeSet<IpAddr>,
    pub(super) dns: BTreeSet<String>,
    /// SANs of other kinds, which only a certificate we did not issue has: they make
    /// it differ from what is wanted, so it gets re-issued.
    other: BTreeSet<String>,
}

impl Sans {
    pub(super) fn wanted(hosts: &[String]) -> anyhow::Result<Sans> {
        let mut sans = Sans {
            ips: BTreeSet::from([
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
            ]),
            dns: BTreeSet::from(["localhost".to_owned()]),
            other: BTreeSet::new(),
        };
        match hostname() {
            Some(name) => match normalize_dns_name(&name) {
                Ok(name) => {
                    sans.dns.insert(name);
                }
                Err(e) => tracing::debug!(%name, "hostname left out of SANs: {e:#}"),
            },
            None => tracing::debug!("hostname unknown, left out of SANs"),
        }
        for host in hosts {
            let host = host.trim();
            match host.parse::<IpAddr>() {
                Ok(ip) => {
                    sans.ips.insert(ip);
                }
                Err(_) => {
                    sans.dns.insert(normalize_dns_name(host)?);
                }
            }
        }
        Ok(sans)
    }

    pub(super) fn of(x509: &X509Certificate<'_>) -> anyhow::Result<Sans> {
        let mut sans = Sans {
            ips: BTreeSet::new(),
            dns: BTreeSet::new(),
            other: BTreeSet::new(),
        };
        let Some(extension) = x509
            .subject_alternative_name()
            .map_err(|e| anyhow!("parse subjectAltName: {e}"))?
        else {
            return Ok(sans);
        };
        for name in &extension.value.general_names {
            match name {
                GeneralName::DNSName(name) => {
                    sans.dns
                        .insert(name.trim_end_matches('.').to_ascii_lowercase());
                }
                GeneralName::IPAddress(bytes) => {
                    let ip = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes).map(IpAddr::from).ok(),
                        16 => <[u8; 16]>::try_from(*bytes).map(IpAddr::from).ok(),
                        _ => None,
                    };
                    sans.ips
                        .insert(ip.ok_or_else(|| anyhow!("IP SAN of {} bytes", bytes.len()))?);
                }
                other => {
                    sans.other.insert(format!("{other:?}"));
                }
            }
        }
        Ok(sans)
    }

    pub(super) fn to_rcgen(&self) -> anyhow::Result<Vec<SanType>> {
        let mut sans: Vec<SanType> = self.ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
        for name in &self.dns {
            sans.push(SanType::DnsName(
                name.as_str()
                    .try_into()
                    .with_context(|| format!("encode DNS SAN {name}"))?,
            ));
        }
        Ok(sans)
    }
}

impl fmt::Display for Sans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ips = self.ips.iter().map(ToString::to_string);
        let names: Vec<String> = ips
            .chain(self.dns.iter().cloned())
            .chain(self.other.iter().cloned())
            .collect();
        write!(f, "[{}]", names.join(", "))
    }
}

fn normalize_dns_name(name: &str) -> anyhow::Result<String> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    DnsName::try_from(name.as_str())
        .map_err(|e| anyhow!("{name:?} is neither an IP address nor a DNS name: {e}"))?;
    Ok(name)
}
