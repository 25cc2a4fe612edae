//! Leader election on a real API server: one holder at a time; a holder that stops renewing
//! loses the lease once it expires.

use std::time::Duration;

use weir_e2e::apiserver::TestApiServer;
use weir_operator::leader::LeaderElection;

#[tokio::test(flavor = "multi_thread")]
async fn one_leader_at_a_time_and_takeover_after_expiry() {
    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    let a = LeaderElection::new(client.clone(), "default", "weir-operator", "a", Duration::from_secs(2));
    let b = LeaderElection::new(client.clone(), "default", "weir-operator", "b", Duration::from_secs(2));
    assert!(a.try_acquire().await.unwrap());
    assert!(!b.try_acquire().await.unwrap(), "b must wait while a holds the lease");
    assert!(a.try_acquire().await.unwrap(), "a renews");
    // a stops renewing: b takes over once the lease expires.
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), b.acquire()).await.expect("b acquires after expiry").unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1500), "not before the lease expired");
    assert!(!a.try_acquire().await.unwrap(), "a lost it");
    // The loser's keep() reports the loss.
    let lost = tokio::time::timeout(Duration::from_secs(5), a.keep()).await.expect("a notices");
    assert!(lost.contains("taken by another replica"), "{lost}");
}
