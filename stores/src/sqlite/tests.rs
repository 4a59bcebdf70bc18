//! Unit tests of the sqlite store: unusable URLs, a second writer on the file, a missing
//! directory, a change and its history entry in one transaction.

use super::*;
use timer_core::ErrorKind;

async fn open_err(url: &str) -> Error {
    let config = SqliteConfig {
        url: url.into(),
        ..SqliteConfig::default()
    };
    match SqliteStore::open(&config).await {
        Ok(_) => panic!("{url} should not open"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn unusable_urls_are_config_errors_naming_the_url() {
    for url in ["sqlite::memory:", "sqlite://", "sqlite://t.db?mode=ro"] {
        let e = open_err(url).await;
        assert_eq!(e.kind(), ErrorKind::Config, "{url}: {e}");
        assert!(e.to_string().contains(url), "{url}: {e}");
    }
}

/// A one-shot timer of tenant `t` due at 60 s.
fn timer(id: &str) -> NewTimer {
    NewTimer::new(TimerKey::new("t", id), Timestamp::from_millis(60_000))
}

/// Another process holding the write lock: schedule and cancel wait for it, up to
/// `store.busy_timeout`, instead of failing at once with "database is locked".
#[tokio::test]
async fn writes_wait_for_another_writer_on_the_same_file() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = SqliteConfig::for_path(dir.path().join("t.db"));
    let store = SqliteStore::open(&config).await.expect("open");
    let now = Timestamp::from_millis(1_000);
    store.schedule(&[timer("a")], now).await.expect("schedule");
    let url = format!("sqlite://{}", config.path());
    let mut other = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("connect");
    for attempt in ["schedule", "cancel"] {
        let lock = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");
        let write = async {
            match attempt {
                "schedule" => store.schedule(&[timer("b")], now).await.map(drop),
                _ => store.cancel(&TimerKey::new("t", "a"), now).await.map(drop),
            }
        };
        tokio::pin!(write);
        // While the lock is held the write waits: it neither fails nor finishes.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(300), &mut write).await;
        assert!(waiting.is_err(), "{attempt} did not wait: {waiting:?}");
        lock.commit().await.expect("release");
        write
            .await
            .unwrap_or_else(|e| panic!("{attempt} after the lock: {e}"));
    }
    let a = store.get(&TimerKey::new("t", "a")).await.expect("get");
    assert_eq!(a.map(|t| t.state), Some(TimerState::Cancelled));
}

#[tokio::test]
async fn a_missing_directory_is_unavailable_naming_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("no/such/dir/t.db");
    let e = open_err(&format!("sqlite://{}", path.display())).await;
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(
        e.chain().contains(&path.display().to_string()),
        "{}",
        e.chain()
    );
}

/// Released migrations never change (`sql::migrations`). 0.1.0's are closed: a new one goes
/// to `migrations/sqlite-releases/` (`migrate.rs`).
#[test]
fn released_migrations_never_change() {
    let closed = sqlx::migrate!("./migrations/sqlite").iter().count();
    assert_eq!(closed, 9, "a new migration goes to migrations/sqlite-releases/");
    crate::sql::migrations::assert_released(
        "sqlite",
        &sqlx::migrate!("./migrations/sqlite"),
        &[
            (1, "a443121a4856a829"),
            (2, "278b5cd910caafb4"),
            (3, "59899fd934de3d51"),
            (4, "b68a6f8582e5cce5"),
            (5, "36b6de9588a5e059"),
            (6, "1fc1464b68324cc6"),
            (7, "4001dff2d0c38f51"),
            (8, "10f014fd3a37dfa2"),
            (9, "0981bfff2a57c967"),
        ],
    );
}

/// A change and its history entry commit together or not at all: with a trigger refusing the
/// entry, and then one refusing the change, a cancel fails and leaves both as they were.
#[tokio::test]
async fn a_change_and_its_history_entry_commit_together_or_not_at_all() {
    use sqlx::{Connection, Executor};
    let dir = tempfile::tempdir().expect("tempdir");
    let config = SqliteConfig::for_path(dir.path().join("t.db"));
    let store = SqliteStore::open(&config).await.expect("open");
    let now = Timestamp::from_millis(1_000);
    let key = TimerKey::new("t", "x");
    store.schedule(&[timer("x")], now).await.expect("schedule");
    let state = || async {
        let timer = store.get(&key).await.expect("get");
        let history = store.history().read(&key, 0, 100).await.expect("history");
        (timer, history.len())
    };
    let before = state().await;
    let url = format!("sqlite://{}", config.path());
    let mut other = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("connect");
    for refused in ["INSERT ON timer_history", "UPDATE ON timers"] {
        let trigger = format!(
            "CREATE TRIGGER refuse BEFORE {refused} WHEN NEW.service_call_id = 'x' \
             BEGIN SELECT RAISE(ABORT, 'injected: refused'); END"
        );
        other.execute(trigger.as_str()).await.expect("trigger");
        let cancelled = store.cancel(&key, now).await;
        assert!(cancelled.is_err(), "{refused}: {cancelled:?}");
        assert_eq!(state().await, before, "{refused}: half a change was kept");
        other.execute("DROP TRIGGER refuse").await.expect("drop");
    }
    assert_eq!(
        store.cancel(&key, now).await.expect("cancel"),
        timer_core::CancelOutcome::Cancelled
    );
    let (timer, entries) = state().await;
    assert_eq!(timer.map(|t| t.state), Some(TimerState::Cancelled));
    assert_eq!(entries, before.1 + 1, "the cancel's entry");
}

/// Released migrations from 0.2.0 on never change either.
#[test]
fn released_migrations_from_0_2_0_never_change() {
    crate::sql::migrations::assert_released(
        "sqlite (from 0.2.0)",
        &migrate::migrator(),
        &[(10, "fb916ff804cbe829"), (11, "1c400c4e92916175")],
    );
}

/// A file 0.1.0 wrote (its migrations only), holding a timer, and one Reached that a
/// completion left without `finished_at` (as releases up to 0.2.0 did).
async fn file_of_0_1_0(path: &std::path::Path) {
    use sqlx::Connection;
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut conn = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("create");
    sqlx::migrate!("./migrations/sqlite")
        .run_direct(&mut conn)
        .await
        .expect("0.1.0's migrations");
    sqlx::query(
        "INSERT INTO timers (tenant_id, service_call_id, due_at, registered_at, available_at) \
         VALUES ('t', 'kept', 60000, 0, 60000)",
    )
    .execute(&mut conn)
    .await
    .expect("a timer");
    sqlx::query(
        "INSERT INTO timers (tenant_id, service_call_id, due_at, registered_at, available_at, \
         state) VALUES ('t', 'completed', 0, 0, 0, 1)",
    )
    .execute(&mut conn)
    .await
    .expect("a timer");
    conn.close().await.expect("close");
}

async fn count(url: &str, sql: &str) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::SqliteConnection::connect(url).await.expect("open");
    let n = sqlx::query_scalar(sql).fetch_one(&mut conn).await.expect(sql);
    conn.close().await.expect("close");
    n
}

#[tokio::test]
async fn a_file_of_0_1_0_is_copied_then_migrated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.db");
    file_of_0_1_0(&path).await;
    let config = SqliteConfig::for_path(&path);
    let store = SqliteStore::open(&config).await.expect("0.2.0 opens it");
    let got = store.get(&TimerKey::new("t", "kept")).await.expect("get");
    assert_eq!(got.map(|t| t.state), Some(TimerState::Scheduled));
    drop(store);
    let release = env!("CARGO_PKG_VERSION");
    let copy = dir.path().join(format!("t.db.before-{release}"));
    assert!(copy.exists(), "no copy at {copy:?}");
    let copy_url = format!("sqlite://{}?mode=ro", copy.display());
    // The copy is the file as 0.1.0 left it: its timer, none of the new migrations.
    assert_eq!(count(&copy_url, "SELECT COUNT(*) FROM timers").await, 2);
    let tables = "SELECT COUNT(*) FROM sqlite_master WHERE name = 'timer_migrations'";
    assert_eq!(count(&copy_url, tables).await, 0);
    let url = format!("sqlite://{}?mode=ro", path.display());
    assert_eq!(count(&url, "SELECT COUNT(*) FROM timer_migrations").await, 2);
    // The finished timer without finished_at has one now: it is purged in time.
    let unfinished = "SELECT COUNT(*) FROM timers WHERE state <> 0 AND finished_at IS NULL";
    assert_eq!(count(&url, unfinished).await, 0);
    // 0.1.0 would still start on it: sqlx's table holds 0.1.0's migrations only.
    assert_eq!(count(&url, "SELECT MAX(version) FROM _sqlx_migrations").await, 9);
    // Opening it again migrates nothing, so copies nothing.
    SqliteStore::open(&config).await.expect("opens again");
    let copies = std::fs::read_dir(dir.path())
        .expect("list")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().contains(".before-"))
        })
        .count();
    assert_eq!(copies, 1);
}

#[tokio::test]
async fn a_new_file_is_not_copied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = SqliteConfig::for_path(dir.path().join("t.db"));
    SqliteStore::open(&config).await.expect("opens");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    assert!(!names.iter().any(|n| n.contains(".before-")), "{names:?}");
}

#[tokio::test]
async fn a_file_a_newer_release_needs_is_refused() {
    use std::borrow::Cow;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.db");
    let config = SqliteConfig::for_path(&path);
    drop(SqliteStore::open(&config).await.expect("opens"));
    // 0.3.0 applies a migration that removes what 0.2.0 uses.
    let mut steps: Vec<sqlx::migrate::Migration> = migrate::migrator().iter().cloned().collect();
    steps.push(sqlx::migrate::Migration::new(
        90,
        Cow::Borrowed("contracts"),
        sqlx::migrate::MigrationType::Simple,
        Cow::Borrowed("-- oldest release: 0.3.0\nCREATE TABLE contracted (x INTEGER)"),
        false,
    ));
    let newer = sqlx::migrate::Migrator {
        migrations: Cow::Owned(steps),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open");
    let v030 = semver::Version::new(0, 3, 0);
    migrate::run(&pool, config.path(), &v030, &newer)
        .await
        .expect("0.3.0 migrates");
    pool.close().await;
    let e = match SqliteStore::open(&config).await {
        Ok(_) => panic!("0.2.0 should refuse a file 0.3.0 needs"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("was migrated by timer-service 0.3.0")
            && text.contains("works with timer-service 0.3.0 or newer only (migration 90)")
            && text.contains(&format!("this binary is timer-service {}", env!("CARGO_PKG_VERSION")))
            && text.contains("t.db.before-"),
        "{text}"
    );
    // And 0.1.0 too: sqlx's table has a migration it does not know.
    let url = format!("sqlite://{}?mode=ro", path.display());
    assert_eq!(count(&url, "SELECT MAX(version) FROM _sqlx_migrations").await, 90);
}

/// A due row that cannot be read (a policy a later release wrote) does not take the rest of its
/// claim with it: the others are claimed and fire; it is left to its lease.
#[tokio::test]
async fn a_row_that_cannot_be_read_is_left_out_of_its_claim() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = SqliteConfig::for_path(dir.path().join("t.db"));
    let store = SqliteStore::open(&config).await.expect("open");
    let ids: Vec<String> = (0..10).map(|i| format!("ok-{i}")).collect();
    let mut timers: Vec<NewTimer> = ids.iter().map(|id| timer(id)).collect();
    timers.push(timer("unreadable"));
    store
        .schedule(&timers, Timestamp::from_millis(1_000))
        .await
        .expect("schedule");
    let url = format!("sqlite://{}", config.path());
    let mut other = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("connect");
    sqlx::query(
        "UPDATE timers SET policy = '{\"overlap\":\"allow\",\"from_a_later_release\":1}' \
         WHERE service_call_id = 'unreadable'",
    )
    .execute(&mut other)
    .await
    .expect("a policy this release cannot read");
    let lease = Lease {
        owner: "i1".into(),
        until: Timestamp::from_millis(90_000),
    };
    let now = Timestamp::from_millis(60_000);
    let claimed = store.claim_due(now.into(), 100, &lease).await.expect("claim");
    let mut got: Vec<String> = claimed
        .iter()
        .map(|c| c.key.service_call_id.clone())
        .collect();
    got.sort();
    assert_eq!(got, ids);
}
