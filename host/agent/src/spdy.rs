//! SPDY/3.1 framing, as much of it as `kubectl port-forward` speaks: Kubernetes'
//! `httpstream` runs over SPDY/3.1 (moby's `spdystream`), each forwarded connection a
//! pair of streams the client opens. Start with [`Decoder`] and [`Encoder`].
//!
//! # Frames (SPDY/3 draft, section 2.2; integers big-endian)
//! - A control frame: `1`, a 15-bit version (3), a 16-bit type, 8 bits of flags, a
//!   24-bit length, then the type's fields: SYN_STREAM (1: stream, associated stream,
//!   priority and slot, header block), SYN_REPLY (2: stream, header block), RST_STREAM
//!   (3: stream, status), SETTINGS (4), PING (6: id), GOAWAY (7: last good stream,
//!   status), HEADERS (8: stream, header block), WINDOW_UPDATE (9: stream, delta).
//! - A data frame: `0`, a 31-bit stream id, 8 bits of flags (FIN = 1), a 24-bit
//!   length, the data.
//!
//! A header block is a count of pairs, then each name and value with its 32-bit
//! length (several values of one name joined by NUL), compressed by zlib with the
//! SPDY/3 dictionary, one zlib stream per direction for the whole session, each block
//! ended by a sync flush.
//!
//! Flow control (WINDOW_UPDATE) is read and ignored, as `spdystream` ignores it.

use std::io;
use std::sync::LazyLock;

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The protocol version of every control frame.
pub const VERSION: u16 = 3;
/// A frame's flag: the sender sends nothing more on the stream.
pub const FLAG_FIN: u8 = 0x01;
/// A frame longer than this (16 MiB − 1 is SPDY's limit) is refused: nothing in a
/// port-forward session needs more.
const MAX_FRAME: usize = 1 << 20;
/// A header block that inflates past this is refused.
const MAX_HEADERS: usize = 256 * 1024;

/// The RST_STREAM status for a stream this side will not serve.
pub const PROTOCOL_ERROR: u32 = 1;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const WINDOW_UPDATE: u16 = 9;

/// Header names (lower case, as SPDY requires) and values.
pub type Headers = Vec<(String, String)>;

/// One frame, as read or to be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream: u32,
        fin: bool,
        data: Bytes,
    },
    SynStream {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    SynReply {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    RstStream {
        stream: u32,
        status: u32,
    },
    Ping(u32),
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    WindowUpdate {
        stream: u32,
        delta: u32,
    },
    /// SETTINGS, or a control frame of a type this side does not act on.
    Other {
        kind: u16,
    },
}

/// The SPDY/3 header compression dictionary (draft 3, section 2.6.10.1): the names
/// below, each after its 32-bit length, then a run of common values.
pub fn dictionary() -> &'static [u8] {
    static DICTIONARY: LazyLock<Vec<u8>> = LazyLock::new(|| {
        const NAMES: &[&str] = &[
            "options",
            "head",
            "post",
            "put",
            "delete",
            "trace",
            "accept",
            "accept-charset",
            "accept-encoding",
            "accept-language",
            "accept-ranges",
            "age",
            "allow",
            "authorization",
            "cache-control",
            "connection",
            "content-base",
            "content-encoding",
            "content-language",
            "content-length",
            "content-location",
            "content-md5",
            "content-range",
            "content-type",
            "date",
            "etag",
            "expect",
            "expires",
            "from",
            "host",
            "if-match",
            "if-modified-since",
            "if-none-match",
            "if-range",
            "if-unmodified-since",
            "last-modified",
            "location",
            "max-forwards",
            "pragma",
            "proxy-authenticate",
            "proxy-authorization",
            "range",
            "referer",
            "retry-after",
            "server",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "user-agent",
            "vary",
            "via",
            "warning",
            "www-authenticate",
            "method",
            "get",
            "status",
            "200 OK",
            "version",
            "HTTP/1.1",
            "url",
            "public",
            "set-cookie",
            "keep-alive",
            "origin",
        ];
        const TAIL: &str = concat!(
            "100101201202205206300302303304305306307402405406407408409410411412413414415416417",
            "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently",
            "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error",
            "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct ",
            "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,",
            "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,",
            "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8",
            "charset=iso-8859-1,utf-,*,enq=0.",
        );
        let mut dictionary = Vec::with_capacity(1423);
        for name in NAMES {
            dictionary.extend_from_slice(&(name.len() as u32).to_be_bytes());
            dictionary.extend_from_slice(name.as_bytes());
        }
        dictionary.extend_from_slice(TAIL.as_bytes());
        dictionary
    });
    &DICTIONARY
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// Reads frames from the bytes a peer sent, inflating header blocks with the session's
/// one zlib stream.
pub struct Decoder {
    inflate: Decompress,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            inflate: Decompress::new(true),
        }
    }
}

impl Decoder {
    /// The next whole frame at the start of `buf` (taken from it), or `None` when
    /// `buf` holds less than one frame.
    pub fn decode(&mut self, buf: &mut BytesMut) -> io::Result<Option<Frame>> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let length = u32::from_be_bytes([0, buf[5], buf[6], buf[7]]) as usize;
        if length > MAX_FRAME {
            return Err(invalid(format!("a SPDY frame of {length} bytes")));
        }
        if buf.len() < 8 + length {
            buf.reserve(8 + length - buf.len());
            return Ok(None);
        }
        let head = buf.split_to(8);
        let mut body = buf.split_to(length).freeze();
        let flags = head[4];
        let fin = flags & FLAG_FIN != 0;
        if head[0] & 0x80 == 0 {
            let stream = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
            return Ok(Some(Frame::Data {
                stream,
                fin,
                data: body,
            }));
        }
        let version = u16::from_be_bytes([head[0] & 0x7f, head[1]]);
        if version != VERSION {
            return Err(invalid(format!("SPDY version {version}, not 3")));
        }
        let kind = u16::from_be_bytes([head[2], head[3]]);
        let need = |n: usize, body: &Bytes| {
            if body.len() < n {
                Err(invalid(format!("a SPDY frame of type {kind} is too short")))
            } else {
                Ok(())
            }
        };
        let stream_id = |body: &mut Bytes| body.get_u32() & 0x7fff_ffff;
        Ok(Some(match kind {
            SYN_STREAM => {
                need(10, &body)?;
                let stream = stream_id(&mut body);
                body.advance(6); // associated stream, priority, slot
                Frame::SynStream {
                    stream,
                    fin,
                    headers: self.headers(&body)?,
                }
            }
            SYN_REPLY | HEADERS => {
                need(4, &body)?;
                let stream = stream_id(&mut body);
                let headers = self.headers(&body)?;
                if kind == SYN_REPLY {
                    Frame::SynReply {
                        stream,
                        fin,
                        headers,
                    }
                } else {
                    Frame::Headers {
                        stream,
                        fin,
                        headers,
                    }
                }
            }
            RST_STREAM => {
                need(8, &body)?;
                Frame::RstStream {
                    stream: stream_id(&mut body),
                    status: body.get_u32(),
                }
            }
            PING => {
                need(4, &body)?;
                Frame::Ping(body.get_u32())
            }
            GOAWAY => {
                need(8, &body)?;
                Frame::GoAway {
                    last_good: stream_id(&mut body),
                    status: body.get_u32(),
                }
            }
            WINDOW_UPDATE => {
                need(8, &body)?;
                Frame::WindowUpdate {
                    stream: stream_id(&mut body),
                    delta: body.get_u32() & 0x7fff_ffff,
                }
            }
            kind => Frame::Other { kind },
        }))
    }

    /// Inflates and parses one header block.
    fn headers(&mut self, compressed: &[u8]) -> io::Result<Headers> {
        let mut plain = Vec::with_capacity(compressed.len() * 4 + 64);
        let mut consumed = 0;
        loop {
            if plain.len() == plain.capacity() {
                if plain.len() >= MAX_HEADERS {
                    return Err(invalid("a SPDY header block inflates past 256 KiB"));
                }
                plain.reserve(plain.len().max(1024));
            }
            let before = self.inflate.total_in();
            let inflated = self.inflate.decompress_vec(
                &compressed[consumed..],
                &mut plain,
                FlushDecompress::Sync,
            );
            consumed += (self.inflate.total_in() - before) as usize;
            match inflated {
                // All in, and room left: everything it had is out.
                Ok(_) if consumed == compressed.len() && plain.len() < plain.capacity() => break,
                Ok(Status::StreamEnd) => break,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(dictionary())
                        .map_err(|e| invalid(format!("SPDY header dictionary: {e}")))?;
                }
                Err(e) => return Err(invalid(format!("SPDY header block: {e}"))),
            }
        }
        parse_headers(&plain)
    }
}

/// Parses an inflated header block.
fn parse_headers(mut plain: &[u8]) -> io::Result<Headers> {
    let short = || invalid("a SPDY header block is cut short");
    let take = |plain: &mut &[u8]| -> io::Result<String> {
        if plain.len() < 4 {
            return Err(short());
        }
        let length = u32::from_be_bytes([plain[0], plain[1], plain[2], plain[3]]) as usize;
        let rest = &plain[4..];
        if rest.len() < length {
            return Err(short());
        }
        let text = String::from_utf8_lossy(&rest[..length]).into_owned();
        *plain = &rest[length..];
        Ok(text)
    };
    let count = {
        let bytes = take_u32(&mut plain).ok_or_else(short)?;
        bytes as usize
    };
    let mut headers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let name = take(&mut plain)?;
        let value = take(&mut plain)?;
        headers.push((name, value));
    }
    Ok(headers)
}

fn take_u32(plain: &mut &[u8]) -> Option<u32> {
    let (head, rest) = plain.split_first_chunk::<4>()?;
    *plain = rest;
    Some(u32::from_be_bytes(*head))
}

/// The value of header `name` (lower case), the first of several.
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.split('\0').next().unwrap_or(v))
}

/// Writes frames, deflating header blocks with the session's one zlib stream.
pub struct Encoder {
    deflate: Compress,
}

impl Default for Encoder {
    fn default() -> Self {
        let mut deflate = Compress::new(Compression::default(), true);
        // Before any output, so that the stream's header names the dictionary; fails
        // only for a stream already written to.
        let _ = deflate.set_dictionary(dictionary());
        Self { deflate }
    }
}

impl Encoder {
    /// Appends `frame` to `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut BytesMut) -> io::Result<()> {
        match frame {
            Frame::Data { stream, fin, data } => {
                if data.len() > MAX_FRAME {
                    return Err(invalid("a SPDY data frame over 1 MiB"));
                }
                out.put_u32(stream & 0x7fff_ffff);
                out.put_u32(u32::from(u8::from(*fin)) << 24 | data.len() as u32);
                out.put_slice(data);
            }
            Frame::SynStream {
                stream,
                fin,
                headers,
            } => {
                let block = self.header_block(headers)?;
                control(out, SYN_STREAM, *fin, 10 + block.len());
                out.put_u32(stream & 0x7fff_ffff);
                out.put_u32(0);
                out.put_u16(0);
                out.put_slice(&block);
            }
            Frame::SynReply {
                stream,
                fin,
                headers,
            }
            | Frame::Headers {
                stream,
                fin,
                headers,
            } => {
                let kind = if matches!(frame, Frame::SynReply { .. }) {
                    SYN_REPLY
                } else {
                    HEADERS
                };
                let block = self.header_block(headers)?;
                control(out, kind, *fin, 4 + block.len());
                out.put_u32(stream & 0x7fff_ffff);
                out.put_slice(&block);
            }
            Frame::RstStream { stream, status } => {
                control(out, RST_STREAM, false, 8);
                out.put_u32(stream & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::Ping(id) => {
                control(out, PING, false, 4);
                out.put_u32(*id);
            }
            Frame::GoAway { last_good, status } => {
                control(out, GOAWAY, false, 8);
                out.put_u32(last_good & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::WindowUpdate { stream, delta } => {
                control(out, WINDOW_UPDATE, false, 8);
                out.put_u32(stream & 0x7fff_ffff);
                out.put_u32(delta & 0x7fff_ffff);
            }
            Frame::Other { kind } => {
                return Err(invalid(format!("cannot write a SPDY frame of type {kind}")));
            }
        }
        Ok(())
    }

    /// Serializes and deflates a header block, ended by a sync flush.
    fn header_block(&mut self, headers: &Headers) -> io::Result<Vec<u8>> {
        let mut plain = Vec::new();
        plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        for (name, value) in headers {
            let name = name.to_ascii_lowercase();
            plain.extend_from_slice(&(name.len() as u32).to_be_bytes());
            plain.extend_from_slice(name.as_bytes());
            plain.extend_from_slice(&(value.len() as u32).to_be_bytes());
            plain.extend_from_slice(value.as_bytes());
        }
        let mut block = Vec::with_capacity(plain.len() + 64);
        let mut consumed = 0;
        loop {
            let before = self.deflate.total_in();
            self.deflate
                .compress_vec(&plain[consumed..], &mut block, FlushCompress::Sync)
                .map_err(|e| invalid(format!("deflate a SPDY header block: {e}")))?;
            consumed += (self.deflate.total_in() - before) as usize;
            // The flush is complete once all is in and it left room unused.
            if consumed == plain.len() && block.len() < block.capacity() {
                return Ok(block);
            }
            block.reserve(256);
        }
    }
}

/// A control frame's 8-byte head.
fn control(out: &mut BytesMut, kind: u16, fin: bool, length: usize) {
    out.put_u16(0x8000 | VERSION);
    out.put_u16(kind);
    out.put_u32(u32::from(u8::from(fin)) << 24 | length as u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dictionary's Adler-32, which a zlib stream that uses it names (its DICTID).
    #[test]
    fn the_dictionary_is_the_drafts() {
        let dictionary = dictionary();
        assert_eq!(dictionary.len(), 1423);
        assert_eq!(&dictionary[..11], b"\0\0\0\x07options");
        assert!(dictionary.ends_with(b",*,enq=0."));
        let (mut a, mut b) = (1u32, 0u32);
        for &byte in dictionary {
            a = (a + u32::from(byte)) % 65521;
            b = (b + a) % 65521;
        }
        assert_eq!(b << 16 | a, 0xe3c6_a7c2);
    }

    /// A DATA frame and a RST_STREAM, byte for byte as section 2.2 lays them out.
    #[test]
    fn writes_frames_as_the_draft_lays_them_out() {
        let mut out = BytesMut::new();
        let mut encoder = Encoder::default();
        encoder
            .encode(
                &Frame::Data {
                    stream: 3,
                    fin: true,
                    data: Bytes::from_static(b"hi"),
                },
                &mut out,
            )
            .unwrap();
        encoder
            .encode(
                &Frame::RstStream {
                    stream: 5,
                    status: CANCEL_FOR_TEST,
                },
                &mut out,
            )
            .unwrap();
        encoder.encode(&Frame::Ping(7), &mut out).unwrap();
        assert_eq!(
            &out[..],
            &[
                0, 0, 0, 3, 1, 0, 0, 2, b'h', b'i', // DATA, stream 3, FIN, 2 bytes
                0x80, 3, 0, 3, 0, 0, 0, 8, 0, 0, 0, 5, 0, 0, 0, 5, // RST_STREAM 5 CANCEL
                0x80, 3, 0, 6, 0, 0, 0, 4, 0, 0, 0, 7, // PING 7
            ][..]
        );
    }
    const CANCEL_FOR_TEST: u32 = 5;

    /// A SYN_STREAM whose header block is a zlib stream made by hand: the header names
    /// the dictionary (FDICT and its Adler-32), then a stored block and the sync
    /// flush's empty stored block, so the bytes follow from the specifications alone.
    #[test]
    fn reads_a_syn_stream_made_by_hand() {
        let mut plain = Vec::new();
        plain.extend_from_slice(&2u32.to_be_bytes());
        for text in ["port", "8080", "streamtype", "data"] {
            plain.extend_from_slice(&(text.len() as u32).to_be_bytes());
            plain.extend_from_slice(text.as_bytes());
        }
        // CMF 0x78 (deflate, 32 KiB window); FLG with FDICT, FCHECK making the pair a
        // multiple of 31.
        let cmf = 0x78u16;
        let mut flg = 0x20u16;
        flg += 31 - ((cmf << 8 | flg) % 31);
        let mut block = vec![cmf as u8, flg as u8];
        block.extend_from_slice(&0xe3c6_a7c2u32.to_be_bytes());
        let len = plain.len() as u16;
        block.push(0); // not final, stored
        block.extend_from_slice(&len.to_le_bytes());
        block.extend_from_slice(&(!len).to_le_bytes());
        block.extend_from_slice(&plain);
        block.extend_from_slice(&[0, 0, 0, 0xff, 0xff]); // the sync flush
        let mut frame = BytesMut::new();
        frame.put_slice(&[0x80, 3, 0, 1, 0]);
        frame.put_slice(&((10 + block.len()) as u32).to_be_bytes()[1..]);
        frame.put_u32(1); // stream 1
        frame.put_u32(0); // associated
        frame.put_u16(0); // priority, slot
        frame.put_slice(&block);
        frame.put_slice(&[0, 0, 0, 1]); // and the start of the next frame

        let mut decoder = Decoder::default();
        let read = decoder.decode(&mut frame).unwrap().unwrap();
        assert_eq!(
            read,
            Frame::SynStream {
                stream: 1,
                fin: false,
                headers: vec![
                    ("port".into(), "8080".into()),
                    ("streamtype".into(), "data".into())
                ],
            }
        );
        assert_eq!(&frame[..], &[0, 0, 0, 1]);
        assert_eq!(decoder.decode(&mut frame).unwrap(), None);
    }

    /// What one side writes the other reads, header blocks across one zlib stream.
    #[test]
    fn round_trips_header_blocks_on_one_stream() {
        let (mut encoder, mut decoder) = (Encoder::default(), Decoder::default());
        let mut wire = BytesMut::new();
        let frames = [
            Frame::SynStream {
                stream: 1,
                fin: true,
                headers: vec![("streamtype".into(), "error".into())],
            },
            Frame::SynReply {
                stream: 1,
                fin: false,
                headers: Vec::new(),
            },
            Frame::SynStream {
                stream: 3,
                fin: false,
                headers: vec![
                    ("port".into(), "80".into()),
                    ("requestid".into(), "0".into()),
                ],
            },
            Frame::GoAway {
                last_good: 3,
                status: 0,
            },
        ];
        for frame in &frames {
            encoder.encode(frame, &mut wire).unwrap();
        }
        // Byte by byte: a frame is read only once it is whole.
        let mut arrived = BytesMut::new();
        let mut read = Vec::new();
        for byte in wire {
            arrived.put_u8(byte);
            while let Some(frame) = decoder.decode(&mut arrived).unwrap() {
                read.push(frame);
            }
        }
        assert_eq!(read, frames);
        assert_eq!(
            header(&vec![("Port".into(), "80\081".into())], "port"),
            Some("80")
        );
    }
}
