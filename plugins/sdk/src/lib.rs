//! Write Trellis plugins in Rust.
//!
//! A plugin is a type that derives `Deserialize` (its configuration, from the Plugin
//! object's `spec.configuration`) and implements one of three traits; one macro then
//! exports it as a WebAssembly component of the matching WIT world:
//!
//! | kind                 | trait          | export macro          | WIT world      |
//! |----------------------|----------------|-----------------------|----------------|
//! | validating admission | [`Validate`]   | [`validating!`]       | `admission`    |
//! | mutating admission   | [`Mutate`]     | [`mutating!`]         | `admission`    |
//! | initializer          | [`Initialize`] | [`initializer!`]      | `initializer`  |
//! | controller           | [`controller::Reconcile`] | [`controller!`] | `controller` |
//! | scheduler            | [`scheduler::Plugin`] | [`scheduler!`] | `scheduler` |
//!
//! ```
//! use serde::Deserialize;
//! use trellis_plugin::{Request, Status, Validate, Verdict};
//!
//! #[derive(Deserialize)]
//! struct RequireTeam {
//!     label: String,
//! }
//!
//! impl Validate for RequireTeam {
//!     fn validate(&self, req: &Request) -> Result<Verdict, Status> {
//!         Ok(match req.label(&self.label) {
//!             Some(_) => Verdict::allow(),
//!             None => Verdict::deny(format!("{} needs the label {}", req.display_name(), self.label)),
//!         })
//!     }
//! }
//!
//! trellis_plugin::validating!(RequireTeam);
//! ```
//!
//! The request and answer types are plain Rust, and the host's imports go through
//! [`host::Host`], so the same logic runs natively under [`testing`]: build a request
//! from an object, run the plugin, assert on its verdict or on the patched object.
//! The macros emit the WIT glue only when compiling for `wasm32`.
//!
//! # Layout
//! - [`plugin`]: the traits, and the generic code the export macros call.
//! - [`request`]: [`Request`] and friends; `object_as::<T>()` decodes into any
//!   `Deserialize` type, e.g. the `k8s-openapi` types re-exported as [`k8s`], and
//!   `spec_as::<T>()` decodes the spec alone.
//! - [`verdict`]: [`Verdict`] and [`Status`].
//! - [`patch`]: the RFC 6902 [`Patch`] builder, [`pointer!`], and `Patch::diff`.
//! - [`log`], [`cluster`]: the host's imports.
//! - [`controller`]: the [`controller::Reconcile`] trait and the controller world's
//!   imports (informer caches, writes, events).
//! - [`host`]: the indirection between those imports and whoever serves them.
//! - [`testing`]: the native harness.

pub mod cluster;
pub mod controller;
pub mod host;
pub mod log;
pub mod patch;
pub mod plugin;
pub mod request;
#[cfg(feature = "k8s-openapi")]
pub mod scheduler;
pub mod testing;
pub mod verdict;
/// Resource quantities (`500m`, `1Gi`), exact, as the host parses and writes them.
pub use trellis_quantity as quantity;

#[cfg(feature = "k8s-openapi")]
pub use k8s_openapi as k8s;
pub use patch::{Patch, PatchOp, Pointer};
pub use plugin::{Initialize, Mutate, Validate};
pub use request::{
    GroupVersionKind, GroupVersionResource, InitializeRequest, Operation, Request, UserInfo,
};
pub use serde_json::{self, Value, json};
pub use verdict::{Status, Verdict};

// `__bindings!(WORLD)`, written by build.rs.
include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// What the export macros expand to; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use std::rc::Rc;

    pub use wit_bindgen;

    pub use crate::controller::with_controller_host;
    pub use crate::host::with_host;
    use crate::{
        GroupVersionKind, GroupVersionResource, Initialize, InitializeRequest, Mutate, Operation,
        Request, UserInfo, Validate, plugin, request::Json,
    };
    pub use crate::{log::Level, plugin::AdmissionResponse};

    /// The fields of the WIT `admission-request`, in WIT order.
    #[allow(clippy::too_many_arguments)]
    pub fn request(
        uid: String,
        kind: GroupVersionKind,
        resource: GroupVersionResource,
        sub_resource: Option<String>,
        name: String,
        namespace: Option<String>,
        operation: Operation,
        user_info: UserInfo,
        object: Option<String>,
        old_object: Option<String>,
        dry_run: bool,
    ) -> Request {
        Request {
            uid,
            kind,
            resource,
            sub_resource,
            name,
            namespace,
            operation,
            user_info,
            object: object.map(Json::new),
            old_object: old_object.map(Json::new),
            dry_run,
        }
    }

    pub fn initialize_request(
        kind: GroupVersionKind,
        resource: GroupVersionResource,
    ) -> InitializeRequest {
        InitializeRequest { kind, resource }
    }

    pub fn validate_configuration_validating<T: Validate>(
        configuration: &str,
    ) -> Result<(), String> {
        plugin::configure::<T>(configuration, T::check_configuration).map(drop)
    }

    pub fn validate_configuration_mutating<T: Mutate>(configuration: &str) -> Result<(), String> {
        plugin::configure::<T>(configuration, T::check_configuration).map(drop)
    }

    pub fn validate_configuration_initializer<T: Initialize>(
        configuration: &str,
    ) -> Result<(), String> {
        plugin::configure::<T>(configuration, T::check_configuration).map(drop)
    }

    pub fn admit_validating<T: Validate>(req: &Request, configuration: &str) -> AdmissionResponse {
        plugin::admit_validating::<T>(req, configuration)
    }

    pub fn admit_mutating<T: Mutate>(req: &Request, configuration: &str) -> AdmissionResponse {
        plugin::admit_mutating::<T>(req, configuration)
    }

    pub fn initialize<T: Initialize>(
        req: &InitializeRequest,
        object: &str,
        configuration: &str,
    ) -> Result<String, String> {
        plugin::initialize::<T>(req, object, configuration)
    }

    pub fn validate_configuration_controller<T: crate::controller::Reconcile>(
        configuration: &str,
    ) -> Result<(), String> {
        plugin::configure::<T>(configuration, T::check_configuration).map(drop)
    }

    pub fn reconcile<T: crate::controller::Reconcile>(
        key: &crate::controller::ObjectKey,
        configuration: &str,
    ) -> Result<crate::controller::Action, String> {
        let plugin = plugin::configure::<T>(configuration, T::check_configuration)?;
        plugin.reconcile(key)
    }

    /// Owned copies of log fields, as the WIT `log` import takes them.
    pub fn owned_fields(fields: &[(&str, &str)]) -> Vec<(String, String)> {
        fields
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }
}

/// The [`host::Host`] backed by the WIT imports, and conversions from the WIT types
/// every world shares. Expanded inside the module that holds the bindings, after
/// `__bindings!`, which names the imports `wit_log` and `wit_cluster` and the types
/// `wit`.
#[doc(hidden)]
#[macro_export]
macro_rules! __shared_glue {
    () => {
        use $crate::__private as sdk;

        struct WitHost;

        impl $crate::host::Host for WitHost {
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

        fn host() -> sdk::Rc<dyn $crate::host::Host> {
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

/// The `admission` world's export for a plugin type; `$admit` and `$configure` pick
/// validating or mutating.
#[doc(hidden)]
#[macro_export]
macro_rules! __admission_glue {
    ($plugin:ty, $configure:ident, $admit:ident) => {
        $crate::__export!(admission, $plugin, configure: $configure, entry: [$admit], guest: {
            fn admit(r: handler::AdmissionRequest) -> handler::AdmissionResponse {
                let operation = match r.operation {
                    wit::Operation::Create => $crate::Operation::Create,
                    wit::Operation::Update => $crate::Operation::Update,
                    wit::Operation::Delete => $crate::Operation::Delete,
                    wit::Operation::Connect => $crate::Operation::Connect,
                };
                let user = $crate::UserInfo {
                    username: r.user_info.username,
                    uid: r.user_info.uid,
                    groups: r.user_info.groups,
                    extra: r.user_info.extra,
                };
                let req = sdk::request(
                    r.uid,
                    gvk(r.kind),
                    gvr(r.resource),
                    r.sub_resource,
                    r.name,
                    r.namespace,
                    operation,
                    user,
                    r.object,
                    r.old_object,
                    r.dry_run,
                );
                let out = sdk::with_host(host(), || {
                    sdk::$admit::<super::__TrellisPlugin>(&req, &r.configuration)
                });
                handler::AdmissionResponse {
                    allowed: out.allowed,
                    status: out.status.map(|s| wit::Status {
                        code: s.code,
                        reason: s.reason,
                        message: s.message,
                    }),
                    warnings: out.warnings,
                    patch: out.patch,
                }
            }
        }, items: { $crate::__kind_glue!(); });
    };
}

/// Exports a [`Validate`] type as the component's `admission` handler.
#[macro_export]
macro_rules! validating {
    ($plugin:ty) => {
        $crate::__admission_glue!($plugin, validate_configuration_validating, admit_validating);
    };
}

/// Exports a [`Mutate`] type as the component's `admission` handler.
#[macro_export]
macro_rules! mutating {
    ($plugin:ty) => {
        $crate::__admission_glue!($plugin, validate_configuration_mutating, admit_mutating);
    };
}

/// Exports an [`Initialize`] type as the component's `initializer` handler.
#[macro_export]
macro_rules! initializer {
    ($plugin:ty) => {
        $crate::__export!(initializer, $plugin,
            configure: validate_configuration_initializer,
            entry: [initialize],
            guest: {
                fn initialize(r: handler::InitializeRequest) -> Result<String, String> {
                    let req = sdk::initialize_request(gvk(r.kind), gvr(r.resource));
                    sdk::with_host(host(), || {
                        sdk::initialize::<super::__TrellisPlugin>(&req, &r.object, &r.configuration)
                    })
                }
            },
            items: { $crate::__kind_glue!(); }
        );
    };
}

/// Exports a component of the `scheduler` world whose plugins `$build` makes from the
/// configuration: `fn(&str) -> Result<Vec<Box<dyn scheduler::Plugin>>, String>`.
#[cfg(feature = "k8s-openapi")]
#[macro_export]
macro_rules! scheduler {
    ($build:path) => {
        #[doc(hidden)]
        const __TRELLIS_SCHEDULER_BUILD: fn(
            &str,
        ) -> Result<
            ::std::vec::Vec<::std::boxed::Box<dyn $crate::scheduler::Plugin>>,
            ::std::string::String,
        > = $build;

        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            let _ = __TRELLIS_SCHEDULER_BUILD;
        };

        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        mod __trellis_export {
            $crate::__bindings!(scheduler);
            $crate::__shared_glue!();

            use std::cell::RefCell;

            use $crate::scheduler as sch;

            thread_local! {
                static FRAMEWORK: RefCell<Option<sch::Framework>> = const { RefCell::new(None) };
            }

            fn with<T>(f: impl FnOnce(&mut sch::Framework) -> T, otherwise: T) -> T {
                sdk::with_host(host(), || {
                    FRAMEWORK.with(|fw| match fw.borrow_mut().as_mut() {
                        Some(fw) => f(fw),
                        None => otherwise,
                    })
                })
            }

            fn status(s: sch::Status) -> wit_scheduler::Status {
                wit_scheduler::Status {
                    code: match s.code {
                        sch::Code::Success => wit_scheduler::Code::Success,
                        sch::Code::Unschedulable => wit_scheduler::Code::Unschedulable,
                        sch::Code::UnschedulableAndUnresolvable => {
                            wit_scheduler::Code::UnschedulableAndUnresolvable
                        }
                        sch::Code::Skip => wit_scheduler::Code::Skip,
                        sch::Code::Error => wit_scheduler::Code::Error,
                    },
                    reasons: s.reasons,
                }
            }

            fn info(p: &dyn sch::Plugin) -> wit_scheduler::PluginInfo {
                let points = p.points();
                let mut flags = wit_scheduler::ExtensionPoints::empty();
                for (on, flag) in [
                    (
                        points.pre_filter,
                        wit_scheduler::ExtensionPoints::PRE_FILTER,
                    ),
                    (points.filter, wit_scheduler::ExtensionPoints::FILTER),
                    (points.pre_score, wit_scheduler::ExtensionPoints::PRE_SCORE),
                    (points.score, wit_scheduler::ExtensionPoints::SCORE),
                    (points.reserve, wit_scheduler::ExtensionPoints::RESERVE),
                    (points.permit, wit_scheduler::ExtensionPoints::PERMIT),
                ] {
                    if on {
                        flags |= flag;
                    }
                }
                let events = p
                    .events()
                    .into_iter()
                    .map(|e| {
                        let mut action = wit_scheduler::Action::empty();
                        for (on, flag) in [
                            (e.add, wit_scheduler::Action::ADD),
                            (e.update, wit_scheduler::Action::UPDATE),
                            (e.delete, wit_scheduler::Action::DELETE),
                        ] {
                            if on {
                                action |= flag;
                            }
                        }
                        wit_scheduler::ClusterEvent {
                            resource: e.resource,
                            action,
                        }
                    })
                    .collect();
                wit_scheduler::PluginInfo {
                    name: p.name().to_owned(),
                    points: flags,
                    weight: p.weight(),
                    events,
                }
            }

            struct Export;

            impl handler::Guest for Export {
                fn plugins(
                    configuration: String,
                ) -> Result<Vec<wit_scheduler::PluginInfo>, String> {
                    let plugins = sdk::with_host(host(), || {
                        (super::__TRELLIS_SCHEDULER_BUILD)(&configuration)
                    })?;
                    let infos = plugins.iter().map(|p| info(p.as_ref())).collect();
                    FRAMEWORK.with(|fw| *fw.borrow_mut() = Some(sch::Framework::new(plugins)));
                    Ok(infos)
                }

                fn update(changes: Vec<wit_scheduler::Change>) {
                    let changes = changes.into_iter().map(|c| match c {
                        wit_scheduler::Change::NodeUpsert(n) => sch::Change::NodeUpsert {
                            node: n.node,
                            object: n.object,
                        },
                        wit_scheduler::Change::NodeRemove(n) => sch::Change::NodeRemove(n),
                        wit_scheduler::Change::PodUpsert(p) => sch::Change::PodUpsert {
                            uid: p.uid,
                            node: p.node,
                            object: p.object,
                        },
                        wit_scheduler::Change::PodRemove(uid) => sch::Change::PodRemove(uid),
                    });
                    with(
                        |fw| {
                            for e in fw.update(changes) {
                                $crate::log::warn(&e);
                            }
                        },
                        (),
                    )
                }

                fn cycle(pod: String) -> Vec<wit_scheduler::PreFilterResult> {
                    let pod = match sch::PodInfo::from_json(&pod) {
                        Ok(pod) => pod,
                        Err(e) => {
                            return vec![wit_scheduler::PreFilterResult {
                                plugin: 0,
                                status: status(sch::Status::error(e)),
                                nodes: None,
                            }];
                        }
                    };
                    with(
                        |fw| {
                            fw.cycle(pod)
                                .into_iter()
                                .map(|(plugin, r)| wit_scheduler::PreFilterResult {
                                    plugin,
                                    status: status(r.status),
                                    nodes: r.nodes,
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn filter(nodes: Vec<u32>) -> Vec<wit_scheduler::Rejection> {
                    with(
                        |fw| {
                            fw.filter(&nodes)
                                .into_iter()
                                .map(|r| wit_scheduler::Rejection {
                                    node: r.node,
                                    plugin: r.plugin,
                                    status: status(r.status),
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn filter_without(
                    victims: Vec<String>,
                    nodes: Vec<u32>,
                ) -> Vec<wit_scheduler::Rejection> {
                    with(
                        |fw| {
                            fw.filter_without(&victims, &nodes)
                                .into_iter()
                                .map(|r| wit_scheduler::Rejection {
                                    node: r.node,
                                    plugin: r.plugin,
                                    status: status(r.status),
                                })
                                .collect()
                        },
                        Vec::new(),
                    )
                }

                fn score(nodes: Vec<u32>) -> Result<Vec<wit_scheduler::PluginScores>, String> {
                    with(
                        |fw| {
                            fw.score(&nodes).map(|all| {
                                all.into_iter()
                                    .map(|(plugin, scores)| wit_scheduler::PluginScores {
                                        plugin,
                                        scores,
                                    })
                                    .collect()
                            })
                        },
                        Err("score before plugins".into()),
                    )
                }

                fn reserve(node: u32) -> wit_scheduler::Status {
                    status(with(
                        |fw| fw.reserve(node),
                        sch::Status::error("reserve before plugins"),
                    ))
                }

                fn unreserve(pod_uid: String, node: u32) {
                    with(|fw| fw.unreserve(&pod_uid, node), ())
                }

                fn permit(node: u32) -> wit_scheduler::PermitVerdict {
                    match with(
                        |fw| fw.permit(node),
                        sch::Permit::Deny(sch::Status::error("permit before plugins")),
                    ) {
                        sch::Permit::Allow => wit_scheduler::PermitVerdict::Allow,
                        sch::Permit::Deny(s) => wit_scheduler::PermitVerdict::Deny(status(s)),
                        sch::Permit::Wait(ms) => wit_scheduler::PermitVerdict::Wait(ms),
                    }
                }

                fn allowed() -> Vec<String> {
                    with(|fw| fw.allowed(), Vec::new())
                }
            }

            export!(Export);
        }
    };
}

/// Exports a [`controller::Reconcile`] type as the component's `controller` handler.
#[macro_export]
macro_rules! controller {
    ($plugin:ty) => {
        $crate::__export!(controller, $plugin,
            configure: validate_configuration_controller,
            entry: [reconcile],
            guest: {
                fn reconcile(
                    key: wit_controller::ObjectKey,
                    configuration: String,
                ) -> Result<wit_controller::Action, String> {
                    let key = $crate::controller::ObjectKey {
                        resource: gvr(key.resource),
                        namespace: key.namespace,
                        name: key.name,
                    };
                    let action = sdk::with_host(host(), || {
                        sdk::with_controller_host(sdk::Rc::new(WitController), || {
                            sdk::reconcile::<super::__TrellisPlugin>(&key, &configuration)
                        })
                    })?;
                    Ok(match action {
                        $crate::controller::Action::Done => wit_controller::Action::Done,
                        $crate::controller::Action::RequeueAfter(after) => {
                            wit_controller::Action::RequeueAfter(
                                u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
                            )
                        }
                    })
                }
            },
            items: {
                $crate::__controller_glue!();
            }
        );
    };
}

/// The controller world's imports as a [`controller::ControllerHost`]: expanded in the
/// module that holds the bindings.
#[doc(hidden)]
#[macro_export]
macro_rules! __controller_glue {
    () => {
        use $crate::controller as ctl;

        struct WitController;

        fn wit_api_error(e: wit_controller::ApiError) -> ctl::ApiError {
            ctl::ApiError {
                code: e.code,
                reason: e.reason,
                message: e.message,
                causes: e
                    .causes
                    .into_iter()
                    .map(|c| ctl::Cause {
                        reason: c.reason,
                        message: c.message,
                        field: c.field,
                    })
                    .collect(),
            }
        }

        fn wit_write(w: ctl::Write) -> wit_client::Write {
            match w {
                ctl::Write::Create {
                    resource,
                    namespace,
                    object,
                } => wit_client::Write::Create(wit_client::CreateRequest {
                    resource: to_wit_gvr(&resource),
                    namespace,
                    object: object.to_string(),
                }),
                ctl::Write::Update {
                    resource,
                    namespace,
                    object,
                    status,
                } => wit_client::Write::Update(wit_client::UpdateRequest {
                    resource: to_wit_gvr(&resource),
                    namespace,
                    object: object.to_string(),
                    status,
                }),
                ctl::Write::Patch {
                    resource,
                    namespace,
                    name,
                    patch_type,
                    patch,
                    status,
                    force,
                } => wit_client::Write::Patch(wit_client::PatchRequest {
                    resource: to_wit_gvr(&resource),
                    namespace,
                    name,
                    patch_type: match patch_type {
                        ctl::PatchType::Json => wit_client::PatchType::Json,
                        ctl::PatchType::Merge => wit_client::PatchType::Merge,
                        ctl::PatchType::Strategic => wit_client::PatchType::Strategic,
                        ctl::PatchType::Apply => wit_client::PatchType::Apply,
                    },
                    patch: patch.to_string(),
                    status,
                    force,
                }),
                ctl::Write::Delete {
                    resource,
                    namespace,
                    name,
                    propagation,
                    uid,
                } => wit_client::Write::Delete(wit_client::DeleteRequest {
                    resource: to_wit_gvr(&resource),
                    namespace,
                    name,
                    propagation: propagation.map(|p| match p {
                        ctl::Propagation::Background => wit_client::Propagation::Background,
                        ctl::Propagation::Foreground => wit_client::Propagation::Foreground,
                        ctl::Propagation::Orphan => wit_client::Propagation::Orphan,
                    }),
                    uid,
                }),
            }
        }

        impl ctl::ControllerHost for WitController {
            fn get(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                name: &str,
            ) -> Result<Option<String>, String> {
                wit_cache::get(&to_wit_gvr(resource), namespace, name)
            }

            fn list(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                label_selector: &str,
            ) -> Result<Vec<String>, String> {
                wit_cache::list(&to_wit_gvr(resource), namespace, label_selector)
            }

            fn owned_by(
                &self,
                resource: &$crate::GroupVersionResource,
                owner_uid: &str,
            ) -> Result<Vec<String>, String> {
                wit_cache::owned_by(&to_wit_gvr(resource), owner_uid)
            }

            fn dependents(&self, owner_uid: &str) -> Result<Vec<String>, String> {
                wit_cache::dependents(owner_uid)
            }

            fn resource_of(&self, api_version: &str, kind: &str) -> Option<ctl::ServedResource> {
                wit_cache::resource_of(api_version, kind).map(|r| ctl::ServedResource {
                    resource: gvr(r.resource),
                    namespaced: r.namespaced,
                })
            }

            fn resources(&self) -> Vec<ctl::ServedResource> {
                wit_cache::resources()
                    .into_iter()
                    .map(|r| ctl::ServedResource {
                        resource: gvr(r.resource),
                        namespaced: r.namespaced,
                    })
                    .collect()
            }

            fn update_subresource(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                object: &$crate::Value,
                subresource: &str,
            ) -> Result<String, ctl::ApiError> {
                let request = wit_client::UpdateRequest {
                    resource: to_wit_gvr(resource),
                    namespace: namespace.map(str::to_owned),
                    object: object.to_string(),
                    status: false,
                };
                wit_client::update_subresource(&request, subresource).map_err(wit_api_error)
            }

            fn read(
                &self,
                resource: &$crate::GroupVersionResource,
                namespace: Option<&str>,
                name: &str,
            ) -> Result<Option<String>, ctl::ApiError> {
                wit_client::read(&to_wit_gvr(resource), namespace, name).map_err(wit_api_error)
            }

            fn batch(&self, writes: Vec<ctl::Write>) -> Vec<Result<String, ctl::ApiError>> {
                let writes: Vec<wit_client::Write> = writes.into_iter().map(wit_write).collect();
                wit_client::batch(&writes)
                    .into_iter()
                    .map(|r| r.map_err(wit_api_error))
                    .collect()
            }

            fn record(
                &self,
                object: &str,
                event_type: ctl::EventType,
                reason: &str,
                message: &str,
            ) {
                let event_type = match event_type {
                    ctl::EventType::Normal => wit_events::EventType::Normal,
                    ctl::EventType::Warning => wit_events::EventType::Warning,
                };
                wit_events::record(object, event_type, reason, message);
            }
        }
    };
}
