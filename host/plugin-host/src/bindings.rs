//! Host bindings of the WIT contract (`wit/`), one module per package version.
//!
//! `core` holds the interfaces every world shares (`types`, `log`, `cluster`); each
//! kind's package reuses them through `with`, so one host implementation serves them
//! all and a request record is the same Rust type whichever world carries it.
//! `plugin_0_1` is the frozen first contract, `trellis:plugin@0.1.0`, whose records
//! have the same shapes as today's: its types are today's, only the names under
//! which they cross differ.

/// `trellis:core@0.1.0`: the shared types and imports.
pub mod core {
    wasmtime::component::bindgen!({
        path: "../../wit/core/0.1.0",
        world: "imports",
        // Cluster reads go to the API server's cache; the guest waits, the host
        // thread does not.
        imports: {
            "trellis:core/cluster.get": async,
            "trellis:core/cluster.list": async,
        },
    });
}

/// `trellis:admission@0.1.0`.
pub mod admission {
    wasmtime::component::bindgen!({
        path: "../../wit/admission/0.1.0",
        world: "admission",
        exports: { default: async },
        with: { "trellis:core": super::core::trellis::core },
    });
}

/// `trellis:initializer@0.1.0`.
pub mod initializer {
    wasmtime::component::bindgen!({
        path: "../../wit/initializer/0.1.0",
        world: "initializer",
        exports: { default: async },
        with: { "trellis:core": super::core::trellis::core },
    });
}

/// `trellis:controller@0.1.0`.
pub mod controller {
    wasmtime::component::bindgen!({
        path: "../../wit/controller/0.1.0",
        world: "controller",
        // Cache reads, writes through the API server and events all wait on the
        // controller runtime; the guest waits, the host thread does not.
        imports: { default: async },
        exports: { default: async },
        with: { "trellis:core": super::core::trellis::core },
    });
}

/// `trellis:scheduler@0.1.0`.
pub mod scheduler {
    wasmtime::component::bindgen!({
        path: "../../wit/scheduler/0.1.0",
        world: "scheduler",
        exports: { default: async },
        with: { "trellis:core": super::core::trellis::core },
    });
}

/// `trellis:plugin@0.1.0`, frozen; both of its worlds.
pub mod plugin_0_1 {
    pub mod admission {
        wasmtime::component::bindgen!({
            path: "../../wit/plugin/0.1.0",
            world: "admission",
            imports: {
                "trellis:plugin/cluster.get": async,
                "trellis:plugin/cluster.list": async,
            },
            exports: { default: async },
            // The same records as today's: mapped, they are today's Rust types.
            with: { "trellis:plugin/types": crate::bindings::core::trellis::core::types },
        });
    }

    pub mod initializer {
        wasmtime::component::bindgen!({
            path: "../../wit/plugin/0.1.0",
            world: "initializer",
            exports: { default: async },
            with: {
                "trellis:plugin/types": crate::bindings::core::trellis::core::types,
                "trellis:plugin/log": super::admission::trellis::plugin::log,
                "trellis:plugin/cluster": super::admission::trellis::plugin::cluster,
            },
        });
    }

    pub use admission::trellis::plugin::{cluster, log};
}

pub use self::core::trellis::core::{cluster, log, types};
