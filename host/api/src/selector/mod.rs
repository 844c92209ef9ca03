//! Label and field selectors: parsing, validation, matching and printing.
//!
//! This module owns the two selector languages a Kubernetes client speaks to the API
//! server, with the semantics of `k8s.io/apimachinery/pkg/labels` and `pkg/fields`:
//!
//! - [`LabelSelector`]: the `?labelSelector=` string form (`app=web,tier in (a,b),!canary`)
//!   and the structured `metav1.LabelSelector` of Deployments, ReplicaSets and the like
//!   ([`LabelSelector::from_k8s`]). Matching reads labels through a closure so callers
//!   can match maps, JSON objects or anything else without copying.
//! - [`FieldSelector`]: the `?fieldSelector=` string form (`spec.nodeName=node-1`). Which
//!   fields a resource supports is the server's business; [`FieldSelector::fields`] lets it
//!   refuse the rest, and [`FieldSelector::exact_match`] lets it narrow a scan.
//!
//! Both print back to their canonical string form through [`std::fmt::Display`].

mod field;
mod label;
mod parse;
#[cfg(test)]
mod test_support;
mod validation;

pub use field::{FieldOp, FieldRequirement, FieldSelector, escape_field_value};
pub use label::{LabelOp, LabelSelector, Requirement};
pub use validation::validate_key;

/// Why a selector could not be parsed or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// The label selector string does not follow the grammar.
    #[error(
        "unable to parse label selector: at position {position}: found {}, expected: {expected}",
        describe_found(.found)
    )]
    Syntax {
        /// Byte offset of the offending token in the selector string.
        position: usize,
        /// The offending token; `None` at the end of the string.
        found: Option<String>,
        /// What the grammar allows here.
        expected: &'static str,
    },

    /// A label key is not a qualified name (`[prefix/]name`).
    #[error("invalid label key \"{key}\": {reason}")]
    InvalidKey { key: String, reason: &'static str },

    /// A label value is not valid for its key.
    #[error("invalid label value \"{value}\" for key \"{key}\": {reason}")]
    InvalidValue {
        key: String,
        value: String,
        reason: &'static str,
    },

    /// An operator got the wrong number of values.
    #[error("invalid requirement on label key \"{key}\": {reason}, got {count}")]
    ValueCount {
        key: String,
        reason: &'static str,
        count: usize,
    },

    /// A `matchExpressions` entry names an operator Kubernetes does not know.
    #[error(
        "\"{0}\" is not a valid label selector operator; expected In, NotIn, Exists or DoesNotExist"
    )]
    UnknownOperator(String),

    /// A field selector term has no `=`, `==` or `!=`.
    #[error(
        "invalid field selector \"{selector}\": can't understand \"{term}\"; expected field=value, field==value or field!=value"
    )]
    FieldTerm { selector: String, term: String },

    /// A field selector value contains a backslash that escapes nothing escapable.
    #[error(
        "invalid field selector term \"{term}\": invalid escape sequence \"{sequence}\"; only \\\\, \\, and \\= are allowed"
    )]
    FieldEscape { term: String, sequence: String },

    /// A field selector value contains a bare `,` or `=`, which must be escaped.
    #[error(
        "invalid field selector term \"{term}\": unescaped '{character}' in value; write it as '\\{character}'"
    )]
    FieldUnescaped { term: String, character: char },
}

/// Result of selector operations.
pub type Result<T, E = SelectorError> = std::result::Result<T, E>;

fn describe_found(found: &Option<String>) -> String {
    match found {
        Some(token) => format!("'{token}'"),
        None => "end of string".to_owned(),
    }
}
