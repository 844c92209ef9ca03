//! WASM plugins: the host's limits and failures on real components built from
//! `plugins/`, plugins in the API server's chains driven by kubectl, their cluster
//! reads, and modules pulled from an OCI registry (the example plugins have a test
//! binary of their own, `tests/plugin_examples`).

mod admission;
mod cluster_read;
mod host;
mod oci;
