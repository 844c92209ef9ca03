//! The API server end to end, with the real kubectl as its client.

mod kubectl;
mod initializers;
mod node_authz;
mod service_accounts;
mod openapi;
