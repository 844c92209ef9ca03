//! The export macros: each turns a plugin type into the component of one WIT world
//! (one file per world), through one mechanism, [`__export!`](crate::__export!), and
//! the glue every world shares. The WIT bindings themselves are generated in the
//! plugin's crate by `__bindings!(WORLD)`, which `build.rs` writes.
//!
//! What the macros expand to call is reached through [`__private`], which is not
//! part of the API.

mod admission;
mod controller;
mod initializer;
#[cfg(feature = "k8s-openapi")]
mod scheduler;

// `__bindings!(WORLD)`, written by build.rs.
include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// What the export macros expand to; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use std::rc::Rc;

    pub use wit_bindgen;

    pub use super::admission::{
        admit_mutating, admit_validating, request, validate_configuration_mutating,
        validate_configuration_validating,
    };
    pub use super::controller::{reconcile, validate_configuration_controller};
    pub use super::initializer::{
        initialize, initialize_request, validate_configuration_initializer,
    };
    pub use crate::controller::with_controller_host;
    pub use crate::imports::{Level, with_host};
    pub use crate::plugin::AdmissionResponse;

    /// Owned copies of log fields, as the WIT `log` import takes them.
    pub fn owned_fields(fields: &[(&str, &str)]) -> Vec<(String, String)> {
        fields
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }
}

/// The [`Host`](crate::imports::Host) backed by the WIT imports, and conversions from the WIT types
/// every world shares. Expanded inside the module that holds the bindings, after
/// `__bindings!`, which names the imports `wit_log` and `wit_cluster` and the types
/// `wit`.
#[doc(hidden)]
#[macro_export]
macro_rules! __shared_glue {
    () => {
        use $crate::__private as sdk;

        struct WitHost;

        impl $crate::imports::Host for WitHost {
            fn log(&self, level: sdk::Level, message: &str, fields: &[(&str, &str)]) {
                let level = match level {
                    sdk::Level::Trace => wit_log::Level::Trace,
                    sdk::Level::Debug => wit_log::Level::Debug,
                    sdk::Level::Info => wit_log::Level::Info,
                    sdk::Level::Warn => wit_log::Level::Warn,
                    sdk::Level::Error => wit_log::Level::Error,
                };
                wit_log::log(level, message, &sdk::owned_fields(fields));
            }

            fn get(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                name: &str,
            ) -> Result<Option<String>, String> {
                wit_cluster::get(&to_wit_gvr(resource), namespace, name)
            }

            fn list(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                label_selector: &str,
            ) -> Result<Vec<String>, String> {
                wit_cluster::list(&to_wit_gvr(resource), namespace, label_selector)
            }
        }

        fn host() -> sdk::Rc<dyn $crate::imports::Host> {
            sdk::Rc::new(WitHost)
        }

        fn to_wit_gvr(r: &$crate::GroupVersionResource) -> wit::GroupVersionResource {
            wit::GroupVersionResource {
                group: r.group.clone(),
                version: r.version.clone(),
                resource: r.resource.clone(),
            }
        }

        // Not every world's records carry kinds and resources.
        #[allow(dead_code)]
        fn gvr(r: wit::GroupVersionResource) -> $crate::GroupVersionResource {
            $crate::GroupVersionResource {
                group: r.group,
                version: r.version,
                resource: r.resource,
            }
        }
    };
}

/// `gvk`, for the worlds whose records carry kinds (the controller world's do not,
/// so its bindings have no `group-version-kind`).
#[doc(hidden)]
#[macro_export]
macro_rules! __kind_glue {
    () => {
        fn gvk(k: wit::GroupVersionKind) -> $crate::GroupVersionKind {
            $crate::GroupVersionKind {
                group: k.group,
                version: k.version,
                kind: k.kind,
            }
        }
    };
}

/// Exports a plugin type as the component of one world: the one mechanism behind
/// every export macro.
///
/// - `$world`: the world (`admission`, `initializer`, ...), as `__bindings!` names it;
/// - `$plugin`: the plugin type;
/// - `configure`: the function that decodes and checks the plugin's configuration,
///   which every world's `validate-configuration` calls;
/// - `entry`: the plugin's other entry points, named so that a native build (which
///   leaves the export out) type-checks and uses the plugin type too;
/// - `guest`: the world's other `handler::Guest` methods. Inside them the plugin type
///   is `super::__TrellisPlugin`, and the bindings' `handler` and `wit`, the SDK as
///   `sdk`, and `host()` and `gvr` are in scope (`gvk` where `items` has
///   `__kind_glue!()`);
/// - `items` (optional): more items in the module that holds the bindings.
#[doc(hidden)]
#[macro_export]
macro_rules! __export {
    (
        $world:ident,
        $plugin:ty,
        configure: $configure:ident,
        entry: [$($entry:ident),* $(,)?],
        guest: { $($guest:tt)* }
        $(, items: { $($items:tt)* })?
    ) => {
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            let _ = $crate::__private::$configure::<$plugin>;
            $(let _ = $crate::__private::$entry::<$plugin>;)*
        };

        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        type __TrellisPlugin = $plugin;

        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __trellis_export {
            $crate::__bindings!($world);
            $crate::__shared_glue!();

            struct Export;

            impl handler::Guest for Export {
                fn validate_configuration(configuration: String) -> Result<(), String> {
                    sdk::with_host(host(), || {
                        sdk::$configure::<super::__TrellisPlugin>(&configuration)
                    })
                }

                $($guest)*
            }

            export!(Export);

            $($($items)*)?
        }
    };
}
