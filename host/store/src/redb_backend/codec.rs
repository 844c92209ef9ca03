//! On-disk encodings of the two record kinds. Little-endian, length-prefixed, no
//! padding: a record is decoded with bounds checks only, never trusted.
//!
//! Each value is stored once, in the history log entry of the revision that wrote it;
//! the `kv` table points at that entry, and every entry points at the key's previous
//! entry. That keeps a write to one value plus two small records.
//!
//! - `kv` record: `create u64 | mod u64 | version u64`
//! - `log` entry (keyed by its revision):
//!   `kind u8 | key_len u32 | key | create u64 | version u64 | prev_mod u64 | value…`
//!   (`prev_mod` 0: the key did not exist before; a delete has no value)

use bytes::Bytes;

use crate::{EventKind, KeyValue, Revision};

const PUT: u8 = 1;
const DELETE: u8 = 2;

/// The latest revisions of a live key; its value is in the log entry `mod_revision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyMeta {
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub version: u64,
}

/// One history entry: what the write at its revision did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub kind: EventKind,
    pub key: String,
    /// For a put: the key's create revision and version after it. Zero for a delete.
    pub create_revision: Revision,
    pub version: u64,
    /// The revision of the key's previous entry; 0 if it did not exist.
    pub prev_mod: Revision,
    pub value: Bytes,
}

impl Entry {
    /// The key-value this entry wrote, as of `revision` (the entry's own revision).
    pub fn into_kv(self, revision: Revision) -> KeyValue {
        KeyValue {
            key: self.key,
            value: self.value,
            create_revision: self.create_revision,
            mod_revision: revision,
            version: self.version,
        }
    }
}

pub(crate) fn encode_meta(m: &KeyMeta) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&m.create_revision.to_le_bytes());
    out[8..16].copy_from_slice(&m.mod_revision.to_le_bytes());
    out[16..].copy_from_slice(&m.version.to_le_bytes());
    out
}

pub(crate) fn decode_meta(bytes: &[u8]) -> Result<KeyMeta, String> {
    let mut r = Reader(bytes);
    let meta = KeyMeta {
        create_revision: r.u64()?,
        mod_revision: r.u64()?,
        version: r.u64()?,
    };
    if !r.0.is_empty() {
        return Err(format!("key record has {} trailing bytes", r.0.len()));
    }
    Ok(meta)
}

pub(crate) fn encode_entry(out: &mut Vec<u8>, e: &Entry) {
    out.clear();
    out.reserve(29 + e.key.len() + e.value.len());
    out.push(match e.kind {
        EventKind::Put => PUT,
        EventKind::Delete => DELETE,
    });
    // Keys are bounded far below 4 GiB by the request size limits above the store.
    out.extend_from_slice(&u32::try_from(e.key.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(e.key.as_bytes());
    out.extend_from_slice(&e.create_revision.to_le_bytes());
    out.extend_from_slice(&e.version.to_le_bytes());
    out.extend_from_slice(&e.prev_mod.to_le_bytes());
    out.extend_from_slice(&e.value);
}

pub(crate) fn decode_entry(revision: Revision, bytes: &[u8]) -> Result<Entry, String> {
    let mut r = Reader(bytes);
    let kind = match r.u8()? {
        PUT => EventKind::Put,
        DELETE => EventKind::Delete,
        other => return Err(format!("unknown entry kind {other} at revision {revision}")),
    };
    let key_len = r.u32()? as usize;
    let key = String::from_utf8(r.take(key_len)?.to_vec())
        .map_err(|_| format!("key at revision {revision} is not UTF-8"))?;
    Ok(Entry {
        kind,
        key,
        create_revision: r.u64()?,
        version: r.u64()?,
        prev_mod: r.u64()?,
        value: Bytes::copy_from_slice(r.rest()),
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "record truncated: wanted {n} bytes, {} left",
                self.0.len()
            ));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let mut buf = Vec::new();
        for e in [
            Entry {
                kind: EventKind::Put,
                key: "/a".into(),
                create_revision: 5,
                version: 2,
                prev_mod: 5,
                value: Bytes::from("v2"),
            },
            Entry {
                kind: EventKind::Delete,
                key: "/a".into(),
                create_revision: 0,
                version: 0,
                prev_mod: 9,
                value: Bytes::new(),
            },
        ] {
            encode_entry(&mut buf, &e);
            assert_eq!(decode_entry(9, &buf).unwrap(), e);
        }
        let meta = KeyMeta {
            create_revision: 3,
            mod_revision: 7,
            version: 4,
        };
        assert_eq!(decode_meta(&encode_meta(&meta)).unwrap(), meta);
    }

    #[test]
    fn truncated_records_are_errors_not_panics() {
        let mut buf = Vec::new();
        let e = Entry {
            kind: EventKind::Put,
            key: "/key".into(),
            create_revision: 3,
            version: 1,
            prev_mod: 0,
            value: Bytes::new(),
        };
        encode_entry(&mut buf, &e);
        for cut in 0..buf.len() {
            assert!(
                decode_entry(3, &buf[..cut]).is_err(),
                "cut at {cut} decoded"
            );
        }
        buf[0] = 7;
        assert!(decode_entry(3, &buf).is_err());
        assert!(decode_meta(&[1, 2, 3]).is_err());
        assert!(decode_meta(&[0; 25]).is_err());
    }
}
