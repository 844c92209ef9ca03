//! The few rtnetlink requests the in-process bridge makes (links, addresses, a
//! route), written as bytes on a rustix socket: a handful of fixed-layout messages
//! need no async netlink stack, and a socket opened on a thread inside a pod's
//! namespace keeps talking to that namespace from any thread.
//!
//! Every request asks for an acknowledgement and waits for it, so an error comes back
//! as the errno the kernel set.

use std::net::Ipv4Addr;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};

use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_SETLINK: u16 = 19;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;

const IFF_UP: u32 = 0x1;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_PROTINFO: u16 = 12;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const AF_BRIDGE: u8 = 7;
const IFLA_BRPORT_MODE: u16 = 4;

const AF_INET: u8 = 2;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_BROADCAST: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_OIF: u16 = 4;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RTN_UNICAST: u8 = 1;

/// A route netlink socket of the namespace of the thread that opened it.
pub(crate) struct Netlink {
    socket: OwnedFd,
    sequence: u32,
}

/// A message under construction: a header whose length is filled in at the end, then
/// a fixed part and attributes, each padded to four bytes.
struct Message {
    bytes: Vec<u8>,
}

impl Message {
    fn new(kind: u16, flags: u16) -> Self {
        let mut bytes = Vec::with_capacity(128);
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        Self { bytes }
    }

    /// An `ifinfomsg`: family, type, index, flags, change.
    fn link(mut self, index: u32, flags: u32) -> Self {
        push_link(&mut self.bytes, index, flags);
        self
    }

    /// An `ifinfomsg` of the bridge family for port `index`, changing no flags.
    fn bridge_port(mut self, index: u32) -> Self {
        push_link(&mut self.bytes, index, 0);
        self.bytes[16] = AF_BRIDGE;
        self
    }

    fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Self {
        push_attr(&mut self.bytes, kind, data);
        self
    }

    fn nest(&mut self, kind: u16, build: impl FnOnce(&mut Vec<u8>)) -> &mut Self {
        push_nest(&mut self.bytes, kind, build);
        self
    }
}

fn push_link(bytes: &mut Vec<u8>, index: u32, flags: u32) {
    bytes.extend_from_slice(&[0, 0, 0, 0]);
    bytes.extend_from_slice(&index.to_ne_bytes());
    bytes.extend_from_slice(&flags.to_ne_bytes());
    bytes.extend_from_slice(&flags.to_ne_bytes());
}

fn push_attr(bytes: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let length = u16::try_from(4 + data.len()).unwrap_or(u16::MAX);
    bytes.extend_from_slice(&length.to_ne_bytes());
    bytes.extend_from_slice(&kind.to_ne_bytes());
    bytes.extend_from_slice(data);
    pad(bytes);
}

fn push_nest(bytes: &mut Vec<u8>, kind: u16, build: impl FnOnce(&mut Vec<u8>)) {
    let start = bytes.len();
    bytes.extend_from_slice(&[0, 0]);
    bytes.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    build(bytes);
    let length = u16::try_from(bytes.len() - start).unwrap_or(u16::MAX);
    bytes[start..start + 2].copy_from_slice(&length.to_ne_bytes());
    pad(bytes);
}

fn pad(bytes: &mut Vec<u8>) {
    while !bytes.len().is_multiple_of(4) {
        bytes.push(0);
    }
}

/// A name as the kernel reads it: NUL-terminated.
fn name(name: &str) -> Vec<u8> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    bytes
}

impl Netlink {
    /// A socket of the calling thread's network namespace.
    pub(crate) fn open() -> std::io::Result<Self> {
        let socket = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, None)?;
        Ok(Self {
            socket,
            sequence: 0,
        })
    }

    /// Sends `message` and reads until its acknowledgement; returns the data messages
    /// that came before it (a GET's answer).
    fn request(&mut self, message: Message) -> std::io::Result<Vec<Vec<u8>>> {
        let mut bytes = message.bytes;
        self.sequence = self.sequence.wrapping_add(1);
        let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        bytes[0..4].copy_from_slice(&length.to_ne_bytes());
        bytes[8..12].copy_from_slice(&self.sequence.to_ne_bytes());
        let kernel = netlink::SocketAddrNetlink::new(0, 0);
        rustix::net::sendto(&self.socket, &bytes, SendFlags::empty(), &kernel)?;
        let mut answers = Vec::new();
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let (read, _) = rustix::net::recv(&self.socket, &mut buffer[..], RecvFlags::empty())?;
            let mut at = 0;
            while at + 16 <= read {
                let u32_at =
                    |i: usize| u32::from_ne_bytes(buffer[i..i + 4].try_into().unwrap_or_default());
                let length = usize::try_from(u32_at(at)).unwrap_or(0);
                if length < 16 || at + length > read {
                    break;
                }
                let kind = u16::from_ne_bytes([buffer[at + 4], buffer[at + 5]]);
                let sequence = u32_at(at + 8);
                if sequence == self.sequence {
                    match kind {
                        NLMSG_ERROR => {
                            let errno = i32::from_ne_bytes(
                                buffer[at + 16..at + 20].try_into().unwrap_or_default(),
                            );
                            return if errno == 0 {
                                Ok(answers)
                            } else {
                                Err(std::io::Error::from_raw_os_error(-errno))
                            };
                        }
                        NLMSG_DONE => return Ok(answers),
                        _ => answers.push(buffer[at..at + length].to_vec()),
                    }
                }
                at += length.next_multiple_of(4);
            }
        }
    }

    /// The index of link `name`; none when there is no such link.
    pub(crate) fn link_index(&mut self, link: &str) -> std::io::Result<Option<u32>> {
        let mut message = Message::new(RTM_GETLINK, 0).link(0, 0);
        message.attr(IFLA_IFNAME, &name(link));
        match self.request(message) {
            Ok(answers) => Ok(answers.first().and_then(|answer| {
                // nlmsghdr (16), then ifinfomsg: family, pad, type, index.
                answer
                    .get(20..24)
                    .and_then(|b| b.try_into().ok())
                    .map(u32::from_ne_bytes)
            })),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NODEV.raw_os_error()) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Makes bridge `bridge` with the MAC address `mac`, up; one that exists is left
    /// as it is.
    pub(crate) fn add_bridge(&mut self, bridge: &str, mac: [u8; 6]) -> std::io::Result<()> {
        let mut message = Message::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL).link(0, IFF_UP);
        message
            .attr(IFLA_IFNAME, &name(bridge))
            .attr(IFLA_ADDRESS, &mac)
            .nest(IFLA_LINKINFO, |b| push_attr(b, IFLA_INFO_KIND, b"bridge"));
        match self.request(message) {
            Err(e) if e.raw_os_error() != Some(rustix::io::Errno::EXIST.raw_os_error()) => Err(e),
            _ => Ok(()),
        }
    }

    /// Brings link `index` up.
    pub(crate) fn set_up(&mut self, index: u32) -> std::io::Result<()> {
        self.request(Message::new(RTM_NEWLINK, 0).link(index, IFF_UP))
            .map(drop)
    }

    /// Gives link `index` the address `ip/prefix` (with its broadcast address); one it
    /// has already is not an error.
    pub(crate) fn add_address(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        prefix: u8,
    ) -> std::io::Result<()> {
        let mut message = Message::new(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL);
        // ifaddrmsg: family, prefix length, flags, scope, index.
        message
            .bytes
            .extend_from_slice(&[AF_INET, prefix, 0, RT_SCOPE_UNIVERSE]);
        message.bytes.extend_from_slice(&index.to_ne_bytes());
        let host_bits = u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0);
        let broadcast = Ipv4Addr::from(u32::from(ip) | host_bits);
        message
            .attr(IFA_LOCAL, &ip.octets())
            .attr(IFA_ADDRESS, &ip.octets())
            .attr(IFA_BROADCAST, &broadcast.octets());
        match self.request(message) {
            Err(e) if e.raw_os_error() != Some(rustix::io::Errno::EXIST.raw_os_error()) => Err(e),
            _ => Ok(()),
        }
    }

    /// Adds the default route via `gateway` on link `index`.
    pub(crate) fn add_default_route(
        &mut self,
        gateway: Ipv4Addr,
        index: u32,
    ) -> std::io::Result<()> {
        let mut message = Message::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL);
        // rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
        message.bytes.extend_from_slice(&[
            AF_INET,
            0,
            0,
            0,
            RT_TABLE_MAIN,
            RTPROT_BOOT,
            RT_SCOPE_UNIVERSE,
            RTN_UNICAST,
        ]);
        message.bytes.extend_from_slice(&0u32.to_ne_bytes());
        message
            .attr(RTA_GATEWAY, &gateway.octets())
            .attr(RTA_OIF, &index.to_ne_bytes());
        self.request(message).map(drop)
    }

    /// Makes the veth pair `host` (up, a port of bridge `master`) and `peer` (down),
    /// the peer made inside the network namespace `netns` names.
    pub(crate) fn add_veth(
        &mut self,
        host: &str,
        master: u32,
        peer: &str,
        netns: &std::fs::File,
    ) -> std::io::Result<()> {
        let fd = u32::try_from(netns.as_fd().as_raw_fd()).unwrap_or(u32::MAX);
        let mut message = Message::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL).link(0, IFF_UP);
        message
            .attr(IFLA_IFNAME, &name(host))
            .attr(IFLA_MASTER, &master.to_ne_bytes())
            .nest(IFLA_LINKINFO, |b| {
                push_attr(b, IFLA_INFO_KIND, b"veth");
                push_nest(b, IFLA_INFO_DATA, |b| {
                    push_nest(b, VETH_INFO_PEER, |b| {
                        // Down: the kernel opens the peer before the pair is joined,
                        // which fails (ENOTCONN); it is brought up inside.
                        push_link(b, 0, 0);
                        push_attr(b, IFLA_IFNAME, &name(peer));
                        push_attr(b, IFLA_NET_NS_FD, &fd.to_ne_bytes());
                    });
                });
            });
        self.request(message).map(drop)
    }

    /// Puts bridge port `index` in hairpin mode (a frame may go back out of the port
    /// it came in by: a pod reaching itself through a hostPort or a Service), as
    /// `bridge link set dev X hairpin on` does. Not through
    /// `/sys/class/net/X/brport/hairpin_mode`: sysfs shows the links of the namespace
    /// it was mounted in, not necessarily the calling thread's.
    pub(crate) fn set_hairpin(&mut self, index: u32) -> std::io::Result<()> {
        let mut message = Message::new(RTM_SETLINK, 0).bridge_port(index);
        // Nested, or the kernel reads the attribute as the old bare port state.
        message.nest(IFLA_PROTINFO, |b| push_attr(b, IFLA_BRPORT_MODE, &[1]));
        self.request(message).map(drop)
    }

    /// Deletes link `link` (a veth takes its peer with it); none is not an error.
    pub(crate) fn delete_link(&mut self, link: &str) -> std::io::Result<()> {
        let mut message = Message::new(RTM_DELLINK, 0).link(0, 0);
        message.attr(IFLA_IFNAME, &name(link));
        match self.request(message) {
            Err(e) if e.raw_os_error() != Some(rustix::io::Errno::NODEV.raw_os_error()) => Err(e),
            _ => Ok(()),
        }
    }
}
