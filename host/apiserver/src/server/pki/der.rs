//! Just enough DER to rewrite the names in a certificate.

use anyhow::{bail, ensure};

pub(super) const VERSION: u8 = 0xa0;
pub(super) const BIT_STRING: u8 = 0x03;
pub(super) const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
const UTF8_STRING: u8 = 0x0c;
/// 2.5.4.3
pub(super) const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// 2.5.4.10
pub(super) const OID_ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];

/// Splits the first TLV off `input`: returns it whole and what follows.
pub(super) fn next(input: &[u8]) -> anyhow::Result<(&[u8], &[u8])> {
    let (header, content_len) = header(input)?;
    let end = header
        .checked_add(content_len)
        .filter(|end| *end <= input.len());
    let Some(end) = end else {
        bail!("truncated DER value");
    };
    Ok(input.split_at(end))
}

/// Expects a TLV with `tag` first in `input`: returns its content and what follows.
pub(super) fn split(input: &[u8], tag: u8) -> anyhow::Result<(&[u8], &[u8])> {
    ensure!(input.first() == Some(&tag), "expected DER tag {tag:#04x}");
    let (whole, rest) = next(input)?;
    let (header, _) = header(whole)?;
    Ok((&whole[header..], rest))
}

/// The header length and content length of the TLV at the start of `input`.
fn header(input: &[u8]) -> anyhow::Result<(usize, usize)> {
    let (Some(tag), Some(first)) = (input.first(), input.get(1)) else {
        bail!("truncated DER header");
    };
    ensure!(tag & 0x1f != 0x1f, "multi-byte DER tags are not supported");
    if first & 0x80 == 0 {
        return Ok((2, usize::from(*first)));
    }
    let count = usize::from(first & 0x7f);
    ensure!((1..=4).contains(&count), "unsupported DER length form");
    let Some(bytes) = input.get(2..2 + count) else {
        bail!("truncated DER length");
    };
    let len = bytes
        .iter()
        .fold(0usize, |len, byte| (len << 8) | usize::from(*byte));
    Ok((2 + count, len))
}

pub(super) fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        // Fits in the short form by the check above.
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        let significant = &bytes[skip..];
        // At most size_of::<usize>() bytes, far below 0x7f.
        out.push(0x80 | significant.len() as u8);
        out.extend_from_slice(significant);
    }
    out.extend_from_slice(content);
    out
}

/// A RelativeDistinguishedName holding one attribute.
pub(super) fn rdn(oid: &[u8], value: &str) -> Vec<u8> {
    let attribute = [tlv(OID, oid), tlv(UTF8_STRING, value.as_bytes())].concat();
    tlv(SET, &tlv(SEQUENCE, &attribute))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_round_trip() {
        for len in [0usize, 1, 127, 128, 255, 256, 70_000] {
            let content = vec![7u8; len];
            let encoded = tlv(SEQUENCE, &content);
            let (decoded, rest) = split(&encoded, SEQUENCE).unwrap();
            assert_eq!(decoded, content.as_slice(), "len {len}");
            assert!(rest.is_empty());
        }
        assert!(next(&[0x30, 0x05, 0x00]).is_err());
        assert!(next(&[0x30, 0x82, 0x01]).is_err());
    }
}
