//! The Job controller: pods run to completion, as Kubernetes' job controller.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Job {}

impl Reconcile for Job {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(Job);
