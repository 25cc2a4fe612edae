//! Weir's checkpoint protocol, storage layout, metadata format, validation and retention.
//!
//! The protocol ([`protocol`]) and the retention plan ([`retention::plan`]) are pure logic;
//! everything that touches storage goes through [`store::Storage`], whose paths all come from
//! [`layout`].

pub mod epoch;
pub mod format;
pub mod layout;
pub mod local;
pub mod metadata;
pub mod protocol;
pub mod recovery;
pub mod retention;
pub mod spare;
pub mod store;

pub use metadata::{CheckpointMetadata, FileDigest, FileRef, OperatorSnapshot, SnapshotKind, SubtaskSnapshot};
pub use store::{cloud_scheme, CloudSettings, CopiedBy, Storage, StorageError};
