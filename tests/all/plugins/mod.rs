//! WASM plugins: the host's limits and failures on real components built from
//! `plugins/`, and plugins in the API server's chains driven by kubectl.

mod admission;
mod host;
