//! Files written whole by rename: a reader sees the old file or the new one, never a
//! partial one, and a key never exists with wider permissions than its own.

use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;

/// Private keys, and files that embed one: readable by their owner alone.
pub const KEY_MODE: u32 = 0o600;
/// Certificates, which are public.
pub const CERT_MODE: u32 = 0o644;
/// Directories holding keys.
pub const DIR_MODE: u32 = 0o700;

/// Replaces `path` with `contents` atomically: readers see the old or the new file,
/// never a partial one, and a key never exists with wider permissions than `mode`.
pub fn write_file_atomic(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    let tmp = write_temp_beside(path, contents, mode)?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .with_context(|| format!("rename into {}", path.display()))?;
    sync_parent(path)
}

/// Like [`write_file_atomic`], but leaves an existing file alone: returns `Ok(false)`
/// if `path` already existed.
pub fn create_file_atomic(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<bool> {
    let tmp = write_temp_beside(path, contents, mode)?;
    match tmp.persist_noclobber(path) {
        Ok(_) => {
            sync_parent(path)?;
            Ok(true)
        }
        Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e.error).with_context(|| format!("create {}", path.display())),
    }
}

/// Reads a file, `None` if it does not exist.
pub fn read_optional(path: &Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(contents) => Ok(Some(contents)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Creates `dir` and its parents, `dir` itself with [`DIR_MODE`].
pub fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, DIR_MODE);
    builder
        .create(dir)
        .with_context(|| format!("create {}", dir.display()))
}

fn write_temp_beside(
    path: &Path,
    contents: &[u8],
    mode: u32,
) -> anyhow::Result<tempfile::NamedTempFile> {
    let dir = parent_dir(path);
    // tempfile creates files with mode 0600, so secrets are never readable by others.
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .with_context(|| format!("create temporary file in {}", dir.display()))?;
    tmp.write_all(contents)
        .with_context(|| format!("write temporary file for {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("set permissions for {}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    tmp.as_file()
        .sync_all()
        .with_context(|| format!("sync temporary file for {}", path.display()))?;
    Ok(tmp)
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Makes a rename durable: it lives in the directory entry.
fn sync_parent(path: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        let dir = parent_dir(path);
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("sync {}", dir.display()))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_file_atomic_replaces_and_create_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write_file_atomic(&path, b"one", 0o600).unwrap();
        write_file_atomic(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(!create_file_atomic(&path, b"three", 0o600).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let fresh = dir.path().join("g");
        assert!(create_file_atomic(&fresh, b"four", 0o600).unwrap());
        assert_eq!(std::fs::read(&fresh).unwrap(), b"four");
    }
}
