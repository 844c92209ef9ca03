//! Who a sandboxed process is: its user and groups, and its capabilities (the
//! bounding set, and the effective and permitted sets of a root user).

use rustix::io::Errno;
use rustix::process::{Gid, Uid};
use rustix::thread::{CapabilitySet, CapabilitySets};
use serde::{Deserialize, Serialize};

/// The capabilities containerd gives a container by default (and Docker before it).
pub(crate) const DEFAULT_CAPABILITIES: CapabilitySet = CapabilitySet::CHOWN
    .union(CapabilitySet::DAC_OVERRIDE)
    .union(CapabilitySet::FSETID)
    .union(CapabilitySet::FOWNER)
    .union(CapabilitySet::MKNOD)
    .union(CapabilitySet::NET_RAW)
    .union(CapabilitySet::SETGID)
    .union(CapabilitySet::SETUID)
    .union(CapabilitySet::SETFCAP)
    .union(CapabilitySet::SETPCAP)
    .union(CapabilitySet::NET_BIND_SERVICE)
    .union(CapabilitySet::SYS_CHROOT)
    .union(CapabilitySet::KILL)
    .union(CapabilitySet::AUDIT_WRITE);

/// The user of `nobody` and group of `nogroup`: a `process` container's user when
/// the pod names none (a program on the node has no image to say which).
pub(crate) const NOBODY: u32 = 65534;

/// The credentials a sandboxed process runs with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// The bounding set; also the effective and permitted sets of a root user (a
    /// non-root user has none, as in Kubernetes).
    pub capabilities: u64,
    /// The effective set, when it differs from the bounding set (an exec mirrors
    /// the container's process, whatever it did with its own).
    pub effective: Option<u64>,
}

/// The bounding set of a container asking for `add` and `drop`, as containerd makes
/// it: "ALL" in `add` is every capability, "ALL" in `drop` none, then the named ones
/// are added and dropped. Names with or without `CAP_`.
pub(crate) fn capability_set(add: &[String], drop: &[String]) -> Result<u64, String> {
    let all = |names: &[String]| names.iter().any(|n| n.eq_ignore_ascii_case("ALL"));
    let mut set = DEFAULT_CAPABILITIES;
    if all(add) {
        set = CapabilitySet::all();
    }
    if all(drop) {
        set = CapabilitySet::empty();
    }
    for name in add.iter().filter(|n| !n.eq_ignore_ascii_case("ALL")) {
        set |= parse(name)?;
    }
    for name in drop.iter().filter(|n| !n.eq_ignore_ascii_case("ALL")) {
        set -= parse(name)?;
    }
    Ok(set.bits())
}

fn parse(name: &str) -> Result<CapabilitySet, String> {
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("CAP_").unwrap_or(&upper);
    CapabilitySet::from_name(bare).ok_or_else(|| format!("unknown capability {name:?}"))
}

/// Takes on `creds`, in a single-threaded process (the calls change the calling
/// thread's credentials alone): the bounding set first, while the capability to
/// change it is held, then groups, group and user, then the capability sets.
pub(crate) fn apply(creds: &Creds) -> std::io::Result<()> {
    let keep = CapabilitySet::from_bits_retain(creds.capabilities);
    for bit in 0..64 {
        let capability = CapabilitySet::from_bits_retain(1 << bit);
        if keep.contains(capability) {
            continue;
        }
        match rustix::thread::remove_capability_from_bounding_set(capability) {
            Ok(()) => {}
            // Past the last capability this kernel knows.
            Err(Errno::INVAL) => break,
            Err(e) => return Err(e.into()),
        }
    }
    let groups: Vec<Gid> = creds.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    rustix::thread::set_thread_groups(&groups)?;
    let gid = Gid::from_raw(creds.gid);
    rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    let uid = Uid::from_raw(creds.uid);
    // From root to another user the kernel clears the permitted and effective sets.
    rustix::thread::set_thread_res_uid(uid, uid, uid)?;
    rustix::thread::clear_ambient_capability_set()?;
    if creds.uid == 0 {
        let effective =
            CapabilitySet::from_bits_retain(creds.effective.unwrap_or(creds.capabilities));
        rustix::thread::set_capabilities(
            None,
            CapabilitySets {
                effective: effective & keep,
                permitted: keep,
                inheritable: CapabilitySet::empty(),
            },
        )?;
    }
    Ok(())
}

/// What a process's `/proc/<pid>/status` says of its credentials, and whether it
/// has no_new_privs and a seccomp filter: what an exec into it takes on.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Mirrored {
    pub creds: Creds,
    pub no_new_privs: bool,
    pub seccomp: bool,
}

pub(crate) fn mirror(status: &str) -> Result<Mirrored, String> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .ok_or_else(|| format!("the process status has no {name}"))
    };
    let first = |name: &str| -> Result<u32, String> {
        field(name)?
            .split_whitespace()
            // The effective id: all four are the same in a container's process.
            .nth(1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("bad {name} in the process status"))
    };
    let hex = |name: &str| -> Result<u64, String> {
        u64::from_str_radix(field(name)?, 16).map_err(|e| format!("bad {name}: {e}"))
    };
    let groups = field("Groups")?
        .split_whitespace()
        .map(|g| g.parse().map_err(|e| format!("bad Groups: {e}")))
        .collect::<Result<Vec<u32>, String>>()?;
    Ok(Mirrored {
        creds: Creds {
            uid: first("Uid")?,
            gid: first("Gid")?,
            groups,
            capabilities: hex("CapBnd")?,
            effective: Some(hex("CapEff")?),
        },
        no_new_privs: field("NoNewPrivs")? == "1",
        seccomp: field("Seccomp")? != "0",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_added_and_dropped_as_containerd_does() {
        let default = DEFAULT_CAPABILITIES.bits();
        assert_eq!(capability_set(&[], &[]).unwrap(), default);
        let net_admin = CapabilitySet::NET_ADMIN.bits();
        let chown = CapabilitySet::CHOWN.bits();
        assert_eq!(
            capability_set(&["CAP_NET_ADMIN".into()], &["chown".into()]).unwrap(),
            (default | net_admin) & !chown
        );
        assert_eq!(
            capability_set(&["NET_ADMIN".into()], &["ALL".into()]).unwrap(),
            net_admin
        );
        assert_eq!(
            capability_set(&["ALL".into()], &["CHOWN".into()]).unwrap(),
            CapabilitySet::all().bits() & !chown
        );
        assert!(capability_set(&["CAP_FLY".into()], &[]).is_err());
    }

    #[test]
    fn an_exec_mirrors_the_process_status() {
        let status = "Name:\tsleep\nUid:\t65534\t65534\t65534\t65534\nGid:\t100\t100\t100\t100\n\
            Groups:\t5 6 \nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
            CapEff:\t0000000000000000\nCapBnd:\t00000000a80425fb\nNoNewPrivs:\t1\nSeccomp:\t2\n";
        let mirrored = mirror(status).unwrap();
        assert_eq!(
            mirrored,
            Mirrored {
                creds: Creds {
                    uid: 65534,
                    gid: 100,
                    groups: vec![5, 6],
                    capabilities: 0xa80425fb,
                    effective: Some(0),
                },
                no_new_privs: true,
                seccomp: true,
            }
        );
        assert_eq!(
            DEFAULT_CAPABILITIES.bits(),
            0xa80425fb,
            "Docker's default set"
        );
    }
}
