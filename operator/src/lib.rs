//! Weir's Kubernetes operator: reconciles `StreamJob` resources into runtime pods, savepoints
//! before upgrades, kills pods when a savepoint on cancel fails, and relaunches failed jobs
//! from the newest valid retained checkpoint.
//!
//! This crate holds no code yet: the reconciler is the work of the operator issue, which
//! builds on the runtime's control API (`weir_crds::control`) and checkpoint storage
//! (`weir_checkpoint::recovery`).
