//! The `admission` world's export: [`validating!`](crate::validating!) and
//! [`mutating!`](crate::mutating!) turn a [`Validate`] or [`Mutate`] type into the
//! world's `admit`.

use crate::plugin::{self, AdmissionResponse};
use crate::request::Json;
use crate::{
    GroupVersionKind, GroupVersionResource, Mutate, Operation, Request, UserInfo, Validate,
};

// What the macros call, through `__private`.

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

pub fn validate_configuration_validating<T: Validate>(configuration: &str) -> Result<(), String> {
    plugin::configure::<T>(configuration, T::check_configuration).map(drop)
}

pub fn validate_configuration_mutating<T: Mutate>(configuration: &str) -> Result<(), String> {
    plugin::configure::<T>(configuration, T::check_configuration).map(drop)
}

pub fn admit_validating<T: Validate>(req: &Request, configuration: &str) -> AdmissionResponse {
    plugin::admit_validating::<T>(req, configuration)
}

pub fn admit_mutating<T: Mutate>(req: &Request, configuration: &str) -> AdmissionResponse {
    plugin::admit_mutating::<T>(req, configuration)
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

/// Exports a [`Validate`](crate::Validate) type as the component's `admission` handler.
#[macro_export]
macro_rules! validating {
    ($plugin:ty) => {
        $crate::__admission_glue!($plugin, validate_configuration_validating, admit_validating);
    };
}

/// Exports a [`Mutate`](crate::Mutate) type as the component's `admission` handler.
#[macro_export]
macro_rules! mutating {
    ($plugin:ty) => {
        $crate::__admission_glue!($plugin, validate_configuration_mutating, admit_mutating);
    };
}
