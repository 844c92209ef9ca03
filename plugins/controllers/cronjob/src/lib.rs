//! The CronJob controller: Jobs started on a schedule, as Kubernetes' cronjob controller.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cronjob {}

impl Reconcile for Cronjob {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(Cronjob);
