//! Discovery, generated from the registry: `/api`, `/apis`, each group-version's
//! `APIResourceList`, and `/version`.
//!
//! `/api` and `/apis` also come aggregated (`apidiscovery.k8s.io` v2 and v2beta1
//! `APIGroupDiscoveryList`, every group-version's resources in one document) when the
//! client's Accept header asks for it before plain JSON, as kubectl 1.30 and later do;
//! the response's Content-Type names the form, which is how the client tells them apart.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use trellis_api::registry::{ResourceInfo, Subresource};

use crate::endpoints::response::json_response;
use crate::state::AppState;

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": format!("v1.33.0-trellis.{}", env!("CARGO_PKG_VERSION")),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "",
        "goVersion": "",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, std::env::consts::ARCH),
    })
}

pub fn core_versions(state: &AppState) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": state.server_address}],
    })
}

/// Groups in the order they were registered, each with its versions.
fn groups(resources: &[ResourceInfo]) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for r in resources.iter().filter(|r| !r.group.is_empty()) {
        match out.iter_mut().find(|(g, _)| *g == r.group) {
            Some((_, versions)) if !versions.contains(&r.version) => {
                versions.push(r.version.clone())
            }
            Some(_) => {}
            None => out.push((r.group.clone(), vec![r.version.clone()])),
        }
    }
    out
}

fn group_json(name: &str, versions: &[String]) -> Value {
    let versions: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    json!({"name": name, "versions": versions.clone(), "preferredVersion": versions[0]})
}

/// The groups this server serves, then those only APIServices of the aggregation
/// layer bring (and their versions this server does not serve).
fn all_groups(state: &AppState) -> Vec<(String, Vec<String>)> {
    let mut all = groups(&state.resources());
    if let Some(aggregator) = crate::aggregator::of(state) {
        for (group, versions) in aggregator.groups() {
            match all.iter_mut().find(|(g, _)| *g == group) {
                Some((_, known)) => {
                    for v in versions {
                        if !known.contains(&v) {
                            known.push(v);
                        }
                    }
                }
                None => all.push((group, versions)),
            }
        }
    }
    all
}

pub fn group_list(state: &AppState) -> Value {
    let groups: Vec<Value> = all_groups(state)
        .iter()
        .map(|(g, v)| group_json(g, v))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

pub fn group(state: &AppState, name: &str) -> Option<Value> {
    let (g, versions) = all_groups(state).into_iter().find(|(g, _)| g == name)?;
    let mut doc = group_json(&g, &versions);
    doc["kind"] = "APIGroup".into();
    doc["apiVersion"] = "v1".into();
    Some(doc)
}

pub fn resource_list(state: &AppState, group: &str, version: &str) -> Value {
    let mut resources: BTreeMap<String, Value> = BTreeMap::new();
    for r in state
        .resources()
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        let mut entry = json!({
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": r.verbs,
        });
        if !r.short_names.is_empty() {
            entry["shortNames"] = json!(r.short_names);
        }
        if !r.categories.is_empty() {
            entry["categories"] = json!(r.categories);
        }
        resources.insert(r.plural.clone(), entry);
        for sub in &r.subresources {
            let (group, version, kind, verbs) = subresource_kind(r, *sub);
            let name = format!("{}/{}", r.plural, sub.name());
            let mut entry = json!({"name": name, "singularName": "", "namespaced": r.namespaced, "kind": kind, "verbs": verbs});
            if !group.is_empty() {
                entry["group"] = group.into();
                entry["version"] = version.into();
            }
            resources.insert(name, entry);
        }
    }
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources.into_values().collect::<Vec<_>>(),
    })
}

/// The aggregated discovery version (`v2` or `v2beta1`) the Accept header asks for
/// before plain JSON, if any.
pub fn aggregated_version(accept: &str) -> Option<&'static str> {
    for entry in accept.split(',') {
        let mut parts = entry.split(';').map(str::trim);
        let media = parts.next().unwrap_or("");
        let (mut g, mut v, mut as_) = ("", "", "");
        for p in parts {
            match p.split_once('=') {
                Some(("g", x)) => g = x,
                Some(("v", x)) => v = x,
                Some(("as", x)) => as_ = x,
                _ => {}
            }
        }
        if media == "application/json" && g.is_empty() && as_.is_empty() {
            return None;
        }
        if matches!(media, "application/json" | "*/*")
            && g == "apidiscovery.k8s.io"
            && as_ == "APIGroupDiscoveryList"
        {
            match v {
                "v2" => return Some("v2"),
                "v2beta1" => return Some("v2beta1"),
                _ => {}
            }
        }
    }
    None
}

/// `/api` (`core`) or `/apis` aggregated, if the request's Accept header asks for it.
pub fn aggregated_response(state: &AppState, core: bool, headers: &HeaderMap) -> Option<Response> {
    let accept = headers.get(header::ACCEPT)?.to_str().ok()?;
    let version = aggregated_version(accept)?;
    let mut r = json_response(StatusCode::OK, &aggregated(state, core, version));
    let content_type =
        format!("application/json;g=apidiscovery.k8s.io;v={version};as=APIGroupDiscoveryList");
    if let Ok(ct) = header::HeaderValue::from_str(&content_type) {
        r.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    r.headers_mut()
        .insert(header::VARY, header::HeaderValue::from_static("Accept"));
    Some(r)
}

/// The aggregated discovery document of the core group (`/api`, `core`) or of every
/// other group (`/apis`).
pub fn aggregated(state: &AppState, core: bool, version: &str) -> Value {
    let resources = state.resources();
    let group_names: Vec<(String, Vec<String>)> = if core {
        vec![(String::new(), vec!["v1".to_owned()])]
    } else {
        all_groups(state)
    };
    let items: Vec<Value> = group_names
        .iter()
        .filter_map(|(group, versions)| {
            let versions: Vec<Value> = versions
                .iter()
                .filter_map(|v| {
                    if let Some(aggregator) = crate::aggregator::of(state)
                        && aggregator.route(group, v).is_some()
                    {
                        let (list, current) = aggregator.discovered(group, v)?;
                        return Some(crate::aggregator::discovery::version_discovery(
                            v, &list, current,
                        ));
                    }
                    let entries: Vec<Value> = resources
                        .iter()
                        .filter(|r| &r.group == group && &r.version == v)
                        .map(aggregated_resource)
                        .collect();
                    Some(json!({"version": v, "resources": entries, "freshness": "Current"}))
                })
                .collect();
            // A remote group none of whose backends has answered yet.
            if versions.is_empty() {
                return None;
            }
            let mut metadata = json!({"creationTimestamp": null});
            if !group.is_empty() {
                metadata["name"] = group.clone().into();
            }
            Some(json!({"metadata": metadata, "versions": versions}))
        })
        .collect();
    json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": format!("apidiscovery.k8s.io/{version}"),
        "metadata": {},
        "items": items,
    })
}

/// A subresource's kind (group and version empty for the resource's own) and verbs.
fn subresource_kind(
    r: &ResourceInfo,
    sub: Subresource,
) -> (&'static str, &'static str, &str, &'static [&'static str]) {
    const READ_WRITE: &[&str] = &["get", "patch", "update"];
    match sub {
        Subresource::Status => ("", "", &r.kind, READ_WRITE),
        Subresource::Scale => ("autoscaling", "v1", "Scale", READ_WRITE),
        Subresource::Binding => ("", "", "Binding", &["create"]),
        Subresource::Token => ("authentication.k8s.io", "v1", "TokenRequest", &["create"]),
        Subresource::Log => ("", "", &r.kind, &["get"]),
        // As Kubernetes lists it: POST (create) and the WebSocket's GET.
        Subresource::Exec => ("", "", "PodExecOptions", &["create", "get"]),
        Subresource::PortForward => ("", "", "PodPortForwardOptions", &["create", "get"]),
        Subresource::Finalize => ("", "", &r.kind, &["update"]),
        Subresource::Eviction => ("policy", "v1", "Eviction", &["create"]),
        Subresource::Approval => ("", "", &r.kind, READ_WRITE),
        // As Kubernetes lists it; only GET is passed on.
        Subresource::Proxy => (
            "",
            "",
            "NodeProxyOptions",
            &["create", "delete", "get", "patch", "update"],
        ),
    }
}

fn aggregated_resource(r: &ResourceInfo) -> Value {
    let subresources: Vec<Value> = r
        .subresources
        .iter()
        .map(|sub| {
            let (group, version, kind, verbs) = subresource_kind(r, *sub);
            json!({
                "subresource": sub.name(),
                "responseKind": {"group": group, "version": version, "kind": kind},
                "verbs": verbs,
            })
        })
        .collect();
    let mut entry = json!({
        "resource": r.plural,
        "responseKind": {"group": "", "version": "", "kind": r.kind},
        "scope": if r.namespaced { "Namespaced" } else { "Cluster" },
        "singularResource": r.singular,
        "verbs": r.verbs,
    });
    if !r.short_names.is_empty() {
        entry["shortNames"] = json!(r.short_names);
    }
    if !r.categories.is_empty() {
        entry["categories"] = json!(r.categories);
    }
    if !subresources.is_empty() {
        entry["subresources"] = Value::Array(subresources);
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregated_discovery_is_chosen_only_when_asked_first() {
        let kubectl = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json";
        assert_eq!(aggregated_version(kubectl), Some("v2"));
        assert_eq!(
            aggregated_version(
                "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"
            ),
            Some("v2beta1")
        );
        assert_eq!(
            aggregated_version(
                "application/json, application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
            ),
            None
        );
        assert_eq!(
            aggregated_version(
                "application/json;g=apidiscovery.k8s.io;v=v3;as=APIGroupDiscoveryList"
            ),
            None
        );
        assert_eq!(aggregated_version(""), None);
    }

    #[test]
    fn aggregated_resources_name_scope_kinds_and_subresources() {
        let all = trellis_api::registry::builtins();
        let deploy = all.iter().find(|r| r.kind == "Deployment").unwrap();
        let entry = aggregated_resource(deploy);
        assert_eq!(entry["resource"], "deployments");
        assert_eq!(entry["scope"], "Namespaced");
        assert_eq!(entry["shortNames"], json!(["deploy"]));
        let scale = entry["subresources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["subresource"] == "scale")
            .unwrap();
        assert_eq!(scale["responseKind"]["kind"], "Scale");
        let ns = all.iter().find(|r| r.plural == "namespaces").unwrap();
        let entry = aggregated_resource(ns);
        assert_eq!(entry["scope"], "Cluster");
        let finalize = entry["subresources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["subresource"] == "finalize")
            .unwrap();
        assert_eq!(finalize["responseKind"]["kind"], "Namespace");
        assert_eq!(finalize["verbs"], json!(["update"]));
    }
}
