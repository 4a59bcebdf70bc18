//! Store plugins of timer-service, one folder per store behind its cargo feature. Each knows its
//! SDK and `timer-core`, nothing of other plugins or of HTTP; each exports a
//! [`StorePlugin`](timer_core::StorePlugin) that [`PLUGINS`] lists.

use timer_core::known;
use timer_core::plugin::{Registry, StorePlugin};

#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// Every store kind, with its descriptor when its cargo feature is compiled in. A new store is
/// its folder, its feature in Cargo.toml and one line here.
pub const PLUGINS: Registry<StorePlugin> = Registry(&[
    known!("memory", memory),
    known!("sqlite", sqlite),
    known!("postgres", postgres),
]);

#[cfg(test)]
mod tests {
    #[test]
    fn registry_lines_name_their_plugins() {
        for known in super::PLUGINS.0 {
            if let Some(plugin) = known.plugin {
                assert_eq!(plugin.kind, known.kind);
            }
        }
    }
}
