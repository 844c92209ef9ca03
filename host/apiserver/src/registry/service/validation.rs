//! A Service's defaults and validation, as Kubernetes 1.30 applies them: the v1
//! defaults (`SetDefaults_Service`), the fields an update keeps or drops with a change
//! of type (`patchAllocatedValues`, `NormalizeClusterIPs`, `dropTypeDependentFields`),
//! the IP family fields of a single-stack IPv4 cluster, then `ValidateService` and
//! `ValidateServiceUpdate` with their field paths and messages.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde_json::{Map, Value, json};
use trellis_api::status::StatusCause;

use crate::object::Object;

pub const EXTERNAL_NAME: &str = "ExternalName";
pub const NODE_PORT: &str = "NodePort";
pub const LOAD_BALANCER: &str = "LoadBalancer";
pub const CLUSTER_IP: &str = "ClusterIP";
pub const NONE: &str = "None";
/// `sessionAffinityConfig.clientIP.timeoutSeconds`' default and most: 3 hours, a day.
const DEFAULT_AFFINITY_SECONDS: i64 = 10800;
const MAX_AFFINITY_SECONDS: i64 = 86400;

fn spec(obj: &Object) -> Option<&Map<String, Value>> {
    obj.get("spec").and_then(Value::as_object)
}

fn spec_mut(obj: &mut Object) -> &mut Map<String, Value> {
    let entry = obj.entry("spec").or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    entry
        .as_object_mut()
        .unwrap_or_else(|| unreachable!("made an object above"))
}

fn text<'a>(spec: &'a Map<String, Value>, field: &str) -> &'a str {
    spec.get(field).and_then(Value::as_str).unwrap_or("")
}

pub fn service_type(obj: &Object) -> &str {
    spec(obj).map_or("", |s| text(s, "type"))
}

/// Every type but ExternalName has a ClusterIP (`None` for a headless Service).
fn needs_cluster_ip(spec: &Map<String, Value>) -> bool {
    text(spec, "type") != EXTERNAL_NAME
}

/// NodePort Services, and LoadBalancers that allocate node ports (the default).
pub fn needs_node_ports(spec: &Map<String, Value>) -> bool {
    match text(spec, "type") {
        NODE_PORT => true,
        LOAD_BALANCER => spec.get("allocateLoadBalancerNodePorts") != Some(&json!(false)),
        _ => false,
    }
}

/// A LoadBalancer with `externalTrafficPolicy: Local` (`NeedsHealthCheck`).
pub fn needs_health_check(spec: &Map<String, Value>) -> bool {
    text(spec, "type") == LOAD_BALANCER && text(spec, "externalTrafficPolicy") == "Local"
}

fn externally_accessible(spec: &Map<String, Value>) -> bool {
    matches!(text(spec, "type"), NODE_PORT | LOAD_BALANCER)
        || spec
            .get("externalIPs")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
}

fn ports_mut(spec: &mut Map<String, Value>) -> impl Iterator<Item = &mut Map<String, Value>> {
    spec.get_mut("ports")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

fn ports(spec: &Map<String, Value>) -> impl Iterator<Item = &Map<String, Value>> {
    spec.get("ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
}

fn int(map: &Map<String, Value>, field: &str) -> i64 {
    map.get(field).and_then(Value::as_i64).unwrap_or(0)
}

fn set_default(map: &mut Map<String, Value>, key: &str, value: Value) {
    if map.get(key).is_none_or(Value::is_null) {
        map.insert(key.to_owned(), value);
    }
}

fn empty(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

/// Defaults of a Service about to be stored; `old` is the stored one of an update.
pub fn default(obj: &mut Object, old: Option<&Object>) {
    let spec = spec_mut(obj);
    // SetDefaults_Service.
    set_default(spec, "type", json!(CLUSTER_IP));
    set_default(spec, "sessionAffinity", json!(NONE));
    match text(spec, "sessionAffinity") {
        NONE => {
            spec.remove("sessionAffinityConfig");
        }
        "ClientIP" => {
            let has_timeout = spec
                .get("sessionAffinityConfig")
                .and_then(|c| c.get("clientIP"))
                .and_then(|c| c.get("timeoutSeconds"))
                .is_some_and(|t| !t.is_null());
            if !has_timeout {
                spec.insert(
                    "sessionAffinityConfig".into(),
                    json!({"clientIP": {"timeoutSeconds": DEFAULT_AFFINITY_SECONDS}}),
                );
            }
        }
        _ => {}
    }
    for port in ports_mut(spec) {
        set_default(port, "protocol", json!("TCP"));
        let target = port.get("targetPort");
        if matches!(target, None | Some(Value::Null))
            || target == Some(&json!(0))
            || target == Some(&json!(""))
        {
            let number = port.get("port").cloned().unwrap_or(json!(0));
            port.insert("targetPort".into(), number);
        }
    }
    let ty = text(spec, "type").to_owned();
    if matches!(ty.as_str(), NODE_PORT | LOAD_BALANCER) {
        set_default(spec, "externalTrafficPolicy", json!("Cluster"));
    }
    if matches!(ty.as_str(), NODE_PORT | LOAD_BALANCER | CLUSTER_IP) {
        set_default(spec, "internalTrafficPolicy", json!("Cluster"));
    }
    if ty == LOAD_BALANCER {
        set_default(spec, "allocateLoadBalancerNodePorts", json!(true));
    }

    if let Some(old) = old.and_then(self::spec) {
        patch_allocated_values(spec, old);
        normalize_cluster_ips_update(spec, old);
        drop_type_dependent_fields(spec, old);
    } else if !empty(spec.get("clusterIP")) && empty(spec.get("clusterIPs")) {
        let ip = spec.get("clusterIP").cloned().unwrap_or(Value::Null);
        spec.insert("clusterIPs".into(), json!([ip]));
    }
    // A single-stack IPv4 cluster: every Service with a ClusterIP (or headless) is
    // IPv4; PreferDualStack stays as asked and gets the one family there is.
    if needs_cluster_ip(spec) {
        set_default(spec, "ipFamilyPolicy", json!("SingleStack"));
        set_default(spec, "ipFamilies", json!(["IPv4"]));
    }
}

/// An update that leaves out what the server allocated keeps it, for idempotent
/// applies (`patchAllocatedValues`).
fn patch_allocated_values(new: &mut Map<String, Value>, old: &Map<String, Value>) {
    if needs_cluster_ip(old) && needs_cluster_ip(new) {
        if empty(new.get("clusterIP")) {
            new.insert(
                "clusterIP".into(),
                old.get("clusterIP").cloned().unwrap_or(Value::Null),
            );
        }
        if empty(new.get("clusterIPs")) && new.get("clusterIP") == old.get("clusterIP") {
            new.insert(
                "clusterIPs".into(),
                old.get("clusterIPs").cloned().unwrap_or(Value::Null),
            );
        }
    }
    if needs_node_ports(old) && needs_node_ports(new) {
        let used = |s: &Map<String, Value>| -> BTreeSet<i64> {
            ports(s)
                .map(|p| int(p, "nodePort"))
                .filter(|n| *n > 0)
                .collect()
        };
        let used: BTreeSet<i64> = used(old).intersection(&used(new)).copied().collect();
        let by_name: Vec<(String, i64)> = ports(old)
            .map(|p| (text(p, "name").to_owned(), int(p, "nodePort")))
            .collect();
        for port in ports_mut(new) {
            if int(port, "nodePort") != 0 {
                continue;
            }
            let name = text(port, "name");
            if let Some((_, old_value)) = by_name.iter().find(|(n, _)| n == name)
                && *old_value > 0
                && !used.contains(old_value)
            {
                port.insert("nodePort".into(), json!(old_value));
            }
        }
    }
    if text(new, "type") == LOAD_BALANCER
        && text(old, "type") == LOAD_BALANCER
        && int(new, "healthCheckNodePort") == 0
        && int(old, "healthCheckNodePort") > 0
        && text(new, "externalTrafficPolicy") == "Local"
    {
        new.insert(
            "healthCheckNodePort".into(),
            old.get("healthCheckNodePort")
                .cloned()
                .unwrap_or(Value::Null),
        );
    }
}

/// `NormalizeClusterIPs` of an update: keeps `clusterIP` and `clusterIPs` in step
/// for clients that write only one of them.
fn normalize_cluster_ips_update(new: &mut Map<String, Value>, old: &Map<String, Value>) {
    if !empty(old.get("clusterIPs"))
        && empty(new.get("clusterIPs"))
        && old.get("clusterIP") == new.get("clusterIP")
    {
        new.insert(
            "clusterIPs".into(),
            old.get("clusterIPs").cloned().unwrap_or(Value::Null),
        );
    }
    if text(old, "clusterIP") != text(new, "clusterIP") {
        let same_ips = old.get("clusterIPs") == new.get("clusterIPs");
        if !empty(old.get("clusterIP")) && empty(new.get("clusterIP")) && same_ips {
            new.remove("clusterIPs");
        }
        if !empty(new.get("clusterIP")) && same_ips {
            let ip = new.get("clusterIP").cloned().unwrap_or(Value::Null);
            new.insert("clusterIPs".into(), json!([ip]));
        }
    }
    if empty(new.get("clusterIP")) && empty(new.get("clusterIPs")) {
        // Both cleared: nothing left to keep in step (the type change below decides).
    } else if !empty(new.get("clusterIP")) && empty(new.get("clusterIPs")) {
        let ip = new.get("clusterIP").cloned().unwrap_or(Value::Null);
        new.insert("clusterIPs".into(), json!([ip]));
    }
}

/// What a change of type leaves behind, dropped when the client left it as it was
/// (`dropTypeDependentFields`).
fn drop_type_dependent_fields(new: &mut Map<String, Value>, old: &Map<String, Value>) {
    let same = |field: &str, new: &Map<String, Value>| new.get(field) == old.get(field);
    if needs_cluster_ip(old) && !needs_cluster_ip(new) {
        if same("clusterIP", new) && same("clusterIPs", new) {
            new.remove("clusterIP");
            new.remove("clusterIPs");
        }
        if same("ipFamilies", new) {
            new.remove("ipFamilies");
        }
        if same("ipFamilyPolicy", new) {
            new.remove("ipFamilyPolicy");
        }
        if same("internalTrafficPolicy", new) {
            new.remove("internalTrafficPolicy");
        }
    }
    if needs_node_ports(old) && !needs_node_ports(new) {
        let old_ports: Vec<i64> = ports(old).map(|p| int(p, "nodePort")).collect();
        let new_ports: Vec<i64> = ports(new).map(|p| int(p, "nodePort")).collect();
        if old_ports == new_ports {
            for port in ports_mut(new) {
                port.remove("nodePort");
            }
        }
    }
    if needs_health_check(old) && !needs_health_check(new) && same("healthCheckNodePort", new) {
        new.remove("healthCheckNodePort");
    }
    if text(old, "type") == LOAD_BALANCER && text(new, "type") != LOAD_BALANCER {
        for field in ["allocateLoadBalancerNodePorts", "loadBalancerClass"] {
            if same(field, new) {
                new.remove(field);
            }
        }
    }
    if externally_accessible(old)
        && !externally_accessible(new)
        && same("externalTrafficPolicy", new)
    {
        new.remove("externalTrafficPolicy");
    }
}

/// `Invalid value` with the value shown as Go's `%#v` shows it.
fn invalid(field: impl Into<String>, shown: &str, detail: &str) -> StatusCause {
    StatusCause::new(
        "FieldValueInvalid",
        field,
        format!("Invalid value: {shown}: {detail}"),
    )
}

fn not_supported(field: impl Into<String>, value: &str, supported: &[&str]) -> StatusCause {
    let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    StatusCause::new(
        "FieldValueNotSupported",
        field,
        format!(
            "Unsupported value: {value:?}: supported values: {}",
            list.join(", ")
        ),
    )
}

fn duplicate(field: impl Into<String>, shown: &str) -> StatusCause {
    StatusCause::new(
        "FieldValueDuplicate",
        field,
        format!("Duplicate value: {shown}"),
    )
}

/// Go's `%#v` of a `[]string`.
pub fn go_strings(values: &[&str]) -> String {
    let quoted: Vec<String> = values.iter().map(|v| format!("{v:?}")).collect();
    format!("[]string{{{}}}", quoted.join(", "))
}

fn strings<'a>(spec: &'a Map<String, Value>, field: &str) -> Vec<&'a str> {
    spec.get(field)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|v| v.as_str().unwrap_or(""))
        .collect()
}

const DNS1123_LABEL_MESSAGE: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MESSAGE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn dns1123_label(field: String, value: &str, causes: &mut Vec<StatusCause>) {
    if value.len() > 63 {
        causes.push(StatusCause::new(
            "FieldValueInvalid",
            field.clone(),
            format!("Invalid value: {value:?}: must be no more than 63 characters"),
        ));
    }
    if !is_dns1123_label(value) {
        causes.push(StatusCause::invalid(field, value, DNS1123_LABEL_MESSAGE));
    }
}

fn dns1123_subdomain(field: &str, value: &str, causes: &mut Vec<StatusCause>) {
    if value.len() > 253 {
        causes.push(StatusCause::invalid(
            field,
            value,
            "must be no more than 253 characters",
        ));
    }
    if !value.split('.').all(is_dns1123_label) {
        causes.push(StatusCause::invalid(
            field,
            value,
            DNS1123_SUBDOMAIN_MESSAGE,
        ));
    }
}

const PORT_RANGE_MESSAGE: &str = "must be between 1 and 65535, inclusive";

fn valid_port_name(name: &str) -> bool {
    // IsValidPortName: at most 15 lowercase alphanumerics or '-', a letter among them,
    // no leading, trailing or double hyphen.
    !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

/// `ValidateService`, plus `ValidateServiceUpdate` when `old` is given.
pub fn validate(obj: &Object, old: Option<&Object>, causes: &mut Vec<StatusCause>) {
    let empty_spec = Map::new();
    let spec = spec(obj).unwrap_or(&empty_spec);
    let ty = text(spec, "type");
    let headless = strings(spec, "clusterIPs") == [NONE] || text(spec, "clusterIP") == NONE;
    const TYPES: &[&str] = &[CLUSTER_IP, EXTERNAL_NAME, LOAD_BALANCER, NODE_PORT];
    if ty.is_empty() {
        causes.push(StatusCause::required("spec.type"));
    } else if !TYPES.contains(&ty) {
        causes.push(not_supported("spec.type", ty, TYPES));
    }

    let port_list: Vec<&Map<String, Value>> = ports(spec).collect();
    if port_list.is_empty() && !headless && ty != EXTERNAL_NAME {
        causes.push(StatusCause::required("spec.ports"));
    }
    let require_name = port_list.len() > 1;
    let mut names = BTreeSet::new();
    for (i, port) in port_list.iter().enumerate() {
        let path = format!("spec.ports[{i}]");
        let name = text(port, "name");
        if require_name && name.is_empty() {
            causes.push(StatusCause::required(format!("{path}.name")));
        } else if !name.is_empty() {
            dns1123_label(format!("{path}.name"), name, causes);
            if !names.insert(name) {
                causes.push(duplicate(format!("{path}.name"), &format!("{name:?}")));
            }
        }
        let number = int(port, "port");
        if !(1..=65535).contains(&number) {
            causes.push(invalid(
                format!("{path}.port"),
                &number.to_string(),
                PORT_RANGE_MESSAGE,
            ));
        }
        const PROTOCOLS: &[&str] = &["SCTP", "TCP", "UDP"];
        let protocol = text(port, "protocol");
        if protocol.is_empty() {
            causes.push(StatusCause::required(format!("{path}.protocol")));
        } else if !PROTOCOLS.contains(&protocol) {
            causes.push(not_supported(
                format!("{path}.protocol"),
                protocol,
                PROTOCOLS,
            ));
        }
        match port.get("targetPort") {
            Some(Value::Number(n)) => {
                let n = n.as_i64().unwrap_or(0);
                if !(1..=65535).contains(&n) {
                    causes.push(invalid(
                        format!("{path}.targetPort"),
                        &n.to_string(),
                        PORT_RANGE_MESSAGE,
                    ));
                }
            }
            Some(Value::String(s)) if !valid_port_name(s) => {
                causes.push(StatusCause::invalid(
                    format!("{path}.targetPort"),
                    s,
                    "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-), must contain at least one letter (a-z), must not contain consecutive hyphens, must be no more than 15 characters",
                ));
            }
            _ => {}
        }
        let node_port = int(port, "nodePort");
        if ty == CLUSTER_IP && node_port != 0 {
            causes.push(StatusCause::forbidden(
                format!("{path}.nodePort"),
                "may not be used when `type` is 'ClusterIP'",
            ));
        }
        if node_port != 0 && !(1..=65535).contains(&node_port) {
            causes.push(invalid(
                format!("{path}.nodePort"),
                &node_port.to_string(),
                PORT_RANGE_MESSAGE,
            ));
        }
    }
    // The same (protocol, nodePort) or (protocol, port) twice.
    let mut seen_node_ports = BTreeSet::new();
    let mut seen_ports = BTreeSet::new();
    for (i, port) in port_list.iter().enumerate() {
        let protocol = text(port, "protocol");
        let node_port = int(port, "nodePort");
        if node_port != 0 && !seen_node_ports.insert((protocol, node_port)) {
            causes.push(duplicate(
                format!("spec.ports[{i}].nodePort"),
                &node_port.to_string(),
            ));
        }
        let number = int(port, "port");
        if !seen_ports.insert((protocol, number)) {
            causes.push(duplicate(
                format!("spec.ports[{i}]"),
                &format!(
                    "core.ServicePort{{Name:\"\", Protocol:\"{protocol}\", AppProtocol:(*string)(nil), Port:{number}, TargetPort:intstr.IntOrString{{Type:0, IntVal:0, StrVal:\"\"}}, NodePort:0}}"
                ),
            ));
        }
    }

    const AFFINITIES: &[&str] = &["ClientIP", NONE];
    let affinity = text(spec, "sessionAffinity");
    if !AFFINITIES.contains(&affinity) {
        causes.push(not_supported("spec.sessionAffinity", affinity, AFFINITIES));
    }
    if affinity == "ClientIP" {
        let timeout = spec
            .get("sessionAffinityConfig")
            .and_then(|c| c.get("clientIP"))
            .and_then(|c| c.get("timeoutSeconds"))
            .and_then(Value::as_i64);
        match timeout {
            None => causes.push(StatusCause::required(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            )),
            Some(t) if t <= 0 || t > MAX_AFFINITY_SECONDS => causes.push(invalid(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                &t.to_string(),
                &format!("must be greater than 0 and less than {MAX_AFFINITY_SECONDS}"),
            )),
            Some(_) => {}
        }
    } else if affinity == NONE && !empty(spec.get("sessionAffinityConfig")) {
        causes.push(StatusCause::forbidden(
            "spec.sessionAffinityConfig",
            "must not be set when session affinity is None",
        ));
    }

    if ty == EXTERNAL_NAME {
        if !empty(spec.get("clusterIPs")) || !empty(spec.get("clusterIP")) {
            causes.push(StatusCause::forbidden(
                "spec.clusterIPs",
                "may not be set for ExternalName services",
            ));
        }
        if !empty(spec.get("ipFamilies")) {
            causes.push(StatusCause::forbidden(
                "spec.ipFamilies",
                "may not be set for ExternalName services",
            ));
        }
        if !empty(spec.get("ipFamilyPolicy")) {
            causes.push(StatusCause::forbidden(
                "spec.ipFamilyPolicy",
                "may not be set for ExternalName services",
            ));
        }
        let cname = text(spec, "externalName");
        let cname = cname.strip_suffix('.').unwrap_or(cname);
        if cname.is_empty() {
            causes.push(StatusCause::required("spec.externalName"));
        } else {
            dns1123_subdomain("spec.externalName", cname, causes);
        }
    } else {
        validate_cluster_ips(spec, causes);
    }

    validate_traffic_policies(spec, causes);
    if let Some(old) = old.and_then(|o| o.get("spec")).and_then(Value::as_object) {
        validate_update(spec, old, causes);
    }
}

/// `ValidateServiceClusterIPsRelatedFields`, and the IPv4-only cluster's limits.
fn validate_cluster_ips(spec: &Map<String, Value>, causes: &mut Vec<StatusCause>) {
    let cluster_ip = text(spec, "clusterIP");
    let ips = strings(spec, "clusterIPs");
    if !cluster_ip.is_empty() {
        if ips.is_empty() {
            causes.push(StatusCause::required("spec.clusterIPs"));
        } else if ips[0] != cluster_ip {
            causes.push(invalid(
                "spec.clusterIPs",
                &go_strings(&ips),
                "first value must match `clusterIP`",
            ));
        }
    } else if !ips.is_empty() {
        causes.push(invalid(
            "spec.clusterIPs",
            &go_strings(&ips),
            "must be empty when `clusterIP` is not specified",
        ));
    }
    const FAMILIES: &[&str] = &["IPv4", "IPv6"];
    let families = strings(spec, "ipFamilies");
    let mut seen = BTreeSet::new();
    for (i, family) in families.iter().enumerate() {
        if !FAMILIES.contains(family) {
            causes.push(not_supported(
                format!("spec.ipFamilies[{i}]"),
                family,
                FAMILIES,
            ));
        } else if *family == "IPv6" {
            causes.push(StatusCause::invalid(
                format!("spec.ipFamilies[{i}]"),
                family,
                "not configured on this cluster",
            ));
        }
        if !seen.insert(*family) {
            causes.push(duplicate(
                format!("spec.ipFamilies[{i}]"),
                &format!("{family:?}"),
            ));
        }
    }
    const POLICIES: &[&str] = &["PreferDualStack", "RequireDualStack", "SingleStack"];
    let policy = text(spec, "ipFamilyPolicy");
    if !policy.is_empty() && !POLICIES.contains(&policy) {
        causes.push(not_supported("spec.ipFamilyPolicy", policy, POLICIES));
    } else if policy == "RequireDualStack" {
        causes.push(StatusCause::invalid(
            "spec.ipFamilyPolicy",
            policy,
            "this cluster is not configured for dual-stack services",
        ));
    }
    let mut bad = false;
    for (i, ip) in ips.iter().enumerate() {
        if i == 0 && *ip == NONE {
            if ips.len() > 1 {
                bad = true;
                causes.push(invalid(
                    "spec.clusterIPs",
                    &go_strings(&ips),
                    "'None' must be the first and only value",
                ));
            }
            continue;
        }
        match ip.parse::<IpAddr>() {
            Err(_) => {
                bad = true;
                causes.push(StatusCause::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    ip,
                    "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
                ));
            }
            Ok(IpAddr::V6(_)) => {
                bad = true;
                causes.push(StatusCause::invalid(
                    format!("spec.clusterIPs[{i}]"),
                    ip,
                    "expected an IPv4 value as indicated by `ipFamilies[0]`",
                ));
            }
            Ok(IpAddr::V4(_)) => {}
        }
    }
    if !bad && ips.len() > 1 {
        causes.push(invalid(
            "spec.clusterIPs",
            &go_strings(&ips),
            "may specify no more than one IP for each IP family",
        ));
    }
}

fn validate_traffic_policies(spec: &Map<String, Value>, causes: &mut Vec<StatusCause>) {
    let external = text(spec, "externalTrafficPolicy");
    const POLICIES: &[&str] = &["Cluster", "Local"];
    if !externally_accessible(spec) {
        if !external.is_empty() {
            causes.push(StatusCause::invalid(
                "spec.externalTrafficPolicy",
                external,
                "may only be set for externally-accessible services",
            ));
        }
    } else if external.is_empty() {
        causes.push(StatusCause::required("spec.externalTrafficPolicy"));
    } else if !POLICIES.contains(&external) {
        causes.push(not_supported(
            "spec.externalTrafficPolicy",
            external,
            POLICIES,
        ));
    }
    let health_check = int(spec, "healthCheckNodePort");
    if health_check != 0 && !needs_health_check(spec) {
        causes.push(invalid(
            "spec.healthCheckNodePort",
            &health_check.to_string(),
            "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'",
        ));
    }
    let internal = text(spec, "internalTrafficPolicy");
    if internal.is_empty() {
        if matches!(text(spec, "type"), CLUSTER_IP | NODE_PORT | LOAD_BALANCER) {
            causes.push(StatusCause::required("spec.internalTrafficPolicy"));
        }
    } else if !POLICIES.contains(&internal) {
        causes.push(not_supported(
            "spec.internalTrafficPolicy",
            internal,
            POLICIES,
        ));
    }
}

/// `ValidateServiceUpdate`: a ClusterIP, once set, stays (but for a change to or from
/// ExternalName, which frees or allocates it).
fn validate_update(
    new: &Map<String, Value>,
    old: &Map<String, Value>,
    causes: &mut Vec<StatusCause>,
) {
    if text(new, "type") == EXTERNAL_NAME || text(old, "type") == EXTERNAL_NAME {
        return;
    }
    let (old_ip, new_ip) = (text(old, "clusterIP"), text(new, "clusterIP"));
    if !old_ip.is_empty() && old_ip != new_ip {
        causes.push(StatusCause::invalid(
            "spec.clusterIP",
            new_ip,
            "field is immutable",
        ));
    }
    let (old_ips, new_ips) = (strings(old, "clusterIPs"), strings(new, "clusterIPs"));
    if old_ips == [NONE] && new_ips == [NONE] {
        return;
    }
    if !old_ips.is_empty() && new_ips.first() != old_ips.first() {
        let detail = if new_ips.is_empty() {
            "primary clusterIP can not be unset"
        } else {
            "may not change once set"
        };
        causes.push(invalid("spec.clusterIPs[0]", &go_strings(&new_ips), detail));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(spec: Value) -> Object {
        let Value::Object(o) = json!({"metadata": {"name": "web"}, "spec": spec}) else {
            unreachable!()
        };
        o
    }

    fn messages(o: &Object, old: Option<&Object>) -> Vec<String> {
        let mut causes = Vec::new();
        validate(o, old, &mut causes);
        causes
            .into_iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect()
    }

    #[test]
    fn defaults_are_what_kubernetes_stores() {
        let mut o = obj(json!({"type": "NodePort", "sessionAffinity": "ClientIP",
            "ports": [{"port": 80}]}));
        default(&mut o, None);
        assert_eq!(
            o["spec"],
            json!({"type": "NodePort", "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 10800}},
                "ports": [{"port": 80, "protocol": "TCP", "targetPort": 80}],
                "externalTrafficPolicy": "Cluster", "internalTrafficPolicy": "Cluster",
                "ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv4"]})
        );
        let mut o = obj(json!({"type": "ExternalName", "externalName": "example.com"}));
        default(&mut o, None);
        assert_eq!(
            o["spec"],
            json!({"type": "ExternalName", "externalName": "example.com",
                "sessionAffinity": "None"})
        );
        assert!(messages(&o, None).is_empty(), "{:?}", messages(&o, None));
    }

    #[test]
    fn validation_names_fields_as_kubernetes() {
        let mut o = obj(json!({"ports": [{"port": 80}, {"port": 0, "name": "b",
            "protocol": "FOO"}], "sessionAffinity": "Sticky"}));
        default(&mut o, None);
        let m = messages(&o, None);
        for expected in [
            "spec.ports[0].name: Required value",
            "spec.ports[1].port: Invalid value: 0: must be between 1 and 65535, inclusive",
            "spec.ports[1].protocol: Unsupported value: \"FOO\": supported values: \"SCTP\", \"TCP\", \"UDP\"",
            "spec.sessionAffinity: Unsupported value: \"Sticky\": supported values: \"ClientIP\", \"None\"",
        ] {
            assert!(m.iter().any(|x| x == expected), "{expected} not in {m:?}");
        }
        let mut o = obj(json!({"ports": [{"port": 80, "nodePort": 30080}]}));
        default(&mut o, None);
        assert_eq!(
            messages(&o, None),
            ["spec.ports[0].nodePort: Forbidden: may not be used when `type` is 'ClusterIP'"]
        );
    }

    #[test]
    fn an_update_keeps_allocations_and_a_type_change_drops_them() {
        let mut old = obj(
            json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": 30080}],
            "clusterIP": "10.43.1.5"}),
        );
        default(&mut old, None);
        // An apply of the original manifest keeps what was allocated.
        let mut same = obj(json!({"type": "NodePort", "ports": [{"port": 80}]}));
        default(&mut same, Some(&old));
        assert_eq!(same["spec"]["clusterIPs"], json!(["10.43.1.5"]));
        assert_eq!(same["spec"]["ports"][0]["nodePort"], json!(30080));
        // NodePort to ClusterIP: the node port goes; to ExternalName: the ClusterIP too.
        let mut to_cluster_ip = old.clone();
        to_cluster_ip["spec"]["type"] = json!("ClusterIP");
        default(&mut to_cluster_ip, Some(&old));
        assert!(to_cluster_ip["spec"]["ports"][0].get("nodePort").is_none());
        assert!(to_cluster_ip["spec"].get("externalTrafficPolicy").is_none());
        assert!(messages(&to_cluster_ip, Some(&old)).is_empty());
        let mut to_external = old.clone();
        to_external["spec"]["type"] = json!("ExternalName");
        to_external["spec"]["externalName"] = json!("example.com");
        default(&mut to_external, Some(&old));
        assert!(to_external["spec"].get("clusterIP").is_none());
        assert!(messages(&to_external, Some(&old)).is_empty());
        // The ClusterIP itself may not change.
        let mut moved = old.clone();
        moved["spec"]["clusterIP"] = json!("10.43.1.6");
        default(&mut moved, Some(&old));
        let m = messages(&moved, Some(&old));
        assert!(
            m.contains(&"spec.clusterIPs[0]: Invalid value: []string{\"10.43.1.6\"}: may not change once set".to_owned()),
            "{m:?}"
        );
    }
}
