//! The runtime's records: what it knows of each sandbox, container and image, as
//! kept across restarts (JSON, see `store`). They name no other module of the
//! runtime: the stores keep them, the live state holds them, the handlers run them.
//! - [`sandbox`]: a pod sandbox as `RunPodSandbox` made it.
//! - [`container`]: a container, from `CreateContainer` to its exit.
//! - [`image`]: a pulled image and its kind, which tells the handler that runs it.

pub(crate) mod container;
pub(crate) mod image;
pub(crate) mod sandbox;

pub(crate) use container::{ContainerRecord, state_name};
pub(crate) use image::{ImageKind, ImageRecord};
pub(crate) use sandbox::SandboxRecord;

/// Nanoseconds since the Unix epoch, as CRI's timestamps are.
pub(crate) fn now_ns() -> i64 {
    jiff::Timestamp::now().as_nanosecond() as i64
}
