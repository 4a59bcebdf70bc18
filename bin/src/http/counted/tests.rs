//! The shared counts: ages, background counts, failures, and counts longer than a request.

use super::*;
use std::sync::atomic::{AtomicU32, Ordering};

/// A count that says how many counts were made before it.
fn counter(made: &Arc<AtomicU32>) -> impl FnOnce() -> std::future::Ready<Result<u32, String>> {
    let made = Arc::clone(made);
    move || std::future::ready(Ok(made.fetch_add(1, Ordering::SeqCst)))
}

async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn answers_from_the_last_count_and_counts_again_in_the_background_at_half_age() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::new("test", Duration::from_secs(4));
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    assert_eq!(made.load(Ordering::SeqCst), 1, "young: no new count");
    tokio::time::advance(Duration::from_secs(2)).await;
    // Half the age passed: this reader still gets the last count, and starts the next.
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    settle().await;
    assert_eq!(made.load(Ordering::SeqCst), 2);
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 1);
    assert_eq!(made.load(Ordering::SeqCst), 2);
}

/// A count that takes `secs` and says how many counts were made before it.
fn slow(
    made: &Arc<AtomicU32>,
    secs: u64,
) -> impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<u32, String>> + Send>>
{
    let made = Arc::clone(made);
    move || {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            Ok(made.fetch_add(1, Ordering::SeqCst))
        })
    }
}

/// A count longer than a request may wait is not started again by every request: the
/// first one's goes on after it gave up, and a later request gets it, whether it came while
/// that count ran or after it ended (a count is served for the maximum age after it ended).
#[tokio::test(start_paused = true)]
async fn a_count_longer_than_a_request_is_kept_for_the_next() {
    let made = Arc::new(AtomicU32::new(0));
    // As by default: counts may be 5 s old, a request waits 10 s; the count takes 12.
    let cached = Cached::new("test", Duration::from_secs(5));
    let within = Duration::from_secs(10);
    let gave_up = tokio::time::timeout(within, cached.get(slow(&made, 12))).await;
    assert!(gave_up.is_err(), "the first request gives up at 10 s");
    let second = tokio::time::timeout(within, cached.get(slow(&made, 12))).await;
    assert_eq!(second.map(|v| v.map(|v| *v)), Ok(Ok(0)));
    assert_eq!(made.load(Ordering::SeqCst), 1, "counted once");
    // A count of 11 s; the next reader comes 2 s after it gave up, after the count ended.
    let cached = Cached::new("test", Duration::from_secs(5));
    let gave_up = tokio::time::timeout(within, cached.get(slow(&made, 11))).await;
    assert!(gave_up.is_err());
    tokio::time::advance(Duration::from_secs(2)).await;
    let later = tokio::time::timeout(within, cached.get(slow(&made, 11))).await;
    assert_eq!(later.map(|v| v.map(|v| *v)), Ok(Ok(1)));
    assert_eq!(made.load(Ordering::SeqCst), 2, "counted once more");
}

/// A background count holds the turn: a reader that finds the last count too old meanwhile
/// waits for it instead of counting beside it.
#[tokio::test(start_paused = true)]
async fn a_background_count_and_a_readers_never_run_at_once() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::new("test", Duration::from_secs(4));
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    tokio::time::advance(Duration::from_secs(2)).await;
    // Half age: the last count, and a background count of 6 s starts.
    assert_eq!(*cached.get(slow(&made, 6)).await.unwrap(), 0);
    settle().await;
    tokio::time::advance(Duration::from_secs(3)).await;
    // Too old now: this reader waits for the background count, and counts nothing itself.
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 1);
    tokio::time::advance(Duration::from_secs(10)).await;
    settle().await;
    assert_eq!(
        made.load(Ordering::SeqCst),
        2,
        "no count ran beside the background one"
    );
}

#[tokio::test(start_paused = true)]
async fn counts_for_the_reader_when_the_last_count_is_too_old() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::new("test", Duration::from_secs(4));
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 1);
}

#[tokio::test(start_paused = true)]
async fn zero_age_counts_for_every_reader() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::new("test", Duration::ZERO);
    for expected in 0..3 {
        assert_eq!(*cached.get(counter(&made)).await.unwrap(), expected);
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_count_is_not_kept() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::<u32>::new("test", Duration::from_secs(4));
    let failed = cached
        .get(|| std::future::ready(Err::<u32, _>("store down".to_owned())))
        .await;
    assert_eq!(failed.err().as_deref(), Some("store down"));
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    // A failed background count leaves the last count in place until it is too old.
    tokio::time::advance(Duration::from_secs(3)).await;
    let kept = cached
        .get(|| std::future::ready(Err::<u32, _>("store down".to_owned())))
        .await;
    assert_eq!(kept.ok().as_deref(), Some(&0));
    settle().await;
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 0);
    settle().await;
    assert_eq!(
        made.load(Ordering::SeqCst),
        2,
        "the failure let the next count start"
    );
    assert_eq!(*cached.get(counter(&made)).await.unwrap(), 1);
}

/// Counts the tenants it is asked for, and records which.
fn summaries_of(
    asked: &Arc<Mutex<Vec<Vec<String>>>>,
) -> impl FnOnce(Vec<String>) -> std::future::Ready<timer_core::Result<Vec<TenantSummary>>> {
    let asked = Arc::clone(asked);
    move |tenants| {
        asked.lock().unwrap().push(tenants.clone());
        std::future::ready(Ok(tenants
            .into_iter()
            .map(|tenant_id| TenantSummary {
                tenant_id,
                ..TenantSummary::default()
            })
            .collect()))
    }
}

#[tokio::test(start_paused = true)]
async fn a_tenant_is_counted_once_per_max_age_whoever_asks() {
    let cache = PerTenant::new(Duration::from_secs(4));
    let asked = Arc::new(Mutex::new(Vec::new()));
    let t = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let now = Timestamp::from_millis(1_000);
    let (got, _) = cache
        .get(&t(&["a", "b"]), now, summaries_of(&asked))
        .await
        .unwrap();
    assert_eq!(
        got.iter().map(|s| s.tenant_id.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    let later = Timestamp::from_millis(2_000);
    let (got, oldest) = cache
        .get(&t(&["b", "c", "a"]), later, summaries_of(&asked))
        .await
        .unwrap();
    assert_eq!(
        got.iter().map(|s| s.tenant_id.as_str()).collect::<Vec<_>>(),
        ["b", "c", "a"]
    );
    assert_eq!(oldest, now, "the oldest summary's time");
    tokio::time::advance(Duration::from_secs(4)).await;
    cache
        .get(&t(&["a"]), later, summaries_of(&asked))
        .await
        .unwrap();
    assert_eq!(
        *asked.lock().unwrap(),
        [t(&["a", "b"]), t(&["c"]), t(&["a"])]
    );
}

#[tokio::test(start_paused = true)]
async fn readers_arriving_during_a_count_share_it() {
    let made = Arc::new(AtomicU32::new(0));
    let cached = Cached::new("test", Duration::from_secs(4));
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let slow = {
        let made = Arc::clone(&made);
        move || async move {
            let _ = released.await;
            Ok::<_, String>(made.fetch_add(1, Ordering::SeqCst))
        }
    };
    let first = tokio::spawn({
        let cached = Arc::clone(&cached);
        async move { *cached.get(slow).await.unwrap() }
    });
    settle().await;
    let second = tokio::spawn({
        let cached = Arc::clone(&cached);
        let counter = counter(&made);
        async move { *cached.get(counter).await.unwrap() }
    });
    settle().await;
    let _ = release.send(());
    assert_eq!((first.await.unwrap(), second.await.unwrap()), (0, 0));
    assert_eq!(made.load(Ordering::SeqCst), 1);
}
