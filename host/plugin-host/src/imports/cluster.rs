//! `cluster`: reads of cluster state, for plugins granted them.

use crate::bindings::{cluster, plugin_0_1, types};
use crate::state::PluginState;

impl types::Host for PluginState {}

impl cluster::Host for PluginState {
    async fn get(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<String>, String> {
        match &self.cluster {
            Some(reader) => reader.get(&resource, namespace.as_deref(), &name).await,
            None => Err(self.not_granted()),
        }
    }

    async fn list(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        label_selector: String,
    ) -> Result<Vec<String>, String> {
        match &self.cluster {
            Some(reader) => {
                reader
                    .list(&resource, namespace.as_deref(), &label_selector)
                    .await
            }
            None => Err(self.not_granted()),
        }
    }
}

impl plugin_0_1::cluster::Host for PluginState {
    async fn get(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<String>, String> {
        cluster::Host::get(self, resource, namespace, name).await
    }

    async fn list(
        &mut self,
        resource: types::GroupVersionResource,
        namespace: Option<String>,
        label_selector: String,
    ) -> Result<Vec<String>, String> {
        cluster::Host::list(self, resource, namespace, label_selector).await
    }
}

impl PluginState {
    fn not_granted(&self) -> String {
        format!(
            "plugin {} is not granted cluster reads (spec.capabilities.clusterRead)",
            self.plugin
        )
    }
}
