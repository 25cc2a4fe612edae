//! Weir's Kubernetes operator: reconciles `StreamJob` resources into runtime pods, savepoints
//! before upgrades, kills pods when a savepoint on cancel fails, and relaunches failed jobs
//! from the newest valid retained checkpoint.
//!
//! So far this crate holds the pure lifecycle planner ([`plan`]); the controller that observes,
//! applies and writes status around it is the rest of the operator issue.

pub mod plan;
