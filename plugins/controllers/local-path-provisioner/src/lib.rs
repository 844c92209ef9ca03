//! The Local-path provisioner: claims of the default StorageClass get a directory on their pod's node.
//!
//! Not yet implemented: every reconcile does nothing.

use serde::Deserialize;
use trellis_plugin::controller::{Action, ObjectKey, Reconcile};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalPathProvisioner {}

impl Reconcile for LocalPathProvisioner {
    fn reconcile(&self, _key: &ObjectKey) -> Result<Action, String> {
        Ok(Action::Done)
    }
}

trellis_plugin::controller!(LocalPathProvisioner);
