//! Names outside the cluster: the query is sent to the upstream resolvers in turn
//! (UDP, or TCP when the client asked over TCP), and the answers are kept in a small
//! cache for as long as their TTLs allow.
//!
//! A truncated upstream answer is passed on truncated, so that a UDP client asks again
//! over TCP, which is then forwarded over TCP; truncated answers are not cached.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context as _, bail};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, LowerName, Record, RecordType};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::{Instant, timeout};

/// The longest a negative answer is cached when its SOA says nothing shorter
/// (RFC 2308 suggests 1–3 hours; a node's cache should follow changes sooner).
const MAX_NEGATIVE_TTL: u32 = 30;
/// The longest any answer is cached, whatever its TTL.
const MAX_TTL: u32 = 3600;
/// The largest UDP answer the forwarder reads (EDNS's usual ceiling).
const UDP_BUFFER: usize = 4096;

/// An upstream answer, as the client gets it.
#[derive(Clone, Debug)]
pub(crate) struct Answer {
    pub(crate) response_code: ResponseCode,
    pub(crate) truncated: bool,
    pub(crate) answers: Vec<Record>,
    pub(crate) authorities: Vec<Record>,
    pub(crate) additionals: Vec<Record>,
}

#[derive(Debug)]
struct Cached {
    answer: Answer,
    stored: Instant,
    expires: Instant,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct CacheKey {
    name: LowerName,
    qtype: RecordType,
    qclass: DNSClass,
}

/// Whether an answer came from the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Cache,
    Upstream,
}

#[derive(Debug)]
pub(crate) struct Forwarder {
    upstream: Vec<SocketAddr>,
    timeout: Duration,
    capacity: usize,
    cache: Mutex<HashMap<CacheKey, Cached>>,
}

impl Forwarder {
    pub(crate) fn new(upstream: Vec<SocketAddr>, timeout: Duration, capacity: usize) -> Self {
        Self {
            upstream,
            timeout,
            capacity,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn has_upstream(&self) -> bool {
        !self.upstream.is_empty()
    }

    /// The answer to `query`, from the cache or the upstream resolvers (over TCP if
    /// `tcp`), with `recursion_desired` as the client asked.
    pub(crate) async fn resolve(
        &self,
        query: &Query,
        recursion_desired: bool,
        tcp: bool,
    ) -> anyhow::Result<(Answer, Source)> {
        let key = CacheKey {
            name: LowerName::new(query.name()),
            qtype: query.query_type(),
            qclass: query.query_class(),
        };
        if let Some(answer) = self.cached(&key) {
            return Ok((answer, Source::Cache));
        }
        let mut message = Message::new(rand::random(), MessageType::Query, OpCode::Query);
        message.metadata.recursion_desired = recursion_desired;
        message.add_query(query.clone());
        let mut edns = hickory_proto::op::Edns::new();
        edns.set_max_payload(UDP_BUFFER as u16);
        message.set_edns(edns);
        let bytes = message.to_vec().context("encode the forwarded query")?;

        let mut last_error = None;
        for upstream in &self.upstream {
            let exchanged = if tcp {
                timeout(self.timeout, exchange_tcp(*upstream, &bytes)).await
            } else {
                timeout(self.timeout, exchange_udp(*upstream, &bytes)).await
            };
            let reply = match exchanged {
                Ok(Ok(reply)) => reply,
                Ok(Err(e)) => {
                    last_error = Some(e.context(format!("ask {upstream}")));
                    continue;
                }
                Err(_) => {
                    last_error = Some(anyhow::anyhow!("{upstream} did not answer in time"));
                    continue;
                }
            };
            let Ok(reply) = Message::from_vec(&reply) else {
                last_error = Some(anyhow::anyhow!("{upstream} sent an answer we cannot read"));
                continue;
            };
            if reply.metadata.id != message.metadata.id
                || reply
                    .queries
                    .first()
                    .map(|q| (LowerName::new(q.name()), q.query_type()))
                    != Some((key.name.clone(), key.qtype))
            {
                last_error = Some(anyhow::anyhow!("{upstream} answered another question"));
                continue;
            }
            // A server failure or refusal: the next upstream may know better.
            if matches!(
                reply.metadata.response_code,
                ResponseCode::ServFail | ResponseCode::Refused
            ) && !std::ptr::eq(upstream, self.upstream.last().unwrap_or(upstream))
            {
                last_error = Some(anyhow::anyhow!(
                    "{upstream} answered {}",
                    reply.metadata.response_code
                ));
                continue;
            }
            let answer = Answer {
                response_code: reply.metadata.response_code,
                truncated: reply.metadata.truncation,
                answers: reply.answers,
                authorities: reply.authorities,
                additionals: reply
                    .additionals
                    .into_iter()
                    .filter(|r| r.record_type() != RecordType::OPT)
                    .collect(),
            };
            self.store(key, &answer);
            return Ok((answer, Source::Upstream));
        }
        match last_error {
            Some(e) => Err(e),
            None => bail!("no upstream resolver"),
        }
    }

    fn cached(&self, key: &CacheKey) -> Option<Answer> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let entry = cache.get(key)?;
        let now = Instant::now();
        if entry.expires <= now {
            cache.remove(key);
            return None;
        }
        // Served with what is left of each TTL, as a cache must.
        let elapsed = now.duration_since(entry.stored).as_secs() as u32;
        let mut answer = entry.answer.clone();
        for record in answer
            .answers
            .iter_mut()
            .chain(answer.authorities.iter_mut())
            .chain(answer.additionals.iter_mut())
        {
            record.ttl = record.ttl.saturating_sub(elapsed);
        }
        Some(answer)
    }

    fn store(&self, key: CacheKey, answer: &Answer) {
        if answer.truncated || self.capacity == 0 {
            return;
        }
        let ttl = match answer.response_code {
            ResponseCode::NoError if !answer.answers.is_empty() => answer
                .answers
                .iter()
                .chain(answer.authorities.iter())
                .map(|r| r.ttl)
                .min()
                .unwrap_or(0)
                .min(MAX_TTL),
            // Negative answers, by the SOA's TTL (RFC 2308).
            ResponseCode::NoError | ResponseCode::NXDomain => answer
                .authorities
                .iter()
                .filter(|r| r.record_type() == RecordType::SOA)
                .map(|r| r.ttl)
                .min()
                .unwrap_or(0)
                .min(MAX_NEGATIVE_TTL),
            _ => 0,
        };
        if ttl == 0 {
            return;
        }
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= self.capacity && !cache.contains_key(&key) {
            cache.retain(|_, entry| entry.expires > now);
            if cache.len() >= self.capacity {
                // Still full of live answers: make room by dropping the one closest to
                // expiry, which would go first anyway.
                if let Some(victim) = cache
                    .iter()
                    .min_by_key(|(_, entry)| entry.expires)
                    .map(|(k, _)| k.clone())
                {
                    cache.remove(&victim);
                }
            }
        }
        cache.insert(
            key,
            Cached {
                answer: answer.clone(),
                stored: now,
                expires: now + Duration::from_secs(u64::from(ttl)),
            },
        );
    }

    #[cfg(test)]
    pub(crate) fn cache_len(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

async fn exchange_udp(upstream: SocketAddr, query: &[u8]) -> anyhow::Result<Vec<u8>> {
    let local: SocketAddr = if upstream.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).await?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buffer = vec![0u8; UDP_BUFFER];
    let len = socket.recv(&mut buffer).await?;
    buffer.truncate(len);
    Ok(buffer)
}

async fn exchange_tcp(upstream: SocketAddr, query: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut stream = TcpStream::connect(upstream).await?;
    let len = u16::try_from(query.len()).context("query too long")?;
    let mut framed = Vec::with_capacity(query.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(query);
    stream.write_all(&framed).await?;
    let len = stream.read_u16().await?;
    let mut buffer = vec![0u8; usize::from(len)];
    stream.read_exact(&mut buffer).await?;
    Ok(buffer)
}

#[cfg(test)]
mod tests {
    use hickory_proto::rr::rdata::A;
    use hickory_proto::rr::{Name, RData};

    use super::*;

    fn answer(name: &Name, ttl: u32) -> Answer {
        Answer {
            response_code: ResponseCode::NoError,
            truncated: false,
            answers: vec![Record::from_rdata(
                name.clone(),
                ttl,
                RData::A(A::new(192, 0, 2, 1)),
            )],
            authorities: Vec::new(),
            additionals: Vec::new(),
        }
    }

    fn key(name: &Name) -> CacheKey {
        CacheKey {
            name: LowerName::new(name),
            qtype: RecordType::A,
            qclass: DNSClass::IN,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_cache_keeps_answers_for_their_ttl_and_no_more_than_its_size() {
        let forwarder = Forwarder::new(Vec::new(), Duration::from_secs(1), 2);
        let names: Vec<Name> = ["a.example.", "b.example.", "c.example."]
            .iter()
            .map(|n| Name::from_ascii(n).unwrap())
            .collect();
        forwarder.store(key(&names[0]), &answer(&names[0], 10));
        forwarder.store(key(&names[1]), &answer(&names[1], 60));
        forwarder.store(key(&names[2]), &answer(&names[2], 60));
        assert_eq!(forwarder.cache_len(), 2);
        // The one closest to expiry made room.
        assert!(forwarder.cached(&key(&names[0])).is_none());

        tokio::time::advance(Duration::from_secs(20)).await;
        let kept = forwarder.cached(&key(&names[1])).unwrap();
        // Served with what is left of its TTL.
        assert_eq!(kept.answers[0].ttl, 40);
        tokio::time::advance(Duration::from_secs(41)).await;
        assert!(forwarder.cached(&key(&names[1])).is_none());

        // A truncated answer is not kept: the client asks again over TCP.
        let mut truncated = answer(&names[0], 60);
        truncated.truncated = true;
        forwarder.store(key(&names[0]), &truncated);
        assert!(forwarder.cached(&key(&names[0])).is_none());
    }
}
