//! Host bindings of the WIT contract (`wit/plugin.wit`), one module per world. The
//! shared interfaces (`types`, `log`, `cluster`) are generated once, in `admission`,
//! and reused by the other worlds so one host implementation serves them all.

pub mod admission {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "admission",
        // Cluster reads go to the API server's store; the guest waits, the host
        // thread does not.
        imports: {
            "trellis:plugin/cluster.get": async,
            "trellis:plugin/cluster.list": async,
        },
        exports: { default: async },
    });
}

pub mod initializer {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "initializer",
        exports: { default: async },
        with: {
            "trellis:plugin/types": super::admission::trellis::plugin::types,
            "trellis:plugin/log": super::admission::trellis::plugin::log,
            "trellis:plugin/cluster": super::admission::trellis::plugin::cluster,
        },
    });
}

pub use admission::trellis::plugin::{cluster, log, types};
