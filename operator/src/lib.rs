//! Weir's Kubernetes operator: reconciles `StreamJob` resources into runtime pods, savepoints
//! before upgrades, kills pods when a savepoint on cancel fails, and relaunches failed jobs
//! from the newest valid retained checkpoint.
//!
//! So far this crate holds the pure lifecycle planner ([`plan`]) and the builders of a job's
//! children ([`children`]); the controller that observes, applies and writes status around
//! them is the rest of the operator issue.

pub mod children;
pub mod plan;
