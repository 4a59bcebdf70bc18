//! The plans of claims, tested without an engine.

use super::*;
use crate::recurrence::Recurrence;

const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);

/// A series that fires every second, at most `max_occurrences` times.
fn every_second(max_occurrences: Option<u32>) -> Recurrence {
    Recurrence {
        cron: "* * * * * *".into(),
        time_zone: "UTC".into(),
        end_at: None,
        max_occurrences,
    }
}

/// The `skipped` entries of `changes`: reason, count, first, last, "at least".
fn skips(changes: &[Change]) -> Vec<(Option<SkipReason>, u64, Timestamp, Timestamp, bool)> {
    changes
        .iter()
        .filter_map(|c| match c {
            Change::Skipped {
                count,
                first,
                last,
                at_least,
                reason,
            } => Some((*reason, *count, *first, *last, *at_least)),
            _ => None,
        })
        .collect()
}

fn claim(recurrence: Option<Recurrence>, policy: Option<Policy>) -> ClaimedTimer {
    ClaimedTimer {
        due_at: T0,
        registered_at: T0,
        recurrence,
        policy,
        ..ClaimedTimer::for_tests(TimerKey::new("t", "plain"))
    }
}

/// The settlement of `claim` fired at its due time.
fn settled(claim: &ClaimedTimer) -> Settlement {
    let Plan::Fire(fire) = plan(claim, T0, 5) else {
        panic!("a due timer fires");
    };
    fired(claim, &fire, T0, "i1", None)
}

/// No policy, no cost: a timer without a policy and without work settles as `Reached` (a
/// one-shot) or `Next` (a series), writing no work; with a policy it takes the `Step` path.
#[test]
fn a_timer_without_a_policy_settles_on_the_fast_path() {
    let every_second = every_second(None);
    assert_eq!(settled(&claim(None, None)), Settlement::Reached);
    assert_eq!(
        settled(&claim(Some(every_second.clone()), None)),
        Settlement::Next(T0.saturating_add(std::time::Duration::from_secs(1)))
    );
    let skip = Policy {
        overlap: Overlap::Skip,
        ..Policy::default()
    };
    for recurrence in [None, Some(every_second)] {
        let with_policy = settled(&claim(recurrence, Some(skip.clone())));
        assert!(
            matches!(with_policy, Settlement::Step(_)),
            "{with_policy:?}"
        );
    }
}

/// A per-second series claimed three days late: `catchUp: all` fires the latest
/// `catchUpLimit` (it fired the 100,000th, then the 200,000th, counting forward from the
/// first), `once` fires the first and skips the rest when it settles, each skip recorded
/// with its true first and last and "at least" its count; a plan looks at about a hundred
/// occurrences, not 259,200.
#[test]
fn a_long_catch_up_fires_the_latest_and_skips_the_rest_without_walking_them() {
    let every_second = every_second(None);
    let later = |s: u64| T0.saturating_add(std::time::Duration::from_secs(s));
    let now = later(3 * 86_400);
    let all = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(1),
        ..Policy::default()
    };
    let claim_all = claim(Some(every_second.clone()), Some(all));
    let Plan::Fire(fire) = plan(&claim_all, now, 0) else {
        panic!("the latest fires");
    };
    assert_eq!((fire.nominal, fire.caught_up), (now, true));
    let [(_, count, first, last, at_least)] = skips(&fire.before)[..] else {
        panic!("one skipped entry: {:?}", fire.before);
    };
    assert_eq!((first, last, at_least), (T0, later(3 * 86_400 - 1), true));
    assert!(count > 100, "{count}");
    // It goes on after the one it fired.
    let Settlement::Step(step) = fired(&claim_all, &fire, now, "i1", None) else {
        panic!("a step");
    };
    assert_eq!(step.due_at, later(3 * 86_400 + 1));

    let once = Policy {
        catch_up: Some(CatchUp::Once),
        ..Policy::default()
    };
    let claim_once = claim(Some(every_second), Some(once));
    let Plan::Fire(fire) = plan(&claim_once, now, 0) else {
        panic!("the first fires");
    };
    assert_eq!((fire.nominal, fire.caught_up), (T0, true));
    let Settlement::Step(step) = fired(&claim_once, &fire, now, "i1", None) else {
        panic!("a step");
    };
    assert_eq!(step.due_at, later(3 * 86_400 + 1), "the first one not due");
    let [(_, _, first, last, at_least)] = skips(&step.changes)[..] else {
        panic!("one skipped entry: {:?}", step.changes);
    };
    assert_eq!((first, last, at_least), (later(1), now, true));
}

/// A `catchUpWindow` after a long outage: what is older than the window is skipped as
/// such, then what is in it as `catchUp` says, each with its true first and last.
#[test]
fn a_long_catch_up_within_a_window_skips_what_is_older() {
    let every_second = every_second(None);
    let later = |s: u64| T0.saturating_add(std::time::Duration::from_secs(s));
    let now = later(86_400);
    let windowed = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(2),
        catch_up_window: Some(std::time::Duration::from_secs(3_600)),
        ..Policy::default()
    };
    let claim = claim(Some(every_second), Some(windowed));
    let Plan::Fire(fire) = plan(&claim, now, 0) else {
        panic!("the latest but one fires");
    };
    assert_eq!(fire.nominal, later(86_399));
    let skips: Vec<_> = skips(&fire.before)
        .into_iter()
        .map(|(reason, _, first, last, at_least)| (reason, first, last, at_least))
        .collect();
    assert_eq!(
        skips,
        [
            (
                Some(SkipReason::CatchUpWindow),
                T0,
                later(86_400 - 3_601),
                true
            ),
            (
                Some(SkipReason::CatchUp),
                later(86_400 - 3_600),
                later(86_398),
                true
            ),
        ]
    );
}

/// A series sent again with a jitter (or a longer one), claimed at the due time it had, is
/// not fired then: it waits for its new time (its event would say a `dueAt` still to come).
#[test]
fn a_jitter_added_later_does_not_fire_early() {
    let daily = Recurrence {
        cron: "0 0 * * *".into(),
        time_zone: "UTC".into(),
        end_at: None,
        max_occurrences: None,
    };
    let jittered = Policy {
        jitter: Some(std::time::Duration::from_secs(1_800)),
        ..Policy::default()
    };
    // T0 is no midnight; the claim's due time is, as the series stored it.
    let midnight = Timestamp::from_millis(T0.as_millis() - T0.as_millis() % 86_400_000);
    let claim = ClaimedTimer {
        due_at: midnight,
        ..claim(Some(daily), Some(jittered.clone()))
    };
    let new_time = fire_time(&claim.key, midnight, Some(&jittered));
    assert!(new_time > midnight, "this key's offset is not 0");
    let Plan::Settle(step) = plan(&claim, midnight, 5) else {
        panic!("fired before its new time");
    };
    assert_eq!(
        (step.state, step.due_at, step.available_at),
        (TimerState::Scheduled, new_time, new_time)
    );
    assert!(matches!(plan(&claim, new_time, 5), Plan::Fire(_)));
}

/// A call's answer goes into the history: the fire is written as a `Step` that records it,
/// with the same state and due time the fast path would write.
#[test]
fn an_answer_is_kept_in_the_fired_entry() {
    let every_second = every_second(None);
    let next = T0.saturating_add(std::time::Duration::from_secs(1));
    for (recurrence, state, due_at) in [
        (None, TimerState::Reached, T0),
        (Some(every_second), TimerState::Scheduled, next),
    ] {
        let claim = claim(recurrence, None);
        let Plan::Fire(fire) = plan(&claim, T0, 5) else {
            panic!("a due timer fires");
        };
        let answer = "h:80 answered 200 OK in 3 ms".to_owned();
        let Settlement::Step(step) = fired(&claim, &fire, T0, "i1", Some(answer.clone())) else {
            panic!("a step");
        };
        assert_eq!((step.state, step.due_at, step.fired), (state, due_at, true));
        assert!(
            matches!(&step.changes[..], [Change::Fired { answer: Some(a), .. }] if *a == answer),
            "{:?}",
            step.changes
        );
    }
}

/// `catchUp: all` of a series with `maxOccurrences`: the latest occurrences it may still fire
/// fire, not a run from the middle cut short by the maximum.
#[test]
fn catch_up_all_fires_the_latest_the_maximum_leaves() {
    let three = every_second(Some(3));
    let all = Policy {
        catch_up: Some(CatchUp::All),
        catch_up_limit: Some(10),
        ..Policy::default()
    };
    let later = |s: u64| T0.saturating_add(std::time::Duration::from_secs(s));
    let claim = claim(Some(three), Some(all));
    let Plan::Fire(fire) = plan(&claim, later(49), 0) else {
        panic!("one fires");
    };
    assert_eq!(fire.nominal, later(47), "the first of the latest three");
    let skipped: Vec<_> = skips(&fire.before)
        .into_iter()
        .map(|(_, count, _, last, _)| (count, last))
        .collect();
    assert_eq!(skipped, [(47, later(46))]);
}
