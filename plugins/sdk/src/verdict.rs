//! What an admission plugin answers.

use std::fmt;

/// A Kubernetes-style failure: the HTTP code, a machine-readable reason and the
/// message `kubectl` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: u16,
    pub reason: String,
    pub message: String,
}

impl Status {
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// 403 Forbidden: a policy refuses the request.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }

    /// 422 Invalid: the object is malformed by the plugin's rules.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    /// 400 BadRequest: the request cannot be understood (e.g. the object does not
    /// decode into the expected type).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 500 InternalError: the plugin itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} {})", self.message, self.code, self.reason)
    }
}

impl std::error::Error for Status {}

/// A validating plugin's answer: allowed or denied, with warnings for the client.
///
/// ```
/// use trellis_plugin::Verdict;
/// let v = Verdict::deny("privileged containers are not allowed");
/// assert!(!v.is_allowed());
/// let w = Verdict::allow().warn("the image has no digest");
/// assert_eq!(w.warnings(), ["the image has no digest"]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub(crate) denial: Option<Status>,
    pub(crate) warnings: Vec<String>,
}

impl Verdict {
    pub fn allow() -> Self {
        Self {
            denial: None,
            warnings: Vec::new(),
        }
    }

    /// Denied with 403 Forbidden and `message`, which the client shows as is.
    pub fn deny(message: impl Into<String>) -> Self {
        Self::deny_with(Status::forbidden(message))
    }

    /// Denied with a chosen status.
    pub fn deny_with(status: Status) -> Self {
        Self {
            denial: Some(status),
            warnings: Vec::new(),
        }
    }

    /// Adds a warning, shown by `kubectl` as `Warning: ...` whether or not the
    /// request is allowed.
    pub fn warn(mut self, warning: impl Into<String>) -> Self {
        self.warnings.push(warning.into());
        self
    }

    pub fn is_allowed(&self) -> bool {
        self.denial.is_none()
    }

    /// The denial, when denied.
    pub fn status(&self) -> Option<&Status> {
        self.denial.as_ref()
    }

    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

impl From<Status> for Verdict {
    fn from(status: Status) -> Self {
        Self::deny_with(status)
    }
}
