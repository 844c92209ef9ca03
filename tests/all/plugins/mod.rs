//! WASM plugins: the host's limits and failures on real components built from
//! `plugins/`, plugins in the API server's chains driven by kubectl, and the example
//! plugins as their READMEs use them.

mod admission;
mod examples;
mod host;
