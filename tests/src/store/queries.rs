//! The query abilities: live timers per tenant, listing with filters and pages, tenant summaries,
//! counts per state.

use std::collections::HashSet;
use std::sync::Arc;

use timer_core::{
    Action, Backlog, ClaimedTimer, ControlOutcome, NewTimer, PageAfter, Store, TenantSummary,
    TimerFilter, TimerKey, TimerQueries, TimerState,
};

use super::{
    act, at, cancel, claim, control, fail, ids, live_by_tenant, mark_reached, pause, put,
    recurring, release, row, timer, T0, T0_MS,
};

pub async fn live_by_tenant_counts_scheduled_and_paused_timers(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let mut batch: Vec<NewTimer> = (0..5)
        .map(|i| timer("a", &format!("a{i}"), T0_MS + 1_000 + i))
        .collect();
    batch.push(timer("b", "b0", T0_MS + 1_000));
    batch.push(timer("c", "due", T0_MS));
    put(s, &batch, T0).await;
    cancel(s, "a", "a0", T0).await;
    let pause = Action::Pause { note: None };
    let paused = control(s)
        .apply(&[TimerKey::new("a", "a1")], &pause, T0)
        .await
        .expect("pause a/a1");
    assert_eq!(paused, vec![ControlOutcome::Paused]);
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    mark_reached(s, &claimed, "i1", T0).await;
    let counts = live_by_tenant(s, &["a", "b", "c", "nobody"]).await;
    assert_eq!(
        counts.get("a"),
        Some(&4),
        "cancelled ones do not count, a paused one does: {counts:?}"
    );
    assert_eq!(counts.get("b"), Some(&1));
    assert_eq!(
        counts.get("c"),
        None,
        "reached ones do not count: {counts:?}"
    );
    assert_eq!(counts.get("nobody"), None);
    let only_b = live_by_tenant(s, &["b"]).await;
    assert_eq!(only_b.len(), 1, "only the tenants asked for");
}

/// The store's listing ability; every store plugin of this project has it.
fn queries(s: &dyn Store) -> &dyn TimerQueries {
    s.queries()
}

/// Every page of `tenant`'s timers that pass `filter`, `limit` per page, as ids.
async fn all_pages(s: &dyn Store, tenant: &str, filter: &TimerFilter, limit: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut after: Option<PageAfter> = None;
    for _ in 0..10_000 {
        let page = queries(s)
            .list(tenant, filter, after.as_ref(), limit)
            .await
            .unwrap_or_else(|e| panic!("listing {tenant} failed: {e}"));
        assert!(
            page.len() <= limit,
            "a page of {} for limit {limit}",
            page.len()
        );
        // A bulk action's page of keys is this page's.
        let keys = queries(s)
            .list_keys(tenant, filter, after.as_ref(), limit)
            .await
            .unwrap_or_else(|e| panic!("listing the keys of {tenant} failed: {e}"));
        let listed: Vec<PageAfter> = page
            .iter()
            .map(|t| PageAfter {
                due_at: t.due_at,
                service_call_id: t.key.service_call_id.clone(),
            })
            .collect();
        assert_eq!(keys, listed, "list_keys lists the keys of list's page");
        ids.extend(page.iter().map(|t| t.key.service_call_id.clone()));
        match page.last() {
            Some(last) if page.len() == limit => {
                after = Some(PageAfter {
                    due_at: last.due_at,
                    service_call_id: last.key.service_call_id.clone(),
                })
            }
            _ => return ids,
        }
    }
    panic!("listing {tenant} did not end")
}

pub async fn list_orders_by_due_time_then_id_within_the_tenant(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "c", T0_MS + 2_000),
            timer("t", "b", T0_MS + 1_000),
            timer("t", "a", T0_MS + 2_000),
            timer("t", "d", T0_MS + 500),
            timer("other", "x", T0_MS + 100),
        ],
        T0,
    )
    .await;
    let every = TimerFilter::default();
    assert_eq!(all_pages(s, "t", &every, 100).await, ["d", "b", "a", "c"]);
    for limit in [1, 2, 3] {
        assert_eq!(
            all_pages(s, "t", &every, limit).await,
            ["d", "b", "a", "c"],
            "pages of {limit}"
        );
    }
    assert_eq!(
        all_pages(s, "nobody", &every, 10).await,
        Vec::<String>::new()
    );
    let page = queries(s).list("t", &every, None, 1).await.expect("list");
    assert_eq!(
        page[0],
        row(s, "t", "d").await,
        "a listed timer is the stored timer"
    );
}

pub async fn list_filters_combine(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "order-1", T0_MS + 1_000),
            timer("t", "order-2", T0_MS + 2_000),
            timer("t", "ORDER-3", T0_MS + 3_000),
            timer("t", "invoice-1", T0_MS + 4_000),
            recurring("t", "order-r", T0_MS + 5_000, "0 * * * *"),
            timer("t", "order-due", T0_MS),
        ],
        T0,
    )
    .await;
    cancel(s, "t", "order-2", T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["order-due"]);
    mark_reached(s, &claimed, "i1", T0).await;
    let list = |filter: TimerFilter| async move { all_pages(s, "t", &filter, 2).await };
    let prefix = |p: &str| Some(p.to_owned());
    assert_eq!(
        list(TimerFilter {
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-due", "order-1", "order-2", "order-r"],
        "a prefix is case-sensitive"
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Scheduled],
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-1", "order-r"]
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Cancelled, TimerState::Reached],
            ..TimerFilter::default()
        })
        .await,
        ["order-due", "order-2"]
    );
    assert_eq!(
        list(TimerFilter {
            due_after: Some(at(T0_MS + 2_000)),
            due_before: Some(at(T0_MS + 4_000)),
            ..TimerFilter::default()
        })
        .await,
        ["order-2", "ORDER-3"],
        "dueAfter is inclusive, dueBefore exclusive"
    );
    assert_eq!(
        list(TimerFilter {
            recurring: Some(true),
            ..TimerFilter::default()
        })
        .await,
        ["order-r"]
    );
    assert_eq!(
        list(TimerFilter {
            recurring: Some(false),
            prefix: prefix("ORDER"),
            ..TimerFilter::default()
        })
        .await,
        ["ORDER-3"]
    );
    assert_eq!(
        list(TimerFilter {
            prefix: prefix("%"),
            ..TimerFilter::default()
        })
        .await,
        Vec::<String>::new(),
        "a prefix is text, not a pattern"
    );
    // A timer whose publish failed waits for its next attempt: it is "retrying".
    put(s, &[timer("t", "order-late", T0_MS + 500)], T0).await;
    let claimed = claim(s, at(T0_MS + 500), 10, "i1", T0_MS + 1_000).await;
    assert_eq!(ids(&claimed), ["order-late"]);
    release(s, &claimed, "i1", at(T0_MS + 60_000), Some("broker down")).await;
    assert_eq!(
        list(TimerFilter {
            retrying: Some(true),
            ..TimerFilter::default()
        })
        .await,
        ["order-late"]
    );
    assert_eq!(
        list(TimerFilter {
            states: vec![TimerState::Scheduled],
            retrying: Some(false),
            prefix: prefix("order-"),
            ..TimerFilter::default()
        })
        .await,
        ["order-1", "order-r"]
    );
}

/// Ids order and match by their bytes (code points), whatever the database's locale: a
/// collation that skips punctuation or folds accents would misplace these.
pub async fn list_compares_ids_byte_by_byte(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let ids = [
        "a",
        "a-b",
        "a.",
        "ab",
        "B",
        "e",
        "é1",
        "éa",
        "f",
        "\u{10FFFF}x",
        "\u{D7FF}",
        "\u{E000}",
    ];
    let batch: Vec<NewTimer> = ids.iter().map(|id| timer("t", id, T0_MS)).collect();
    put(s, &batch, T0).await;
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    assert_eq!(
        all_pages(s, "t", &TimerFilter::default(), 5).await,
        sorted,
        "equal due times: ids in byte order"
    );
    let with = |p: &str| TimerFilter {
        prefix: Some(p.to_owned()),
        ..TimerFilter::default()
    };
    for (prefix, expected) in [
        ("a-", &["a-b"][..]),
        ("a", &["a", "a-b", "a.", "ab"]),
        ("é", &["é1", "éa"]),
        ("e", &["e"]),
        ("\u{10FFFF}", &["\u{10FFFF}x"]),
        ("\u{D7FF}", &["\u{D7FF}"]),
        ("b", &[]),
    ] {
        assert_eq!(
            all_pages(s, "t", &with(prefix), 2).await,
            expected,
            "prefix {prefix:?}"
        );
    }
}

/// Timers written between two pages: a timer that was there all along is listed exactly once;
/// one added before the cursor is not listed, one added after it is.
pub async fn list_pages_are_stable_under_concurrent_writes(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let batch: Vec<NewTimer> = (0..50)
        .map(|i| timer("t", &format!("k{i:02}"), T0_MS + 1_000 * i))
        .collect();
    put(s, &batch, T0).await;
    let every = TimerFilter::default();
    let first = queries(s).list("t", &every, None, 20).await.expect("list");
    let last = first.last().expect("a full page");
    let after = PageAfter {
        due_at: last.due_at,
        service_call_id: last.key.service_call_id.clone(),
    };
    // Between the pages: one new timer before the cursor, one after, one moved from after to
    // before it, and one with the cursor's own due time (its id sorts after the cursor's).
    put(
        s,
        &[
            timer("t", "early", T0_MS + 500),
            timer("t", "late", T0_MS + 60_000),
            timer("t", "k40", T0_MS + 1),
            timer("t", "k19b", T0_MS + 19_000),
        ],
        T0,
    )
    .await;
    let mut seen: Vec<String> = first
        .iter()
        .map(|t| t.key.service_call_id.clone())
        .collect();
    let mut next = Some(after);
    while let Some(after) = next.take() {
        let page = queries(s)
            .list("t", &every, Some(&after), 20)
            .await
            .expect("list");
        if let Some(last) = page.last().filter(|_| page.len() == 20) {
            next = Some(PageAfter {
                due_at: last.due_at,
                service_call_id: last.key.service_call_id.clone(),
            });
        }
        seen.extend(page.iter().map(|t| t.key.service_call_id.clone()));
    }
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a timer listed twice: {seen:?}");
    for i in (0..50).filter(|i| *i != 40) {
        assert!(
            seen.contains(&format!("k{i:02}")),
            "k{i:02} missing: {seen:?}"
        );
    }
    assert!(
        seen.contains(&"late".to_owned()) && seen.contains(&"k19b".to_owned()),
        "{seen:?}"
    );
    assert!(!seen.contains(&"early".to_owned()), "{seen:?}");
}

pub async fn summaries_count_states_next_due_and_recent_failures(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("a", "s1", T0_MS + 5_000),
            timer("a", "s2", T0_MS + 3_000),
            timer("a", "c", T0_MS + 1_000),
            timer("a", "f-old", T0_MS),
            timer("a", "f-new", T0_MS),
            timer("b", "r", T0_MS),
        ],
        T0,
    )
    .await;
    cancel(s, "a", "c", T0).await;
    let claimed = claim(s, T0, 10, "i1", T0_MS + 1_000).await;
    let (b, a): (Vec<ClaimedTimer>, Vec<ClaimedTimer>) =
        claimed.into_iter().partition(|c| c.key.tenant_id == "b");
    mark_reached(s, &b, "i1", T0).await;
    let old: Vec<ClaimedTimer> = a
        .iter()
        .filter(|c| c.key.service_call_id == "f-old")
        .cloned()
        .collect();
    let new: Vec<ClaimedTimer> = a
        .iter()
        .filter(|c| c.key.service_call_id == "f-new")
        .cloned()
        .collect();
    fail(s, &old, "i1", at(T0_MS + 10), "down").await;
    fail(s, &new, "i1", at(T0_MS + 1_000), "down").await;
    let tenants = queries(s).tenants(None, 10).await.expect("tenants");
    assert_eq!(tenants, ["a", "b"]);
    assert_eq!(
        queries(s).tenants(Some("a"), 10).await.expect("tenants"),
        ["b"]
    );
    assert_eq!(queries(s).tenants(None, 1).await.expect("tenants"), ["a"]);
    let wanted: Vec<String> = ["b", "a", "nobody"].map(String::from).to_vec();
    let summaries = queries(s)
        .summaries(&wanted, at(T0_MS + 500), T0)
        .await
        .expect("summaries");
    let names: Vec<&str> = summaries.iter().map(|x| x.tenant_id.as_str()).collect();
    assert_eq!(names, ["b", "a", "nobody"], "in the order asked for");
    let counts = |x: &TenantSummary| {
        let mut c: Vec<(TimerState, u64)> = x.counts.iter().map(|(s, n)| (*s, *n)).collect();
        c.sort_by_key(|(s, _)| s.code());
        c
    };
    assert_eq!(counts(&summaries[0]), [(TimerState::Reached, 1)]);
    assert_eq!(summaries[0].next_due_at, None);
    assert_eq!(
        counts(&summaries[1]),
        [
            (TimerState::Scheduled, 2),
            (TimerState::Cancelled, 1),
            (TimerState::Failed, 2)
        ]
    );
    assert_eq!(summaries[1].next_due_at, Some(at(T0_MS + 3_000)));
    assert_eq!(
        summaries[1].failed_since, 1,
        "only the failure at or after failed_since"
    );
    assert_eq!(
        (summaries[0].fired_since, summaries[1].fired_since),
        (1, 0),
        "b's timer fired at T0"
    );
    let later = queries(s)
        .summaries(&wanted, at(T0_MS + 500), at(T0_MS + 1))
        .await
        .expect("summaries");
    assert_eq!(later[0].fired_since, 0, "b's fire was before fired_since");
    assert_eq!(
        summaries[2],
        TenantSummary {
            tenant_id: "nobody".into(),
            ..TenantSummary::default()
        }
    );
}

pub async fn count_counts_each_state(store: Arc<dyn Store>) {
    let s = store.as_ref();
    put(
        s,
        &[
            timer("t", "a", T0_MS),
            timer("t", "b", T0_MS + 10),
            timer("u", "c", T0_MS + 20),
        ],
        T0,
    )
    .await;
    act(s, "b", &pause(), T0).await;
    control(s)
        .apply(&[TimerKey::new("u", "c")], &Action::Cancel, T0)
        .await
        .expect("cancel");
    let q = queries(s);
    let count = |state| async move { q.count(state).await.expect("count") };
    assert_eq!(count(TimerState::Scheduled).await, 1);
    assert_eq!(count(TimerState::Paused).await, 1);
    assert_eq!(count(TimerState::Cancelled).await, 1);
    assert_eq!(count(TimerState::Reached).await, 0);
}

pub async fn backlog_counts_claimable_rows_by_tenant_longest_waiting_first(store: Arc<dyn Store>) {
    let s = store.as_ref();
    let mut batch: Vec<NewTimer> = (1..=10)
        .map(|i| timer("big", &format!("b{i:02}"), T0_MS + i))
        .collect();
    batch.push(timer("small", "early", T0_MS + 5));
    batch.push(timer("small", "later", T0_MS + 500));
    batch.push(timer("quiet", "later", T0_MS + 2_000));
    put(s, &batch, T0).await;
    let queries = s.queries();
    let backlog = |now: i64, limit: usize| async move {
        queries
            .backlog(at(now), limit)
            .await
            .unwrap_or_else(|e| panic!("backlog: {}", e.chain()))
    };
    let waiting = |b: &Backlog| -> Vec<(String, u64, i64)> {
        b.by_tenant
            .iter()
            .map(|t| (t.tenant_id.clone(), t.due, t.since.as_millis() - T0_MS))
            .collect()
    };

    let nothing = backlog(T0_MS, 10).await;
    assert_eq!((nothing.due, nothing.tenants), (0, 0), "nothing due yet");
    assert!(nothing.by_tenant.is_empty(), "{nothing:?}");

    let now = T0_MS + 100;
    let all = backlog(now, 10).await;
    assert_eq!((all.due, all.tenants), (11, 2), "{all:?}");
    assert_eq!(
        waiting(&all),
        [("big".into(), 10, 1), ("small".into(), 1, 5)],
        "tenants with claimable rows, longest waiting first; `quiet` is not due"
    );
    let first = backlog(now, 1).await;
    assert_eq!(
        (first.due, first.tenants, waiting(&first)),
        (11, 2, vec![("big".into(), 10, 1)]),
        "the limit keeps the longest waiting; the totals count every tenant"
    );

    // Claimed rows wait no more (their lease is in the future); an expired lease waits again.
    // (At T0 + 3 ms only these three are due: a plain claim, earliest first.)
    let claimed = claim(s, at(T0_MS + 3), 3, "i1", now + 1_000).await;
    assert_eq!(ids(&claimed), ["b01", "b02", "b03"]);
    let after_claim = backlog(now, 10).await;
    assert_eq!(
        waiting(&after_claim),
        [("big".into(), 7, 4), ("small".into(), 1, 5)],
        "{after_claim:?}"
    );
    let lease_expired = backlog(now + 1_000, 10).await;
    assert_eq!(
        (lease_expired.due, lease_expired.tenants),
        (12, 2),
        "ten of big (three leases ran out) and both of small: {lease_expired:?}"
    );
}
