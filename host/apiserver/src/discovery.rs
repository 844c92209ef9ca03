//! Discovery, generated from the registry: `/api`, `/apis`, each group-version's
//! `APIResourceList`, and `/version`. Aggregated discovery is not served: clients that
//! ask for it get the legacy documents, which kubectl accepts as a fallback.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use trellis_api::registry::ResourceInfo;

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

pub fn group_list(state: &AppState) -> Value {
    let groups: Vec<Value> = groups(&state.resources())
        .iter()
        .map(|(g, v)| group_json(g, v))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

pub fn group(state: &AppState, name: &str) -> Option<Value> {
    let (g, versions) = groups(&state.resources())
        .into_iter()
        .find(|(g, _)| g == name)?;
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
            let (kind, verbs): (String, Vec<&str>) = match sub.name() {
                "status" => (r.kind.clone(), vec!["get", "patch", "update"]),
                "scale" => ("Scale".into(), vec!["get", "patch", "update"]),
                "binding" => ("Binding".into(), vec!["create"]),
                "token" => ("TokenRequest".into(), vec!["create"]),
                _ => (r.kind.clone(), vec!["get"]),
            };
            let name = format!("{}/{}", r.plural, sub.name());
            let mut entry = json!({"name": name, "singularName": "", "namespaced": r.namespaced, "kind": kind, "verbs": verbs});
            if sub.name() == "scale" {
                entry["group"] = "autoscaling".into();
                entry["version"] = "v1".into();
            }
            if sub.name() == "token" {
                entry["group"] = "authentication.k8s.io".into();
                entry["version"] = "v1".into();
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
