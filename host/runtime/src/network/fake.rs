//! A hollow node's pod network: each pod gets an address from the node's (first IPv4)
//! pod CIDR and nothing else, so the flow through the control plane is a real one's
//! while a sandbox stays a record.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;

use tonic::Status;

#[derive(Debug, Default)]
pub(crate) struct FakeNetwork {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The range's first address and its size; none until the node has a pod CIDR.
    range: Option<(u32, u32)>,
    /// Offsets in the range by sandbox, and those taken.
    by_sandbox: HashMap<String, u32>,
    taken: BTreeSet<u32>,
    /// Where the next search starts, so a freed address is not handed out at once.
    next: u32,
}

impl FakeNetwork {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn set_pod_cidr(&self, subnets: &[String]) {
        let range = subnets
            .iter()
            .filter_map(|subnet| super::parse_cidr(subnet))
            .find_map(|(ip, bits)| match ip {
                IpAddr::V4(ip) => {
                    let size = 1u64 << (32 - u32::from(bits));
                    let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
                    Some((
                        u32::from(ip) & mask,
                        u32::try_from(size).unwrap_or(u32::MAX),
                    ))
                }
                IpAddr::V6(_) => None,
            });
        let mut state = self.state();
        if state.range != range {
            *state = State {
                range,
                ..State::default()
            };
        }
    }

    pub(crate) fn has_pod_cidr(&self) -> bool {
        self.state().range.is_some()
    }

    /// An address for sandbox `id`: the range's first is the network's and the second
    /// its gateway's, as with the bridge; the last is its broadcast.
    pub(crate) fn allocate(&self, id: &str) -> Result<IpAddr, Status> {
        let mut state = self.state();
        let Some((base, size)) = state.range else {
            return Err(Status::failed_precondition("the node has no pod CIDR"));
        };
        if let Some(&offset) = state.by_sandbox.get(id) {
            return Ok(address(base, offset));
        }
        let usable = 2..size.saturating_sub(1);
        let start = state.next.clamp(usable.start, usable.end.max(usable.start));
        let free = (start..usable.end)
            .chain(usable.start..start)
            .find(|offset| !state.taken.contains(offset))
            .ok_or_else(|| Status::resource_exhausted("the node's pod CIDR is full"))?;
        state.taken.insert(free);
        state.by_sandbox.insert(id.to_string(), free);
        state.next = free + 1;
        Ok(address(base, free))
    }

    pub(crate) fn release(&self, id: &str) {
        let mut state = self.state();
        if let Some(offset) = state.by_sandbox.remove(id) {
            state.taken.remove(&offset);
        }
    }
}

fn address(base: u32, offset: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(base.wrapping_add(offset)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_each_address_once() {
        let fake = FakeNetwork::default();
        assert!(!fake.has_pod_cidr());
        assert!(fake.allocate("a").is_err());
        fake.set_pod_cidr(&["fd00::/64".into(), "10.42.3.7/30".into()]);
        assert!(fake.has_pod_cidr());
        let a = fake.allocate("a").unwrap();
        assert_eq!(a, IpAddr::from([10, 42, 3, 6]));
        assert_eq!(
            fake.allocate("a").unwrap(),
            a,
            "the same sandbox, the same address"
        );
        assert_eq!(
            fake.allocate("b").unwrap_err().code(),
            tonic::Code::ResourceExhausted
        );
        fake.release("a");
        fake.release("a");
        assert_eq!(fake.allocate("b").unwrap(), a);
        fake.set_pod_cidr(&["10.42.0.0/24".into()]);
        let ips: BTreeSet<_> = (0..253)
            .map(|i| fake.allocate(&i.to_string()).unwrap())
            .collect();
        assert_eq!(ips.len(), 253);
        assert!(!ips.contains(&IpAddr::from([10, 42, 0, 1])));
        assert!(!ips.contains(&IpAddr::from([10, 42, 0, 255])));
    }
}
