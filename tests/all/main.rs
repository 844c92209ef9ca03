//! Cross-crate and end-to-end tests of Trellis, in one binary (one link, one run).
//!
//! # Layout
//! - `apiserver`: the API server end to end, driven by the real kubectl (tables,
//!   apply, selectors, conflicts, validation, finalizers, namespaces, watch, paging,
//!   the status subresource, authentication and authorization, Pod Security, the
//!   workload, batch, storage and autoscaling APIs).
//! - `autoscaling`: HorizontalPodAutoscalers made by `kubectl autoscale` (current and
//!   1.20, `autoscaling/v2` and `/v1`) held within their bounds by the bundled
//!   autoscaler, through the scale subresource, with its conditions and events.
//! - `cgroups`: a process container's memory and CPU limits through the runtime's
//!   cgroups, measured by its CRI stats.
//! - `churn`: pods on the pod network come and go through a node and leave nothing of
//!   their network; the agent collects what gone pods left.
//! - `client`: `trellis-client` (kube-rs) against the server, remote and in-process:
//!   the verbs, identities held to their roles, shared informers.
//! - `containerd`: the node agent on a real containerd over CRI v1 (started by the
//!   test, as root): a busybox OCI image runs to completion, its log through kubectl; a
//!   long-running container is probed, then stopped gracefully when its pod is deleted.
//! - `controllers`: controller plugins run by `trellis-controllers`: informers, the
//!   key mapping, batched writes under the controller's identity, events.
//! - `daemonsets`: the DaemonSet controller on hollow nodes driven by kubectl: one pod
//!   per node that fits, a node that joins or is tainted, rolling update and roll back,
//!   failed pods replaced, `kubectl drain --ignore-daemonsets` (current and 1.20).
//! - `dns`: the cluster DNS server's records (ClusterIP, headless, ExternalName, PTR,
//!   pods, NXDOMAIN, TTL) over UDP and TCP from a server's Services and EndpointSlices,
//!   and forwarding of other names.
//! - `endpointslices`: the bundled Endpoints and EndpointSlice controllers: slices of
//!   at most 100, conditions, ports per pod, hostnames, zones, kubectl's tables.
//! - `eviction`: a node under memory pressure evicts its BestEffort pod first, is
//!   tainted and admits no new BestEffort pod; soft thresholds wait their grace period.
//! - `hollow`: hollow nodes (the agent on fake runtimes) running a Deployment.
//! - `incluster`: the `kubernetes` and `kube-dns` Services and every API server's
//!   address in the `kubernetes` Endpoints and EndpointSlice, the certificate's names.
//! - `jobs`: Jobs, the TTL controller and CronJobs on a real node, by Kubernetes'
//!   conformance names, with kubectl current and 1.20.
//! - `join`: bootstrap tokens and CertificateSigningRequests: authentication,
//!   requester, auto-approval, manual approval, signing, validation.
//! - `layout`: no import circle between the modules of any crate, host or plugin.
//! - `metrics`: the aggregation layer (APIServices proxied, discovery, availability)
//!   and the metrics server behind `kubectl top nodes|pods` (current and 1.20).
//! - `multinode`: two test hosts in network namespaces of their own, joined by a
//!   bridge: pods across nodes over host-gw and VXLAN without NAT, the Granular Checks.
//! - `node`: the node agent and the runtime over CRI: pods' lifecycle and status,
//!   restarts, env and volumes, graceful deletion, an agent restart.
//! - `node_services`: a node's service proxy and node-local DNS (`trellis-dns`) for
//!   its pods: names, ClusterIPs, UDP, a WASM program's lookups, an agent restart.
//! - `plugins`: the WASM plugin host's limits and failures, and plugins in the API
//!   server's admission and initializer chains.
//! - `pod_files`: a `process` pod's hostname, `/etc/hosts`, `resolv.conf` and volumes
//!   in its own mount namespace, and exec seeing the same.
//! - `pod_network`: the runtime's default network made in-process; an operator's
//!   conflist through the CNI plugins.
//! - `proxy`: the service proxy's table in a namespace of its own: ClusterIP, NodePort,
//!   UDP, affinity, refusal, hairpin, drift repair, a restart.
//! - `port_forward`: `kubectl port-forward` (current and 1.20) through the API server
//!   and the node into pods' own network namespaces.
//! - `resources`: `process` pods held to their limits (OOMKilled with back-off, a CPU
//!   hog throttled, measured from its cgroup), their cgroups per QoS class, the user
//!   and groups they ask for, `runAsNonRoot`, the Node's allocatable.
//! - `runtime`: `trellis-runtime` over real gRPC, as a kubelet drives a CRI runtime:
//!   WASM programs and `wasi:http` servers, native processes, images from files and
//!   from an OCI registry, stops, limits, a runtime restart.
//! - `sandbox`: what a sandboxed `process` container can reach (not the node's data,
//!   credentials, other pods' volumes or processes) and who it runs as.
//! - `scheduler`: the scheduler with the bundled default plugins against a server.
//! - `services`: Services and cluster DNS on three test hosts: Kubernetes' Service and
//!   DNS conformance checks, hairpin, reject, UDP, traffic policies, an agent restart.
//! - `statefulsets`: the StatefulSet controller, with the garbage collector and the
//!   disruption controller, driven by kubectl: ordered and burst scaling, rolling
//!   update, roll back, partition, claims and their retention.
//! - `stats`: the node's Summary API and resource metrics through the API server's
//!   node proxy; `nodes/proxy` needed.
//! - `storage`: claims of the default `local-path` class provisioned on their first
//!   pod's node (two test hosts), bound, kept across pods; static volumes bound and
//!   released.
//! - `store`: the store conformance suite on both backends, the embedded backend's
//!   own checks (bad files, limits, reopen) and the crash test.
//! - `tokens`: projected ServiceAccount tokens refreshed in a running pod's volume, and
//!   dropped when it goes.
//! - `wasi_sockets`: a `wasi:cli` program's sockets and name lookups in its pod's
//!   network.
//! - `wasm_limits`: WASM containers' CPU limit and usage through the CRI.

mod apiserver;
mod autoscaling;
mod cgroups;
mod churn;
mod client;
mod containerd;
mod controllers;
mod daemonsets;
mod dns;
mod endpointslices;
mod eviction;
mod hollow;
mod incluster;
mod jobs;
mod join;
mod layout;
mod metrics;
mod multinode;
mod node;
mod node_services;
mod plugins;
mod pod_files;
mod pod_network;
mod port_forward;
mod proxy;
mod resources;
mod runtime;
mod sandbox;
mod scheduler;
mod services;
mod statefulsets;
mod stats;
mod storage;
mod store;
mod tokens;
mod wasi_sockets;
mod wasm_limits;
