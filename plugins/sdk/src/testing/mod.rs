//! Run a plugin's logic natively, in ordinary `#[test]`s.
//!
//! The [`Harness`] holds what the host would provide: the configuration, the
//! objects the `cluster` import serves, and a log that records what the plugin
//! writes. Each call goes through the same code as a component's export (decode
//! and check the configuration, run the trait method, encode the answer).
//!
//! ```
//! use serde::Deserialize;
//! use trellis_plugin::{Mutate, Patch, Request, Status, json, testing};
//!
//! #[derive(Deserialize)]
//! struct Owner { owner: String }
//!
//! impl Mutate for Owner {
//!     fn mutate(&self, req: &Request) -> Result<Option<Patch>, Status> {
//!         let object = req.object().ok_or_else(|| Status::bad_request("no object"))?;
//!         Ok(Some(Patch::new().set_label(object, "owner", &self.owner)))
//!     }
//! }
//!
//! let harness = testing::Harness::new().with_configuration(json!({"owner": "ana"}));
//! let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "a"}});
//! let admission = harness.mutate::<Owner>(testing::create(pod).user("bob", &["dev"]));
//! assert!(admission.is_allowed());
//! assert_eq!(admission.patched_object()["metadata"]["labels"]["owner"], "ana");
//! ```
//!
//! [`ControllerHarness`] does the same for a controller's `reconcile`: an in-memory
//! cache, the writes it makes and the events it records.

mod admission;
mod controller;
mod request;

use serde_json::Value;

pub use admission::{Admission, Harness, LogRecord};
pub use controller::ControllerHarness;
pub use request::{RequestBuilder, create, delete, update};

/// A JSON file, read relative to the package (where `cargo test` runs tests), e.g.
/// `fixture("testdata/pod.json")`. Panics with the path when it cannot.
pub fn fixture(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read fixture {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {path} is not JSON: {e}"))
}
