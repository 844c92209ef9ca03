//! A pod's own network: its namespace (`netns`) and the CNI plugins that connect it
//! (`cni`).

// Used by the sandbox service once it makes pods their own network.
#[allow(dead_code)]
pub(crate) mod netns;
// Used by the sandbox service once it makes pods their own network.
#[allow(dead_code)]
pub(crate) mod cni;
