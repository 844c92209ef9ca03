//! The ClusterIP and NodePort ranges, how a free value is picked in them, and the
//! store keys that record who holds each value.
//!
//! Each allocated value is a key of its own outside `/registry/` (nothing serves or
//! watches it), created only if absent in the transaction that stores its Service:
//! two API servers on one store can never hand out one value twice, whatever each
//! believes is free. The value of each key names its holder, for the repair.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `/allocations/serviceips/10.43.0.5`: one key per allocated ClusterIP.
pub const IP_PREFIX: &str = "/allocations/serviceips/";
/// `/allocations/servicenodeports/30080`: one key per allocated NodePort (a number is
/// one allocation whatever its protocols, as in Kubernetes).
pub const NODE_PORT_PREFIX: &str = "/allocations/servicenodeports/";

pub fn ip_key(ip: Ipv4Addr) -> String {
    format!("{IP_PREFIX}{ip}")
}

pub fn node_port_key(port: u16) -> String {
    format!("{NODE_PORT_PREFIX}{port}")
}

/// Who holds an allocation: the value of its key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// An IPv4 service range (`--service-cluster-ip-range`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceCidr {
    network: Ipv4Addr,
    prefix: u8,
}

impl Default for ServiceCidr {
    /// k3s' `10.43.0.0/16`.
    fn default() -> Self {
        Self {
            network: Ipv4Addr::new(10, 43, 0, 0),
            prefix: 16,
        }
    }
}

impl FromStr for ServiceCidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (ADDRESS/PREFIX)"))?;
        if addr.contains(':') {
            return Err(format!(
                "{s:?}: only IPv4 service ranges are supported (single-stack IPv4)"
            ));
        }
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|e| format!("{s:?}: bad address: {e}"))?;
        let prefix: u8 = prefix
            .parse()
            .map_err(|e| format!("{s:?}: bad prefix length: {e}"))?;
        // Kubernetes refuses ranges larger than a /12 (a bitmap of 2^20) and a range
        // needs room for at least two addresses besides the network and broadcast.
        if !(12..=30).contains(&prefix) {
            return Err(format!(
                "{s:?}: the prefix length must be between 12 and 30"
            ));
        }
        let mask = u32::MAX << (32 - prefix);
        Ok(Self {
            network: Ipv4Addr::from(u32::from(addr) & mask),
            prefix,
        })
    }
}

impl fmt::Display for ServiceCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl ServiceCidr {
    /// Addresses that can be allocated: all but the network and broadcast addresses.
    pub fn size(&self) -> u32 {
        (1u32 << (32 - self.prefix)) - 2
    }

    /// The `offset`th allocatable address (0 is the network address + 1).
    pub fn ip(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1 + offset)
    }

    /// The offset of `ip`, if it is allocatable in this range.
    pub fn offset(&self, ip: Ipv4Addr) -> Option<u32> {
        let o = u32::from(ip).checked_sub(u32::from(self.network) + 1)?;
        (o < self.size()).then_some(o)
    }

    /// The first addresses, left to explicit requests (the `kubernetes` and DNS
    /// Services): dynamic allocation takes them only once the rest is full
    /// (Kubernetes' `calculateRangeOffset`: a sixteenth of the range, 16 to 256).
    pub fn static_band(&self) -> u32 {
        let range = 1u32 << (32 - self.prefix);
        (range / 16).clamp(16, 256)
    }
}

/// A NodePort range (`--service-node-port-range`), inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl Default for PortRange {
    fn default() -> Self {
        Self {
            first: 30000,
            last: 32767,
        }
    }
}

impl FromStr for PortRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (first, last) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?} is not a port range (FIRST-LAST)"))?;
        let parse = |p: &str| {
            p.trim()
                .parse::<u16>()
                .map_err(|e| format!("{s:?}: bad port {p:?}: {e}"))
        };
        let (first, last) = (parse(first)?, parse(last)?);
        if first == 0 || first > last {
            return Err(format!(
                "{s:?}: the range must be FIRST-LAST with 0 < FIRST <= LAST"
            ));
        }
        Ok(Self { first, last })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl PortRange {
    pub fn size(&self) -> u32 {
        u32::from(self.last - self.first) + 1
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// The first ports, left to explicit requests (Kubernetes' node port
    /// `calculateRangeOffset`: a 32nd of the range, 16 to 128; none under 17 ports).
    pub fn static_band(&self) -> u32 {
        let size = self.size();
        if size <= 16 {
            return 0;
        }
        (size / 32).clamp(16, 128)
    }
}

/// A free offset in `0..size` (one `taken` says no to): from a random start in the
/// upper band (`band..size`) first, then in the lower one (Kubernetes' random scan
/// with offset).
pub fn pick(size: u32, band: u32, taken: impl Fn(u32) -> bool) -> Option<u32> {
    let band = band.min(size);
    for (lo, hi) in [(band, size), (0, band)] {
        if lo >= hi {
            continue;
        }
        let start = rand::random_range(lo..hi);
        if let Some(free) = (start..hi).chain(lo..start).find(|o| !taken(*o)) {
            return Some(free);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_split_as_kubernetes() {
        let cidr: ServiceCidr = "10.43.0.0/16".parse().unwrap();
        assert_eq!(cidr, ServiceCidr::default());
        assert_eq!(cidr.size(), 65534);
        assert_eq!(cidr.static_band(), 256);
        assert_eq!(cidr.ip(0), Ipv4Addr::new(10, 43, 0, 1));
        assert_eq!(cidr.offset(Ipv4Addr::new(10, 43, 0, 10)), Some(9));
        assert_eq!(cidr.offset(Ipv4Addr::new(10, 43, 0, 0)), None);
        assert_eq!(cidr.offset(Ipv4Addr::new(10, 43, 255, 255)), None);
        assert_eq!(cidr.offset(Ipv4Addr::new(10, 44, 0, 1)), None);
        assert_eq!(
            "10.96.3.4/28".parse::<ServiceCidr>().unwrap().to_string(),
            "10.96.3.0/28"
        );
        assert!(
            "fd00::/108"
                .parse::<ServiceCidr>()
                .unwrap_err()
                .contains("IPv4")
        );
        let ports: PortRange = "30000-32767".parse().unwrap();
        assert_eq!((ports.size(), ports.static_band()), (2768, 86));
        assert!("32767-30000".parse::<PortRange>().is_err());
    }

    #[test]
    fn dynamic_picks_prefer_the_upper_band_then_fill_the_lower() {
        let mut taken = std::collections::BTreeSet::new();
        for _ in 0..12 {
            let o = pick(16, 4, |o| taken.contains(&o)).unwrap();
            assert!(o >= 4, "{o} picked while the upper band had room");
            taken.insert(o);
        }
        for _ in 0..4 {
            let o = pick(16, 4, |o| taken.contains(&o)).unwrap();
            assert!(o < 4 && taken.insert(o));
        }
        assert_eq!(pick(16, 4, |o| taken.contains(&o)), None);
    }
}
