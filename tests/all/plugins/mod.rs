//! WASM plugins: the host's limits and failures on real components built from
//! `plugins/`, and plugins in the API server's chains driven by kubectl (the example
//! plugins have a test binary of their own, `tests/plugin_examples`).

mod admission;
mod host;
