//! CIDR ranges, and a cluster CIDR cut into node ranges of one size (Kubernetes'
//! `cidrset`). Addresses of both families are held as `u128`, an IPv4 address in its
//! low 32 bits.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::Range;

/// A cluster CIDR is cut into at most 2^16 node ranges, as Kubernetes' cidrset
/// allows: the allocator's bookkeeping stays small.
pub const MAX_SUBNET_BITS: u8 = 16;

/// An address range, `10.42.0.0/16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    /// The network address: host bits are zero.
    value: u128,
    prefix: u8,
    ipv6: bool,
}

impl Cidr {
    /// Parses `ADDRESS/PREFIX`; host bits are cleared, as Go's `net.ParseCIDR` does.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (address, prefix) = text
            .split_once('/')
            .ok_or_else(|| format!("{text:?} is not a CIDR (ADDRESS/PREFIX)"))?;
        let address: IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?}: {address:?} is not an IP address"))?;
        let (value, ipv6) = match address {
            IpAddr::V4(a) => (u128::from(u32::from(a)), false),
            IpAddr::V6(a) => (u128::from(a), true),
        };
        let bits = if ipv6 { 128 } else { 32 };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= bits)
            .ok_or_else(|| format!("{text:?}: the prefix must be a number from 0 to {bits}"))?;
        Ok(Self {
            value: network(value, prefix, bits),
            prefix,
            ipv6,
        })
    }

    pub fn is_ipv6(&self) -> bool {
        self.ipv6
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    fn bits(&self) -> u8 {
        if self.ipv6 { 128 } else { 32 }
    }
}

/// `value` with the bits after the first `prefix` of `bits` cleared.
fn network(value: u128, prefix: u8, bits: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        value & (u128::MAX << (bits - prefix))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ipv6 {
            write!(f, "{}/{}", Ipv6Addr::from(self.value), self.prefix)
        } else {
            // In range: an IPv4 value is built from a u32 and only ever cleared or
            // offset within its range.
            let v4 = u32::try_from(self.value).unwrap_or(u32::MAX);
            write!(f, "{}/{}", Ipv4Addr::from(v4), self.prefix)
        }
    }
}

/// A cluster CIDR cut into node ranges of prefix length `mask`, numbered from 0 at
/// its lowest address.
#[derive(Clone, Debug)]
pub struct CidrSet {
    cluster: Cidr,
    mask: u8,
}

impl CidrSet {
    /// Refuses a mask that is not longer than the cluster CIDR's prefix, longer than
    /// the family's addresses, or that would cut it into more than 2^16 ranges.
    pub fn new(cluster: Cidr, mask: u8) -> Result<Self, String> {
        if mask <= cluster.prefix {
            return Err(format!(
                "a node range of /{mask} must be smaller than the cluster CIDR {cluster}: \
                 the mask size must be larger than {}",
                cluster.prefix
            ));
        }
        if mask > cluster.bits() {
            return Err(format!(
                "/{mask} is longer than an {} address",
                if cluster.ipv6 { "IPv6" } else { "IPv4" }
            ));
        }
        if mask - cluster.prefix > MAX_SUBNET_BITS {
            return Err(format!(
                "/{mask} cuts {cluster} into 2^{} node ranges; at most 2^{MAX_SUBNET_BITS} \
                 (a mask size of at most {})",
                mask - cluster.prefix,
                cluster.prefix + MAX_SUBNET_BITS
            ));
        }
        Ok(Self { cluster, mask })
    }

    pub fn cluster(&self) -> Cidr {
        self.cluster
    }

    /// How many node ranges there are.
    pub fn count(&self) -> u32 {
        1 << (self.mask - self.cluster.prefix)
    }

    /// Node range `index` (below [`count`](Self::count)).
    pub fn range(&self, index: u32) -> Cidr {
        let shift = self.cluster.bits() - self.mask;
        Cidr {
            value: self.cluster.value + (u128::from(index) << shift),
            prefix: self.mask,
            ipv6: self.cluster.ipv6,
        }
    }

    /// The node ranges `cidr` overlaps, or `None` when it is not inside the cluster
    /// CIDR (another family included). A range larger than one node range covers
    /// several; a smaller one, the node range it falls in.
    pub fn indexes(&self, cidr: &Cidr) -> Option<Range<u32>> {
        let cluster = &self.cluster;
        if cidr.ipv6 != cluster.ipv6
            || cidr.prefix < cluster.prefix
            || network(cidr.value, cluster.prefix, cluster.bits()) != cluster.value
        {
            return None;
        }
        let shift = cluster.bits() - self.mask;
        // Below 2^16: the offset is inside the cluster CIDR, cut into at most 2^16.
        let first = u32::try_from((cidr.value - cluster.value) >> shift).ok()?;
        let count = if cidr.prefix >= self.mask {
            1
        } else {
            1 << (self.mask - cidr.prefix)
        };
        Some(first..first + count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cluster: &str, mask: u8) -> CidrSet {
        CidrSet::new(Cidr::parse(cluster).unwrap(), mask).unwrap()
    }

    #[test]
    fn cidrs_parse_and_print_as_networks() {
        assert_eq!(
            Cidr::parse("10.42.0.0/16").unwrap().to_string(),
            "10.42.0.0/16"
        );
        assert_eq!(
            Cidr::parse("10.42.7.1/16").unwrap().to_string(),
            "10.42.0.0/16"
        );
        assert_eq!(
            Cidr::parse("fd00:10:42::/48").unwrap().to_string(),
            "fd00:10:42::/48"
        );
        assert!(Cidr::parse("10.42.0.0").is_err());
        assert!(Cidr::parse("10.42.0.0/33").is_err());
        assert!(Cidr::parse("10.420.0.0/16").is_err());
        assert!(Cidr::parse("::/129").is_err());
    }

    #[test]
    fn a_cluster_cidr_is_cut_into_node_ranges_from_its_lowest_address() {
        let s = set("10.42.0.0/16", 24);
        assert_eq!(s.count(), 256);
        assert_eq!(s.range(0).to_string(), "10.42.0.0/24");
        assert_eq!(s.range(1).to_string(), "10.42.1.0/24");
        assert_eq!(s.range(255).to_string(), "10.42.255.0/24");
        let s = set("fd00:10:42::/48", 64);
        assert_eq!(s.range(2).to_string(), "fd00:10:42:2::/64");
    }

    #[test]
    fn ranges_map_to_the_node_ranges_they_overlap() {
        let s = set("10.42.0.0/16", 24);
        let idx = |c: &str| s.indexes(&Cidr::parse(c).unwrap());
        assert_eq!(idx("10.42.3.0/24"), Some(3..4));
        assert_eq!(idx("10.42.4.0/23"), Some(4..6));
        assert_eq!(idx("10.42.9.128/25"), Some(9..10));
        assert_eq!(idx("10.43.0.0/24"), None);
        assert_eq!(idx("10.0.0.0/8"), None);
        assert_eq!(idx("fd00::/64"), None);
    }

    #[test]
    fn mask_sizes_that_cannot_cut_the_cluster_cidr_are_refused() {
        let cluster = Cidr::parse("10.42.0.0/16").unwrap();
        assert!(CidrSet::new(cluster, 16).is_err());
        assert!(CidrSet::new(cluster, 8).is_err());
        assert!(CidrSet::new(cluster, 33).is_err());
        assert_eq!(set("10.42.0.0/16", 32).count(), 65536);
        let wide = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(CidrSet::new(wide, 25).is_err());
        assert_eq!(set("10.0.0.0/8", 24).count(), 65536);
    }
}
