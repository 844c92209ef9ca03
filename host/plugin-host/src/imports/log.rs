//! `log`: one structured record in the host's log, tagged with the plugin.

use crate::bindings::{log, plugin_0_1};
use crate::state::PluginState;

impl log::Host for PluginState {
    fn log(&mut self, level: log::Level, message: String, fields: Vec<(String, String)>) {
        let mut kv = String::new();
        for (k, v) in &fields {
            if !kv.is_empty() {
                kv.push(' ');
            }
            kv.push_str(k);
            kv.push('=');
            kv.push_str(v);
        }
        let plugin = &*self.plugin;
        match level {
            log::Level::Trace => tracing::trace!(plugin, fields = %kv, "{message}"),
            log::Level::Debug => tracing::debug!(plugin, fields = %kv, "{message}"),
            log::Level::Info => tracing::info!(plugin, fields = %kv, "{message}"),
            log::Level::Warn => tracing::warn!(plugin, fields = %kv, "{message}"),
            log::Level::Error => tracing::error!(plugin, fields = %kv, "{message}"),
        }
    }
}

impl plugin_0_1::log::Host for PluginState {
    fn log(
        &mut self,
        level: plugin_0_1::log::Level,
        message: String,
        fields: Vec<(String, String)>,
    ) {
        use plugin_0_1::log::Level as Old;
        let level = match level {
            Old::Trace => log::Level::Trace,
            Old::Debug => log::Level::Debug,
            Old::Info => log::Level::Info,
            Old::Warn => log::Level::Warn,
            Old::Error => log::Level::Error,
        };
        log::Host::log(self, level, message, fields);
    }
}
