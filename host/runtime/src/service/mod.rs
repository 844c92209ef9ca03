//! The CRI `RuntimeService` and `ImageService` on [`Runtime`]: requests checked and
//! answered from the records, containers started and stopped through their handler's
//! module. Kubernetes' idempotency rules hold: stopping a stopped container, removing
//! an unknown container or sandbox, removing an absent image all succeed.
//!
//! As containerd's CRI server, by the noun a call is about:
//! - `runtime`: the `RuntimeService` itself, the gRPC edge of the calls below and the
//!   runtime's own (`Version`, `Status`, container events).
//! - `sandbox`: a pod sandbox's lifecycle, from `RunPodSandbox` to `RemovePodSandbox`.
//! - `container`: a container's lifecycle, from `CreateContainer` to
//!   `RemoveContainer`, its status, stats and `ExecSync`.
//! - `image`: the `ImageService`.

mod container;
mod image;
mod runtime;
mod sandbox;

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Response, Status};

use crate::Runtime;
use crate::handler::Handler;

type Reply<T> = Result<Response<T>, Status>;

impl Runtime {
    /// The handler a sandbox asking for `name` gets.
    fn handler(&self, name: &str) -> Result<String, Status> {
        match name {
            "" => self
                .handlers
                .first()
                .map(|(h, _)| h.clone())
                .ok_or_else(|| Status::failed_precondition("this node has no runtime handler")),
            name if self.handlers.iter().any(|(h, _)| h == name) => Ok(name.to_string()),
            name => Err(Status::invalid_argument(format!(
                "no runtime handler {name:?} on this node (it has: {})",
                self.handlers().join(", ")
            ))),
        }
    }

    /// The handler named `name`.
    fn handler_named(&self, name: &str) -> Result<&Arc<dyn Handler>, Status> {
        self.handlers
            .iter()
            .find(|(h, _)| h == name)
            .map(|(_, handler)| handler)
            .ok_or_else(|| Status::failed_precondition(format!("no runtime handler {name:?}")))
    }
}

/// Whether `labels` hold every label of a CRI filter's `selector`.
fn selects(selector: &HashMap<String, String>, labels: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn no_container(id: &str) -> Status {
    Status::not_found(format!("no container {id}"))
}

/// A new sandbox or container id: 32 hex digits.
fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
