//! Checks the examples of the wire contract (`README.md`, this module's docs) against the code.
//!
//! Every fenced block of the README is preceded by a marker, an HTML comment on the line before
//! the fence (or before one blank line), that says what the block is:
//!
//! | marker | the block | checked by |
//! |---|---|---|
//! | `<!-- schedule -->` | a `ScheduleTimer` | `decode_command` accepts it as a schedule; with `cron` it is recurring; its `target` and `message.body` are the timer's |
//! | `<!-- schedule: dueAt=T now=N -->` | the same | also: decoded at `N` (default [`NOW`]), its due time is `T` |
//! | `<!-- cancel -->` | a `CancelTimer` | `decode_command` accepts it as a cancel, `decode_schedule` refuses it (`not_accepted_here`) |
//! | `<!-- pause -->`, `<!-- resume -->`, `<!-- complete -->` | a `PauseTimer`, a `ResumeTimer`, a `TimerCompleted` | the same, as a pause, a resume or a completion |
//! | `<!-- manual-event -->` | the `DueTimeReached` of a manual trigger | built again by `Envelope::manual` at its `timestampMs`: equal as JSON, `id` included |
//! | `<!-- rejected: REASON field=FIELD -->` | a refused command | `decode_command` refuses it with that reason and field (no `field=`: none) |
//! | `<!-- event: KIND revision=R -->` | a `DueTimeReached` or `TimerFailed` envelope | built again by `Envelope::for_timer` from its inputs at timer revision `R`: equal as JSON, `id` included; an occurrence of a recurring `schedule` example must be one of that series |
//! | `<!-- http-error -->` | 400 bodies, one per line | each is `{"error": rejection}` for a command of [`PROVOKE`] |
//! | `<!-- dead-letter-reason -->` | dead-letter reasons, one per line | each is the `Display` of the rejection of a command of [`PROVOKE`] |
//!
//! A block without a known marker fails, so no example goes unchecked.

use serde_json::Value;

use super::{
    decode_command, decode_schedule, Command, DueTimeReachedEnvelope, Reason, Rejection,
    TimerFailedEnvelope,
};
use crate::config::Limits;
use crate::model::{ClaimedTimer, NewTimer, Timer, TimerKey, Timestamp};

const README: &str = include_str!("README.md");

/// The time examples are decoded at unless their marker says `now=`: 2026-11-20T14:11:02.118Z.
/// Decoding takes "now" as an argument, so the examples' dates (2026 to 2030) stay valid
/// whatever day the tests run.
const NOW: Timestamp = Timestamp::from_millis(1_795_183_862_118);

/// Commands that produce the rejections the README shows as 400 bodies or dead-letter reasons,
/// by reason and field. An example with a pair not listed here fails until a command is added.
const PROVOKE: &[(&str, Option<&str>, &str)] = &[
    (
        "missing_field",
        Some("serviceCallId"),
        r#"{"tenantId":"acme","dueAt":"2027-01-15T10:00:00Z"}"#,
    ),
    (
        "invalid_time",
        Some("dueAt"),
        r#"{"tenantId":"acme","serviceCallId":"call-7","dueAt":"2027-01-01T00:00:00"}"#,
    ),
    (
        "invalid_id",
        Some("serviceCallId"),
        r#"{"tenantId":"acme","serviceCallId":"","dueAt":"2027-01-15T10:00:00Z"}"#,
    ),
    (
        "invalid_id",
        Some("payload.tenantId"),
        r#"{"type":"ScheduleTimer","tenantId":"acme","payload":{"tenantId":"other","serviceCallId":"call-7","dueAt":"2027-01-15T10:00:00Z"}}"#,
    ),
];

/// A fenced block of the README and the marker before it.
struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    marker: Option<String>,
    body: String,
}

/// The marker on `line`: the text of an HTML comment that fills the line.
fn marker_on(line: &str) -> Option<String> {
    let inner = line.trim().strip_prefix("<!--")?.strip_suffix("-->")?;
    Some(inner.trim().to_owned())
}

/// Every fenced block, with the marker directly before it (or before one blank line).
fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        assert!(
            !trimmed.starts_with("~~~"),
            "README.md:{}: use ``` fences, the tests read only those",
            i + 1
        );
        if !trimmed.starts_with("```") {
            i += 1;
            continue;
        }
        assert_eq!(
            trimmed,
            line,
            "README.md:{}: an indented fence; keep examples at the top level, where the tests \
             and their markers are",
            i + 1
        );
        let marker = match i {
            0 => None,
            _ if lines[i - 1].trim().is_empty() && i >= 2 => marker_on(lines[i - 2]),
            _ => marker_on(lines[i - 1]),
        };
        let start = i;
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && !lines[i].starts_with("```") {
            body.push(lines[i]);
            i += 1;
        }
        assert!(i < lines.len(), "README.md:{}: unclosed fence", start + 1);
        blocks.push(Block {
            line: start + 1,
            marker,
            body: body.join("\n"),
        });
        i += 1;
    }
    blocks
}

/// `kind: word key=value ...` → the kind, the words and the `key=value` pairs.
fn parse_marker(marker: &str) -> (&str, Vec<&str>, Vec<(&str, &str)>) {
    let (kind, rest) = marker.split_once(':').unwrap_or((marker, ""));
    let (mut words, mut pairs) = (Vec::new(), Vec::new());
    for token in rest.split_whitespace() {
        match token.split_once('=') {
            Some(pair) => pairs.push(pair),
            None => words.push(token),
        }
    }
    (kind.trim(), words, pairs)
}

fn time(text: &str) -> Result<Timestamp, String> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| Timestamp::from_datetime(&t))
        .map_err(|e| format!("{text:?} is not RFC 3339: {e}"))
}

fn json(body: &str) -> Result<Value, String> {
    serde_json::from_str(body).map_err(|e| format!("not JSON: {e}"))
}

/// A `schedule` example decoded as the broker path does, at the marker's `now=` or [`NOW`].
fn decode_example(pairs: &[(&str, &str)], body: &str) -> Result<NewTimer, String> {
    let now = match pairs.iter().find(|(k, _)| *k == "now") {
        Some((_, now)) => time(now)?,
        None => NOW,
    };
    match decode_command(body.as_bytes(), &Limits::default(), now) {
        Ok(Command::Schedule(timer)) => Ok(timer),
        other => Err(format!("expected a ScheduleTimer, decoded {other:?}")),
    }
}

/// The README's `schedule` examples that decode, as timers.
fn schedule_examples() -> Vec<NewTimer> {
    blocks(README)
        .iter()
        .filter_map(|block| {
            let (kind, _, pairs) = parse_marker(block.marker.as_deref()?);
            (kind == "schedule")
                .then(|| decode_example(&pairs, &block.body).ok())
                .flatten()
        })
        .collect()
}

/// Checks one block against the code; `Err` says what differs.
fn check(kind: &str, words: &[&str], pairs: &[(&str, &str)], body: &str) -> Result<(), String> {
    let get = |key: &str| pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    let limits = Limits::default();
    match kind {
        "schedule" => {
            let timer = decode_example(pairs, body)?;
            let example = json(body)?;
            let cron = example.get("cron").is_some() || example["payload"].get("cron").is_some();
            if timer.recurrence.is_some() != cron {
                return Err(format!("recurring should be {cron}: {timer:?}"));
            }
            if let Some(due) = get("dueAt") {
                let due_at = timer.due_at.to_rfc3339();
                if due_at != due {
                    return Err(format!("due at {due_at}, the marker says {due}"));
                }
            }
            let target = timer
                .target
                .as_ref()
                .map(|t| Value::Object(t.fields().clone()));
            if target.as_ref() != example.get("target") {
                return Err(format!(
                    "target {target:?}, the example says {}",
                    example["target"]
                ));
            }
            if let Some(given) = example.get("message").and_then(|m| m.get("body")) {
                let body = timer
                    .message
                    .as_ref()
                    .map(|m| m.body.as_slice())
                    .unwrap_or_default();
                if json(&String::from_utf8_lossy(body))? != *given {
                    return Err(format!("message body {body:?}, the example says {given}"));
                }
            }
            Ok(())
        }
        "cancel" | "pause" | "resume" | "complete" => {
            match (kind, decode_command(body.as_bytes(), &limits, NOW)) {
                ("cancel", Ok(Command::Cancel(_)))
                | ("pause", Ok(Command::Pause(_)))
                | ("resume", Ok(Command::Resume(_)))
                | ("complete", Ok(Command::Complete(..))) => {}
                (_, other) => return Err(format!("expected a {kind} command, decoded {other:?}")),
            }
            match decode_schedule(body.as_bytes(), &limits, NOW) {
                Err(r)
                    if r.reason == Reason::NotAcceptedHere
                        && r.field.as_deref() == Some("type") =>
                {
                    Ok(())
                }
                other => Err(format!(
                    "POST /v1/timers should refuse it with not_accepted_here (type): {other:?}"
                )),
            }
        }
        "rejected" => {
            let [reason] = words else {
                return Err("say `rejected: REASON [field=FIELD]`".into());
            };
            match decode_command(body.as_bytes(), &limits, NOW) {
                Err(r) if r.reason == *reason && r.field.as_deref() == get("field") => Ok(()),
                other => Err(format!(
                    "expected {reason} (field {:?}), decoded {other:?}",
                    get("field")
                )),
            }
        }
        "event" => {
            let [event] = words else {
                return Err("say `event: DueTimeReached|TimerFailed revision=R`".into());
            };
            let revision = get("revision")
                .and_then(|r| r.parse().ok())
                .ok_or("the marker needs revision=R (the timer revision that gives the id)")?;
            check_event(event, revision, &json(body)?)
        }
        "manual-event" => check_manual_event(&json(body)?),
        "http-error" => each_value(body, |example| {
            let error = &example["error"];
            let rejection = provoke(error["reason"].as_str(), error["field"].as_str(), true)?;
            let built = serde_json::json!({ "error": rejection });
            equal(&built, example)
        }),
        "dead-letter-reason" => {
            body.lines()
                .filter(|l| !l.trim().is_empty())
                .try_for_each(|line| {
                    // `field (reason): message`, or `reason: message` without a field.
                    let (head, _) = line
                        .split_once(": ")
                        .ok_or("not `field (reason): message`")?;
                    let (field, reason) = match head.split_once(" (") {
                        Some((field, reason)) => (Some(field), reason.strip_suffix(')')),
                        None => (None, Some(head)),
                    };
                    let rejection = provoke(reason, field, false)?;
                    let built = rejection.to_string();
                    if built == line {
                        Ok(())
                    } else {
                        Err(format!("the code says {built:?}"))
                    }
                })
        }
        _ => Err(format!("unknown marker {kind:?}")),
    }
}

/// The rejection of the [`PROVOKE`] command for `reason` and `field`, decoded as the HTTP API
/// (`http`) or the broker path does.
fn provoke(reason: Option<&str>, field: Option<&str>, http: bool) -> Result<Rejection, String> {
    let reason = reason.ok_or("no reason")?;
    let (_, _, command) = PROVOKE
        .iter()
        .find(|(r, f, _)| *r == reason && *f == field)
        .ok_or_else(|| format!("add a command for {reason} (field {field:?}) to PROVOKE"))?;
    let limits = Limits::default();
    let decoded = if http {
        decode_schedule(command.as_bytes(), &limits, NOW).map(|_| ())
    } else {
        decode_command(command.as_bytes(), &limits, NOW).map(|_| ())
    };
    match decoded {
        Err(r) if r.reason == reason && r.field.as_deref() == field => Ok(r),
        other => Err(format!("PROVOKE's command for {reason} gave {other:?}")),
    }
}

/// Calls `check` on each JSON value of a block that holds one or more.
fn each_value(body: &str, check: impl Fn(&Value) -> Result<(), String>) -> Result<(), String> {
    let mut count = 0;
    for value in serde_json::Deserializer::from_str(body).into_iter::<Value>() {
        check(&value.map_err(|e| format!("not JSON: {e}"))?)?;
        count += 1;
    }
    if count == 0 {
        return Err("no JSON value".into());
    }
    Ok(())
}

fn equal(built: &Value, example: &Value) -> Result<(), String> {
    if built == example {
        Ok(())
    } else {
        Err(format!(
            "the code gives\n{built}\nthe example is\n{example}"
        ))
    }
}

/// Builds the event of `example` again, through the code the engine publishes with, and
/// compares the two as JSON. The inputs are the example's own (tenant, service call id, due time,
/// fire time, correlation id, payload; for `TimerFailed` attempts and last error), except for a
/// timer that has a recurring `schedule` example: its event must be an occurrence of that
/// series, fired on time, with that command's correlation id and payload.
fn check_event(kind: &str, revision: i64, example: &Value) -> Result<(), String> {
    let payload = &example["payload"];
    let text = |v: &Value, what: &str| {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{what} is not a string"))
    };
    let key = TimerKey::new(
        text(&example["tenantId"], "tenantId")?,
        text(&payload["serviceCallId"], "payload.serviceCallId")?,
    );
    let at = example["timestampMs"]
        .as_i64()
        .map(Timestamp::from_millis)
        .ok_or("timestampMs is not an integer")?;
    let mut timer = ClaimedTimer {
        due_at: time(&text(&payload["dueAt"], "payload.dueAt")?)?,
        correlation_id: example
            .get("correlationId")
            .and_then(Value::as_str)
            .map(str::to_owned),
        payload: payload.get("payload").map(Value::to_string),
        revision,
        trace: crate::trace::TraceContext::from_stored(
            example.get("traceparent").and_then(Value::as_str),
            example.get("tracestate").and_then(Value::as_str),
        ),
        ..ClaimedTimer::for_tests(key)
    };
    let series = schedule_examples()
        .into_iter()
        .find(|t| t.key == timer.key && t.recurrence.is_some());
    match (series, payload.get("occurrence")) {
        (None, None) => {}
        (None, Some(_)) => {
            return Err(format!(
                "an event with an occurrence needs the recurring schedule example of {}",
                timer.key
            ))
        }
        (Some(_), None) => {
            return Err(format!(
                "{} is recurring: where is its occurrence?",
                timer.key
            ))
        }
        (Some(series), Some(n)) => {
            let n = n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| *n >= 1)
                .ok_or("occurrence is not an integer of at least 1")?;
            let recurrence = series.recurrence.clone().ok_or("not recurring")?;
            let schedule = recurrence.schedule().map_err(|e| e.message)?;
            let mut due = series.due_at;
            for fired in 1..n {
                due = schedule
                    .next(due, fired)
                    .ok_or_else(|| format!("the series ends after {fired} occurrences"))?;
            }
            if due != timer.due_at {
                return Err(format!(
                    "occurrence {n} of {} is due at {due}, the example says {}",
                    timer.key, timer.due_at
                ));
            }
            timer.correlation_id = series.correlation_id;
            timer.payload = series.payload;
            timer.recurrence = Some(recurrence);
            timer.occurrences = n - 1;
        }
    }
    let bytes = match kind {
        "DueTimeReached" => DueTimeReachedEnvelope::for_timer(&timer, at).to_json(),
        "TimerFailed" => {
            let attempts = payload["attempts"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or("payload.attempts is not an integer")?;
            let error = text(&payload["lastError"], "payload.lastError")?;
            TimerFailedEnvelope::for_timer(&timer, at, attempts, &error).to_json()
        }
        other => return Err(format!("no event {other:?}")),
    };
    let built: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    equal(&built, example)
}

/// Builds the event of a manual trigger again (`Envelope::manual`) from the example's tenant,
/// service call id, time (`timestampMs`), correlation id and payload, and compares the two as
/// JSON.
fn check_manual_event(example: &Value) -> Result<(), String> {
    let payload = &example["payload"];
    let text = |v: &Value, what: &str| {
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("{what} is not a string"))
    };
    let at = example["timestampMs"]
        .as_i64()
        .map(Timestamp::from_millis)
        .ok_or("timestampMs is not an integer")?;
    let key = TimerKey::new(
        text(&example["tenantId"], "tenantId")?,
        text(&payload["serviceCallId"], "payload.serviceCallId")?,
    );
    // Not in a manual event: its dueAt is the moment of the trigger.
    let new = NewTimer {
        correlation_id: example
            .get("correlationId")
            .and_then(Value::as_str)
            .map(str::to_owned),
        payload: payload.get("payload").map(Value::to_string),
        ..NewTimer::new(key, Timestamp::EPOCH)
    };
    let timer = Timer::registered(new, Timestamp::EPOCH);
    let bytes = DueTimeReachedEnvelope::manual(&timer, at).to_json();
    let built: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    equal(&built, example)
}

#[test]
fn every_example_has_a_marker_and_matches_the_code() {
    let blocks = blocks(README);
    let mut failures = Vec::new();
    let mut kinds = Vec::new();
    for block in &blocks {
        let Some(marker) = &block.marker else {
            failures.push(format!(
                "README.md:{}: no marker (an HTML comment such as <!-- schedule --> on the line \
                 before the fence)",
                block.line
            ));
            continue;
        };
        let (kind, words, pairs) = parse_marker(marker);
        kinds.push(kind.to_owned());
        if let Err(e) = check(kind, &words, &pairs, &block.body) {
            failures.push(format!("README.md:{}: <!-- {marker} -->: {e}", block.line));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
    // A reader that found no blocks would pass anything: every kind is in use.
    for kind in [
        "schedule",
        "cancel",
        "pause",
        "resume",
        "complete",
        "manual-event",
        "rejected",
        "event",
        "http-error",
        "dead-letter-reason",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "no <!-- {kind} --> example"
        );
    }
}

/// The rows of the table in `## Rejections`: the code in the first column.
fn table_codes(text: &str) -> Vec<String> {
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with("Rejections\n"))
        .expect("a ## Rejections section");
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| l.split('`').nth(1).expect("a code in backticks").to_owned())
        .collect()
}

#[test]
fn the_rejections_table_has_one_row_per_reason() {
    let codes = table_codes(README);
    for reason in Reason::ALL {
        let rows = codes.iter().filter(|c| *c == reason.as_str()).count();
        assert_eq!(rows, 1, "{reason}: {rows} rows in the Rejections table");
    }
    for code in &codes {
        assert!(
            Reason::ALL.iter().any(|r| r.as_str() == code),
            "the Rejections table has {code}, which is no wire::Reason"
        );
    }
}

#[test]
fn headings_other_docs_link_to_are_there() {
    let headings: Vec<&str> = README.lines().filter(|l| l.starts_with('#')).collect();
    for heading in [
        "# The wire contract",
        "## ScheduleTimer (in)",
        "## Recurring timers",
        "## CancelTimer (in)",
        "## PauseTimer and ResumeTimer (in)",
        "## Rejections",
        "## DueTimeReached (out)",
        "## TimerFailed (out)",
    ] {
        let count = headings.iter().filter(|h| **h == heading).count();
        assert_eq!(count, 1, "{heading:?} appears {count} times");
    }
    assert_eq!(headings.first(), Some(&"# The wire contract"));
}

#[test]
fn the_block_reader_finds_markers() {
    let text = "intro\n<!-- cancel -->\n```json\n{}\n```\n\n<!-- event: TimerFailed revision=3 -->\n\n```json\n{\"a\": 1}\nx\n```\n```text\nbare\n```\n";
    let found = blocks(text);
    let markers: Vec<Option<&str>> = found.iter().map(|b| b.marker.as_deref()).collect();
    assert_eq!(
        markers,
        [Some("cancel"), Some("event: TimerFailed revision=3"), None]
    );
    assert_eq!(found[1].body, "{\"a\": 1}\nx");
    assert_eq!(found[1].line, 9);
    assert_eq!(
        parse_marker("event: TimerFailed revision=3"),
        ("event", vec!["TimerFailed"], vec![("revision", "3")])
    );
}
