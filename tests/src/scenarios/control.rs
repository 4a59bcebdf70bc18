//! Scenarios of control commands and completions: `PauseTimer` and `ResumeTimer`, and a series with
//! `overlap: skip` that fires after each `TimerCompleted`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::setup::{envelope, Access, Setup};
use super::{BrokerCase, WAIT};
use crate::e2e::{due_ms, now_ms, schedule};
use crate::wait_for;

/// A `PauseTimer` on the broker holds its timer back while a neighbour due at the same time
/// fires; a `ResumeTimer` lets it fire at once (its due time passed); its history shows each
/// step.
pub async fn pause_and_resume_commands_hold_a_timer_back_and_let_it_go(case: Arc<BrokerCase>) {
    let setup = Setup::new(&case);
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    let fired = |id: &'static str| {
        let access = &access;
        move || async move {
            access
                .events()
                .await
                .filter(|events| events.iter().any(|e| envelope(e)["aggregateId"] == id))
        }
    };
    // Commands travel in order: the pause comes right after its timer, long before it is due.
    let due = now_ms() + 3_000;
    access.send(&schedule("t", "held", due)).await;
    access
        .send(r#"{"type":"PauseTimer","tenantId":"t","serviceCallId":"held"}"#)
        .await;
    access.send(&schedule("t", "neighbour", due)).await;
    let events = wait_for(WAIT, fired("neighbour"))
        .await
        .unwrap_or_else(|| service.fail("the neighbour fired"));
    assert!(
        !events.iter().any(|e| envelope(e)["aggregateId"] == "held"),
        "a paused timer does not fire"
    );
    let (_, held) = service.get("/v1/tenants/t/timers/held").await;
    assert_eq!(held["state"], "Paused", "{held}");
    access
        .send(r#"{"type":"ResumeTimer","tenantId":"t","serviceCallId":"held"}"#)
        .await;
    wait_for(WAIT, fired("held"))
        .await
        .unwrap_or_else(|| service.fail("the resumed timer fired"));
    // The history records the fire when it is settled, just after the broker confirmed it.
    let want = ["created", "paused", "resumed", "fired"];
    let history = wait_for(WAIT, || async {
        let (_, history) = service.get("/v1/tenants/t/timers/held/history").await;
        let types: Vec<String> = history["history"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["type"].as_str().map(str::to_owned))
            .collect();
        (types == want).then_some(())
    })
    .await;
    if history.is_none() {
        let (_, history) = service.get("/v1/tenants/t/timers/held/history").await;
        service.fail(format!("the history is {want:?}: {history}"));
    }
    drop(access);
    service.terminate().await;
    setup.clean_up().await;
}

/// A history entry's time, epoch ms.
fn at_ms(entry: &Value) -> i64 {
    entry["at"]
        .as_str()
        .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
        .map(|at| at.timestamp_millis())
        .unwrap_or_else(|| panic!("a history entry has its time: {entry}"))
}

/// A `*/1 * * * * *` series with `overlap: skip` whose consumer completes each occurrence 2.5 s
/// after its event (a `TimerCompleted` on the broker; the second one through `POST
/// …/complete`): every fire waits for the previous one's completion, so the series fires every
/// third second and skips the two occurrences between. Checked exactly against the history: each
/// fire is the first occurrence after the previous completion, and every occurrence between is
/// a `skipped` entry with reason `overlap`.
pub async fn an_overlap_skip_series_fires_after_each_completion(case: Arc<BrokerCase>) {
    const FIRES: i64 = 4;
    const WORK_MS: i64 = 2_500;
    let setup = Setup::new(&case);
    let client = setup.client_if_served(case.plugin).await;
    let service = setup.start().await;
    let access = Access::of(client, &service).await;
    let schedule = json!({"tenantId": "t", "serviceCallId": "work", "cron": "*/1 * * * * *",
                          "overlap": "skip", "completionTimeout": "30s"});
    access.send(&schedule.to_string()).await;
    let mut fires: Vec<Value> = Vec::new();
    for n in 1..=FIRES {
        let fire = wait_for(WAIT, || async {
            access
                .events()
                .await?
                .iter()
                .map(envelope)
                .find(|e| e["aggregateId"] == "work" && e["payload"]["occurrence"] == n)
        })
        .await
        .unwrap_or_else(|| service.fail(format!("occurrence {n} fired")));
        if n == FIRES {
            fires.push(fire);
            break;
        }
        // The consumer's work takes 2.5 s from the fire (the scenario, not a wait for a
        // condition).
        let done_at = fire["timestampMs"].as_i64().unwrap_or_else(now_ms) + WORK_MS;
        let left = u64::try_from(done_at - now_ms()).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(left)).await;
        if n == 2 {
            let body = json!({"occurrence": n, "outcome": "succeeded", "message": "by http"});
            let (status, answer) = service
                .post("/v1/tenants/t/timers/work/complete", body.to_string())
                .await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["outcome"], "completed", "{answer}");
        } else {
            let completed = json!({"type": "TimerCompleted", "tenantId": "t",
                                   "serviceCallId": "work", "occurrence": n});
            access.send(&completed.to_string()).await;
        }
        fires.push(fire);
    }
    // The last fire's event goes out before its settle is written (behind the firing task):
    // wait for the store to record it as awaiting its completion.
    let timer = crate::wait_for(Duration::from_secs(10), || async {
        let (_, timer) = service.get("/v1/tenants/t/timers/work").await;
        (timer["work"]["awaiting"]["occurrence"] == FIRES).then_some(timer)
    })
    .await
    .unwrap_or_else(|| panic!("the last fire recorded as awaiting its completion"));
    let (status, cancelled) = service.delete("/v1/tenants/t/timers/work").await;
    assert_eq!(status, 200, "{cancelled}");
    let (_, history) = service
        .get("/v1/tenants/t/timers/work/history?limit=1000")
        .await;
    let history: Vec<Value> = history["history"].as_array().cloned().unwrap_or_default();
    let metrics = service.text("/metrics").await;
    drop(access);
    service.terminate().await;

    // Between two fires: the completion of the first, and one `skipped` entry per occurrence
    // that came due before it.
    let fired: Vec<usize> = (0..history.len())
        .filter(|i| history[*i]["type"] == "fired")
        .collect();
    assert!(
        fired.len() >= FIRES as usize,
        "{FIRES} fires in the history: {history:?}"
    );
    let dues: Vec<i64> = fires.iter().map(due_ms).collect();
    let mut skipped_total = 0;
    for (k, pair) in fired.windows(2).take(FIRES as usize - 1).enumerate() {
        let between = &history[pair[0] + 1..pair[1]];
        let completions: Vec<&Value> = between
            .iter()
            .filter(|e| e["type"] == "completed")
            .collect();
        assert_eq!(
            completions.len(),
            1,
            "one completion between fires: {between:?}"
        );
        let completion = completions[0];
        assert_eq!(completion["occurrence"], k + 1, "{completion}");
        let took = completion["durationMs"].as_i64().unwrap_or(0);
        assert!(took >= WORK_MS, "the work took 2.5 s or more: {completion}");
        let completed_at = at_ms(completion);
        // The first occurrence (a whole second) after the completion fires next.
        let expected = (completed_at / 1_000 + 1) * 1_000;
        assert_eq!(
            dues[k + 1],
            expected,
            "occurrence {} is the first one after the completion at {completed_at}: {between:?}",
            k + 2
        );
        let skips: Vec<&Value> = between.iter().filter(|e| e["type"] == "skipped").collect();
        let skipped: i64 = skips.iter().map(|e| e["count"].as_i64().unwrap_or(0)).sum();
        assert!(
            skips.iter().all(|e| e["reason"] == "overlap"),
            "skipped for overlap: {skips:?}"
        );
        assert_eq!(
            skipped,
            (dues[k + 1] - dues[k]) / 1_000 - 1,
            "every occurrence between two fires is skipped: {between:?}"
        );
        skipped_total += skipped;
    }
    let counts = &timer["work"]["counts"];
    assert_eq!(counts["skippedOverlap"], skipped_total, "{timer}");
    // The metric counts what the history says was skipped (another series of this service
    // would add to it: there is none).
    let skipped_metric =
        crate::e2e::metric(&metrics, r#"timer_occurrences_skipped{reason="overlap"}"#);
    assert_eq!(
        skipped_metric, skipped_total as f64,
        "timer_occurrences_skipped{{reason=\"overlap\"}}"
    );
    assert_eq!(counts["completed"], FIRES - 1, "{timer}");
    assert_eq!(timer["work"]["awaiting"]["occurrence"], FIRES, "{timer}");
    assert_eq!(timer["policy"]["overlap"], "skip", "{timer}");
    assert_eq!(timer["policy"]["completionTimeoutMs"], 30_000, "{timer}");
    let gaps: Vec<i64> = dues.windows(2).map(|d| d[1] - d[0]).collect();
    println!(
        "overlap skip, work 2.5 s: fires {gaps:?} ms apart, {skipped_total} occurrences skipped"
    );
    setup.clean_up().await;
}
