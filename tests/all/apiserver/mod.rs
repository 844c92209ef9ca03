//! The API server end to end, with the real kubectl as its client.

mod apply;
mod initializers;
mod kubectl;
mod node_authz;
mod openapi;
mod service_accounts;
