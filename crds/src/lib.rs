//! Weir's public API types: the job graph model a user writes, its pure validation, and the
//! requests and responses of the runtime's control API, and (with the `kubernetes` feature, on by
//! default; the runtime turns it off) the `StreamJob` custom resource.
//! No I/O lives here.

pub mod compat;
pub mod control;
pub mod duration;
pub mod expr;
pub mod job;
#[cfg(feature = "kubernetes")]
pub mod streamjob;
pub mod validate;
pub mod yaml11;

pub use duration::HumanDuration;
pub use job::JobSpec;
#[cfg(feature = "kubernetes")]
pub use streamjob::{StreamJob, StreamJobSpec, StreamJobStatus};
pub use validate::{validate, ValidatedJob, ValidationErrors};
