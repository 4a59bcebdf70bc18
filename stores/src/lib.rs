//! Store plugins of timer-service, one folder per store behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP; each exports a
//! [`StorePlugin`](timer_core::StorePlugin) that `PLUGINS` lists. A new store is its folder,
//! its feature in Cargo.toml and one line here.

/// What the sqlx-based stores share.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod sql;

timer_core::plugins! { StorePlugin:
    memory = "memory",
    sqlite = "sqlite",
    postgres = "postgres",
}
