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

/// Another process holding the write lock: schedule and cancel wait for it, up to
/// `store.busy_timeout`, instead of failing at once with "database is locked".
/// A one-shot timer of tenant `t` due at 60 s.
fn timer(id: &str) -> NewTimer {
    NewTimer {
        key: TimerKey::new("t", id),
        due_at: Timestamp::from_millis(60_000),
        correlation_id: None,
        payload: None,
        recurrence: None,
        policy: None,
        work: None,
        target: None,
        message: None,
        trace: None,
    }
}

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

/// Released migrations never change (`sql::migrations`); a new one adds its line.
#[test]
fn released_migrations_never_change() {
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
