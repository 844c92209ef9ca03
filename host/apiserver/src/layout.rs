//! The crate's modules depend on each other one way: a module never reaches, through
//! the `crate::` and `super::` paths of its code (tests aside), a module that reaches
//! it back. Cycles hide which stage of the request chain owns what.

#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of `src`, by path (`registry::create`; `""` for the crate root), with
/// its source up to its tests.
fn modules() -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut BTreeMap<String, String>, root: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out, root);
            } else if path.extension().is_some_and(|e| e == "rs") {
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
                let name = if name == "lib" { String::new() } else { name };
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
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    walk(&root, &mut out, &root);
    out
}

/// The modules `code` (of module `this`) names: the longest known prefix of each
/// `crate::a::b::…` path, and the sibling or parent each `super::x` names.
fn references(this: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let ident = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|p| {
                p.chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|p| !p.is_empty())
            .collect()
    };
    let parent = this.rsplit_once("::").map_or("", |(p, _)| p);
    let mut out = BTreeSet::new();
    for (marker, base) in [("crate::", ""), ("super::", parent)] {
        for (at, _) in code.match_indices(marker) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let parts = ident(&code[at + marker.len()..]);
            let found = (0..=parts.len()).rev().find_map(|n| {
                let mut path: Vec<&str> = Vec::new();
                if !base.is_empty() {
                    path.push(base);
                }
                path.extend(parts[..n].iter().map(String::as_str));
                let candidate = path.join("::");
                known.contains(&candidate).then_some(candidate)
            });
            if let Some(module) = found.filter(|m| m != this && !m.is_empty()) {
                out.insert(module);
            }
        }
    }
    out
}

#[test]
fn modules_depend_on_each_other_one_way() {
    let modules = modules();
    assert!(modules.len() > 40, "found only {} modules", modules.len());
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    let edges: BTreeMap<&str, BTreeSet<String>> = modules
        .iter()
        .map(|(m, code)| (m.as_str(), references(m, code, &known)))
        .collect();
    // A cycle is a module that reaches itself.
    let mut cycles = Vec::new();
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<&str> = edges[start].iter().map(String::as_str).collect();
        while let Some(next) = stack.pop() {
            if next == *start {
                cycles.push(start.to_string());
                break;
            }
            if seen.insert(next) {
                stack.extend(edges.get(next).into_iter().flatten().map(String::as_str));
            }
        }
    }
    assert!(cycles.is_empty(), "modules in an import cycle: {cycles:?}");
}
