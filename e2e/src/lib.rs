//! Weir's end-to-end tooling: a real kube-apiserver and etcd (built from the Kubernetes Go
//! modules by `e2e/tools/build-k8s.sh`) started on loopback for tests, and the scenario suite
//! that will run against a real cluster.

pub mod apiserver;
pub mod local_pods;
