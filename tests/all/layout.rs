//! Every crate's modules depend on each other one way: a module never reaches,
//! through the `crate::` and `super::` paths of its code (tests aside), a module that
//! reaches it back. A circle hides which module owns what, and makes each of its
//! modules a change to all the others.
//!
//! The check reads the source as text, for every crate of both workspaces and of the
//! examples (`host/*`, `plugins/**`, `examples/**`), so it needs no build of a plugin.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The folders of the crates checked: each holding a `Cargo.toml` with a `[package]`
/// and a `src/`.
fn crates() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let name = entry.file_name();
            if !path.is_dir() || name == "target" || name.to_string_lossy().starts_with('.') {
                continue;
            }
            let manifest = std::fs::read_to_string(path.join("Cargo.toml")).unwrap_or_default();
            if manifest.contains("[package]") && path.join("src").is_dir() {
                out.push(path.clone());
            }
            walk(&path, out);
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for top in ["host", "plugins", "examples"] {
        walk(&root.join(top), &mut out);
    }
    out.sort();
    out
}

/// Every module of a crate's `src` (binaries under `src/bin` are crates of their
/// own, left out), by path (`registry::create`; `""` for the crate root), with its
/// source up to its tests and without comments.
fn modules(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                if path != root.join("bin") {
                    walk(&path, root, out);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let Ok(relative) = path.strip_prefix(root) else {
                continue;
            };
            let name = relative
                .with_extension("")
                .to_string_lossy()
                .replace('/', "::");
            let name = name
                .strip_suffix("::mod")
                .map(str::to_owned)
                .unwrap_or(name);
            let name = if name == "lib" || name == "main" {
                String::new()
            } else {
                name
            };
            let source = std::fs::read_to_string(&path).unwrap_or_default();
            let code = source
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(name, code);
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

/// The module paths a path names from where it starts (just after `crate::` or
/// `super::`): `a::b::Thing` names `a::b::Thing` (its known prefix is found later),
/// and a group `a::{b::X, c}` names `a::b::X` and `a::c`.
fn paths(s: &str) -> Vec<Vec<String>> {
    let mut parts = Vec::new();
    let mut rest = s.trim_start();
    loop {
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        rest = &rest[ident.len()..];
        parts.push(ident);
        match rest.strip_prefix("::") {
            Some(after) => rest = after.trim_start(),
            None => return vec![parts],
        }
    }
    let Some(group) = rest.strip_prefix('{') else {
        return vec![parts];
    };
    // The group's items, split at the commas outside nested groups.
    let mut items = Vec::new();
    let (mut depth, mut from) = (0, 0);
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[from..at]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[from..at]);
                from = at + 1;
            }
            _ => {}
        }
    }
    items
        .into_iter()
        .flat_map(paths)
        .map(|tail| parts.iter().cloned().chain(tail).collect())
        .collect()
}

/// The modules `code` (of module `this`) names: the longest known prefix of each
/// `crate::…` path, and of each `super::…` path from this module's parent.
fn references(this: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent = this.rsplit_once("::").map_or("", |(p, _)| p);
    let mut out = BTreeSet::new();
    for (marker, base) in [("crate::", ""), ("super::", parent)] {
        for (at, _) in code.match_indices(marker) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            for mut parts in paths(&code[at + marker.len()..]) {
                let mut base: Vec<&str> = base.split("::").filter(|p| !p.is_empty()).collect();
                // `super::super::x` climbs one more level for each `super`.
                while parts.first().is_some_and(|p| p == "super") {
                    parts.remove(0);
                    base.pop();
                }
                let found = (0..=parts.len()).rev().find_map(|n| {
                    let path: Vec<&str> = base
                        .iter()
                        .copied()
                        .chain(parts[..n].iter().map(String::as_str))
                        .collect();
                    let candidate = path.join("::");
                    known.contains(&candidate).then_some(candidate)
                });
                if let Some(module) = found.filter(|m| m != this && !m.is_empty()) {
                    out.insert(module);
                }
            }
        }
    }
    out
}

/// The modules of `edges` that reach themselves, each with one way round.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found: Vec<Vec<String>> = Vec::new();
    for start in edges.keys() {
        if found.iter().any(|c| c.contains(start)) {
            continue;
        }
        // Breadth first, so the way round reported is a shortest one.
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue: std::collections::VecDeque<&str> = [start.as_str()].into();
        let mut closed = None;
        while let Some(at) = queue.pop_front() {
            for next in edges.get(at).into_iter().flatten() {
                if next == start {
                    closed = Some(at);
                    break;
                }
                if !came_from.contains_key(next.as_str()) {
                    came_from.insert(next, at);
                    queue.push_back(next);
                }
            }
            if closed.is_some() {
                break;
            }
        }
        if let Some(mut at) = closed {
            let mut way = vec![at.to_owned()];
            while at != start {
                at = came_from[at];
                way.push(at.to_owned());
            }
            way.reverse();
            found.push(way);
        }
    }
    found
}

#[test]
fn every_crate_s_modules_depend_on_each_other_one_way() {
    let crates = crates();
    assert!(crates.len() >= 30, "found only {} crates", crates.len());
    let mut total = 0;
    let mut report = Vec::new();
    for dir in &crates {
        let modules = modules(&dir.join("src"));
        total += modules.len();
        let known: BTreeSet<String> = modules.keys().cloned().collect();
        let edges: BTreeMap<String, BTreeSet<String>> = modules
            .iter()
            .map(|(m, code)| (m.clone(), references(m, code, &known)))
            .collect();
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        for way in circles(&edges) {
            report.push(format!("{name}: {} -> {}", way.join(" -> "), way[0]));
        }
    }
    assert!(total > 200, "found only {total} modules");
    assert!(
        report.is_empty(),
        "modules in an import circle:\n{}",
        report.join("\n")
    );
}

#[test]
fn a_circle_is_found_and_named() {
    let known: BTreeSet<String> = ["a", "b", "c", "c::d"].map(String::from).into();
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a", references("a", "use crate::b::Thing;", &known)),
        ("b", references("b", "use crate::c::d::Other;", &known)),
        ("c", BTreeSet::new()),
        (
            "c::d",
            references("c::d", "// crate::b\nuse crate::a::x;", &known),
        ),
    ]
    .into_iter()
    .map(|(m, e)| (m.to_owned(), e))
    .collect();
    assert_eq!(edges["b"], BTreeSet::from(["c::d".to_owned()]));
    // Groups, nested groups and `super::super` are read too.
    let grouped = references("c::d", "use crate::{a, c::{d::X, e}};", &known);
    assert_eq!(grouped, BTreeSet::from(["a".to_owned(), "c".to_owned()]));
    let up = references("c::d", "use super::super::b::Y;", &known);
    assert_eq!(up, BTreeSet::from(["b".to_owned()]));
    assert_eq!(circles(&edges), vec![vec!["a", "b", "c::d"]]);
}
