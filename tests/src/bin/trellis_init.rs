//! The init of sandboxed `process` containers, for the runtimes the tests start in
//! their own process (the `trellis` binary is its own init: `trellis __init …`).

fn main() {
    match trellis_runtime::sandbox::dispatch() {
        Some(code) => std::process::exit(code),
        None => {
            eprintln!(
                "usage: trellis_init {} …",
                trellis_runtime::sandbox::INIT_ARG
            );
            std::process::exit(2)
        }
    }
}
