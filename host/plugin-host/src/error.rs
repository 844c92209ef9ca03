//! Why a plugin could not be loaded ([`LoadError`]) and why a call failed
//! ([`PluginError`], which names the plugin).

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadErrorReason {
    /// Not a component, or not one wasmtime can compile.
    CompileFailed,
    /// Imports something the host does not provide, or lacks the world's exports.
    WrongWorld,
    /// Trapped or timed out while starting.
    InstantiateFailed,
    /// `validate-configuration` refused the configuration.
    ConfigurationRejected,
}

impl LoadErrorReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CompileFailed => "CompileFailed",
            Self::WrongWorld => "WrongWorld",
            Self::InstantiateFailed => "InstantiateFailed",
            Self::ConfigurationRejected => "ConfigurationRejected",
        }
    }
}

/// Why a plugin could not be loaded; the last good version (if any) keeps serving.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct LoadError {
    pub reason: LoadErrorReason,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginErrorKind {
    Timeout(Duration),
    Trapped(String),
    /// The instance hit its memory cap (bytes).
    OutOfMemory(usize),
    /// The plugin answered something the host cannot use.
    BadAnswer(String),
}

/// A failed call, named: `plugin NAME (validating, v sha256:…) timed out after 100ms`.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{label} {}", describe(.kind))]
pub struct PluginError {
    pub label: String,
    pub kind: PluginErrorKind,
}

fn describe(kind: &PluginErrorKind) -> String {
    match kind {
        PluginErrorKind::Timeout(t) => format!("timed out after {}ms", t.as_millis()),
        PluginErrorKind::Trapped(why) => format!("trapped: {why}"),
        PluginErrorKind::OutOfMemory(limit) => {
            format!("exceeded its {} MiB memory limit", limit >> 20)
        }
        PluginErrorKind::BadAnswer(what) => format!("returned {what}"),
    }
}

/// The first line of an error's message: wasmtime's carry a backtrace of causes.
pub(crate) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}
