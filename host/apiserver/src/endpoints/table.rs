//! `meta.k8s.io/v1` Tables: what `kubectl get` prints. Columns per kind as kubectl
//! shows them; for custom resources, NAME and the CRD's `additionalPrinterColumns`;
//! NAME and AGE for everything else.

use serde_json::{Value, json};
use trellis_api::registry::{PrinterColumn, ResourceInfo};
use trellis_store::Revision;

use crate::endpoints::request::IncludeObject;
use crate::object::{Object, meta_str, metadata};

mod workloads;

struct Column {
    name: &'static str,
    kind: &'static str,
    format: &'static str,
    description: &'static str,
    /// 0: `kubectl get` shows it; 1: only `kubectl get -o wide` does.
    priority: u8,
}

const fn col(
    name: &'static str,
    kind: &'static str,
    format: &'static str,
    description: &'static str,
) -> Column {
    Column {
        name,
        kind,
        format,
        description,
        priority: 0,
    }
}

/// A column `kubectl get -o wide` adds.
const fn wide(name: &'static str, description: &'static str) -> Column {
    Column {
        priority: 1,
        ..col(name, "string", "", description)
    }
}

const NAME: Column = col(
    "Name",
    "string",
    "name",
    "Name must be unique within a namespace.",
);
const AGE: Column = col(
    "Age",
    "string",
    "",
    "CreationTimestamp is a timestamp representing the server time when this object was created.",
);

fn columns(res: &ResourceInfo) -> Vec<Column> {
    if let Some(columns) = workloads::columns(res) {
        return columns;
    }
    match (res.group.as_str(), res.plural.as_str()) {
        ("", "pods") => vec![
            NAME,
            col(
                "Ready",
                "string",
                "",
                "The aggregate readiness state of this pod for accepting traffic.",
            ),
            col(
                "Status",
                "string",
                "",
                "The aggregate status of the containers in this pod.",
            ),
            col(
                "Restarts",
                "string",
                "",
                "The number of times the containers in this pod have been restarted.",
            ),
            AGE,
            wide("IP", "IP address allocated to the pod."),
            wide("Node", "Name of the node this pod runs on."),
            wide(
                "Nominated Node",
                "Name of the node the scheduler nominated for this pod, once it preempted others.",
            ),
            wide(
                "Readiness Gates",
                "Ready readiness gates of this pod, out of all of them.",
            ),
        ],
        ("apps", "deployments") => vec![
            NAME,
            col("Ready", "string", "", "Number of the pod with ready state"),
            col(
                "Up-to-date",
                "string",
                "",
                "Total number of non-terminated pods targeted by this deployment that have the desired template spec.",
            ),
            col(
                "Available",
                "string",
                "",
                "Total number of available pods (ready for at least minReadySeconds) targeted by this deployment.",
            ),
            AGE,
            wide("Containers", "Names of each container in the template."),
            wide(
                "Images",
                "Images referenced by each container in the template.",
            ),
            wide("Selector", "Label selector for pods."),
        ],
        ("apps", "replicasets") => vec![
            NAME,
            col("Desired", "integer", "", "Number of desired pods."),
            col("Current", "integer", "", "Number of actual replicas."),
            col(
                "Ready",
                "integer",
                "",
                "The number of ready replicas for this replica set.",
            ),
            AGE,
            wide("Containers", "Names of each container in the template."),
            wide(
                "Images",
                "Images referenced by each container in the template.",
            ),
            wide("Selector", "Label selector for pods."),
        ],
        ("", "replicationcontrollers") => vec![
            NAME,
            col("Desired", "integer", "", "Number of desired pods."),
            col("Current", "integer", "", "Number of actual replicas."),
            col(
                "Ready",
                "integer",
                "",
                "The number of ready replicas for this replication controller.",
            ),
            AGE,
            wide("Containers", "Names of each container in the template."),
            wide(
                "Images",
                "Images referenced by each container in the template.",
            ),
            wide("Selector", "Label selector for pods."),
        ],
        ("", "namespaces") => vec![
            NAME,
            col("Status", "string", "", "The status of the namespace"),
            AGE,
        ],
        ("", "nodes") => vec![
            NAME,
            col("Status", "string", "", "The status of the node"),
            col("Roles", "string", "", "The roles of the node"),
            AGE,
            col(
                "Version",
                "string",
                "",
                "Kubelet Version reported by the node.",
            ),
            wide("Internal-IP", "The node's internal IP address."),
            wide("External-IP", "The node's external IP address."),
            wide("OS-Image", "OS image reported by the node."),
            wide("Kernel-Version", "Kernel version reported by the node."),
            wide(
                "Container-Runtime",
                "Container runtime and version reported by the node.",
            ),
        ],
        ("", "configmaps") => vec![
            NAME,
            col("Data", "string", "", "Number of data entries"),
            AGE,
        ],
        ("", "services") => vec![
            NAME,
            col(
                "Type",
                "string",
                "",
                "The type of the service: ClusterIP, NodePort, LoadBalancer or ExternalName.",
            ),
            col(
                "Cluster-IP",
                "string",
                "",
                "The IP address of the service, allocated from the service range.",
            ),
            col(
                "External-IP",
                "string",
                "",
                "The addresses the service is reachable at from outside the cluster.",
            ),
            col(
                "Port(s)",
                "string",
                "",
                "The list of ports that are exposed by this service.",
            ),
            AGE,
            wide(
                "Selector",
                "Route service traffic to pods with label keys and values matching this selector.",
            ),
        ],
        ("", "resourcequotas") => vec![
            NAME,
            AGE,
            col(
                "Request",
                "string",
                "",
                "Used and hard requests, and counts",
            ),
            col("Limit", "string", "", "Used and hard limits"),
        ],
        ("", "limitranges") => vec![
            NAME,
            col(
                "Created At",
                "date",
                "",
                "CreationTimestamp is a timestamp representing the server time when this object was created.",
            ),
        ],
        ("", "secrets") => vec![
            NAME,
            col("Type", "string", "", "The type of the secret"),
            col("Data", "string", "", "Number of data entries"),
            AGE,
        ],
        ("", "events") => vec![
            col("Last Seen", "string", "", "Time of the last occurrence"),
            col("Type", "string", "", "Type of this event"),
            col(
                "Reason",
                "string",
                "",
                "Short, machine understandable string",
            ),
            col("Object", "string", "", "The object this event is about"),
            wide("Subobject", "The part of the object this event is about"),
            wide("Source", "The component reporting this event"),
            col("Message", "string", "", "A human-readable description"),
            wide("First Seen", "Time of the first occurrence"),
            wide("Count", "Number of occurrences"),
            wide("Name", "Name of the event"),
        ],
        ("certificates.k8s.io", "certificatesigningrequests") => vec![
            NAME,
            AGE,
            col("SignerName", "string", "", "The name of the signer"),
            col(
                "Requestor",
                "string",
                "",
                "The user who requested the certificate",
            ),
            col(
                "RequestedDuration",
                "string",
                "",
                "The duration the requester asked the certificate to be valid for",
            ),
            col(
                "Condition",
                "string",
                "",
                "The approval state of the request",
            ),
        ],
        ("", "endpoints") => vec![
            NAME,
            col(
                "Endpoints",
                "string",
                "",
                "The set of all endpoints is the union of all subsets.",
            ),
            AGE,
        ],
        ("discovery.k8s.io", "endpointslices") => vec![
            NAME,
            col(
                "AddressType",
                "string",
                "",
                "addressType specifies the type of address carried by this EndpointSlice.",
            ),
            col(
                "Ports",
                "string",
                "",
                "ports specifies the list of network ports exposed by each endpoint in this slice.",
            ),
            col(
                "Endpoints",
                "string",
                "",
                "endpoints is a list of unique endpoints in this slice.",
            ),
            AGE,
        ],
        ("coordination.k8s.io", "leases") => {
            vec![
                NAME,
                col("Holder", "string", "", "The holder of the lease"),
                AGE,
            ]
        }
        _ => vec![NAME, AGE],
    }
}

/// kubectl's CONDITION of a CSR: its conditions' types, joined, or `Pending`.
fn csr_condition(obj: &Object) -> String {
    let types: Vec<&str> = obj
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .map(|c| c.iter().filter_map(|c| c["type"].as_str()).collect())
        .unwrap_or_default();
    if types.is_empty() {
        return "Pending".to_owned();
    }
    let mut shown = types.join(",");
    let issued = obj
        .get("status")
        .and_then(|s| s.get("certificate"))
        .and_then(Value::as_str)
        .is_some_and(|c| !c.is_empty());
    if issued {
        shown.push_str(",Issued");
    }
    shown
}

fn str_at<'a>(obj: &'a Object, path: &[&str]) -> Option<&'a str> {
    let mut cur = obj.get(path[0])?;
    for p in &path[1..] {
        cur = cur.get(p)?;
    }
    cur.as_str()
}

fn int_at(obj: &Object, path: &[&str]) -> i64 {
    let mut cur = obj.get(path[0]);
    for p in &path[1..] {
        cur = cur.and_then(|c| c.get(p));
    }
    cur.and_then(Value::as_i64).unwrap_or(0)
}

fn count(obj: &Object, field: &str) -> usize {
    obj.get(field)
        .and_then(Value::as_object)
        .map_or(0, |m| m.len())
}

/// Kubernetes' human-readable durations: `45s`, `3m20s`, `5h`, `2d3h`, `400d`.
pub fn human_duration(seconds: i64) -> String {
    if seconds < 0 {
        return "0s".into();
    }
    let (m, h, d) = (seconds / 60, seconds / 3600, seconds / 86400);
    match () {
        _ if seconds < 120 => format!("{seconds}s"),
        _ if m < 10 && seconds % 60 != 0 => format!("{m}m{}s", seconds % 60),
        _ if m < 180 => format!("{m}m"),
        _ if h < 8 && m % 60 != 0 => format!("{h}h{}m", m % 60),
        _ if h < 48 => format!("{h}h"),
        _ if d < 8 && h % 24 != 0 => format!("{d}d{}h", h % 24),
        _ if d < 730 => format!("{d}d"),
        _ => format!("{}y{}d", d / 365, d % 365),
    }
}

fn age(obj: &Object) -> String {
    let Some(created) = meta_str(obj, "creationTimestamp") else {
        return "<unknown>".into();
    };
    since(created)
}

/// How long ago an RFC 3339 timestamp was, as kubectl prints ages.
fn since(timestamp: &str) -> String {
    match timestamp.parse::<jiff::Timestamp>() {
        Ok(t) => human_duration(jiff::Timestamp::now().as_second() - t.as_second()),
        Err(_) => "<invalid>".into(),
    }
}

/// The value at `path` in kubectl's JSONPath as CRDs' printer columns use it: fields
/// (`.spec.replicas`), indices (`.spec.ports[0].port`) and equality filters
/// (`.status.conditions[?(@.type=="Ready")].status`, the first match). `None` when
/// nothing is there or the path uses more than that.
fn json_path<'a>(obj: &'a Object, path: &str) -> Option<&'a Value> {
    let path = path.trim();
    let path = path
        .strip_prefix('{')
        .and_then(|p| p.strip_suffix('}'))
        .unwrap_or(path);
    let rest = path.strip_prefix('.').unwrap_or(path);
    // The first step is a field of the object itself.
    let end = rest.find(['.', '[']).unwrap_or(rest.len());
    let mut at = obj.get(&rest[..end])?;
    let mut rest = rest[end..].strip_prefix('.').unwrap_or(&rest[end..]);
    while !rest.is_empty() {
        if let Some(inner) = rest.strip_prefix('[') {
            let end = inner.find(']')?;
            let selector = &inner[..end];
            at = match selector
                .strip_prefix("?(@.")
                .and_then(|s| s.strip_suffix(')'))
            {
                Some(filter) => {
                    let (field, value) = filter.split_once("==")?;
                    let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
                    at.as_array()?.iter().find(|item| {
                        item.get(field.trim()).and_then(Value::as_str) == Some(value)
                    })?
                }
                None => at.get(selector.trim().parse::<usize>().ok()?)?,
            };
            rest = inner[end + 1..]
                .strip_prefix('.')
                .unwrap_or(&inner[end + 1..]);
        } else {
            let end = rest.find(['.', '[']).unwrap_or(rest.len());
            at = at.get(&rest[..end])?;
            rest = rest[end..].strip_prefix('.').unwrap_or(&rest[end..]);
        }
    }
    Some(at)
}

/// One printer column's cell: dates as ages, numbers and booleans as themselves, other
/// values as text; null when the path finds nothing (kubectl prints `<none>`).
fn printer_cell(column: &PrinterColumn, obj: &Object) -> Value {
    let Some(value) = json_path(obj, &column.json_path) else {
        return Value::Null;
    };
    // As kube-apiserver: a value of another type than the column's is no value, and a
    // string column shows any value as text.
    match (column.kind.as_str(), value) {
        ("date", Value::String(t)) => json!(since(t)),
        ("integer", Value::Number(n)) if n.is_i64() || n.is_u64() => value.clone(),
        ("number", Value::Number(_)) | ("boolean", Value::Bool(_)) => value.clone(),
        ("integer" | "number" | "boolean" | "date", _) | (_, Value::Null) => Value::Null,
        (_, Value::String(_)) => value.clone(),
        (_, other) => json!(other.to_string()),
    }
}

fn pod_cells(obj: &Object) -> Vec<Value> {
    let containers = obj
        .get("spec")
        .and_then(|s| s.get("containers"))
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let statuses = obj
        .get("status")
        .and_then(|s| s.get("containerStatuses"))
        .and_then(Value::as_array);
    let ready = statuses.map_or(0, |s| {
        s.iter()
            .filter(|c| c.get("ready") == Some(&Value::Bool(true)))
            .count()
    });
    let restarts: i64 = statuses.map_or(0, |s| {
        s.iter()
            .filter_map(|c| c.get("restartCount")?.as_i64())
            .sum()
    });
    let status = if meta_str(obj, "deletionTimestamp").is_some() {
        "Terminating".to_owned()
    } else {
        pod_status_column(obj)
    };
    vec![
        json!(format!("{ready}/{containers}")),
        json!(status),
        json!(restarts.to_string()),
    ]
}

/// The STATUS column as kubectl's printer makes it: the pod's reason or phase, unless
/// a container says more — an init container's progress or failure (`Init:1/2`,
/// `Init:Error`), a container's waiting or terminated reason (`CrashLoopBackOff`,
/// `Completed`, `ExitCode:3`).
fn pod_status_column(obj: &Object) -> String {
    let mut reason = str_at(obj, &["status", "reason"])
        .or_else(|| str_at(obj, &["status", "phase"]))
        .unwrap_or("Pending")
        .to_owned();
    let status = obj.get("status");
    let list = |field: &str| {
        status
            .and_then(|s| s.get(field))
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let state_reason = |state: &Value, key: &str| {
        state
            .get(key)
            .and_then(|s| s.get("reason"))
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .map(str::to_owned)
    };
    let init = list("initContainerStatuses");
    let init_total = obj
        .get("spec")
        .and_then(|s| s.get("initContainers"))
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    for (i, c) in init.iter().enumerate() {
        let state = c.get("state").cloned().unwrap_or(Value::Null);
        if let Some(t) = state.get("terminated") {
            if t.get("exitCode").and_then(Value::as_i64) == Some(0) {
                continue;
            }
            let why = state_reason(&state, "terminated").unwrap_or_else(|| {
                format!(
                    "ExitCode:{}",
                    t.get("exitCode").and_then(Value::as_i64).unwrap_or(0)
                )
            });
            return format!("Init:{why}");
        }
        if let Some(why) = state_reason(&state, "waiting").filter(|r| r != "PodInitializing") {
            return format!("Init:{why}");
        }
        return format!("Init:{i}/{init_total}");
    }
    let mut running = false;
    for c in list("containerStatuses").iter().rev() {
        let state = c.get("state").cloned().unwrap_or(Value::Null);
        if let Some(why) = state_reason(&state, "waiting") {
            reason = why;
        } else if let Some(t) = state.get("terminated") {
            reason = state_reason(&state, "terminated").unwrap_or_else(|| {
                format!(
                    "ExitCode:{}",
                    t.get("exitCode").and_then(Value::as_i64).unwrap_or(0)
                )
            });
        } else if state.get("running").is_some() && c.get("ready") == Some(&Value::Bool(true)) {
            running = true;
        }
    }
    if reason == "Completed" && running {
        reason = "Running".to_owned();
    }
    reason
}

/// A string field, or `<none>` as kubectl prints a missing one.
fn or_none(value: Option<&str>) -> Value {
    json!(value.filter(|v| !v.is_empty()).unwrap_or(NONE))
}

const NONE: &str = "<none>";

/// The pod's wide columns: IP, node, nominated node, readiness gates.
fn pod_wide_cells(obj: &Object) -> Vec<Value> {
    let gates = obj
        .get("spec")
        .and_then(|s| s.get("readinessGates"))
        .and_then(Value::as_array)
        .filter(|g| !g.is_empty());
    let gates = gates.map_or_else(
        || json!(NONE),
        |gates| {
            let conditions = obj
                .get("status")
                .and_then(|s| s.get("conditions"))
                .and_then(Value::as_array);
            let ready = gates
                .iter()
                .filter(|g| {
                    let kind = g.get("conditionType");
                    conditions.is_some_and(|c| {
                        c.iter().any(|c| {
                            c.get("type") == kind && c.get("status") == Some(&json!("True"))
                        })
                    })
                })
                .count();
            json!(format!("{ready}/{}", gates.len()))
        },
    );
    vec![
        or_none(str_at(obj, &["status", "podIP"])),
        or_none(str_at(obj, &["spec", "nodeName"])),
        or_none(str_at(obj, &["status", "nominatedNodeName"])),
        gates,
    ]
}

/// A workload's wide columns: its template's container names and images, and its
/// selector as kubectl prints one.
fn workload_wide_cells(obj: &Object) -> Vec<Value> {
    let containers = obj
        .get("spec")
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("spec"))
        .and_then(|s| s.get("containers"))
        .and_then(Value::as_array);
    let field = |name: &str| {
        containers
            .map(|c| {
                c.iter()
                    .filter_map(|c| c.get(name).and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default()
    };
    // A ReplicationController's plain map of labels is its matchLabels.
    let selector = crate::object::spec_selector(obj);
    vec![
        json!(field("name")),
        json!(field("image")),
        json!(selector_text(selector.as_ref())),
    ]
}

/// A label selector as `kubectl` prints it: requirements sorted by key, `k=v`, `k in
/// (a,b)`, `k notin (a)`, `k`, `!k`; `<none>` for none.
fn selector_text(selector: Option<&Value>) -> String {
    let Some(selector) = selector else {
        return NONE.to_owned();
    };
    let mut requirements: Vec<(String, String)> = Vec::new();
    if let Some(labels) = selector.get("matchLabels").and_then(Value::as_object) {
        for (k, v) in labels {
            requirements.push((k.clone(), format!("{k}={}", v.as_str().unwrap_or(""))));
        }
    }
    for e in selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = e.get("key").and_then(Value::as_str).unwrap_or("");
        let mut values: Vec<&str> = e
            .get("values")
            .and_then(Value::as_array)
            .map(|v| v.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        values.sort_unstable();
        let text = match e.get("operator").and_then(Value::as_str) {
            Some("In") => format!("{key} in ({})", values.join(",")),
            Some("NotIn") => format!("{key} notin ({})", values.join(",")),
            Some("Exists") => key.to_owned(),
            Some("DoesNotExist") => format!("!{key}"),
            _ => continue,
        };
        requirements.push((key.to_owned(), text));
    }
    if requirements.is_empty() {
        return NONE.to_owned();
    }
    requirements.sort();
    requirements
        .into_iter()
        .map(|(_, text)| text)
        .collect::<Vec<_>>()
        .join(",")
}

/// A node's address of `kind` (`InternalIP`, `ExternalIP`).
fn node_address(obj: &Object, kind: &str) -> Value {
    let address = obj
        .get("status")
        .and_then(|s| s.get("addresses"))
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find(|a| a.get("type") == Some(&json!(kind))))
        .and_then(|a| a.get("address"))
        .and_then(Value::as_str);
    or_none(address)
}

/// A quota's `used/hard` pairs, as kubectl shows them: limits in one column,
/// everything else in the other.
fn quota_cells(obj: &Object) -> (String, String) {
    let hard = obj
        .get("status")
        .and_then(|s| s.get("hard"))
        .and_then(Value::as_object);
    let used = obj.get("status").and_then(|s| s.get("used"));
    let (mut request, mut limit) = (Vec::new(), Vec::new());
    for (name, hard) in hard.into_iter().flatten() {
        let used = used
            .and_then(|u| u.get(name))
            .and_then(Value::as_str)
            .unwrap_or("0");
        let pair = format!("{name}: {used}/{}", hard.as_str().unwrap_or(""));
        if name.starts_with("limits.") {
            limit.push(pair);
        } else {
            request.push(pair);
        }
    }
    (request.join(", "), limit.join(", "))
}

/// kubectl's ENDPOINTS of an Endpoints (`formatEndpoints`): the first three ready
/// `ip:port`s (or bare IPs for a subset without ports), then `+ N more...`;
/// `<none>` without subsets.
fn endpoints_text(obj: &Object) -> String {
    let Some(subsets) = obj
        .get("subsets")
        .and_then(Value::as_array)
        .filter(|s| !s.is_empty())
    else {
        return "<none>".into();
    };
    const MAX: usize = 3;
    let (mut list, mut count, mut more) = (Vec::new(), 0, false);
    for subset in subsets {
        let addresses: Vec<&str> = subset["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["ip"].as_str())
            .collect();
        let ports: Vec<Option<i64>> = match subset["ports"].as_array() {
            Some(p) if !p.is_empty() => p.iter().map(|p| p["port"].as_i64()).collect(),
            _ => vec![None],
        };
        for port in ports {
            count += addresses.len();
            for ip in &addresses {
                if list.len() == MAX {
                    more = true;
                    break;
                }
                list.push(match port {
                    Some(port) if ip.contains(':') => format!("[{ip}]:{port}"),
                    Some(port) => format!("{ip}:{port}"),
                    None => (*ip).to_owned(),
                });
            }
        }
    }
    let text = list.join(",");
    if more {
        format!("{text} + {} more...", count - MAX)
    } else {
        text
    }
}

/// kubectl's `listWithMoreString`: three items, then `+ N more...`; `<unset>` for none.
fn list_with_more(items: impl Iterator<Item = String>) -> String {
    const MAX: usize = 3;
    let items: Vec<String> = items.collect();
    let text = items[..items.len().min(MAX)].join(",");
    if items.len() > MAX {
        format!("{text} + {} more...", items.len() - MAX)
    } else if text.is_empty() {
        "<unset>".into()
    } else {
        text
    }
}

/// kubectl's PORTS of an EndpointSlice: each port's number (its name without one,
/// `*` with neither).
fn slice_ports_text(obj: &Object) -> String {
    list_with_more(
        obj.get("ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|p| match (p["port"].as_i64(), p["name"].as_str()) {
                (Some(port), _) => port.to_string(),
                (None, Some(name)) => name.to_owned(),
                (None, None) => "*".to_owned(),
            }),
    )
}

/// kubectl's ENDPOINTS of an EndpointSlice: every endpoint's addresses.
fn slice_endpoints_text(obj: &Object) -> String {
    list_with_more(
        obj.get("endpoints")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .flat_map(|e| e["addresses"].as_array().into_iter().flatten())
            .filter_map(|a| a.as_str().map(str::to_owned)),
    )
}

fn cells(res: &ResourceInfo, obj: &Object) -> Vec<Value> {
    if let Some(cells) = workloads::cells(res, obj) {
        return cells;
    }
    let name = json!(meta_str(obj, "name").unwrap_or_default());
    let age = json!(age(obj));
    match (res.group.as_str(), res.plural.as_str()) {
        ("", "pods") => [vec![name], pod_cells(obj), vec![age], pod_wide_cells(obj)].concat(),
        ("apps", "deployments") => {
            let want = obj
                .get("spec")
                .and_then(|s| s.get("replicas"))
                .and_then(Value::as_i64)
                .unwrap_or(1);
            vec![
                name,
                json!(format!(
                    "{}/{want}",
                    int_at(obj, &["status", "readyReplicas"])
                )),
                json!(int_at(obj, &["status", "updatedReplicas"])),
                json!(int_at(obj, &["status", "availableReplicas"])),
                age,
            ]
            .into_iter()
            .chain(workload_wide_cells(obj))
            .collect()
        }
        ("apps", "replicasets") | ("", "replicationcontrollers") => vec![
            name,
            json!(
                obj.get("spec")
                    .and_then(|s| s.get("replicas"))
                    .and_then(Value::as_i64)
                    .unwrap_or(1)
            ),
            json!(int_at(obj, &["status", "replicas"])),
            json!(int_at(obj, &["status", "readyReplicas"])),
            age,
        ]
        .into_iter()
        .chain(workload_wide_cells(obj))
        .collect(),
        ("", "namespaces") => vec![
            name,
            json!(str_at(obj, &["status", "phase"]).unwrap_or("Active")),
            age,
        ],
        ("", "nodes") => {
            let ready = obj
                .get("status")
                .and_then(|s| s.get("conditions"))
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|c| c.get("type") == Some(&json!("Ready"))))
                .and_then(|c| c.get("status"))
                .and_then(Value::as_str);
            let status = match ready {
                Some("True") => "Ready",
                _ => "NotReady",
            };
            let roles: Vec<&str> = metadata(obj)
                .and_then(|m| m.get("labels"))
                .and_then(Value::as_object)
                .map(|l| {
                    l.keys()
                        .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                        .collect()
                })
                .unwrap_or_default();
            let roles = if roles.is_empty() {
                "<none>".to_owned()
            } else {
                roles.join(",")
            };
            let version = str_at(obj, &["status", "nodeInfo", "kubeletVersion"]).unwrap_or("");
            let info = |field: &str| or_none(str_at(obj, &["status", "nodeInfo", field]));
            vec![
                name,
                json!(status),
                json!(roles),
                age,
                json!(version),
                node_address(obj, "InternalIP"),
                node_address(obj, "ExternalIP"),
                info("osImage"),
                info("kernelVersion"),
                info("containerRuntimeVersion"),
            ]
        }
        ("", "configmaps") => {
            vec![
                name,
                json!((count(obj, "data") + count(obj, "binaryData")).to_string()),
                age,
            ]
        }
        ("", "services") => {
            let [ty, cluster_ip, external_ip, ports, selector] =
                crate::registry::service::table::cells(obj);
            vec![name, ty, cluster_ip, external_ip, ports, age, selector]
        }
        ("", "resourcequotas") => {
            let (request, limit) = quota_cells(obj);
            vec![name, age, json!(request), json!(limit)]
        }
        ("", "limitranges") => vec![
            name,
            json!(meta_str(obj, "creationTimestamp").unwrap_or_default()),
        ],
        ("", "secrets") => vec![
            name,
            json!(obj.get("type").and_then(Value::as_str).unwrap_or("Opaque")),
            json!(count(obj, "data").to_string()),
            age,
        ],
        ("", "events") => {
            let involved = format!(
                "{}/{}",
                str_at(obj, &["involvedObject", "kind"])
                    .unwrap_or("")
                    .to_lowercase(),
                str_at(obj, &["involvedObject", "name"]).unwrap_or("")
            );
            let text = |field: &str| json!(obj.get(field).and_then(Value::as_str).unwrap_or(""));
            let source = [
                str_at(obj, &["source", "component"])
                    .or_else(|| obj.get("reportingComponent").and_then(Value::as_str)),
                str_at(obj, &["source", "host"]),
            ]
            .into_iter()
            .flatten()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
            let first_seen = obj
                .get("firstTimestamp")
                .and_then(Value::as_str)
                .or_else(|| obj.get("eventTime").and_then(Value::as_str))
                .map_or_else(|| age.clone(), |t| json!(since(t)));
            vec![
                age,
                text("type"),
                text("reason"),
                json!(involved),
                json!(str_at(obj, &["involvedObject", "fieldPath"]).unwrap_or("")),
                json!(source),
                text("message"),
                first_seen,
                json!(obj.get("count").and_then(Value::as_i64).unwrap_or(1)),
                json!(meta_str(obj, "name").unwrap_or_default()),
            ]
        }
        ("certificates.k8s.io", "certificatesigningrequests") => {
            let duration = obj
                .get("spec")
                .and_then(|s| s.get("expirationSeconds"))
                .and_then(Value::as_i64)
                .map_or_else(|| "<none>".to_owned(), human_duration);
            vec![
                name,
                age,
                json!(str_at(obj, &["spec", "signerName"]).unwrap_or("<none>")),
                json!(str_at(obj, &["spec", "username"]).unwrap_or_default()),
                json!(duration),
                json!(csr_condition(obj)),
            ]
        }
        ("", "endpoints") => vec![name, json!(endpoints_text(obj)), age],
        ("discovery.k8s.io", "endpointslices") => vec![
            name,
            json!(str_at(obj, &["addressType"]).unwrap_or_default()),
            json!(slice_ports_text(obj)),
            json!(slice_endpoints_text(obj)),
            age,
        ],
        ("coordination.k8s.io", "leases") => {
            vec![
                name,
                json!(str_at(obj, &["spec", "holderIdentity"]).unwrap_or("")),
                age,
            ]
        }
        _ => vec![name, age],
    }
}

/// A Table of `items`, each row carrying what `include` asks for. `list` carries the
/// list's revision and continue token.
pub fn object_table(
    res: &ResourceInfo,
    items: &[Object],
    list: Option<(Revision, Option<String>)>,
    include: IncludeObject,
) -> Value {
    let printer = res.printer_columns.as_deref();
    let column_definitions: Vec<Value> = match printer {
        Some(declared) => std::iter::once(json!({"name": NAME.name, "type": NAME.kind, "format": NAME.format, "description": NAME.description, "priority": 0}))
            .chain(declared.iter().map(|c| json!({"name": c.name, "type": c.kind, "format": c.format, "description": c.description, "priority": c.priority})))
            .collect(),
        None => columns(res)
            .iter()
            .map(|c| json!({"name": c.name, "type": c.kind, "format": c.format, "description": c.description, "priority": c.priority}))
            .collect(),
    };
    let rows: Vec<Value> = items
        .iter()
        .map(|obj| {
            let cells = match printer {
                Some(declared) => std::iter::once(json!(meta_str(obj, "name").unwrap_or_default()))
                    .chain(declared.iter().map(|c| printer_cell(c, obj)))
                    .collect(),
                None => cells(res, obj),
            };
            json!({"cells": cells, "object": row_object(res, obj, include)})
        })
        .collect();
    let mut meta = json!({});
    if let Some((revision, next)) = list {
        meta["resourceVersion"] = revision.to_string().into();
        if let Some(token) = next {
            meta["continue"] = token.into();
        }
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": column_definitions,
        "rows": rows,
    })
}

/// A row's `object`, as kube-apiserver fills it for `includeObject`.
fn row_object(res: &ResourceInfo, obj: &Object, include: IncludeObject) -> Value {
    match include {
        IncludeObject::None => Value::Null,
        IncludeObject::Metadata => json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({})),
        }),
        IncludeObject::Object => {
            // Clients decode it on its own (kubectl's sorter), so it names its kind even
            // where a list's items may not.
            let mut whole = obj.clone();
            whole
                .entry("apiVersion")
                .or_insert_with(|| res.api_version().into());
            whole
                .entry("kind")
                .or_insert_with(|| res.kind.clone().into());
            Value::Object(whole)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_kubectl() {
        assert_eq!(human_duration(45), "45s");
        assert_eq!(human_duration(200), "3m20s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(3 * 3600 + 120), "3h2m");
        assert_eq!(human_duration(30 * 3600), "30h");
        assert_eq!(human_duration(3 * 86400 + 3600), "3d1h");
        assert_eq!(human_duration(400 * 86400), "400d");
    }

    #[test]
    fn endpoints_and_slices_read_as_kubectl_prints_them() {
        let object = |v: Value| -> Object { serde_json::from_value(v).unwrap() };
        let endpoints = object(json!({"subsets": [
            {"addresses": [{"ip": "10.244.1.5"}, {"ip": "10.244.2.7"}],
             "notReadyAddresses": [{"ip": "10.244.3.1"}],
             "ports": [{"port": 8080}, {"port": 9090}]}]}));
        assert_eq!(
            endpoints_text(&endpoints),
            "10.244.1.5:8080,10.244.2.7:8080,10.244.1.5:9090 + 1 more..."
        );
        assert_eq!(endpoints_text(&object(json!({}))), "<none>");
        assert_eq!(
            endpoints_text(&object(
                json!({"subsets": [{"addresses": [{"ip": "10.0.0.1"}]}]})
            )),
            "10.0.0.1"
        );
        let slice = object(json!({
            "ports": [{"name": "http", "port": 80}, {"name": "https", "port": 443}],
            "endpoints": [{"addresses": ["10.244.1.5"]}, {"addresses": ["10.244.2.7"]},
                          {"addresses": ["10.244.3.1"]}, {"addresses": ["10.244.4.1"]}]}));
        assert_eq!(slice_ports_text(&slice), "80,443");
        assert_eq!(
            slice_endpoints_text(&slice),
            "10.244.1.5,10.244.2.7,10.244.3.1 + 1 more..."
        );
        assert_eq!(slice_ports_text(&object(json!({}))), "<unset>");
        assert_eq!(
            slice_endpoints_text(&object(json!({"endpoints": []}))),
            "<unset>"
        );
    }

    fn pods() -> trellis_api::registry::ResourceInfo {
        trellis_api::registry::builtins()
            .into_iter()
            .find(|r| r.plural == "pods")
            .unwrap()
    }

    #[test]
    fn pod_rows_show_readiness_and_phase() {
        let res = pods();
        let pod: Object = serde_json::from_value(json!({
            "metadata": {"name": "web"},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"phase": "Running", "containerStatuses": [{"ready": true, "restartCount": 2}, {"ready": false, "restartCount": 1}]}
        }))
        .unwrap();
        let table = object_table(&res, &[pod], Some((7, None)), IncludeObject::Metadata);
        assert_eq!(table["columnDefinitions"][1]["name"], "Ready");
        assert_eq!(
            table["rows"][0]["cells"],
            json!([
                "web",
                "1/2",
                "Running",
                "3",
                "<unknown>",
                "<none>",
                "<none>",
                "<none>",
                "<none>"
            ])
        );
        assert_eq!(table["columnDefinitions"][5]["name"], "IP");
        assert_eq!(table["columnDefinitions"][5]["priority"], 1);
        assert_eq!(table["metadata"]["resourceVersion"], "7");
    }

    #[test]
    fn rows_carry_what_include_object_asks_for() {
        let res = pods();
        let pod: Object = serde_json::from_value(json!({
            "metadata": {"name": "web"},
            "status": {"startTime": "2020-01-01T00:00:00Z"}
        }))
        .unwrap();
        let row = |include| {
            object_table(&res, std::slice::from_ref(&pod), None, include)["rows"][0]["object"]
                .clone()
        };
        assert_eq!(
            row(IncludeObject::Metadata),
            json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": {"name": "web"}})
        );
        assert_eq!(
            row(IncludeObject::Object),
            json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "web"},
                   "status": {"startTime": "2020-01-01T00:00:00Z"}})
        );
        assert_eq!(row(IncludeObject::None), Value::Null);
    }

    #[test]
    fn the_status_column_says_what_the_containers_say() {
        let column = |status: serde_json::Value, init: usize| {
            let pod: Object = serde_json::from_value(json!({
                "metadata": {"name": "p"},
                "spec": {"initContainers": vec![json!({"name": "i"}); init], "containers": [{"name": "c"}]},
                "status": status,
            }))
            .unwrap();
            pod_status_column(&pod)
        };
        let terminated = |code: i64, reason: Option<&str>| json!({"terminated": {"exitCode": code, "reason": reason}});
        assert_eq!(
            column(
                json!({"phase": "Succeeded", "containerStatuses": [{"state": terminated(0, Some("Completed"))}]}),
                0
            ),
            "Completed"
        );
        assert_eq!(
            column(
                json!({"phase": "Running", "containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}),
                0
            ),
            "CrashLoopBackOff"
        );
        assert_eq!(
            column(
                json!({"phase": "Failed", "containerStatuses": [{"state": terminated(3, None)}]}),
                0
            ),
            "ExitCode:3"
        );
        assert_eq!(
            column(
                json!({"phase": "Pending", "initContainerStatuses": [{"state": {"running": {}}}]}),
                2
            ),
            "Init:0/2"
        );
        assert_eq!(
            column(
                json!({"phase": "Pending", "initContainerStatuses": [{"state": terminated(1, Some("Error"))}]}),
                1
            ),
            "Init:Error"
        );
        assert_eq!(
            column(
                json!({"phase": "Failed", "reason": "UnsupportedRuntimeHandler"}),
                0
            ),
            "UnsupportedRuntimeHandler"
        );
        assert_eq!(
            column(
                json!({"phase": "Running", "containerStatuses": [{"ready": true, "state": {"running": {}}}]}),
                0
            ),
            "Running"
        );
    }

    #[test]
    fn custom_resources_show_their_printer_columns() {
        let column = |name: &str, kind: &str, priority: i64, path: &str| PrinterColumn {
            name: name.into(),
            kind: kind.into(),
            format: String::new(),
            description: String::new(),
            priority,
            json_path: path.into(),
        };
        let res = ResourceInfo {
            group: "example.com".into(),
            kind: "Widget".into(),
            plural: "widgets".into(),
            printer_columns: Some(
                vec![
                    column("Size", "integer", 0, ".spec.size"),
                    column("Port", "integer", 0, ".spec.ports[1].port"),
                    column(
                        "Ready",
                        "string",
                        0,
                        r#".status.conditions[?(@.type=="Ready")].status"#,
                    ),
                    column("Tags", "string", 1, ".spec.tags"),
                    column("Missing", "string", 0, ".spec.nothing"),
                    column("Age", "date", 0, ".metadata.creationTimestamp"),
                ]
                .into(),
            ),
            ..trellis_api::registry::builtins().remove(0)
        };
        let widget: Object = serde_json::from_value(json!({
            "metadata": {"name": "w", "creationTimestamp": "2020-01-01T00:00:00Z"},
            "spec": {"size": 3, "ports": [{"port": 80}, {"port": 443}], "tags": ["a"]},
            "status": {"conditions": [
                {"type": "Synced", "status": "False"},
                {"type": "Ready", "status": "True"}
            ]}
        }))
        .unwrap();
        let table = object_table(&res, &[widget], None, IncludeObject::Metadata);
        let names: Vec<&Value> = table["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| &c["name"])
            .collect();
        assert_eq!(
            names,
            ["Name", "Size", "Port", "Ready", "Tags", "Missing", "Age"]
        );
        assert_eq!(table["columnDefinitions"][4]["priority"], 1);
        let cells = table["rows"][0]["cells"].as_array().unwrap();
        assert_eq!(
            cells[..6],
            [
                json!("w"),
                json!(3),
                json!(443),
                json!("True"),
                json!("[\"a\"]"),
                Value::Null
            ]
        );
        let age = cells[6].as_str().unwrap();
        assert!(age.ends_with('d') && age.contains('y'), "{age}");
    }
}
