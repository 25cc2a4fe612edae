//! Weir's Kubernetes operator: reconciles `StreamJob` resources into runtime pods, savepoints
//! before upgrades, kills pods when a savepoint on cancel fails, and relaunches failed jobs
//! from the newest valid retained checkpoint.
//!
//! So far this crate holds the pure lifecycle planner ([`plan`]), the builders of a job's
//! children ([`children`]) and the observers of pods and checkpoint storage ([`observe`]);
//! the controller that runs them in a loop, applies and writes status is the rest of the
//! operator issue.

pub mod children;
pub mod control_client;
pub mod controller;
pub mod inputs;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod plan;
