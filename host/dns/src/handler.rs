//! One query in, one answer out: the cluster's names from the [`Zone`], every other
//! name through the [`Forwarder`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use hickory_proto::op::{Edns, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::{LowerName, Name, Record, RecordType};
use hickory_server::net::runtime::Time;
use hickory_server::net::xfer::Protocol;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use tokio::time::Instant;
use tracing::debug;

use crate::forward::{Forwarder, Source};
use crate::metrics::{Metrics, RequestLabels, ResponseLabels, ZoneLabel, rcode_label};
use crate::records::{Lookup, RecordSets, Zone};

/// The longest CNAME chain followed inside the cluster (an ExternalName naming another).
const MAX_CHASE: usize = 8;

#[derive(Debug)]
pub(crate) struct Handler {
    pub(crate) zone: Arc<RwLock<Zone>>,
    /// Whether the informers' first lists are in: until then the cluster's names are
    /// unknown, not absent (SERVFAIL, which resolvers retry, rather than NXDOMAIN).
    pub(crate) synced: Arc<AtomicBool>,
    pub(crate) forwarder: Arc<Forwarder>,
    pub(crate) metrics: Metrics,
}

/// What the answer says, before it is encoded.
struct Reply {
    code: ResponseCode,
    authoritative: bool,
    truncated: bool,
    /// The records of the name asked for, shared with the zone (not copied per query):
    /// those of the query's type go first in the answer and additional sections.
    found: Option<(Arc<RecordSets>, RecordType)>,
    /// The SOA of a negative answer.
    soa: Option<Arc<[Record]>>,
    answers: Vec<Record>,
    authorities: Vec<Record>,
    additionals: Vec<Record>,
    zone: &'static str,
}

impl Reply {
    fn error(code: ResponseCode, zone: &'static str) -> Self {
        Self {
            code,
            authoritative: false,
            truncated: false,
            found: None,
            soa: None,
            answers: Vec::new(),
            authorities: Vec::new(),
            additionals: Vec::new(),
            zone,
        }
    }
}

fn read_zone(zone: &RwLock<Zone>) -> std::sync::RwLockReadGuard<'_, Zone> {
    zone.read().unwrap_or_else(|e| e.into_inner())
}

impl Handler {
    /// The cluster's answer to `name`/`qtype`, following CNAMEs inside the cluster;
    /// `None` when the name is not the cluster's.
    fn cluster_answer(&self, name: &LowerName, qtype: RecordType) -> Option<(Reply, Option<Name>)> {
        let zone = read_zone(&self.zone);
        let mut reply = Reply::error(ResponseCode::NoError, "cluster");
        reply.authoritative = true;
        // The name a CNAME led to, once one did.
        let mut chased: Option<LowerName> = None;
        for _ in 0..MAX_CHASE {
            let at = chased.as_ref().unwrap_or(name);
            match zone.lookup(at) {
                Lookup::Found(sets) => {
                    let (answers, additionals) = sets.get(qtype);
                    if answers.is_empty() {
                        reply.soa = Some(zone.soa_for(at));
                    }
                    let target = match &sets.cname_target {
                        Some(target) if qtype != RecordType::CNAME && !answers.is_empty() => {
                            Some(target.clone())
                        }
                        _ => None,
                    };
                    if reply.found.is_none() {
                        reply.found = Some((sets.clone(), qtype));
                    } else {
                        reply.answers.extend(answers.iter().cloned());
                        reply.additionals.extend(additionals.iter().cloned());
                    }
                    let Some(target) = target else {
                        return Some((reply, None));
                    };
                    let target_lower = LowerName::new(&target);
                    if !zone.holds(&target_lower) {
                        // Outside the cluster: the upstream resolves the rest.
                        return Some((reply, Some(target)));
                    }
                    chased = Some(target_lower);
                }
                Lookup::Pod(ip) => {
                    let record = zone.pod_record(at, ip);
                    if record.record_type() == qtype {
                        reply.answers.push(record);
                    } else {
                        reply.soa = Some(zone.soa_for(at));
                    }
                    return Some((reply, None));
                }
                Lookup::Empty => {
                    reply.soa = Some(zone.soa_for(at));
                    return Some((reply, None));
                }
                Lookup::NxDomain => {
                    reply.code = ResponseCode::NXDomain;
                    reply.soa = Some(zone.soa_for(at));
                    return Some((reply, None));
                }
                Lookup::Elsewhere => return None,
            }
        }
        Some((reply, None))
    }

    async fn forward(&self, query: &Query, recursion_desired: bool, tcp: bool) -> Reply {
        if !self.forwarder.has_upstream() {
            return Reply::error(ResponseCode::Refused, "forward");
        }
        match self.forwarder.resolve(query, recursion_desired, tcp).await {
            Ok((answer, source)) => {
                match source {
                    Source::Cache => {
                        self.metrics.cache_hits.inc();
                    }
                    Source::Upstream => {
                        self.metrics.cache_misses.inc();
                        self.metrics.forwarded.inc();
                    }
                };
                Reply {
                    code: answer.response_code,
                    authoritative: false,
                    truncated: answer.truncated,
                    found: None,
                    soa: None,
                    answers: answer.answers,
                    authorities: answer.authorities,
                    additionals: answer.additionals,
                    zone: "forward",
                }
            }
            Err(e) => {
                self.metrics.cache_misses.inc();
                debug!(name = %query.name(), error = %format!("{e:#}"), "forward failed");
                Reply::error(ResponseCode::ServFail, "forward")
            }
        }
    }

    async fn reply(&self, request: &Request) -> Reply {
        if request.metadata.op_code != OpCode::Query {
            return Reply::error(ResponseCode::NotImp, "cluster");
        }
        let Ok(info) = request.request_info() else {
            return Reply::error(ResponseCode::FormErr, "cluster");
        };
        let name = info.query.name();
        let qtype = info.query.query_type();
        let tcp = request.protocol() == Protocol::Tcp;
        let recursion_desired = request.metadata.recursion_desired;
        let cluster = self.cluster_answer(name, qtype);
        match cluster {
            Some((reply, _)) if !self.synced.load(Ordering::Acquire) => {
                Reply::error(ResponseCode::ServFail, reply.zone)
            }
            Some((reply, None)) => reply,
            Some((mut reply, Some(target))) => {
                // An ExternalName: its target's records, as CoreDNS adds them.
                let mut query = Query::query(target, qtype);
                query.set_query_class(info.query.query_class());
                let rest = self.forward(&query, true, tcp).await;
                reply.answers.extend(rest.answers);
                reply.truncated = rest.truncated;
                reply
            }
            None => {
                self.forward(info.query.original(), recursion_desired, tcp)
                    .await
            }
        }
    }
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let started = Instant::now();
        let reply = self.reply(request).await;

        let edns = request.edns.as_ref().map(|asked| {
            let mut edns = Edns::new();
            edns.set_max_payload(asked.max_payload().max(512));
            edns
        });
        let mut metadata = Metadata::response_from_request(&request.metadata);
        metadata.response_code = reply.code;
        metadata.authoritative = reply.authoritative;
        metadata.truncation = reply.truncated;
        metadata.recursion_available = self.forwarder.has_upstream();
        let builder = MessageResponseBuilder::new(&request.queries, edns.as_ref());
        let (found_answers, found_additionals) = match &reply.found {
            Some((sets, qtype)) => sets.get(*qtype),
            None => (&[][..], &[][..]),
        };
        let message = builder.build(
            metadata,
            found_answers.iter().chain(reply.answers.iter()),
            reply.authorities.iter(),
            reply.soa.iter().flat_map(|soa| soa.iter()),
            found_additionals.iter().chain(reply.additionals.iter()),
        );
        let info = match response.send_response(message).await {
            Ok(info) => info,
            Err(e) => {
                debug!(error = %e, "could not send a DNS answer");
                let mut failed = Metadata::response_from_request(&request.metadata);
                failed.response_code = ResponseCode::ServFail;
                ResponseInfo::from(hickory_proto::op::Header {
                    metadata: failed,
                    counts: Default::default(),
                })
            }
        };

        let qtype = request
            .queries
            .queries()
            .first()
            .map(|q| <&'static str>::from(q.query_type()))
            .unwrap_or("none");
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                zone: reply.zone,
                proto: if request.protocol() == Protocol::Tcp {
                    "tcp"
                } else {
                    "udp"
                },
                r#type: qtype,
            })
            .inc();
        self.metrics
            .responses
            .get_or_create(&ResponseLabels {
                zone: reply.zone,
                rcode: rcode_label(reply.code),
            })
            .inc();
        self.metrics
            .duration
            .get_or_create(&ZoneLabel { zone: reply.zone })
            .observe(started.elapsed().as_secs_f64());
        info
    }
}
