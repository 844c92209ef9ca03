//! The field manager of every write: a create, update or patch records its manager
//! and the fields it set in `metadata.managedFields` (Kubernetes' `FieldManager`), and
//! a patch's options are checked as `PatchOptions`. An apply merges through
//! [`crate::fieldmanager::structured_merge`].

use trellis_api::ApiError;
use trellis_api::registry::{ResourceInfo, Subresource};
use trellis_api::status::StatusCause;

use crate::endpoints::request::ApiRequest;
use crate::fieldmanager::managed_fields::{self, Schema, Scope};
use crate::object::{self, Object, now_timestamp};
use crate::state::AppState;

/// Which part of an object a write to `sub` may own.
pub fn scope(res: &ResourceInfo, sub: Option<Subresource>) -> Scope {
    match sub {
        Some(Subresource::Status) => Scope::Status,
        _ if res.has(Subresource::Status) => Scope::NoStatus,
        _ => Scope::All,
    }
}

pub fn subresource_name(req: &ApiRequest) -> &'static str {
    req.subresource.map_or("", |s| s.name())
}

/// The options kind a verb's query parameters belong to, as errors name it.
fn options_kind(req: &ApiRequest) -> &'static str {
    match req.verb {
        "create" => "CreateOptions",
        "update" => "UpdateOptions",
        _ => "PatchOptions",
    }
}

/// Records a create, update or non-apply patch of `old` into `new`'s managedFields
/// (see [`managed_fields::record_update`]).
pub fn record_write(
    state: &AppState,
    req: &ApiRequest,
    old: Option<&Object>,
    new: &mut Object,
) -> Result<(), ApiError> {
    managed_fields::check_manager(req.query.field_manager.as_deref(), options_kind(req))?;
    let manager = managed_fields::manager_name(
        req.query.field_manager.as_deref(),
        req.user_agent.as_deref(),
    );
    let crd = state.schema_for(&req.resource);
    let schema = crd
        .as_deref()
        .map_or(Schema::Builtin, |s| Schema::Crd(s.raw()));
    managed_fields::record_update(
        old,
        new,
        schema,
        scope(&req.resource, req.subresource),
        &manager,
        &req.resource.api_version(),
        subresource_name(req),
        &now_timestamp(),
    )
    .map_err(|causes| {
        let name = object::name(new).unwrap_or_default().to_owned();
        ApiError::invalid(&req.resource.group, &req.resource.kind, &name, causes)
    })
}

/// The query options of a patch, checked as Kubernetes checks `PatchOptions`.
pub fn check_patch_options(req: &ApiRequest, apply: bool) -> Result<(), ApiError> {
    let invalid = |cause| ApiError::invalid("meta.k8s.io", "PatchOptions", "", vec![cause]);
    if apply {
        if req.query.field_manager.as_deref().unwrap_or("").is_empty() {
            return Err(invalid(
                StatusCause::required("fieldManager")
                    .with_message("Required value: is required for apply patch"),
            ));
        }
    } else if req.query.force.is_some() {
        return Err(invalid(StatusCause::forbidden(
            "force",
            "may not be specified for non-apply patch",
        )));
    }
    managed_fields::check_manager(req.query.field_manager.as_deref(), "PatchOptions")
}
