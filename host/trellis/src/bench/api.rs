//! `trellis bench api`: request throughput and latency of the API server, as a client
//! sees them over HTTPS.
//!
//! Without `--kubeconfig` a server is started in this process on an embedded store in a
//! temporary directory, and the clients authenticate with its admin bearer token. With
//! `--kubeconfig` the server, the cluster CA and the credentials (a token or a client
//! certificate) come from the file's current context, and the objects stay behind.
//!
//! Each of `--clients` tasks holds its own TLS connection, speaking HTTP/1.1 (or HTTP/2
//! with `--http2`), opened before the clock starts; together they send `--ops`
//! requests, one at a time each. The client is [`crate::rest`]'s, hyper's connection
//! API without a pool: about 20 µs of CPU per request, half of what `hey` spends, which
//! matters when the server runs in the same process on a small machine.
//!
//! `create` POSTs objects with unique names to `/api/v1/namespaces/default/{kind}`;
//! `get` first creates up to [`GET_OBJECTS`] objects, then reads them round-robin. A
//! short warm-up, not counted, precedes the measured requests.
//!
//! Every response is checked: any status but 201 (create) or 200 (get), a transport
//! error or a request that takes longer than [`CALL_TIMEOUT`] ends the run with an
//! error carrying the server's `Status` message, so a printed report counts only
//! successes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::builder::RangedU64ValueParser;
use clap::{Args, ValueEnum};
use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::cluster::LocalCluster;
use super::{CALL_TIMEOUT, Percentiles, run_id, share};
use crate::rest::{
    Connection, Credentials, Target, build_request, call, connect, exchange, send_and_read,
    status_message,
};

mod process;
mod watch;

/// Objects a `get` run creates and then reads: enough that reads spread over many
/// keys, few enough that setting them up stays short.
const GET_OBJECTS: usize = 1000;

/// Most requests of the warm-up: enough to settle connections, buffers and the store
/// file, small enough not to dominate short runs.
const MAX_WARMUP: usize = 1000;

/// Where every object of the benchmark lives; the namespace every cluster has.
const NAMESPACE: &str = "default";

#[derive(Debug, Args)]
pub struct ApiArgs {
    /// Measure the cluster of this kubeconfig's current context (its server, CA and
    /// token or client certificate). Without it a server is started in this process on
    /// a temporary data directory.
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Concurrent clients, each on its own connection; they share the requests. With
    /// `--verb watch`, the watchers.
    #[arg(long, default_value_t = 50, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    clients: usize,

    /// Measured requests in total, not counting the warm-up and a `get` run's setup.
    /// With `--verb watch`, the creates every watcher must see.
    #[arg(long, default_value_t = 10_000, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ops: usize,

    /// The resource to create or read.
    #[arg(long, value_enum)]
    kind: Kind,

    /// What each request does.
    #[arg(long, value_enum)]
    verb: Verb,

    /// Bytes of each ConfigMap's one data value (pods carry no payload).
    #[arg(long, default_value_t = 256, value_name = "BYTES")]
    value_size: usize,

    /// With `--verb watch`, creates per second. Paced rather than flat out, so the
    /// figure is delivery latency, not queueing behind a backlog.
    #[arg(long, default_value_t = 100, value_name = "CREATES_PER_SEC", value_parser = RangedU64ValueParser::<u32>::new().range(1..))]
    rate: u32,

    /// Measure as this ServiceAccount rather than as the admin: it is created (with
    /// its namespace), bound to the `edit` ClusterRole in the benchmark's namespace by
    /// a RoleBinding, and given a token by a TokenRequest. Every request then goes
    /// through authentication of a ServiceAccount token and RBAC, as a controller's
    /// would.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    as_serviceaccount: Option<String>,

    /// With `--verb relist`, objects per page (`limit`).
    #[arg(long, default_value_t = 500, value_name = "N", value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    page_size: usize,

    /// Speak HTTP/2 (one stream at a time per connection), as kubectl and client-go
    /// do, instead of HTTP/1.1. HTTP/1.1 is the default because it costs both sides
    /// less CPU, so the figure is the server's rather than the protocol's.
    #[arg(long)]
    http2: bool,

    /// With `--verb watch --http2`, open this many connections and spread the watchers
    /// over them as streams, as one client-go process runs all its informers over one
    /// connection. Default: one connection per watcher.
    #[arg(long, value_name = "N", requires = "http2", value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    connections: Option<usize>,

    /// Start the server as a child process rather than in this one, and report its
    /// memory after the run: its resident set size a second after the last request
    /// and the largest it reached.
    #[arg(long, conflicts_with = "kubeconfig")]
    server_process: bool,

    /// With `--server-process`, run this program's `server` instead of this one's:
    /// another build of the server measured by the same client, for an A/B comparison.
    #[arg(long, value_name = "PROGRAM", requires = "server_process")]
    server_exe: Option<PathBuf>,

    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    json: bool,
}

impl ApiArgs {
    /// Pod creates by `clients` clients over HTTP/1.1, on a server this process
    /// starts, and no more: what `trellis bench admission` measures each side with.
    pub(super) fn pod_creates(clients: usize, ops: usize) -> Self {
        Self {
            kubeconfig: None,
            clients,
            ops,
            kind: Kind::Pods,
            verb: Verb::Create,
            value_size: 0,
            rate: 1,
            page_size: 500,
            as_serviceaccount: None,
            server_process: false,
            server_exe: None,
            http2: false,
            connections: None,
            json: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// ConfigMaps holding `--value-size` bytes.
    #[value(name = "configmaps")]
    ConfigMaps,
    /// Pods with one container: the object the control plane handles most.
    Pods,
}

impl Kind {
    /// The resource's plural, as in the path.
    fn plural(self) -> &'static str {
        match self {
            Kind::ConfigMaps => "configmaps",
            Kind::Pods => "pods",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Verb {
    /// POST new objects.
    Create,
    /// GET existing objects.
    Get,
    /// Watch the collection from `--clients` connections while one more creates
    /// objects at `--rate`; latency is a create's acknowledgement to its arrival at the
    /// last watcher, and requests/s the creates'.
    Watch,
    /// Create `--ops` objects, then list them all in pages of `--page-size`, following
    /// the continue tokens, as an informer's relist does; requests/s is objects listed
    /// per second, latency a page's.
    Relist,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::Create => "create",
            Verb::Get => "get",
            Verb::Watch => "watch",
            Verb::Relist => "relist",
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    kind: &'static str,
    verb: &'static str,
    clients: usize,
    /// Connections the clients share, when fewer than the clients (`--connections`).
    #[serde(skip_serializing_if = "Option::is_none")]
    connections: Option<usize>,
    ops: usize,
    pub(super) ops_per_sec: f64,
    /// Request latency; for `watch`, an event's acknowledgement → its arrival at the
    /// last watcher.
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    max_ms: f64,
    /// `watch` only: every delivery, acknowledgement → arrival at that watcher.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    delivery: Option<Delivery>,
    /// Failed requests. Always 0 in a printed report: the first failure ends the run
    /// with an error instead, so that a figure never hides failures.
    errors: usize,
    /// With `--server-process`: the server's memory after the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    server_memory: Option<process::Memory>,
}

/// Per-delivery latency of a watch run: one sample per watcher and event.
#[derive(Debug, Serialize)]
struct Delivery {
    deliveries: usize,
    delivery_p50_ms: f64,
    delivery_p99_ms: f64,
    delivery_max_ms: f64,
}

/// How long the server settles after the run before its memory is read: long enough
/// for requests' buffers to be freed, short next to a run.
const SETTLE: Duration = Duration::from_secs(1);

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    if args.connections.is_some() && args.verb != Verb::Watch {
        bail!("--connections applies to --verb watch only");
    }
    let report = match &args.kubeconfig {
        Some(path) => {
            let target = Target::from_kubeconfig(path, args.http2)?;
            tracing::info!(server = %target.base, "measuring the kubeconfig's cluster");
            measure(&target, &args).await?
        }
        None if args.server_process => {
            let mut server =
                process::ChildServer::start(args.server_exe.as_deref(), args.http2).await?;
            let measured = measure(&server.target, &args).await;
            tokio::time::sleep(SETTLE).await;
            let memory = server.memory();
            let stopped = server.stop().await;
            let mut report = measured?;
            report.server_memory = Some(memory?);
            stopped?;
            report
        }
        None => {
            let cluster = LocalCluster::start().await?;
            let target = Target::new(
                &cluster.server.url,
                &cluster.server.ca_pem,
                Credentials::Token(cluster.server.admin_token.clone()),
                args.http2,
            )?;
            let measured = measure(&target, &args).await;
            // Stop even after a failed run, but report the run's error first.
            let stopped = cluster.stop().await;
            let report = measured?;
            stopped?;
            report
        }
    };

    super::print_report(args.json, &report, || {
        let memory = report.server_memory.map_or(String::new(), |m| {
            format!(
                "; server RSS {:.1} MiB, peak {:.1} MiB",
                m.rss_mib, m.peak_rss_mib
            )
        });
        let (what, delivery) = match &report.delivery {
            Some(d) => (
                " to the last watcher",
                format!(
                    "; per delivery ({}) p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
                    d.deliveries, d.delivery_p50_ms, d.delivery_p99_ms, d.delivery_max_ms
                ),
            ),
            None => ("", String::new()),
        };
        let shared = report
            .connections
            .map_or(String::new(), |n| format!(" on {n} connections"));
        format!(
            "api {} {}: {} clients{shared}, {} requests: {:.0} requests/s, \
             latency{what} p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms{delivery}{memory}",
            report.verb,
            report.kind,
            report.clients,
            report.ops,
            report.ops_per_sec,
            report.p50_ms,
            report.p99_ms,
            report.max_ms,
        )
    })?;
    Ok(())
}

pub(super) async fn measure(target: &Target, args: &ApiArgs) -> anyhow::Result<Report> {
    let as_account;
    let target = match &args.as_serviceaccount {
        Some(account) => {
            as_account = service_account_target(target, account)
                .await
                .with_context(|| format!("prepare the ServiceAccount {account}"))?;
            &as_account
        }
        None => target,
    };
    match args.verb {
        Verb::Create => measure_requests(target, args, false).await,
        Verb::Get => measure_requests(target, args, true).await,
        Verb::Watch => watch::measure(target, args).await,
        Verb::Relist => measure_relist(target, args).await,
    }
}

/// `target` with the token of ServiceAccount `NAMESPACE/NAME`, which `target`'s own
/// credentials create and bind to `edit` in the benchmark's namespace.
async fn service_account_target(target: &Target, account: &str) -> anyhow::Result<Target> {
    let (namespace, name) = account
        .split_once('/')
        .context("name the ServiceAccount as NAMESPACE/NAME")?;
    if target.authorization.is_none() {
        bail!("--as-serviceaccount needs credentials that are a token, not a client certificate");
    }
    let create = |path: String, body: serde_json::Value| async move {
        let (status, answer) =
            exchange(target, Method::POST, &path, body.to_string().into_bytes()).await?;
        if status != StatusCode::CREATED && status != StatusCode::CONFLICT {
            bail!("POST {path}: {status}: {}", status_message(&answer));
        }
        anyhow::Ok(answer)
    };
    create(
        "/api/v1/namespaces".into(),
        serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
    )
    .await?;
    create(
        format!("/api/v1/namespaces/{namespace}/serviceaccounts"),
        serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}),
    )
    .await?;
    create(
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings"),
        serde_json::json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("bench-{namespace}-{name}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}),
    )
    .await?;
    let answer = create(
        format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"),
        serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}}),
    )
    .await?;
    let answer: serde_json::Value =
        serde_json::from_slice(&answer).context("decode the TokenRequest")?;
    let token = answer["status"]["token"]
        .as_str()
        .context("the TokenRequest has no token")?;
    let authorization = HeaderValue::try_from(format!("Bearer {token}"))
        .context("use the token in an Authorization header")?;
    Ok(Target {
        authorization: Some(authorization),
        ..target.clone()
    })
}

/// Creates `--ops` objects, then lists them in pages, timing the whole relist and each
/// page. The pages after the first must cost what the first does: a server that
/// counts what remains on every page makes a relist quadratic.
async fn measure_relist(target: &Target, args: &ApiArgs) -> anyhow::Result<Report> {
    let connections = connect_all(target, args.clients)
        .await
        .context("connect the clients")?;
    // A namespace of the run's own, so the list holds exactly this run's objects.
    let namespace = format!("relist-{}", run_id());
    let mut admin = connect(
        &target.addr,
        target.server_name.clone(),
        target.tls.clone(),
        target.http2,
    )
    .await
    .context("connect the lister")?;
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
    let request = build_request(
        &target.base,
        target.http2,
        target.authorization.as_ref(),
        &Method::POST,
        "/api/v1/namespaces",
        Bytes::from(ns.to_string()),
    )?;
    call(&mut admin, request, StatusCode::CREATED)
        .await
        .context("create the run's namespace")?;
    let collection = format!("/api/v1/namespaces/{namespace}/{}", args.kind.plural());
    let setup = Plan::Create {
        collection: collection.clone(),
        prefix: "o".into(),
        body: ObjectBody::new(args.kind, args.value_size),
    };
    drive(target, connections, &setup, args.ops)
        .await
        .context("create the objects to list")?;

    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut listed = 0;
    let mut token = String::new();
    loop {
        let path = format!(
            "{collection}?limit={}{}",
            args.page_size,
            if token.is_empty() {
                String::new()
            } else {
                format!("&continue={token}")
            }
        );
        let request = build_request(
            &target.base,
            target.http2,
            target.authorization.as_ref(),
            &Method::GET,
            &path,
            Bytes::new(),
        )?;
        let page_started = Instant::now();
        let (status, body) = send_and_read(&mut admin, request).await?;
        latencies.push(page_started.elapsed());
        if status != StatusCode::OK {
            bail!("list page: {status}: {}", status_message(&body));
        }
        let page: serde_json::Value = serde_json::from_slice(&body).context("decode a page")?;
        listed += page["items"].as_array().map_or(0, Vec::len);
        match page["metadata"]["continue"].as_str() {
            Some(next) if !next.is_empty() => token = next.to_owned(),
            _ => break,
        }
    }
    let elapsed = started.elapsed();
    if listed != args.ops {
        bail!("the relist returned {listed} objects, not {}", args.ops);
    }
    let percentiles = Percentiles::of(&mut latencies);
    Ok(Report {
        kind: args.kind.plural(),
        verb: args.verb.name(),
        clients: 1,
        connections: None,
        ops: listed,
        ops_per_sec: (listed as f64 / elapsed.as_secs_f64()).round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        delivery: None,
        errors: 0,
        server_memory: None,
    })
}

/// Creates (or with `reads`, GETs) over `--clients` connections.
async fn measure_requests(target: &Target, args: &ApiArgs, reads: bool) -> anyhow::Result<Report> {
    let mut connections = connect_all(target, args.clients)
        .await
        .context("connect the clients")?;
    let prefix = format!("bench-{}", run_id());
    let body = ObjectBody::new(args.kind, args.value_size);
    let collection = format!("/api/v1/namespaces/{NAMESPACE}/{}", args.kind.plural());
    if args.kubeconfig.is_some() {
        tracing::info!(namespace = NAMESPACE, %prefix, "objects of this run stay behind, named after the prefix");
    }
    let create = |phase: &str| Plan::Create {
        collection: collection.clone(),
        prefix: format!("{prefix}-{phase}"),
        body: body.clone(),
    };
    let warmup = (args.ops / 10).min(MAX_WARMUP);

    let (warmup_plan, measured_plan) = if reads {
        let objects = args.ops.min(GET_OBJECTS);
        let setup = create("g");
        connections = drive(target, connections, &setup, objects)
            .await
            .context("create the objects to read")?
            .0;
        let names: Arc<[String]> = (0..objects).map(|i| setup.name(i)).collect();
        let get = Plan::Get {
            collection: collection.clone(),
            names,
        };
        (get.clone(), get)
    } else {
        (create("w"), create("m"))
    };
    connections = drive(target, connections, &warmup_plan, warmup)
        .await
        .context("warm up")?
        .0;
    tracing::debug!(requests = warmup, "warm-up done");

    let started = Instant::now();
    let (connections, mut latencies) =
        drive(target, connections, &measured_plan, args.ops)
            .await
            .with_context(|| format!("{} {}", args.verb.name(), args.kind.plural()))?;
    let elapsed = started.elapsed();
    drop(connections);

    let percentiles = Percentiles::of(&mut latencies);
    Ok(Report {
        kind: args.kind.plural(),
        verb: args.verb.name(),
        clients: args.clients,
        connections: None,
        ops: args.ops,
        ops_per_sec: (args.ops as f64 / elapsed.as_secs_f64()).round(),
        p50_ms: percentiles.p50_ms,
        p99_ms: percentiles.p99_ms,
        max_ms: percentiles.max_ms,
        delivery: None,
        errors: 0,
        server_memory: None,
    })
}

/// Opens `clients` connections concurrently, each within [`CALL_TIMEOUT`].
async fn connect_all(target: &Target, clients: usize) -> anyhow::Result<Vec<Connection>> {
    let mut tasks = JoinSet::new();
    for client in 0..clients {
        let (addr, name, tls, http2) = (
            target.addr.clone(),
            target.server_name.clone(),
            target.tls.clone(),
            target.http2,
        );
        tasks.spawn(async move {
            let connection = tokio::time::timeout(CALL_TIMEOUT, connect(&addr, name, tls, http2))
                .await
                .unwrap_or_else(|_| bail!("no connection within {CALL_TIMEOUT:?}"))
                .with_context(|| format!("connect client {client} to {addr}"))?;
            anyhow::Ok((client, connection))
        });
    }
    let mut connections: Vec<Option<Connection>> = (0..clients).map(|_| None).collect();
    // Returning early drops `tasks`, which aborts the other connects.
    while let Some(joined) = tasks.join_next().await {
        let (client, connection) = joined.context("join a connecting task")??;
        connections[client] = Some(connection);
    }
    connections
        .into_iter()
        .enumerate()
        .map(|(client, c)| c.with_context(|| format!("connect client {client}: no connection")))
        .collect()
}

/// A JSON object with a unique name spliced in: the bytes before and after the name.
#[derive(Clone, Debug)]
struct ObjectBody {
    before_name: Arc<str>,
    after_name: Arc<str>,
}

impl ObjectBody {
    fn new(kind: Kind, value_size: usize) -> Self {
        let (before_name, after_name) = match kind {
            Kind::ConfigMaps => (
                r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":""#.to_owned(),
                format!(r#""}},"data":{{"value":"{}"}}}}"#, "x".repeat(value_size)),
            ),
            Kind::Pods => (
                r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":""#.to_owned(),
                r#"","labels":{"team":"bench"}},"spec":{"containers":[{"name":"main","image":"registry.k8s.io/pause:3.10"}]}}"#
                    .to_owned(),
            ),
        };
        Self {
            before_name: before_name.into(),
            after_name: after_name.into(),
        }
    }

    fn with_name(&self, name: &str) -> Bytes {
        let mut body =
            String::with_capacity(self.before_name.len() + name.len() + self.after_name.len());
        body.push_str(&self.before_name);
        body.push_str(name);
        body.push_str(&self.after_name);
        Bytes::from(body)
    }
}

/// The requests of one phase: request `i` of a phase is the same whichever client
/// sends it.
#[derive(Clone, Debug)]
enum Plan {
    /// POST `{prefix}-{i}` to the collection.
    Create {
        collection: String,
        prefix: String,
        body: ObjectBody,
    },
    /// GET `names[i % names.len()]`.
    Get {
        collection: String,
        names: Arc<[String]>,
    },
}

impl Plan {
    fn name(&self, i: usize) -> String {
        match self {
            Plan::Create { prefix, .. } => format!("{prefix}-{i}"),
            Plan::Get { names, .. } => names[i % names.len()].clone(),
        }
    }

    fn expected(&self) -> StatusCode {
        match self {
            Plan::Create { .. } => StatusCode::CREATED,
            Plan::Get { .. } => StatusCode::OK,
        }
    }

    /// Request `i`: its method, its path and query, and its body.
    fn request(&self, i: usize) -> (Method, String, Bytes) {
        let name = self.name(i);
        match self {
            Plan::Create {
                collection, body, ..
            } => (Method::POST, collection.clone(), body.with_name(&name)),
            Plan::Get { collection, .. } => {
                (Method::GET, format!("{collection}/{name}"), Bytes::new())
            }
        }
    }
}

/// Sends `total` requests of `plan` over `connections`, one client task per connection
/// with an even share each, and returns the connections and every request's latency.
/// Client `c` sends requests `c`, `c + clients`, `c + 2 * clients`, …, so that `get`
/// reads go round-robin over the objects.
async fn drive(
    target: &Target,
    connections: Vec<Connection>,
    plan: &Plan,
    total: usize,
) -> anyhow::Result<(Vec<Connection>, Vec<Duration>)> {
    let clients = connections.len();
    let mut tasks = JoinSet::new();
    for (client, mut connection) in connections.into_iter().enumerate() {
        let n = share(total, clients, client);
        let plan = plan.clone();
        let (base, authorization, http2) = (
            target.base.clone(),
            target.authorization.clone(),
            target.http2,
        );
        tasks.spawn(async move {
            let mut latencies = Vec::with_capacity(n);
            for seq in 0..n {
                let (method, path, body) = plan.request(client + seq * clients);
                let request =
                    build_request(&base, http2, authorization.as_ref(), &method, &path, body)?;
                let sent = Instant::now();
                call(&mut connection, request, plan.expected())
                    .await
                    .with_context(|| format!("{method} {path}"))?;
                latencies.push(sent.elapsed());
            }
            anyhow::Ok((client, connection, latencies))
        });
    }
    let mut returned: Vec<Option<Connection>> = (0..clients).map(|_| None).collect();
    let mut latencies = Vec::with_capacity(total);
    // Returning early drops `tasks`, which aborts the other clients.
    while let Some(joined) = tasks.join_next().await {
        let (client, connection, l) = joined.context("join a client task")??;
        returned[client] = Some(connection);
        latencies.extend(l);
    }
    let connections = returned.into_iter().flatten().collect::<Vec<_>>();
    Ok((connections, latencies))
}

#[cfg(test)]
// A panic is how a test reports failure.
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_json_with_the_name_and_the_value() {
        let body = ObjectBody::new(Kind::ConfigMaps, 3).with_name("a-1");
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["metadata"]["name"], "a-1");
        assert_eq!(value["data"]["value"], "xxx");
        let body = ObjectBody::new(Kind::Pods, 3).with_name("p-1");
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["kind"], "Pod");
        assert_eq!(value["spec"]["containers"][0]["name"], "main");
    }

    #[test]
    fn gets_go_round_robin_over_the_names() {
        let plan = Plan::Get {
            collection: "/api/v1/namespaces/default/pods".into(),
            names: ["a".to_owned(), "b".to_owned()].into(),
        };
        let paths: Vec<String> = (0..3).map(|i| plan.request(i).1).collect();
        assert_eq!(
            paths,
            [
                "/api/v1/namespaces/default/pods/a",
                "/api/v1/namespaces/default/pods/b",
                "/api/v1/namespaces/default/pods/a"
            ]
        );
    }
}
