//! Builds components of the plugins workspace (`plugins/`) for wasm32-wasip2 and
//! copies them into a build script's OUT_DIR, for crates that include them in the
//! binary (the built-in controllers, the scheduler's default plugins).
//!
//! They are built by a nested cargo in the plugins' own workspace and target
//! directory, which `plugins/build.sh` shares: whichever runs second finds them
//! built. `TRELLIS_BUNDLED_PLUGINS=DIR` takes `DIR/NAME.wasm` instead (a machine with
//! no wasm target, or components built elsewhere).

use std::path::{Path, PathBuf};
use std::process::Command;

const TARGET: &str = "wasm32-wasip2";

/// From a build script: builds the packages `names` of the plugins workspace (or
/// takes them from `TRELLIS_BUNDLED_PLUGINS`) and copies each to `OUT_DIR/NAME.wasm`.
/// `inputs` (paths from the repository's root) are what the build reruns on.
pub fn bundle(names: &[&str], inputs: &[&str]) -> Result<(), String> {
    let var = |name: &str| std::env::var(name).map_err(|e| format!("{name}: {e}"));
    let manifest_dir = PathBuf::from(var("CARGO_MANIFEST_DIR")?);
    let repo = manifest_dir.join("../..");
    let plugins = repo.join("plugins");
    let out = PathBuf::from(var("OUT_DIR")?);
    println!("cargo:rerun-if-env-changed=TRELLIS_BUNDLED_PLUGINS");
    for input in [
        "plugins/sdk",
        "plugins/Cargo.toml",
        "plugins/Cargo.lock",
        "host/quantity",
        "host/quota",
        "wit",
    ]
    .iter()
    .chain(inputs)
    {
        println!("cargo:rerun-if-changed={}", repo.join(input).display());
    }
    let built = match std::env::var_os("TRELLIS_BUNDLED_PLUGINS") {
        Some(dir) => PathBuf::from(dir),
        None => build(&plugins, names)?,
    };
    for name in names {
        // Cargo names a library's output after the crate, `-` as `_`.
        let from = built.join(format!("{}.wasm", name.replace('-', "_")));
        let to = out.join(format!("{name}.wasm"));
        std::fs::copy(&from, &to)
            .map_err(|e| format!("copy {} to {}: {e}", from.display(), to.display()))?;
    }
    Ok(())
}

/// Builds the packages; the directory their components are in.
fn build(plugins: &Path, names: &[&str]) -> Result<PathBuf, String> {
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
    for name in names {
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
        .map_err(|e| format!("run cargo to build the bundled plugins: {e}"))?;
    if !status.success() {
        return Err(format!(
            "building the bundled plugins {names:?} (plugins/) for {TARGET} failed: {status}"
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
