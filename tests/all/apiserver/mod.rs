//! The API server end to end, with the real kubectl as its client.

mod apply;
mod compat;
mod hardening;
mod initializers;
mod kubectl;
mod kubectl_1_20;
mod node_authz;
mod on_etcd;
mod openapi;
mod pod_security;
mod quota;
mod service_accounts;
mod services;
mod workloads;
