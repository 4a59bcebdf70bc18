//! The history ability: each change recorded in order, the newest kept, gone with the timer.

use std::sync::Arc;

use timer_core::{Action, Change, Store, TimerKey};

use super::{
    act, at, claim, fail, history, history_of, kinds, mark_reached, pause, put, release, timer, T0,
    T0_MS,
};

pub async fn history_records_each_change_in_order(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(s, &[timer("t", "a", T0_MS)], T0).await;
    put(s, &[timer("t", "a", T0_MS + 100)], T0).await;
    let claimed = claim(s, at(T0_MS + 100), 10, "i1", T0_MS + 10_000).await;
    release(s, &claimed, "i1", at(T0_MS + 200), Some("broker down")).await;
    let claimed = claim(s, at(T0_MS + 200), 10, "i2", T0_MS + 10_000).await;
    mark_reached(s, &claimed, "i2", at(T0_MS + 250)).await;
    let entries = history(s, "a").await;
    assert_eq!(
        kinds(&entries),
        ["created", "rescheduled", "publish_failed", "fired"]
    );
    assert_eq!(
        entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert_eq!(entries[0].at, T0);
    assert_eq!(entries[0].change, Change::Created { due_at: T0 });
    assert_eq!(
        entries[1].change,
        Change::Rescheduled {
            due_at: at(T0_MS + 100)
        }
    );
    assert_eq!(
        entries[2].change,
        Change::PublishFailed {
            attempt: 1,
            error: "broker down".into()
        }
    );
    assert_eq!(
        entries[3].change,
        Change::Fired {
            due_at: at(T0_MS + 100),
            lateness_ms: 150,
            instance: "i2".into(),
            occurrence: None,
            caught_up: false,
            refire: None,
            answer: None,
        }
    );
    assert_eq!(entries[3].at, at(T0_MS + 250));
    // Pages: after an entry, up to a limit.
    let page = history_of(s)
        .read(&TimerKey::new("t", "a"), 1, 2)
        .await
        .expect("page");
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    // A change made outside the store (a manual trigger), and a timer that does not exist.
    let triggered = Change::Triggered {
        event_id: "e-1".into(),
    };
    assert!(history_of(s)
        .record(&TimerKey::new("t", "a"), at(T0_MS + 300), &triggered)
        .await
        .expect("record"));
    assert!(!history_of(s)
        .record(&TimerKey::new("t", "none"), T0, &triggered)
        .await
        .expect("record"));
    assert!(history(s, "none").await.is_empty());
    assert_eq!(
        history(s, "a")
            .await
            .last()
            .map(|e| (e.seq, e.change.clone())),
        Some((5, triggered))
    );
    // Given up and cancelled.
    put(
        s,
        &[timer("t", "f", T0_MS), timer("t", "c", T0_MS + 60_000)],
        T0,
    )
    .await;
    let f = claim(s, T0, 1, "i1", T0_MS + 1_000).await;
    fail(s, &f, "i1", T0, "gone").await;
    assert_eq!(kinds(&history(s, "f").await), ["created", "given_up"]);
    act(s, "c", &pause(), T0).await;
    act(s, "c", &Action::Cancel, T0).await;
    assert_eq!(
        kinds(&history(s, "c").await),
        ["created", "paused", "cancelled"]
    );
}

pub async fn history_keeps_the_newest_entries_and_goes_with_the_timer(store: Arc<dyn Store>) {
    let s = store.as_ref();
    history_of(s).set_limit(3);
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    for _ in 0..3 {
        act(s, "a", &pause(), T0).await;
        act(s, "a", &Action::Resume, T0).await;
    }
    let entries = history(s, "a").await;
    assert_eq!(
        entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [5, 6, 7],
        "the newest 3 of 7"
    );
    assert_eq!(kinds(&entries), ["resumed", "paused", "resumed"]);
    // Off: nothing more is recorded.
    history_of(s).set_limit(0);
    act(s, "a", &pause(), T0).await;
    assert_eq!(history(s, "a").await.len(), 3);
    history_of(s).set_limit(100);
    // Purged with the timer: a new timer of the same key starts a new history.
    act(s, "a", &Action::Cancel, T0).await;
    assert_eq!(s.purge(at(T0_MS + 1), 10).await.expect("purge"), 1);
    assert!(history(s, "a").await.is_empty());
    put(s, &[timer("t", "a", T0_MS + 1_000)], T0).await;
    let fresh = history(s, "a").await;
    assert_eq!(fresh.iter().map(|e| e.seq).collect::<Vec<_>>(), [1]);
}
