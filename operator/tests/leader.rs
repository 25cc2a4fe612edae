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

/// Expiry is judged by how long this process saw the same record, never by comparing another
/// host's clock with ours: a holder whose clock runs an hour behind is not robbed of a lease it
/// renews, and a holder whose clock runs an hour ahead does not keep a lease it abandoned.
#[tokio::test(flavor = "multi_thread")]
async fn expiry_ignores_the_holders_clock() {
    use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    use kube::api::{Api, PostParams};

    let server = TestApiServer::start().expect("API server starts");
    let client = server.client().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let write = |name: &'static str, holder: &'static str, offset_secs: i64| {
        let leases = leases.clone();
        async move {
            let renew = MicroTime(Timestamp::now().checked_add(SignedDuration::from_secs(offset_secs)).unwrap());
            let spec = LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(2),
                renew_time: Some(renew.clone()),
                acquire_time: Some(renew),
                ..LeaseSpec::default()
            };
            match leases.get_opt(name).await.unwrap() {
                Some(mut l) => {
                    l.spec = Some(spec);
                    leases.replace(name, &PostParams::default(), &l).await.unwrap();
                }
                None => {
                    let l = Lease {
                        metadata: kube::api::ObjectMeta { name: Some(name.into()), ..Default::default() },
                        spec: Some(spec),
                    };
                    leases.create(&PostParams::default(), &l).await.unwrap();
                }
            }
        }
    };
    // A live holder with a clock an hour behind: its renewals look an hour old.
    write("behind", "slow-clock", -3600).await;
    let b = LeaderElection::new(client.clone(), "default", "behind", "b", Duration::from_secs(2));
    for _ in 0..4 {
        assert!(!b.try_acquire().await.unwrap(), "a lease renewed within its duration is not taken");
        tokio::time::sleep(Duration::from_millis(700)).await;
        write("behind", "slow-clock", -3600).await; // it renews
    }
    // A dead holder with a clock an hour ahead: its last renewal looks an hour in the future.
    write("ahead", "fast-clock", 3600).await;
    let c = LeaderElection::new(client.clone(), "default", "ahead", "c", Duration::from_secs(2));
    let started = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(10), c.acquire())
        .await
        .expect("c takes the abandoned lease within its duration")
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1900), "not before the lease duration passed");
}

/// A renewal that hangs (an API server that accepts the connection and never answers) must
/// not keep a leader acting past its lease: `keep` gives up within two thirds of the lease,
/// before another replica may take over. (Renewals used to have no timeout of their own.)
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_renewal_ends_leadership_before_the_lease_expires() {
    // Accepts connections and reads them, never answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let lease = Duration::from_secs(3);
    let leader = LeaderElection::new(client, "default", "weir-operator", "a", lease);
    let started = tokio::time::Instant::now();
    let lost = tokio::time::timeout(Duration::from_secs(20), leader.keep())
        .await
        .expect("keep returns while the API server hangs");
    assert!(lost.contains("not renewed in time"), "{lost}");
    assert!(started.elapsed() < lease, "gave up after {:?}, not within the lease ({lease:?})", started.elapsed());
}
