//! Leader election with a `coordination.k8s.io/v1` Lease: one operator replica reconciles, the
//! others wait; a leader that cannot renew in time stops (the process exits), so two replicas
//! never act on the same job at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

/// One candidate for the lease.
pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    lease: Duration,
    /// The other holder's record as last seen, and when (by this process's monotonic clock).
    observed: std::sync::Mutex<Option<(ObservedRecord, tokio::time::Instant)>>,
}

/// What identifies one renewal of a lease by its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ObservedRecord {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    resource_version: Option<String>,
}

impl LeaderElection {
    /// A candidate `identity` for the lease `namespace/name`, held for `lease` per renewal.
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str, lease: Duration) -> Self {
        LeaderElection {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            lease,
            observed: std::sync::Mutex::new(None),
        }
    }

    fn spec(&self, acquired: Option<MicroTime>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease.as_secs().max(1) as i32),
            acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
            renew_time: Some(now),
            ..LeaseSpec::default()
        }
    }

    /// Takes or renews the lease if it is free, expired or already ours; `false` when another
    /// holder has it.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: kube::api::ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(self.spec(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        // Expiry is judged as client-go does: by how long *this* process has seen the same
        // record unchanged, on its own monotonic clock. The holder's renewTime was written by
        // another host's clock, which may be ahead or behind ours.
        let record = ObservedRecord {
            holder: spec.holder_identity.clone(),
            renew_time: spec.renew_time.clone(),
            resource_version: lease.metadata.resource_version.clone(),
        };
        let now = tokio::time::Instant::now();
        let duration = spec.lease_duration_seconds.map(|s| Duration::from_secs(s.max(0) as u64));
        let expired = {
            let mut observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
            let since = match observed.as_ref() {
                Some((seen, at)) if *seen == record => *at,
                _ => {
                    *observed = Some((record, now));
                    now
                }
            };
            spec.holder_identity.is_none() || duration.is_none_or(|d| now.duration_since(since) >= d)
        };
        if !ours && !expired {
            return Ok(false);
        }
        lease.spec = Some(self.spec(if ours { spec.acquire_time } else { None }));
        // The resourceVersion makes this a compare-and-swap: a racing candidate gets 409.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits until this candidate holds the lease.
    pub async fn acquire(&self) -> Result<(), kube::Error> {
        loop {
            if self.try_acquire().await? {
                return Ok(());
            }
            tokio::time::sleep(self.lease / 3).await;
        }
    }

    /// Renews the lease every third of its duration; returns when it was lost or could not be
    /// renewed in time. Each renewal attempt is bounded by a third of the lease, so a hung
    /// request cannot outlast the lease: the leader gives up while its lease is still valid
    /// (a renewal deadline of two thirds of the lease), before another replica may take over.
    pub async fn keep(&self) -> String {
        let mut last_renewal = tokio::time::Instant::now();
        let deadline = self.lease * 2 / 3;
        loop {
            tokio::time::sleep(self.lease / 3).await;
            let attempt = tokio::time::timeout(self.lease / 3, self.try_acquire()).await;
            match attempt {
                Ok(Ok(true)) => last_renewal = tokio::time::Instant::now(),
                Ok(Ok(false)) => return format!("lease {} taken by another replica", self.name),
                Ok(Err(e)) if last_renewal.elapsed() < deadline => {
                    tracing::warn!(error = %e, "lease renewal failed; retrying")
                }
                Err(_) if last_renewal.elapsed() < deadline => tracing::warn!("lease renewal timed out; retrying"),
                Ok(Err(e)) => return format!("lease {} not renewed in time: {e}", self.name),
                Err(_) => return format!("lease {} not renewed in time: renewals time out", self.name),
            }
        }
    }
}
