//! Migrations are append-only: a database keeps the checksum (SHA-384) of every migration it
//! applied, and sqlx refuses to start on it when a file of those changed. Each store lists the
//! checksums of its released migrations; its test fails when one changed or went away, and when
//! a new one is not listed yet (add its line in the same change).

#[cfg(test)]
use sqlx::migrate::Migrator;

/// Checks `migrator` against `released`: `(version, first 16 hex digits of the checksum)`.
#[cfg(test)]
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

/// The migrations from release 0.2.0 on (`migrations/<store>-releases/`), which the stores run
/// themselves under the release rules (`docs/src/operations/upgrades.md`): each file names, in a
/// line `-- oldest release: X.Y.Z`, the oldest release whose instances work with the schema once
/// it is applied. A migration that names a newer release than the one before it contracts: it
/// removes what older releases use. They are recorded in `timer_migrations`, not in sqlx's
/// table, so a 0.1.0 binary (which refuses a schema with a migration it does not know in sqlx's
/// table) still starts on a schema they changed, as long as none of them contracts.
pub(crate) mod releases {
    use semver::Version;
    use sqlx::migrate::{Migration, Migrator};
    use sqlx::{Database, Encode, Executor, IntoArguments, Type};
    use timer_core::{Error, Result};

    /// The release of this build (the workspace version).
    pub(crate) fn this_release() -> Result<Version> {
        release(env!("CARGO_PKG_VERSION"), "this build's version")
    }

    /// The release before the record: its binaries do not read it, and its instances do not
    /// say which release they run.
    pub(crate) const BEFORE_RECORDS: Version = Version::new(0, 1, 0);

    /// One migration under the release rules.
    pub(crate) struct Step<'a> {
        pub migration: &'a Migration,
        /// The oldest release whose instances work with the schema once it is applied.
        pub oldest_release: Version,
    }

    impl Step<'_> {
        pub fn label(&self) -> String {
            format!(
                "{} ({})",
                self.migration.version, self.migration.description
            )
        }
    }

    /// The migrations a database applied, as [`Applied`] rows.
    pub(crate) const APPLIED: &str = "SELECT version, checksum, oldest_release, applied_by \
        FROM timer_migrations ORDER BY version";

    /// A migration a database applied, as its `timer_migrations` row says.
    #[derive(sqlx::FromRow)]
    pub(crate) struct Applied {
        pub version: i64,
        pub checksum: Vec<u8>,
        pub oldest_release: String,
        pub applied_by: String,
    }

    /// Writes `step`'s row in `timer_migrations`, applied by `this` in `took_ms`; for a step that
    /// contracts, also a row in sqlx's `_sqlx_migrations`, which makes a 0.1.0 binary (which
    /// does not read the record) refuse the database as one with a migration it does not know.
    pub(crate) async fn record<DB>(
        conn: &mut DB::Connection,
        step: &Step<'_>,
        this: &Version,
        took_ms: i64,
    ) -> std::result::Result<(), sqlx::Error>
    where
        DB: Database,
        for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
        for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
        for<'q> i64: Encode<'q, DB> + Type<DB>,
        for<'q> String: Encode<'q, DB> + Type<DB>,
        for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
    {
        let migration = step.migration;
        sqlx::query::<DB>(
            "INSERT INTO timer_migrations \
               (version, description, checksum, oldest_release, applied_by, took_ms) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(migration.version)
        .bind(migration.description.to_string())
        .bind(migration.checksum.to_vec())
        .bind(step.oldest_release.to_string())
        .bind(this.to_string())
        .bind(took_ms)
        .execute(&mut *conn)
        .await?;
        if step.oldest_release > BEFORE_RECORDS {
            sqlx::query::<DB>(
                "INSERT INTO _sqlx_migrations \
                   (version, description, success, checksum, execution_time) \
                 VALUES ($1, $2, TRUE, $3, -1) ON CONFLICT (version) DO NOTHING",
            )
            .bind(migration.version)
            .bind(format!(
                "needs timer-service {} or newer (timer_migrations)",
                step.oldest_release
            ))
            .bind(migration.checksum.to_vec())
            .execute(&mut *conn)
            .await?;
        }
        Ok(())
    }

    /// The steps `applied` lacks, in order.
    pub(crate) fn pending<'s, 'a>(steps: &'s [Step<'a>], applied: &[Applied]) -> Vec<&'s Step<'a>> {
        steps
            .iter()
            .filter(|s| !applied.iter().any(|a| a.version == s.migration.version))
            .collect()
    }

    /// Parses a release (`0.2.0`); `what` names it in the error.
    pub(crate) fn release(text: &str, what: &str) -> Result<Version> {
        Version::parse(text.trim())
            .map_err(|e| Error::config(format!("{what} {text:?} is not a release (X.Y.Z): {e}")))
    }

    /// The steps of `migrator`, each with its `-- oldest release:` line.
    pub(crate) fn steps(migrator: &Migrator) -> Result<Vec<Step<'_>>> {
        migrator
            .iter()
            .map(|migration| {
                let line = migration
                    .sql
                    .lines()
                    .take_while(|l| l.starts_with("--"))
                    .find_map(|l| l.strip_prefix("-- oldest release:"))
                    .ok_or_else(|| {
                        Error::config(format!(
                            "migration {} has no `-- oldest release: X.Y.Z` line among its \
                             first comments",
                            migration.version
                        ))
                    })?;
                let what = format!("migration {}'s oldest release", migration.version);
                Ok(Step {
                    migration,
                    oldest_release: release(line, &what)?,
                })
            })
            .collect()
    }

    /// Checks what a database applied against this build (`this`): a migration this build has
    /// too must be the same file, and the oldest release the applied ones name must not be
    /// newer than this build. `store` names the database in the errors ("postgres store:
    /// schema timer_service"); `back` says how to go back to this release.
    pub(crate) fn check_applied(
        store: &str,
        back: &str,
        this: &Version,
        ours: &[Step<'_>],
        applied: &[Applied],
    ) -> Result<()> {
        for row in applied {
            let same = ours.iter().find(|s| s.migration.version == row.version);
            if let Some(step) = same.filter(|s| *s.migration.checksum != *row.checksum) {
                return Err(Error::config(format!(
                    "{store}: migration {} was applied from a different file than this build's \
                     (applied by timer-service {}): the file of a released migration never \
                     changes, so this build or the database is not what it seems",
                    step.label(),
                    row.applied_by
                )));
            }
        }
        let mut needs: Option<(Version, &Applied)> = None;
        for row in applied {
            let oldest = release(&row.oldest_release, "an applied migration's oldest release")?;
            if needs.as_ref().is_none_or(|(v, _)| oldest > *v) {
                needs = Some((oldest, row));
            }
        }
        match needs {
            Some((oldest, row)) if *this < oldest => Err(Error::config(format!(
                "{store} was migrated by timer-service {} and works with timer-service {oldest} \
                 or newer only (migration {}); this binary is timer-service {this}. Run \
                 timer-service {oldest} or newer on it, or {back}",
                row.applied_by, row.version
            ))),
            _ => Ok(()),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::borrow::Cow;

        fn migration(version: i64, sql: &'static str) -> Migration {
            Migration::new(
                version,
                Cow::Borrowed("m"),
                sqlx::migrate::MigrationType::Simple,
                Cow::Borrowed(sql),
                sql.starts_with("-- no-transaction"),
            )
        }

        fn applied(version: i64, checksum: &[u8], oldest: &str, by: &str) -> Applied {
            Applied {
                version,
                checksum: checksum.to_vec(),
                oldest_release: oldest.to_owned(),
                applied_by: by.to_owned(),
            }
        }

        #[test]
        fn a_step_reads_its_oldest_release_after_no_transaction() {
            let m = Migrator {
                migrations: Cow::Owned(vec![migration(
                    20,
                    "-- no-transaction\n-- oldest release: 0.3.1\nCREATE INDEX CONCURRENTLY i ON t (a)",
                )]),
                ..Migrator::DEFAULT
            };
            let steps = steps(&m).unwrap();
            assert_eq!(steps[0].oldest_release, Version::new(0, 3, 1));
            assert!(steps[0].migration.no_tx);
        }

        #[test]
        fn a_step_without_its_line_is_refused() {
            let m = Migrator {
                migrations: Cow::Owned(vec![migration(21, "-- nothing\nSELECT 1")]),
                ..Migrator::DEFAULT
            };
            let e = steps(&m).err().unwrap().to_string();
            assert!(
                e.contains("migration 21") && e.contains("oldest release"),
                "{e}"
            );
        }

        #[test]
        fn an_older_binary_refuses_a_schema_that_needs_a_newer_one() {
            let this = Version::new(0, 2, 0);
            let rows = [
                applied(15, b"a", "0.1.0", "0.2.0"),
                applied(30, b"b", "0.3.0", "0.4.1"),
            ];
            let e = check_applied("postgres store: schema s", "restore", &this, &[], &rows)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("timer-service 0.4.1")
                    && e.contains("timer-service 0.3.0 or newer")
                    && e.contains("this binary is timer-service 0.2.0")
                    && e.contains("migration 30"),
                "{e}"
            );
            let newer = Version::new(0, 3, 0);
            check_applied("s", "restore", &newer, &[], &rows).unwrap();
        }

        #[test]
        fn a_changed_file_is_refused() {
            let m = Migrator {
                migrations: Cow::Owned(vec![migration(15, "-- oldest release: 0.1.0\nSELECT 1")]),
                ..Migrator::DEFAULT
            };
            let ours = steps(&m).unwrap();
            let rows = [applied(15, b"other", "0.1.0", "0.2.0")];
            let e = check_applied("s", "restore", &Version::new(0, 2, 0), &ours, &rows)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("migration 15 (m)") && e.contains("different file"),
                "{e}"
            );
        }
    }
}
