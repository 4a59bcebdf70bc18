//! The fair claim against a model of a store: rows in a list, each step done by hand.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::*;
use crate::model::TimerKey;
use std::time::Duration;

/// Rows `(available_at, tenant, id)`; a claimed row moves to the lease end. It counts its
/// plain claims and its visits, and fails its plain claims (the fill) or its counts of the due
/// when told to.
#[derive(Default)]
struct Model {
    rows: Mutex<Vec<(i64, String, String)>>,
    earliest: AtomicUsize,
    visits: AtomicUsize,
    fill_fails: AtomicBool,
    count_fails: AtomicBool,
}

impl Model {
    fn with(rows: &[(i64, &str, &str)]) -> Self {
        let rows = rows
            .iter()
            .map(|(at, t, id)| (*at, t.to_string(), id.to_string()))
            .collect();
        Model {
            rows: Mutex::new(rows),
            ..Model::default()
        }
    }

    /// (plain claims, visits) so far.
    fn counts(&self) -> (usize, usize) {
        (
            self.earliest.load(Ordering::Relaxed),
            self.visits.load(Ordering::Relaxed),
        )
    }

    fn take(
        &self,
        now: Timestamp,
        lease: &Lease,
        pick: impl Fn(&str) -> bool,
        n: usize,
    ) -> Vec<ClaimedTimer> {
        let mut rows = self.rows.lock().unwrap();
        let mut due: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].0 <= now.as_millis() && pick(&rows[i].1))
            .collect();
        due.sort_by_key(|&i| (rows[i].0, rows[i].2.clone()));
        due.truncate(n);
        due.into_iter()
            .map(|i| {
                let (at, tenant, id) = rows[i].clone();
                rows[i].0 = lease.until.as_millis();
                claimed(&tenant, &id, at)
            })
            .collect()
    }
}

fn claimed(tenant: &str, id: &str, at: i64) -> ClaimedTimer {
    ClaimedTimer {
        due_at: Timestamp::from_millis(at),
        ..ClaimedTimer::for_tests(TimerKey::new(tenant, id))
    }
}

#[async_trait]
impl FairSteps for Model {
    async fn claim_earliest(
        &self,
        due: Due,
        limit: usize,
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        self.earliest.fetch_add(1, Ordering::Relaxed);
        if self.fill_fails.load(Ordering::Relaxed) {
            return Err(crate::error::Error::unavailable(
                "injected: the fill failed",
            ));
        }
        // The model's rows are first due (available when due): the window's end is its bound.
        Ok(self.take(due.ahead, lease, |_| true, limit))
    }

    async fn more_due_than(&self, due: Due, limit: usize) -> Result<bool> {
        if self.count_fails.load(Ordering::Relaxed) {
            return Err(crate::error::Error::unavailable(
                "injected: the count failed",
            ));
        }
        let rows = self.rows.lock().unwrap();
        Ok(rows.iter().filter(|r| r.0 <= due.ahead.as_millis()).count() > limit)
    }

    async fn visit_tenants(
        &self,
        now: Timestamp,
        after: &str,
        visits: usize,
    ) -> Result<Vec<Visited>> {
        self.visits.fetch_add(1, Ordering::Relaxed);
        let rows = self.rows.lock().unwrap();
        let tenants: BTreeSet<&String> = rows.iter().map(|r| &r.1).collect();
        Ok(tenants
            .into_iter()
            .filter(|t| t.as_str() > after)
            .take(visits)
            .map(|t| Visited {
                tenant: t.clone(),
                due: rows.iter().any(|r| &r.1 == t && r.0 <= now.as_millis()),
            })
            .collect())
    }

    async fn claim_of_tenants(
        &self,
        due: Due,
        shares: &[(String, usize)],
        lease: &Lease,
    ) -> Result<Vec<ClaimedTimer>> {
        let mut all = Vec::new();
        for (t, share) in shares {
            all.extend(self.take(due.ahead, lease, |x| x == t, *share));
        }
        Ok(all)
    }
}

fn lease() -> Lease {
    Lease {
        owner: "me".into(),
        until: Timestamp::from_millis(1_000_000),
    }
}

/// `big` has 10 rows due at 1..=10, `small` one due at 50: the claims at 100 with a limit of 4.
fn herd() -> Model {
    let mut rows: Vec<(i64, &str, &str)> = Vec::new();
    let ids = [
        "b01", "b02", "b03", "b04", "b05", "b06", "b07", "b08", "b09", "b10",
    ];
    for (i, id) in ids.iter().enumerate() {
        rows.push((i as i64 + 1, "big", id));
    }
    rows.push((50, "small", "s1"));
    Model::with(&rows)
}

fn ids(claimed: &[ClaimedTimer]) -> Vec<&str> {
    claimed
        .iter()
        .map(|c| c.key.service_call_id.as_str())
        .collect()
}

#[tokio::test]
async fn a_claim_with_more_due_than_it_takes_shares_from_the_first() {
    let model = herd();
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    // 11 due, 4 taken: `small` is served by the first claim, not after the herd.
    let first = fair.claim(&model, now.into(), 4, &lease()).await.unwrap();
    assert_eq!(ids(&first), ["b01", "b02", "b03", "s1"]);
    assert!(fair.cursor().backlog);
    let second = fair.claim(&model, now.into(), 4, &lease()).await.unwrap();
    assert_eq!(ids(&second), ["b04", "b05", "b06", "b07"]);
    let third = fair.claim(&model, now.into(), 4, &lease()).await.unwrap();
    assert_eq!(ids(&third), ["b08", "b09", "b10"]);
    // Not full: back to the plain claim.
    assert!(!fair.cursor().backlog);
}

#[tokio::test]
async fn a_herd_due_within_the_shares_window_is_seen_coming() {
    // `big` has 10 rows due at 200..=209 and `small` one at 210: none within the claim's own
    // window (50 ms from 100), all within its shares' (eight of it).
    let mut rows: Vec<(i64, String, String)> = (0..10)
        .map(|i| (200 + i, "big".to_string(), format!("b{:02}", i + 1)))
        .collect();
    rows.push((210, "small".into(), "s1".into()));
    let model = Model {
        rows: Mutex::new(rows),
        ..Model::default()
    };
    let fair = FairShare::new();
    let due = Due::ahead(Timestamp::from_millis(100), Duration::from_millis(50));
    let first = fair.claim(&model, due, 4, &lease()).await.unwrap();
    assert_eq!(
        ids(&first),
        ["b01", "b02", "s1"],
        "each tenant's share is held before the herd's first full claim"
    );
    assert_eq!(
        model.counts(),
        (1, 1),
        "(plain claims: the fill, empty in the claim's own window; visits)"
    );
}

#[tokio::test]
async fn with_no_more_due_than_it_takes_the_claim_is_plain() {
    let model = herd();
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    // 11 due, 11 taken: no tenant waits behind another, so no visit.
    let all = fair.claim(&model, now.into(), 11, &lease()).await.unwrap();
    assert_eq!(all.len(), 11);
    assert_eq!(model.counts(), (1, 0), "(plain claims, visits)");
    // It was full: the next claim visits (a backlog may have begun), finds nothing due and
    // leaves the backlog.
    assert!(fair.cursor().backlog);
    let next = fair.claim(&model, now.into(), 11, &lease()).await.unwrap();
    assert!(next.is_empty());
    assert_eq!(model.counts(), (2, 1), "(plain claims, visits)");
    assert!(!fair.cursor().backlog);
}

#[tokio::test]
async fn a_claim_that_is_not_full_leaves_no_backlog() {
    let model = herd();
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    let all = fair.claim(&model, now.into(), 20, &lease()).await.unwrap();
    assert_eq!(all.len(), 11);
    assert_eq!(
        all.last().map(|c| c.key.service_call_id.as_str()),
        Some("s1")
    );
    assert!(!fair.cursor().backlog);
}

#[tokio::test]
async fn beyond_the_visit_bound_every_tenant_is_served_in_turn() {
    // Six tenants of three due rows each, a limit of 2: a claim visits two tenants.
    let tenants = ["t1", "t2", "t3", "t4", "t5", "t6"];
    let ids = ["a", "b", "c"];
    let mut rows: Vec<(i64, &str, &str)> = Vec::new();
    for t in tenants {
        for (i, id) in ids.iter().enumerate() {
            rows.push((i as i64, t, id));
        }
    }
    let model = Model::with(&rows);
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    let mut first_claim_of = std::collections::HashMap::new();
    for n in 0..6 {
        for c in fair.claim(&model, now.into(), 2, &lease()).await.unwrap() {
            first_claim_of.entry(c.key.tenant_id.clone()).or_insert(n);
        }
    }
    // 18 due, 2 taken: from the first, each claim visits the next two tenants: t1 and t2,
    // t3 and t4, t5 and t6.
    for t in tenants {
        let n = first_claim_of.get(t).copied();
        assert!(n.is_some_and(|n| n <= 2), "{t} first served by claim {n:?}");
    }
}

#[tokio::test]
async fn within_a_tenant_due_order_is_kept() {
    let model = herd();
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    let mut big = Vec::new();
    loop {
        let claimed = fair.claim(&model, now.into(), 3, &lease()).await.unwrap();
        if claimed.is_empty() {
            break;
        }
        big.extend(
            claimed
                .into_iter()
                .filter(|c| c.key.tenant_id == "big")
                .map(|c| c.due_at),
        );
    }
    assert_eq!(big.len(), 10);
    assert!(big.windows(2).all(|w| w[0] <= w[1]), "{big:?}");
}

#[test]
fn shares_add_up_to_the_limit() {
    let tenants = |n: usize| (0..n).map(|i| format!("t{i}")).collect::<Vec<_>>();
    let of = |n, limit| {
        shares(tenants(n), limit)
            .into_iter()
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
    };
    assert_eq!(of(3, 10), [4, 3, 3]);
    assert_eq!(of(2, 4), [2, 2]);
    assert_eq!(of(4, 4), [1, 1, 1, 1]);
    assert_eq!(of(16, 500).iter().sum::<usize>(), 500);
}

#[tokio::test]
async fn a_claim_of_one_still_goes_round_the_tenants() {
    // Three tenants of three due rows each; every claim takes one.
    let rows: Vec<(i64, &str, &str)> = ["t1", "t2", "t3"]
        .iter()
        .flat_map(|t| [(0, *t, "a"), (1, *t, "b"), (2, *t, "c")])
        .collect();
    let model = Model::with(&rows);
    let fair = FairShare::new();
    let now = Timestamp::from_millis(100);
    let mut tenants = Vec::new();
    for _ in 0..4 {
        for c in fair.claim(&model, now.into(), 1, &lease()).await.unwrap() {
            tenants.push(c.key.tenant_id);
        }
    }
    // One tenant a claim, in turn from the first; then the visit starts again.
    assert_eq!(tenants, ["t1", "t2", "t3", "t1"]);
}

#[tokio::test]
async fn a_failed_fill_keeps_what_the_shares_leased() {
    let store = herd();
    store.fill_fails.store(true, Ordering::Relaxed);
    let fair = FairShare::new();
    fair.update(|c| c.backlog = true);
    let now = Timestamp::from_millis(100);
    // big and small share 4; small has only 1, so 1 is left to the fill, which fails.
    let claimed = fair
        .claim(&store, now.into(), 4, &lease())
        .await
        .expect("the shares");
    assert_eq!(ids(&claimed), ["b01", "b02", "s1"]);
    // Nothing leased at all: the error.
    let empty = Model::default();
    empty.fill_fails.store(true, Ordering::Relaxed);
    let fair = FairShare::new();
    assert!(fair.claim(&empty, now.into(), 4, &lease()).await.is_err());
}

/// `big` due at 1..=10, `small` one at 150; the claim at 100 of 4, looking `ahead` further,
/// finds more due than it takes: a backlog from the first claim.
async fn first_claim_of_a_backlog(ahead: u64, lease_until: i64) -> Vec<ClaimedTimer> {
    let mut model = herd();
    model.rows.get_mut().unwrap().retain(|r| r.1 == "big");
    model
        .rows
        .get_mut()
        .unwrap()
        .push((150, "small".into(), "s1".into()));
    let fair = FairShare::new();
    let lease = Lease {
        owner: "me".into(),
        until: Timestamp::from_millis(lease_until),
    };
    let due = Due::ahead(Timestamp::from_millis(100), Duration::from_millis(ahead));
    fair.claim(&model, due, 4, &lease).await.unwrap()
}

#[tokio::test]
async fn in_a_backlog_the_shares_look_further_ahead_than_the_claim() {
    // A claim looking 10 ms ahead (to 110): the shares look 80 ms, to 180, and take `s1`
    // (held until 150 by the engine); the fill keeps the claim's own window.
    let claimed = first_claim_of_a_backlog(10, 1_000_000).await;
    assert_eq!(ids(&claimed), ["b01", "b02", "b03", "s1"]);
    // Looking 5 ms ahead, the shares look 40 (to 140): `s1` waits for a later claim.
    let claimed = first_claim_of_a_backlog(5, 1_000_000).await;
    assert_eq!(ids(&claimed), ["b01", "b02", "b03", "b04"]);
    // Never more than a fifth of the lease ahead: a lease to 300 allows 40 ms.
    let claimed = first_claim_of_a_backlog(10, 300).await;
    assert_eq!(ids(&claimed), ["b01", "b02", "b03", "b04"]);
}

#[test]
fn the_backlog_window_is_eight_of_the_claims_up_to_a_fifth_of_the_lease() {
    let t = Timestamp::from_millis;
    let lease = |until| Lease {
        owner: "me".into(),
        until: t(until),
    };
    let window = |ahead, until| {
        let due = Due::ahead(t(1_000), Duration::from_millis(ahead));
        backlog_window(due, &lease(until), None).ahead
    };
    assert_eq!(window(50, 100_000), t(1_400));
    assert_eq!(window(50, 1_500), t(1_100), "a fifth of the lease's 500 ms");
    assert_eq!(
        window(50, 1_100),
        t(1_050),
        "never shorter than the claim's"
    );
    assert_eq!(
        window(0, 100_000),
        t(1_000),
        "claim_ahead 0: nothing claimed ahead"
    );
}

#[test]
fn claims_far_apart_in_a_backlog_look_twice_their_gap_ahead() {
    let t = Timestamp::from_millis;
    let window = |ahead, previous: Option<i64>, until| {
        let due = Due::ahead(t(1_000), Duration::from_millis(ahead));
        let lease = Lease {
            owner: "me".into(),
            until: t(until),
        };
        backlog_window(due, &lease, previous.map(t)).ahead
    };
    let cases = [
        (50, 700, 100_000, 1_600, "300 ms since: 600 ahead"),
        (
            50,
            900,
            100_000,
            1_400,
            "100 ms since: eight windows are longer",
        ),
        (50, 0, 6_000, 2_000, "at most a fifth of the lease"),
        (
            0,
            850,
            100_000,
            1_000,
            "claim_ahead 0: nothing claimed ahead",
        ),
    ];
    for (ahead, previous, until, end, why) in cases {
        assert_eq!(window(ahead, Some(previous), until), t(end), "{why}");
    }
}

#[tokio::test]
async fn a_backlog_remembers_when_its_previous_claim_was_made() {
    let model = herd();
    let fair = FairShare::new();
    let lease = lease();
    let claim = |at: i64| fair.claim(&model, Timestamp::from_millis(at).into(), 4, &lease);
    claim(100).await.unwrap();
    assert_eq!(fair.cursor().shared_at, Some(Timestamp::from_millis(100)));
    claim(120).await.unwrap();
    assert_eq!(fair.cursor().shared_at, Some(Timestamp::from_millis(120)));
    // The third is not full: the backlog ends, and with it the gap (a herd coming later is
    // not measured from it).
    assert_eq!(claim(140).await.unwrap().len(), 3);
    assert!(!fair.cursor().backlog);
    assert_eq!(fair.cursor().shared_at, None);
    assert!(claim(160).await.unwrap().is_empty());
    assert_eq!(fair.cursor().shared_at, None);
}

#[tokio::test]
async fn a_failed_count_fails_the_claim_before_anything_is_leased_and_forgets_the_gap() {
    let store = herd();
    store.count_fails.store(true, Ordering::Relaxed);
    let fair = FairShare::new();
    fair.update(|c| c.shared_at = Some(Timestamp::from_millis(50)));
    let now = Timestamp::from_millis(100);
    assert!(fair.claim(&store, now.into(), 4, &lease()).await.is_err());
    assert_eq!(store.counts(), (0, 0), "(plain claims, visits)");
    assert_eq!(fair.cursor().shared_at, None);
    // In a backlog no count is asked: the claim goes on.
    fair.update(|c| c.backlog = true);
    assert_eq!(
        fair.claim(&store, now.into(), 4, &lease())
            .await
            .unwrap()
            .len(),
        4
    );
}
