//! Builds the built-in controllers (`plugins/controllers/*`) for wasm32-wasip2 and
//! puts them in OUT_DIR, where `bundled.rs` includes them in the binary.
//!
//! They are built by a nested cargo in the plugins' own workspace and target
//! directory, which `plugins/build.sh` shares: whichever runs second finds them
//! built. `TRELLIS_BUNDLED_PLUGINS=DIR` takes `DIR/NAME.wasm` instead (a machine with
//! no wasm target, or components built elsewhere).

use std::path::{Path, PathBuf};
use std::process::Command;

const CONTROLLERS: [&str; 8] = [
    "endpoints",
    "namespace",
    "node-lifecycle",
    "replicaset",
    "deployment",
    "garbage-collector",
    "serviceaccount",
    "root-ca-cert-publisher",
];
const TARGET: &str = "wasm32-wasip2";

fn main() -> Result<(), String> {
    let var = |name: &str| std::env::var(name).map_err(|e| format!("{name}: {e}"));
    let manifest_dir = PathBuf::from(var("CARGO_MANIFEST_DIR")?);
    let repo = manifest_dir.join("../..");
    let plugins = repo.join("plugins");
    let out = PathBuf::from(var("OUT_DIR")?);
    println!("cargo:rerun-if-env-changed=TRELLIS_BUNDLED_PLUGINS");
    for input in [
        "plugins/controllers",
        "plugins/sdk",
        "host/quantity",
        "plugins/Cargo.toml",
        "plugins/Cargo.lock",
        "wit",
    ] {
        println!("cargo:rerun-if-changed={}", repo.join(input).display());
    }

    let built = match std::env::var_os("TRELLIS_BUNDLED_PLUGINS") {
        Some(dir) => PathBuf::from(dir),
        None => build(&plugins)?,
    };
    for name in CONTROLLERS {
        // Cargo names a library's output after the crate, `-` as `_`.
        let from = built.join(format!("{}.wasm", name.replace('-', "_")));
        let to = out.join(format!("{name}.wasm"));
        std::fs::copy(&from, &to)
            .map_err(|e| format!("copy {} to {}: {e}", from.display(), to.display()))?;
    }
    Ok(())
}

/// Builds the controllers; the directory their components are in.
fn build(plugins: &Path) -> Result<PathBuf, String> {
    install_target()?;
    let target_dir = plugins.join("target");
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo
        .args([
            "build",
            "--quiet",
            "--release",
            "--target",
            TARGET,
            "--manifest-path",
        ])
        .arg(plugins.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target_dir);
    for name in CONTROLLERS {
        cargo.args(["-p", name]);
    }
    // What the outer build set for itself (its flags, clippy's wrapper, its
    // profile's settings) is not for the components.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET",
        "CARGO_PROFILE_RELEASE_DEBUG",
        "CARGO_INCREMENTAL",
    ] {
        cargo.env_remove(var);
    }
    let status = cargo
        .status()
        .map_err(|e| format!("run cargo to build the built-in controllers: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building the built-in controllers (plugins/controllers) for {TARGET} failed: {status}"
        ));
    }
    Ok(target_dir.join(TARGET).join("release"))
}

/// Adds the wasm target through rustup when it is missing, as `plugins/build.sh` does.
fn install_target() -> Result<(), String> {
    let Ok(listed) = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
    else {
        // No rustup: the toolchain must have the target already.
        return Ok(());
    };
    if String::from_utf8_lossy(&listed.stdout)
        .lines()
        .any(|l| l.trim() == TARGET)
    {
        return Ok(());
    }
    let status = Command::new("rustup")
        .args(["target", "add", TARGET])
        .status()
        .map_err(|e| format!("rustup target add {TARGET}: {e}"))?;
    if !status.success() {
        return Err(format!("rustup target add {TARGET} failed: {status}"));
    }
    Ok(())
}
