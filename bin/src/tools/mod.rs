//! The tools of the binary: `bench` measures the configured store and broker, `fuzz` feeds
//! generated inputs to the command decoder.

pub mod bench;
pub mod fuzz;
