//! On-disk encodings of the two record kinds. Little-endian, length-prefixed, no
//! padding: a record is decoded with bounds checks only, never trusted.
//!
//! - `kv` record: `create u64 | mod u64 | version u64 | value…`
//! - `log` record (keyed by its revision):
//!   `kind u8 | key_len u32 | key | create u64 | version u64 | value_len u32 | value |
//!    has_prev u8 | [prev_create u64 | prev_mod u64 | prev_version u64 | prev_value…]`

use bytes::Bytes;

use crate::{Event, EventKind, KeyValue, Revision};

const PUT: u8 = 1;
const DELETE: u8 = 2;

/// The latest state of a key, without its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub version: u64,
    pub value: Bytes,
}

impl Record {
    pub fn into_kv(self, key: String) -> KeyValue {
        KeyValue {
            key,
            value: self.value,
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
        }
    }

    pub fn from_kv(kv: &KeyValue) -> Self {
        Record {
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            value: kv.value.clone(),
        }
    }
}

pub(crate) fn encode_record(out: &mut Vec<u8>, r: &Record) {
    out.clear();
    out.reserve(24 + r.value.len());
    out.extend_from_slice(&r.create_revision.to_le_bytes());
    out.extend_from_slice(&r.mod_revision.to_le_bytes());
    out.extend_from_slice(&r.version.to_le_bytes());
    out.extend_from_slice(&r.value);
}

pub(crate) fn decode_record(bytes: &[u8]) -> Result<Record, String> {
    let mut r = Reader(bytes);
    Ok(Record {
        create_revision: r.u64()?,
        mod_revision: r.u64()?,
        version: r.u64()?,
        value: Bytes::copy_from_slice(r.rest()),
    })
}

pub(crate) fn encode_event(out: &mut Vec<u8>, e: &Event) {
    out.clear();
    let prev_len = e.prev.as_ref().map_or(0, |p| 24 + p.value.len());
    out.reserve(30 + e.kv.key.len() + e.kv.value.len() + prev_len);
    out.push(match e.kind {
        EventKind::Put => PUT,
        EventKind::Delete => DELETE,
    });
    put_len(out, e.kv.key.len());
    out.extend_from_slice(e.kv.key.as_bytes());
    out.extend_from_slice(&e.kv.create_revision.to_le_bytes());
    out.extend_from_slice(&e.kv.version.to_le_bytes());
    put_len(out, e.kv.value.len());
    out.extend_from_slice(&e.kv.value);
    match &e.prev {
        None => out.push(0),
        Some(p) => {
            out.push(1);
            out.extend_from_slice(&p.create_revision.to_le_bytes());
            out.extend_from_slice(&p.mod_revision.to_le_bytes());
            out.extend_from_slice(&p.version.to_le_bytes());
            out.extend_from_slice(&p.value);
        }
    }
}

pub(crate) fn decode_event(revision: Revision, bytes: &[u8]) -> Result<Event, String> {
    let mut r = Reader(bytes);
    let kind = match r.u8()? {
        PUT => EventKind::Put,
        DELETE => EventKind::Delete,
        other => return Err(format!("unknown event kind {other} at revision {revision}")),
    };
    let key_len = r.len()?;
    let key = String::from_utf8(r.take(key_len)?.to_vec())
        .map_err(|_| format!("key at revision {revision} is not UTF-8"))?;
    let create_revision = r.u64()?;
    let version = r.u64()?;
    let value_len = r.len()?;
    let value = Bytes::copy_from_slice(r.take(value_len)?);
    let prev = match r.u8()? {
        0 => None,
        _ => Some(KeyValue {
            key: key.clone(),
            create_revision: r.u64()?,
            mod_revision: r.u64()?,
            version: r.u64()?,
            value: Bytes::copy_from_slice(r.rest()),
        }),
    };
    Ok(Event {
        kind,
        kv: KeyValue {
            key,
            value,
            create_revision,
            mod_revision: revision,
            version,
        },
        prev,
    })
}

fn put_len(out: &mut Vec<u8>, len: usize) {
    // Keys and values are bounded by the value size limit, far below 4 GiB.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
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
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self) -> Result<usize, String> {
        let b = self.take(4)?;
        let mut a = [0u8; 4];
        a.copy_from_slice(b);
        Ok(u32::from_le_bytes(a) as usize)
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str, create: u64, modr: u64, version: u64) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Bytes::from(value.to_owned()),
            create_revision: create,
            mod_revision: modr,
            version,
        }
    }

    #[test]
    fn event_round_trips_with_and_without_prev() {
        let mut buf = Vec::new();
        for e in [
            Event {
                kind: EventKind::Put,
                kv: kv("/a", "v1", 5, 5, 1),
                prev: None,
            },
            Event {
                kind: EventKind::Put,
                kv: kv("/a", "v2", 5, 9, 2),
                prev: Some(kv("/a", "v1", 5, 5, 1)),
            },
            Event {
                kind: EventKind::Delete,
                kv: kv("/a", "", 0, 12, 0),
                prev: Some(kv("/a", "", 5, 9, 2)),
            },
        ] {
            encode_event(&mut buf, &e);
            assert_eq!(decode_event(e.revision(), &buf).unwrap(), e);
        }
    }

    #[test]
    fn truncated_records_are_errors_not_panics() {
        let mut buf = Vec::new();
        let e = Event {
            kind: EventKind::Put,
            kv: kv("/key", "value", 3, 3, 1),
            prev: Some(kv("/key", "old", 2, 2, 1)),
        };
        encode_event(&mut buf, &e);
        for cut in 0..buf.len() - "old".len() {
            assert!(
                decode_event(3, &buf[..cut]).is_err(),
                "cut at {cut} decoded"
            );
        }
        assert!(decode_record(&[1, 2, 3]).is_err());
    }
}
