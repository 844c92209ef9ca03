//! Rotation, as the kubelet's certificate manager: a new certificate when 70–90 %
//! (jittered) of the current one's lifetime has passed, retried with back-off.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};
use trellis_api::Shutdown;

use super::transport::Identity;
use super::{Credentials, Files, request_certificate};

/// The first wait before a failed rotation is tried again; doubled up to a minute.
const ROTATION_RETRY: Duration = Duration::from_secs(1);

/// When to rotate a certificate valid from `not_before` to `not_after` (Unix seconds):
/// at 70–90 % of its lifetime, as kubelet's certificate manager, by `jitter` in [0, 1).
pub fn rotation_deadline(not_before: i64, not_after: i64, jitter: f64) -> i64 {
    let lifetime = (not_after - not_before).max(0) as f64;
    not_before + (lifetime * (0.7 + 0.2 * jitter.clamp(0.0, 1.0))) as i64
}

pub(super) async fn rotate(
    mut creds: Credentials,
    identity: Arc<Identity>,
    client: kube::Client,
    files: Files,
    node_name: String,
    duration: Option<u64>,
    stopped: Shutdown,
) {
    let mut retry = ROTATION_RETRY;
    loop {
        let wait = match trellis_pki::cert_validity(&creds.cert_pem) {
            Ok((not_before, not_after)) => {
                let deadline = rotation_deadline(not_before, not_after, rand::random::<f64>());
                let now = jiff::Timestamp::now().as_second();
                // At least a second apart, whatever the certificate says.
                Duration::from_secs(u64::try_from(deadline - now).unwrap_or(0).max(1))
            }
            Err(e) => {
                warn!(error = %format!("{e:#}"), "cannot read the node's certificate; not rotating it");
                return;
            }
        };
        info!(node = %node_name, in_seconds = wait.as_secs(), "certificate rotation scheduled");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stopped.wait() => return,
        }
        let rotated = async {
            let (cert_pem, key_pem) =
                request_certificate(client.clone(), &node_name, duration).await?;
            let next = Credentials {
                cert_pem,
                key_pem,
                ..creds.clone()
            };
            files.store(&next, &node_name)?;
            identity.replace(&next)?;
            anyhow::Ok(next)
        };
        let rotated = tokio::select! {
            r = rotated => r,
            _ = stopped.wait() => return,
        };
        match rotated {
            Ok(next) => {
                info!(node = %node_name, "certificate rotated");
                creds = next;
                retry = ROTATION_RETRY;
            }
            Err(e) => {
                warn!(node = %node_name, error = %format!("{e:#}"), "failed to rotate the certificate; retrying");
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    _ = stopped.wait() => return,
                }
                retry = (retry * 2).min(Duration::from_secs(60));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_falls_between_seventy_and_ninety_percent() {
        assert_eq!(rotation_deadline(0, 1000, 0.0), 700);
        assert_eq!(rotation_deadline(0, 1000, 0.999_999), 899);
        assert_eq!(rotation_deadline(100, 100, 0.5), 100);
    }
}
