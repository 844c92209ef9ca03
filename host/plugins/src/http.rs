//! One HTTP/1.1 GET at a time, for fetching `https://` modules: [`trellis_oci::http`],
//! which also carries the `oci://` pulls (HTTPS verified against the system's roots,
//! plain HTTP only to loopback addresses).

pub use trellis_oci::http::get;
