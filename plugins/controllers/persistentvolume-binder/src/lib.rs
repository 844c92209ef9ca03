//! The PersistentVolume binder: claims bound to volumes, as Kubernetes' persistent volume controller.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PersistentvolumeBinder {}

impl Reconcile for PersistentvolumeBinder {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(PersistentvolumeBinder);
