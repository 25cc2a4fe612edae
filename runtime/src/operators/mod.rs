//! Built-in operators.

pub mod accumulators;
pub mod keyed;
pub mod stateless;
pub mod window;
