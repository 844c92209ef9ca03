//! Logging into the host's log (the WIT `log` import), where each record is tagged
//! with the plugin's name.
//!
//! ```
//! use trellis_plugin::log;
//! log::info("defaulted resources");
//! log::with_fields(log::Level::Warn, "image outside the allow-list", &[("image", "evil.io/x")]);
//! ```

use std::fmt;

/// Severity, as the WIT `log.level` enum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Trace => "TRACE",
            Level::Debug => "DEBUG",
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        })
    }
}

/// Writes one record with structured `fields` (key/value pairs).
pub fn with_fields(level: Level, message: &str, fields: &[(&str, &str)]) {
    crate::host::current().log(level, message, fields);
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

/// One line: `INFO message key=value ...`, as the stderr fallback and the harness
/// print it.
pub(crate) fn format_record(level: Level, message: &str, fields: &[(&str, &str)]) -> String {
    let mut line = format!("{level} {message}");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v:?}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_print_fields_quoted() {
        assert_eq!(
            format_record(Level::Warn, "denied", &[("image", "a b"), ("n", "1")]),
            r#"WARN denied image="a b" n="1""#
        );
    }
}
