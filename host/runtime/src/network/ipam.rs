//! Pods' addresses from the node's (IPv4) pod CIDR, kept on disk exactly as the CNI
//! `host-local` plugin keeps them: a file per address in `<data dir>/<network>`
//! holding `<sandbox id>\r\n<interface>`, the last address handed out in
//! `last_reserved_ip.0`, and the directory itself locked (`flock`) while it changes.
//! So the in-process bridge and the plugins share one record of the addresses taken:
//! a node that switches between them never hands out an address twice, and a restart
//! never reuses a live one.

use std::fs::File;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// The interface the address is for, as host-local records it.
const IFNAME: &str = "eth0";
const LAST_RESERVED: &str = "last_reserved_ip.0";

#[derive(Clone, Debug)]
pub(crate) struct Ipam {
    /// `<data dir>/<network name>`.
    dir: PathBuf,
    /// The range's network address and prefix length.
    network: u32,
    prefix: u8,
}

impl Ipam {
    /// The addresses of `subnet` (`network/prefix`, up to a /30) for the network named
    /// `name`, recorded under `data_dir`.
    pub(crate) fn new(data_dir: &Path, name: &str, network: Ipv4Addr, prefix: u8) -> Self {
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        Self {
            dir: data_dir.join(name),
            network: u32::from(network) & mask,
            prefix,
        }
    }

    pub(crate) fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The range's first address: the bridge's, the pods' gateway.
    pub(crate) fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.network + 1)
    }

    /// The addresses pods get, in host-local's order: after the gateway, before the
    /// broadcast address.
    fn usable(&self) -> std::ops::RangeInclusive<u32> {
        let size = 1u64 << (32 - u32::from(self.prefix));
        let last = u64::from(self.network) + size - 2;
        self.network + 2..=u32::try_from(last).unwrap_or(u32::MAX)
    }

    /// Holds the directory's lock, as host-local does, until dropped.
    fn lock(&self) -> std::io::Result<File> {
        std::fs::create_dir_all(&self.dir)?;
        let dir = File::open(&self.dir)?;
        rustix::fs::flock(&dir, rustix::fs::FlockOperation::LockExclusive)?;
        Ok(dir)
    }

    /// An address for sandbox `id`: the one it has, else the next free one after the
    /// last handed out (so a freed address is not reused at once).
    pub(crate) fn allocate(&self, id: &str) -> std::io::Result<Ipv4Addr> {
        let _lock = self.lock()?;
        if let Some(ip) = self.find(id)? {
            return Ok(ip);
        }
        let usable = self.usable();
        let last = std::fs::read_to_string(self.dir.join(LAST_RESERVED))
            .ok()
            .and_then(|s| s.trim().parse::<Ipv4Addr>().ok())
            .map(u32::from)
            .filter(|ip| usable.contains(ip));
        let start = last.map_or(*usable.start(), |ip| {
            if ip == *usable.end() {
                *usable.start()
            } else {
                ip + 1
            }
        });
        for candidate in (start..=*usable.end()).chain(*usable.start()..start) {
            let ip = Ipv4Addr::from(candidate);
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(self.dir.join(ip.to_string()));
            match file {
                Ok(mut file) => {
                    file.write_all(format!("{}\r\n{IFNAME}", id.trim()).as_bytes())?;
                    std::fs::write(self.dir.join(LAST_RESERVED), ip.to_string())?;
                    return Ok(ip);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other(format!(
            "no free address in {}/{}",
            Ipv4Addr::from(self.network),
            self.prefix
        )))
    }

    /// Frees sandbox `id`'s address; none is not an error.
    pub(crate) fn release(&self, id: &str) -> std::io::Result<()> {
        if !self.dir.exists() {
            return Ok(());
        }
        let _lock = self.lock()?;
        while let Some(ip) = self.find(id)? {
            match std::fs::remove_file(self.dir.join(ip.to_string())) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// The address reserved for `id`, read as host-local matches its records (with
    /// its interface, or the id alone as older versions wrote).
    fn find(&self, id: &str) -> std::io::Result<Option<Ipv4Addr>> {
        let wanted = format!("{}\r\n{IFNAME}", id.trim());
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let Some(ip) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<Ipv4Addr>().ok())
            else {
                continue;
            };
            let held = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let held = held.trim();
            if held == wanted || held == id.trim() {
                return Ok(Some(ip));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_addresses_as_host_local_records_them() {
        let dir = tempfile::tempdir().unwrap();
        let ipam = Ipam::new(dir.path(), "net", "10.9.8.0".parse().unwrap(), 29);
        assert_eq!(ipam.gateway(), Ipv4Addr::new(10, 9, 8, 1));
        let a = ipam.allocate("a").unwrap();
        assert_eq!(a, Ipv4Addr::new(10, 9, 8, 2));
        assert_eq!(
            ipam.allocate("a").unwrap(),
            a,
            "the same sandbox, the same one"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("net/10.9.8.2")).unwrap(),
            "a\r\neth0"
        );
        // An address host-local gave out is taken.
        std::fs::write(dir.path().join("net/10.9.8.3"), "cni\r\neth0").unwrap();
        assert_eq!(ipam.allocate("b").unwrap(), Ipv4Addr::new(10, 9, 8, 4));
        for id in ["c", "d"] {
            ipam.allocate(id).unwrap();
        }
        assert!(
            ipam.allocate("f").is_err(),
            "2..=6 are taken, 7 is broadcast"
        );
        ipam.release("a").unwrap();
        ipam.release("a").unwrap();
        assert_eq!(ipam.allocate("f").unwrap(), a);
        // A fresh reader of the same records (a restarted runtime) agrees.
        let again = Ipam::new(dir.path(), "net", "10.9.8.0".parse().unwrap(), 29);
        assert_eq!(again.allocate("b").unwrap(), Ipv4Addr::new(10, 9, 8, 4));
        again.release("cni").unwrap();
        assert!(!dir.path().join("net/10.9.8.3").exists());
    }
}
