//! The HorizontalPodAutoscaler controller: a workload's scale follows its pods' metrics.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HorizontalPodAutoscaler {}

impl Reconcile for HorizontalPodAutoscaler {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(HorizontalPodAutoscaler);
