//! The TTL-after-finished controller: finished Jobs removed after their ttlSecondsAfterFinished.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TtlAfterFinished {}

impl Reconcile for TtlAfterFinished {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(TtlAfterFinished);
