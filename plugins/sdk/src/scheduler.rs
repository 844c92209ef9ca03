//! Scheduler plugins: the [`Plugin`] trait, the typed view of the cluster every plugin
//! of a component shares ([`Cluster`], [`NodeInfo`], [`PodInfo`]), and the
//! [`Framework`] that runs a component's plugins for the host, which
//! [`scheduler!`](crate::scheduler!) exports as the `scheduler` world.
//!
//! The host sends each node, and each pod placed on a node, once per change; the
//! view parses them once ([`Cluster::apply`]) and keeps what filters and scores read
//! most (requested resources, used host ports) precomputed per node, as
//! kube-scheduler's `NodeInfo` does. A cycle parses the pod being scheduled once.
//!
//! The same [`Framework`] runs natively: [`Framework::schedule`] filters and scores
//! like the host (without its sampling of nodes), so a plugin's table tests need no
//! host.
//!
//! # Layout
//! - [`interface`]: the [`Plugin`] trait, its extension points ([`Points`]), and
//!   what it answers ([`Status`], [`PreFilterResult`], [`Permit`]).
//! - [`types`]: [`PodInfo`], [`NodeInfo`], [`Resources`], [`ClusterEvent`].
//! - [`cluster`](mod@cluster): the [`Cluster`] view and the [`Change`]s the host sends.
//! - [`framework`]: the [`Framework`].

pub mod cluster;
pub mod framework;
pub mod interface;
pub mod types;

pub use cluster::{Change, Cluster};
pub use framework::{Framework, Rejection};
pub use interface::{
    Code, MAX_NODE_SCORE, Permit, Plugin, Points, PreFilterResult, Status, default_normalize,
};
pub use types::{
    ClusterEvent, DEFAULT_MEMORY_REQUEST, DEFAULT_MILLI_CPU_REQUEST, HostPort, NodeId, NodeInfo,
    PodInfo, Resources,
};
