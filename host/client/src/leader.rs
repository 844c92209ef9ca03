//! Leader election over a `coordination.k8s.io/v1` Lease, as client-go's
//! `leaderelection`: of several processes running the same loops, one leads and the
//! others wait to take over.
//!
//! - A candidate tries to acquire the Lease every `retry_period`. It may take it when
//!   it is free (no holder) or when the holder has not renewed it within
//!   `lease_duration` *as this candidate observed it*: expiry is judged by the local
//!   clock from the moment the candidate last saw the record change, never by
//!   comparing the holder's timestamps with ours, so clock skew cannot hand the lease
//!   over early.
//! - Every write is a compare-and-swap on the Lease's resourceVersion: two candidates
//!   can never both believe their write won.
//! - The leader renews every `retry_period`; if it cannot renew for `renew_deadline`,
//!   it stops leading (its work is cancelled) before anyone else may take the lease.
//! - A leader that finishes its work hands the lease back (clears the holder), so a
//!   successor need not wait out the duration.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::time::Instant;
use tracing::{info, warn};

/// Kubernetes' defaults (kube-scheduler's and kube-controller-manager's flags).
#[derive(Clone, Copy, Debug)]
pub struct LeaderConfig {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl Default for LeaderConfig {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// One candidate for the Lease `namespace/name`, known as `identity`.
#[derive(Clone, Debug)]
pub struct LeaderElector {
    leases: Api<Lease>,
    name: String,
    identity: String,
    config: LeaderConfig,
}

/// How a run of [`LeaderElector::run`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The work finished while leading; the lease was handed back.
    Finished,
    /// The lease could not be renewed within the deadline; the work was stopped.
    Lost,
}

/// What the candidate saw of the Lease the last time it read it.
struct Observed {
    /// The record (holder, renew time, transitions) as read.
    record: Option<Lease>,
    /// When, by the local clock, the record last changed.
    changed_at: Instant,
}

impl LeaderElector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        config: LeaderConfig,
    ) -> Self {
        Self {
            leases: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            config,
        }
    }

    /// Waits until this candidate leads, then runs `work` for as long as it leads.
    /// Returns when `work` finishes ([`Outcome::Finished`]) or the lease is lost
    /// ([`Outcome::Lost`], `work` dropped).
    pub async fn run<F, Fut>(&self, work: F) -> Outcome
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut observed = Observed {
            record: None,
            changed_at: Instant::now(),
        };
        loop {
            match self.try_acquire_or_renew(&mut observed).await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    warn!(lease = %self.name, error = %e, "reading or taking the lease failed")
                }
            }
            tokio::time::sleep(self.config.retry_period).await;
        }
        info!(lease = %self.name, identity = %self.identity, "leading");
        let work = work();
        tokio::pin!(work);
        let mut renewed_at = Instant::now();
        let mut tick = tokio::time::interval_at(
            Instant::now() + self.config.retry_period,
            self.config.retry_period,
        );
        loop {
            tokio::select! {
                () = &mut work => {
                    self.release().await;
                    return Outcome::Finished;
                }
                _ = tick.tick() => {
                    match tokio::time::timeout(
                        self.config.renew_deadline,
                        self.try_acquire_or_renew(&mut observed),
                    ).await {
                        Ok(Ok(true)) => renewed_at = Instant::now(),
                        Ok(Ok(false)) => {
                            warn!(lease = %self.name, "another candidate holds the lease");
                            return Outcome::Lost;
                        }
                        Ok(Err(e)) => warn!(lease = %self.name, error = %e, "renewing the lease failed"),
                        Err(_) => {}
                    }
                    if renewed_at.elapsed() >= self.config.renew_deadline {
                        warn!(lease = %self.name, "the lease was not renewed within the deadline; stopping");
                        return Outcome::Lost;
                    }
                }
            }
        }
    }

    fn now() -> MicroTime {
        MicroTime(jiff::Timestamp::now())
    }

    fn seconds(d: Duration) -> i32 {
        i32::try_from(d.as_secs().max(1)).unwrap_or(i32::MAX)
    }

    /// One attempt: `true` when this candidate holds the lease afterwards.
    async fn try_acquire_or_renew(&self, observed: &mut Observed) -> Result<bool, kube::Error> {
        let now = Self::now();
        let Some(current) = self.leases.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(Self::seconds(self.config.lease_duration)),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.leases.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    observed.record = Some(created);
                    observed.changed_at = Instant::now();
                    Ok(true)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = current.spec.clone().unwrap_or_default();
        if observed.record.as_ref().map(|r| &r.spec) != Some(&current.spec) {
            observed.record = Some(current.clone());
            observed.changed_at = Instant::now();
        }
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let mine = holder == self.identity;
        let duration = spec
            .lease_duration_seconds
            .map_or(self.config.lease_duration, |s| {
                Duration::from_secs(u64::try_from(s).unwrap_or(0))
            });
        if !holder.is_empty() && !mine && observed.changed_at.elapsed() < duration {
            return Ok(false);
        }
        let mut lease = current;
        let transitions = spec.lease_transitions.unwrap_or(0);
        lease.spec = Some(LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(Self::seconds(self.config.lease_duration)),
            acquire_time: if mine {
                spec.acquire_time.clone()
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if mine { transitions } else { transitions + 1 }),
            ..spec
        });
        // The resourceVersion read makes this a compare-and-swap.
        match self
            .leases
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => {
                observed.record = Some(written);
                observed.changed_at = Instant::now();
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Hands the lease back: no holder, so a successor takes it at its next try.
    async fn release(&self) {
        let Ok(Some(mut lease)) = self.leases.get_opt(&self.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(Self::now());
        if let Err(e) = self
            .leases
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            warn!(lease = %self.name, error = %e, "handing the lease back failed");
        }
    }
}
