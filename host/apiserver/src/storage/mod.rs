//! Between the registry and the store: the watch cache (one store watch that every
//! client watch and lister shares) and listers (cached reads fenced by this server's
//! writes).
//!
//! # Layout
//! - [`watch_cache`]: the store watch, its window of recent events and the stored-object
//!   codec.
//! - [`lister`]: cached reads for admission steps.
//! - [`metered`]: the store with every call timed for `/metrics`.

pub mod lister;
pub mod metered;
pub mod watch_cache;
