//! Store plugins of timer-service, one module per store behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP.

#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;
