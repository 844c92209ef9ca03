//! Builds the default scheduler plugins (`plugins/scheduler/default-plugins`), and
//! the empty component the benchmark measures the boundary with
//! (`plugins/fixtures/scheduler-empty`), for the binary to include (see
//! `trellis-bundle-build`).

fn main() {
    if let Err(e) = trellis_bundle_build::bundle(
        &["default-plugins", "scheduler-empty"],
        &["plugins/scheduler", "plugins/fixtures/scheduler-empty"],
    ) {
        println!("cargo:warning={e}");
        std::process::exit(1);
    }
}
