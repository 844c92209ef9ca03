//! The `controller` world's export: [`controller!`](crate::controller!) turns a
//! [`Reconcile`](crate::controller::Reconcile) type into the world's `reconcile`, and
//! serves the world's imports (caches, writes, events) as a
//! [`ControllerHost`](crate::controller::ControllerHost).

use crate::plugin;

// What the macros call, through `__private`.

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

/// Exports a [`controller::Reconcile`](crate::controller::Reconcile) type as the
/// component's `controller` handler.
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

/// The controller world's imports as a
/// [`controller::ControllerHost`](crate::controller::ControllerHost): expanded in the
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
