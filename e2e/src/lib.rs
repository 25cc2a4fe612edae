//! Weir's end-to-end scenario suite, run against a real cluster.
//!
//! This crate holds no scenarios yet: they arrive with the end-to-end issue, after the
//! operator.
