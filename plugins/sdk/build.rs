//! Turns the WIT contract into one macro per world (`__admission_bindings!`,
//! `__initializer_bindings!`) that runs `wit_bindgen::generate!` in the plugin's own
//! crate with the WIT inlined.
//!
//! The bindings must be generated in the plugin's crate, not here: a component-type
//! section for both worlds in this crate would end up in every plugin, and a plugin
//! exports only one world. Inlining the text keeps plugins independent of where the
//! WIT file sits.

use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let wit_path = manifest.join("../../wit/plugin.wit");
    println!("cargo:rerun-if-changed={}", wit_path.display());
    let wit = fs::read_to_string(&wit_path)
        .unwrap_or_else(|e| panic!("read {}: {e}", wit_path.display()));
    assert!(
        !wit.contains("\"###"),
        "the WIT text must fit in a r###\"...\"### literal"
    );

    let mut out = String::new();
    for world in ["admission", "initializer"] {
        out.push_str(&format!(
            "#[doc(hidden)]\n#[macro_export]\nmacro_rules! __{world}_bindings {{\n    () => {{\n        \
             ::trellis_plugin::__private::wit_bindgen::generate!({{\n            \
             inline: r###\"{wit}\"###,\n            world: \"{world}\",\n            \
             runtime_path: \"::trellis_plugin::__private::wit_bindgen::rt\",\n            \
             generate_all,\n        }});\n    }};\n}}\n"
        ));
    }
    let dest = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo")).join("bindings.rs");
    fs::write(&dest, out).unwrap_or_else(|e| panic!("write {}: {e}", dest.display()));
}
