//! Turns the WIT contract into one macro, `__bindings!(WORLD)`, that runs
//! `wit_bindgen::generate!` for that world in the plugin's own crate with the WIT
//! inlined, and names what the export glue uses with the same names whatever the
//! contract's version: `handler` (the world's export), `wit` (the shared types),
//! `wit_log` and `wit_cluster` (the shared imports).
//!
//! The bindings must be generated in the plugin's crate, not here: a component-type
//! section for every world in this crate would end up in every plugin, and a plugin
//! exports only one world. Inlining the text keeps plugins independent of where the
//! WIT files sit.
//!
//! With the feature `wit-plugin-0-1` the bindings are those of the frozen
//! `trellis:plugin@0.1.0` instead: its records have the same shapes, so the glue is
//! the same.

use std::{env, fs, path::Path, path::PathBuf};

/// A world the SDK exports: its name, its package's folder under `wit/`, and the
/// names its glue uses beyond the shared ones.
const WORLDS: [(&str, &str, &str); 4] = [
    ("admission", "admission/0.1.0", ""),
    ("initializer", "initializer/0.1.0", ""),
    (
        "controller",
        "controller/0.1.0",
        "use trellis::controller::{cache as wit_cache, client as wit_client, \
         events as wit_events, types as wit_controller};",
    ),
    (
        "scheduler",
        "scheduler/0.1.0",
        "use trellis::scheduler::types as wit_scheduler;",
    ),
];

/// The shared package, nested into each world's text.
const CORE: &str = "core/0.1.0/core.wit";

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let wit = manifest.join("../../wit");
    let frozen = env::var_os("CARGO_FEATURE_WIT_PLUGIN_0_1").is_some();

    let mut arms = String::new();
    for (world, folder, own_names) in WORLDS {
        // The frozen contract has only the first two worlds.
        if frozen && !own_names.is_empty() {
            continue;
        }
        let (text, names) = if frozen {
            let text = read(&wit.join("plugin/0.1.0/plugin.wit"));
            let names = format!(
                "use exports::trellis::plugin::{world}_handler as handler;\n\
                 use trellis::plugin::{{cluster as wit_cluster, log as wit_log, types as wit}};"
            );
            (text, names)
        } else {
            let main = read(&wit.join(folder).join(format!("{world}.wit")));
            let text = format!("{main}\n{}", nested(&read(&wit.join(CORE))));
            let names = format!(
                "use exports::trellis::{world}::handler;\n\
                 use trellis::core::{{cluster as wit_cluster, log as wit_log, types as wit}};\n\
                 {own_names}"
            );
            (text, names)
        };
        assert!(
            !text.contains("\"###"),
            "the WIT text must fit in a r###\"...\"### literal"
        );
        arms.push_str(&format!(
            "    ({world}) => {{\n        \
             ::trellis_plugin::__private::wit_bindgen::generate!({{\n            \
             inline: r###\"{text}\"###,\n            world: \"{world}\",\n            \
             runtime_path: \"::trellis_plugin::__private::wit_bindgen::rt\",\n            \
             generate_all,\n        }});\n        {names}\n    }};\n"
        ));
    }
    let out = format!("#[doc(hidden)]\n#[macro_export]\nmacro_rules! __bindings {{\n{arms}}}\n");
    let dest = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo")).join("bindings.rs");
    fs::write(&dest, out).unwrap_or_else(|e| panic!("write {}: {e}", dest.display()));
}

fn read(path: &Path) -> String {
    println!("cargo:rerun-if-changed={}", path.display());
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// A package file (`package a:b@v;` then its items) as a nested package
/// (`package a:b@v { ... }`), so that one inline text carries a world and the
/// package it depends on.
fn nested(file: &str) -> String {
    let mut out = String::new();
    let mut opened = false;
    for line in file.lines() {
        match line
            .strip_prefix("package ")
            .and_then(|l| l.strip_suffix(';'))
        {
            Some(name) if !opened => {
                out.push_str(&format!("package {name} {{\n"));
                opened = true;
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    assert!(opened, "a WIT package file starts with `package NAME;`");
    out.push_str("}\n");
    out
}
