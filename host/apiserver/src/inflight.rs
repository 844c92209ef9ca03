//! The limits on requests in flight (kube-apiserver's max-in-flight filter): how many
//! read-only and mutating requests are served at once before new ones get 429.

use std::sync::Arc;

use trellis_api::ApiError;

/// kube-apiserver's `--max-requests-inflight` and `--max-mutating-requests-inflight`:
/// requests past them get 429 with `Retry-After` instead of queueing without bound.
/// Long-running requests (watches) and `system:masters` are not counted, so an
/// administrator can still reach a server that clients flood; nor are the Leases that
/// keep the cluster standing (see [`Inflight::is_heartbeat`]), which Kubernetes' API
/// Priority and Fairness serves at levels of their own.
#[derive(Debug)]
pub struct Inflight {
    readonly: Option<Arc<tokio::sync::Semaphore>>,
    mutating: Option<Arc<tokio::sync::Semaphore>>,
}

impl Inflight {
    /// Limits of `max_readonly` and `max_mutating` requests at once (as
    /// [`crate::state::Settings`] names them); 0: no limit.
    pub fn new(max_readonly: usize, max_mutating: usize) -> Self {
        let limit = |n: usize| (n > 0).then(|| Arc::new(tokio::sync::Semaphore::new(n)));
        Self {
            readonly: limit(max_readonly),
            mutating: limit(max_mutating),
        }
    }

    /// A slot for one request, held until it is dropped; `None` when the request is not
    /// counted.
    pub fn admit(
        &self,
        user: &trellis_api::UserInfo,
        path: &str,
        mutating: bool,
        long_running: bool,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, ApiError> {
        if long_running
            || user.in_group(trellis_api::user::groups::MASTERS)
            || Self::is_heartbeat(user, path)
        {
            return Ok(None);
        }
        let pool = if mutating {
            &self.mutating
        } else {
            &self.readonly
        };
        let Some(pool) = pool else {
            return Ok(None);
        };
        pool.clone().try_acquire_owned().map(Some).map_err(|_| {
            let mut e = ApiError::new(
                429,
                trellis_api::status::Reason::TooManyRequests,
                "Too many requests, please try again later.",
            );
            e.details = Some(Box::new(trellis_api::status::StatusDetails {
                retry_after_seconds: Some(1),
                ..Default::default()
            }));
            e
        })
    }
}

impl Inflight {
    /// A Lease that keeps the cluster standing: the scheduler's or the controller
    /// manager's leader election in kube-system, or a node's heartbeat in its own
    /// Lease in kube-node-lease. Kubernetes' default flow schemas (`system-leader-election`,
    /// `system-node-high`) give these their own seats, so that a burst of other
    /// requests cannot cost a leader its lease or mark a node unready; here they are
    /// simply not counted. There are few of them: one a few seconds per component
    /// and node.
    pub fn is_heartbeat(user: &trellis_api::UserInfo, path: &str) -> bool {
        const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/";
        let Some(rest) = path.strip_prefix(LEASES) else {
            return false;
        };
        match rest.split_once("/leases/") {
            Some(("kube-system", name)) if !name.is_empty() && !name.contains('/') => {
                matches!(
                    user.name.as_str(),
                    "system:kube-scheduler" | "system:kube-controller-manager"
                )
            }
            // A node's own Lease only.
            Some(("kube-node-lease", name)) if !name.is_empty() && !name.contains('/') => {
                user.in_group("system:nodes")
                    && user.name.strip_prefix("system:node:") == Some(name)
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use trellis_api::UserInfo;

    use super::*;
    use crate::state::Settings;

    #[test]
    fn leases_that_keep_the_cluster_standing_pass_a_full_limit() {
        let settings = Settings {
            max_mutating_requests_inflight: 1,
            ..Settings::default()
        };
        let inflight = Inflight::new(
            settings.max_requests_inflight,
            settings.max_mutating_requests_inflight,
        );
        let someone = UserInfo::new("someone", ["system:authenticated"]);
        let pods = "/api/v1/namespaces/default/pods";
        let held = inflight.admit(&someone, pods, true, false).unwrap();
        assert!(held.is_some());
        assert_eq!(
            inflight
                .admit(&someone, pods, true, false)
                .unwrap_err()
                .code,
            429
        );

        let scheduler = UserInfo::new("system:kube-scheduler", ["system:authenticated"]);
        let node = UserInfo::new("system:node:n1", ["system:nodes"]);
        let election = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler";
        let heartbeat = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1";
        assert!(inflight.admit(&scheduler, election, true, false).is_ok());
        assert!(inflight.admit(&node, heartbeat, true, false).is_ok());
        // Anything else of theirs is counted.
        for (user, path) in [
            (
                &scheduler,
                "/apis/coordination.k8s.io/v1/namespaces/default/leases/x",
            ),
            (&scheduler, pods),
            (&node, election),
            (&someone, heartbeat),
            (
                &node,
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/",
            ),
            // Another node's Lease.
            (
                &node,
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n2",
            ),
        ] {
            assert!(
                inflight.admit(user, path, true, false).is_err(),
                "{} {path}",
                user.name
            );
        }
    }
}
