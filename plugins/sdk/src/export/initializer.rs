//! The `initializer` world's export: [`initializer!`](crate::initializer!) turns an
//! [`Initialize`] type into the world's `initialize`.

use crate::plugin;
use crate::{GroupVersionKind, GroupVersionResource, Initialize, InitializeRequest};

// What the macro calls, through `__private`.

pub fn initialize_request(
    kind: GroupVersionKind,
    resource: GroupVersionResource,
) -> InitializeRequest {
    InitializeRequest { kind, resource }
}

pub fn validate_configuration_initializer<T: Initialize>(
    configuration: &str,
) -> Result<(), String> {
    plugin::configure::<T>(configuration, T::check_configuration).map(drop)
}

pub fn initialize<T: Initialize>(
    req: &InitializeRequest,
    object: &str,
    configuration: &str,
) -> Result<String, String> {
    plugin::initialize::<T>(req, object, configuration)
}

/// Exports an [`Initialize`](crate::Initialize) type as the component's `initializer`
/// handler.
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
