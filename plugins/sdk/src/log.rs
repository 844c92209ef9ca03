//! Logging into the host's log (the WIT `log` import), where each record is tagged
//! with the plugin's name.
//!
//! ```
//! use trellis_plugin::log;
//! log::info("defaulted resources");
//! log::with_fields(log::Level::Warn, "image outside the allow-list", &[("image", "evil.io/x")]);
//! ```

pub use crate::imports::Level;

/// Writes one record with structured `fields` (key/value pairs).
pub fn with_fields(level: Level, message: &str, fields: &[(&str, &str)]) {
    crate::imports::current().log(level, message, fields);
}

pub fn trace(message: &str) {
    with_fields(Level::Trace, message, &[]);
}

pub fn debug(message: &str) {
    with_fields(Level::Debug, message, &[]);
}

pub fn info(message: &str) {
    with_fields(Level::Info, message, &[]);
}

pub fn warn(message: &str) {
    with_fields(Level::Warn, message, &[]);
}

pub fn error(message: &str) {
    with_fields(Level::Error, message, &[]);
}
