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
}

impl LeaderElection {
    /// A candidate `identity` for the lease `namespace/name`, held for `lease` per renewal.
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str, lease: Duration) -> Self {
        LeaderElection { api: Api::namespaced(client, namespace), name: name.to_string(), identity: identity.to_string(), lease }
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
        let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
            (Some(MicroTime(t)), Some(secs)) => Timestamp::now().as_millisecond() > t.as_millisecond() + i64::from(secs) * 1000,
            _ => true,
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
    /// renewed in time.
    pub async fn keep(&self) -> String {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.lease / 3).await;
            match self.try_acquire().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => return format!("lease {} taken by another replica", self.name),
                Err(e) if last_renewal.elapsed() < self.lease * 2 / 3 => tracing::warn!(error = %e, "lease renewal failed; retrying"),
                Err(e) => return format!("lease {} not renewed in time: {e}", self.name),
            }
        }
    }
}
