//! The `RuntimeDefault` seccomp profile of a sandboxed process: a denylist in the
//! spirit of Docker's default profile. What only an administrator of the node does
//! (mounts, modules, kexec, reboot, the clock, swap, accounting, keyrings, BPF,
//! perf, new namespaces, handles to any file, io_uring) fails with `EPERM`; `clone3`,
//! whose flags a filter cannot read, fails with `ENOSYS`, so the C library falls back
//! to `clone`, whose namespace flags it can. Built with `seccompiler`; applying a
//! filter also sets `no_new_privs` (it must, for a process without `CAP_SYS_ADMIN`).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Denied whatever their arguments.
const DENIED: &[i64] = &[
    libc::SYS_acct,
    libc::SYS_add_key,
    libc::SYS_adjtimex,
    libc::SYS_bpf,
    libc::SYS_clock_adjtime,
    libc::SYS_clock_settime,
    libc::SYS_delete_module,
    libc::SYS_finit_module,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fsopen,
    libc::SYS_fspick,
    libc::SYS_init_module,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_io_uring_setup,
    libc::SYS_kexec_file_load,
    libc::SYS_kexec_load,
    libc::SYS_keyctl,
    libc::SYS_mount,
    libc::SYS_mount_setattr,
    libc::SYS_move_mount,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_open_tree,
    libc::SYS_perf_event_open,
    libc::SYS_pivot_root,
    libc::SYS_quotactl,
    libc::SYS_reboot,
    libc::SYS_request_key,
    libc::SYS_setns,
    libc::SYS_settimeofday,
    libc::SYS_swapoff,
    libc::SYS_swapon,
    libc::SYS_syslog,
    libc::SYS_umount2,
    libc::SYS_userfaultfd,
    libc::SYS_vhangup,
];

/// The flags of `clone` and `unshare` that make namespaces.
const NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWCGROUP,
];

fn arch() -> Result<TargetArch, String> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("seccomp on {}: {e}", std::env::consts::ARCH))
}

/// The two filters: the denylist (`EPERM`) and `clone3` (`ENOSYS`).
fn filters() -> Result<[BpfProgram; 2], String> {
    let arch = arch()?;
    let bad = |e: seccompiler::BackendError| format!("build the seccomp filter: {e}");
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|call| (*call, Vec::new())).collect();
    let with_namespace_flag = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            let flag = *flag as u64;
            SeccompRule::new(vec![
                SeccompCondition::new(
                    0,
                    SeccompCmpArgLen::Qword,
                    SeccompCmpOp::MaskedEq(flag),
                    flag,
                )
                .map_err(bad)?,
            ])
            .map_err(bad)
        })
        .collect::<Result<Vec<_>, String>>()?;
    rules.insert(libc::SYS_unshare, with_namespace_flag.clone());
    // The flags are clone's first argument on the architectures this runs on.
    rules.insert(libc::SYS_clone, with_namespace_flag);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(bad)?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(bad)?;
    let compile = |f: SeccompFilter| {
        BpfProgram::try_from(f).map_err(|e| format!("compile the seccomp filter: {e}"))
    };
    Ok([compile(deny)?, compile(clone3)?])
}

/// Applies the profile to the calling thread (and what it starts).
pub(crate) fn apply_runtime_default() -> Result<(), String> {
    for filter in filters()? {
        seccompiler::apply_filter(&filter).map_err(|e| format!("apply the seccomp filter: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_compiles_for_this_machine() {
        let [deny, clone3] = filters().unwrap();
        assert!(deny.len() > DENIED.len(), "{}", deny.len());
        assert!(!clone3.is_empty());
    }
}
