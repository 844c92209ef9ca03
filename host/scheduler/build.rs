//! Builds the default scheduler plugins (`plugins/scheduler/default-plugins`) for
//! the binary to include (see `trellis-bundle-build`).

fn main() {
    if let Err(e) = trellis_bundle_build::bundle(&["default-plugins"], &["plugins/scheduler"]) {
        println!("cargo:warning={e}");
        std::process::exit(1);
    }
}
