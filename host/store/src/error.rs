//! The errors every [`Store`](crate::Store) backend returns.
//!
//! Variants name what went wrong for the caller (a conflict, a compacted revision, a
//! watcher that fell behind) so the API server can map each to its HTTP status in one
//! place; backend failures carry the step that failed and their source.

use std::path::PathBuf;

use crate::{KeyValue, Revision};

pub type Result<T, E = Error> = std::result::Result<T, E>;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("key {key:?} already exists")]
    AlreadyExists { key: String },

    #[error("key {key:?} not found")]
    NotFound { key: String },

    /// A compare-and-swap failed; `current` is the key's value now.
    #[error(
        "conflict on key {key:?}: expected modification revision {expected}, found {}",
        current.mod_revision
    )]
    Conflict {
        key: String,
        expected: Revision,
        current: Box<KeyValue>,
    },

    /// The requested revision is older than the compacted one.
    #[error("revision {requested} has been compacted{}", compacted.map(|c| format!(" (compacted revision {c})")).unwrap_or_default())]
    Compacted {
        requested: Revision,
        compacted: Option<Revision>,
    },

    #[error("revision {requested} is newer than the current revision {current}")]
    FutureRevision {
        requested: Revision,
        current: Revision,
    },

    #[error("value for key {key:?} is {size} bytes, over the limit of {limit} bytes")]
    ValueTooLarge {
        key: String,
        size: usize,
        limit: usize,
    },

    #[error("key must not be empty")]
    EmptyKey,

    /// The watcher did not keep up and was ended so it could not hold back writers or
    /// other watchers. Watching again from `resume_from` loses nothing, as long as that
    /// revision is still in history.
    #[error("watcher fell behind and was ended; resume from revision {resume_from}")]
    WatcherLagged { resume_from: Revision },

    #[error("store is closed")]
    Closed,

    #[error("open store file {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: BoxError,
    },

    #[error("store file {} is corrupt: {detail}", path.display())]
    Corrupt { path: PathBuf, detail: String },

    /// The write was not committed (for example the disk is full); nothing of it is
    /// visible and no revision was used.
    #[error("commit write transaction")]
    Commit(#[source] BoxError),

    #[error("{step}")]
    Backend {
        step: &'static str,
        #[source]
        source: BoxError,
    },
}

impl Error {
    pub(crate) fn backend(step: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            step,
            source: source.into(),
        }
    }
}
