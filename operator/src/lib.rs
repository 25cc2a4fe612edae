//! Weir's Kubernetes operator: reconciles `StreamJob` resources into runtime pods, savepoints
//! before upgrades, kills pods when a savepoint on cancel fails, and relaunches failed jobs
//! from the newest valid retained checkpoint.
//!
//! The pure lifecycle planner is [`plan`]; [`controller`] runs its steps (observe, validate with
//! [`inputs`], plan, apply with the builders in [`children`], publish events, write status).
//! The runtime's control API is called through `weir_client`. What a tenant's job may make the
//! operator do with storage and credentials is decided in [`tenancy`].

pub mod children;
pub mod controller;
pub mod events;
pub mod inputs;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod plan;
pub mod runtime_pod;
pub mod tenancy;
