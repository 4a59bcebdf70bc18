//! Migrations are append-only: a database keeps the checksum (SHA-384) of every migration it
//! applied, and sqlx refuses to start on it when a file of those changed. Each store lists the
//! checksums of its released migrations; its test fails when one changed or went away, and when
//! a new one is not listed yet (add its line in the same change).

use sqlx::migrate::Migrator;

/// Checks `migrator` against `released`: `(version, first 16 hex digits of the checksum)`.
pub(crate) fn assert_released(store: &str, migrator: &Migrator, released: &[(i64, &str)]) {
    let now: Vec<(i64, String)> = migrator
        .iter()
        .map(|m| {
            let hex: String = m.checksum.iter().map(|b| format!("{b:02x}")).collect();
            (m.version, hex[..16].to_owned())
        })
        .collect();
    for (i, (version, sum)) in released.iter().enumerate() {
        match now.get(i) {
            Some((v, s)) if v == version && s == sum => {}
            Some((v, s)) => panic!(
                "{store} migration {version} (checksum {sum}) was released: it must not change; \
                 found {v} with checksum {s}. Add a new migration instead."
            ),
            None => panic!("{store} migration {version} was released and is gone"),
        }
    }
    let unlisted: Vec<String> = now[released.len()..]
        .iter()
        .map(|(v, s)| format!("({v}, \"{s}\")"))
        .collect();
    assert!(
        unlisted.is_empty(),
        "new {store} migrations: add {} to its released list",
        unlisted.join(", ")
    );
}
