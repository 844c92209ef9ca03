//! Where a pod's logs live on the node: `ROOT/logs/NAMESPACE_NAME_UID`, as the kubelet
//! names the directory. The sandbox is given it, the log reader finds it by the pod's
//! name, and the pod's clean-up removes it.

use std::path::{Path, PathBuf};

/// The longest file name Linux file systems take (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// The directory of a pod's logs in `logs` (the agent's `ROOT/logs`):
/// `NAMESPACE_NAME_UID`, as the kubelet names it. A pod name may be 253 characters,
/// more than one path component holds with the rest, so a name too long is cut and
/// ends in a hash of the whole name: the directory stays unique to its pod and
/// [`pod_logs_prefix`] finds it from the name again.
pub fn pod_logs_dir(logs: &Path, namespace: &str, name: &str, uid: &str) -> PathBuf {
    logs.join(format!("{}{uid}", pod_logs_prefix(namespace, name)))
}

/// `NAMESPACE_NAME_`, with the name cut as [`pod_logs_dir`] says.
pub fn pod_logs_prefix(namespace: &str, name: &str) -> String {
    // A UID is 36 characters; room for it and the two separators.
    let room = NAME_MAX.saturating_sub(namespace.len() + 2 + 36);
    if name.len() <= room {
        return format!("{namespace}_{name}_");
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    let hash: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // Names are ASCII (DNS subdomains), so any byte is a character boundary.
    let keep = room.saturating_sub(hash.len() + 1).min(name.len());
    format!("{namespace}_{}-{hash}_", &name[..keep])
}

/// The UID of a pod logs directory's name (`NAMESPACE_NAME_UID`), if it is one.
pub fn uid_of_pod_logs_dir(dir_name: &str) -> Option<&str> {
    let (rest, uid) = dir_name.rsplit_once('_')?;
    (rest.contains('_') && !uid.is_empty()).then_some(uid)
}
