//! `timer-service fuzz`: feeds generated inputs to the command decoder (the code every broker
//! and the HTTP API run on untrusted bytes) and checks that each gets a typed answer: a timer or
//! a rejection with a known reason, never a panic. Inputs are arbitrary bytes and mutations of
//! valid commands: huge and negative numbers, deep nesting, invalid UTF-8, control characters,
//! duplicate keys, far-past and far-future times, over-long ids, truncation.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use anyhow::bail;
use indicatif::{ProgressBar, ProgressDrawTarget};
use timer_core::{decode_command, Limits, Timestamp};

/// splitmix64: small, fast, and the same sequence for the same seed on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const FIELDS: &[&str] = &[
    "tenantId",
    "serviceCallId",
    "dueAt",
    "dueTimeMs",
    "correlationId",
    "payload",
    "type",
    "id",
    "timestampMs",
    "cron",
    "timeZone",
    "endAt",
    "maxOccurrences",
];

/// A JSON value chosen to hit an edge.
fn value(rng: &mut Rng) -> String {
    match rng.below(17) {
        0 => "null".into(),
        1 => "true".into(),
        2 => format!("{}", rng.next() as i64),
        3 => format!("{}", rng.next()),
        4 => "1e308".into(),
        5 => "-9223372036854775809".into(),
        6 => "99999999999999999999999999".into(),
        7 => format!("\"{}\"", "x".repeat(rng.below(300))),
        8 => "\"\\u0000\\u001f\\n\"".into(),
        9 => format!(
            "{}{}",
            "[".repeat(rng.below(200)),
            "]".repeat(rng.below(200))
        ),
        10 => format!(
            "\"{}\"",
            rng.pick(&[
                "2027-01-15T10:00:00Z",
                "2027-01-15T10:00:00",
                "0001-01-01T00:00:00Z",
                "9999-12-31T23:59:59.999+14:00",
                "2027-02-30T25:61:61Z",
                "yesterday",
                "",
            ])
        ),
        11 => "{\"a\":{\"b\":{\"c\":[1,2,{\"d\":null}]}}}".into(),
        12 => rng
            .pick(&["\"ScheduleTimer\"", "\"CancelTimer\""])
            .to_string(),
        13 => "\"\\ud800\"".into(),
        14 => format!("{}", 1_700_000_000_000i64 + rng.below(1 << 30) as i64),
        15 => format!(
            "\"{}\"",
            rng.pick(&[
                "*/1 * * * * *",
                "0 9 * * MON-FRI",
                "0 0 29 2 *",
                "59 23 L * *",
                "0 0 * * 5#3",
                "* * * * * * * *",
                "0 0 31 2 *",
                "Europe/Berlin",
                "America/St_Johns",
                "Etc/GMT+14",
            ])
        ),
        _ => "{}".into(),
    }
}

/// A command-shaped object with random fields, some duplicated, some nested as an envelope.
fn object(rng: &mut Rng, depth: usize) -> String {
    let mut parts = Vec::new();
    for _ in 0..rng.below(8) {
        let key = rng.pick(FIELDS);
        let v = if key == "payload" && depth < 2 && rng.below(2) == 0 {
            object(rng, depth + 1)
        } else {
            value(rng)
        };
        parts.push(format!("\"{key}\":{v}"));
    }
    format!("{{{}}}", parts.join(","))
}

fn valid(rng: &mut Rng) -> String {
    let due = 1_800_000_000_000i64 + rng.below(1_000_000) as i64;
    if rng.below(2) == 0 {
        format!(
            r#"{{"tenantId":"t{}","serviceCallId":"c{}","dueTimeMs":{due},"payload":{{"k":[1,2]}}}}"#,
            rng.below(9),
            rng.next()
        )
    } else if rng.below(3) == 0 {
        r#"{"tenantId":"t","serviceCallId":"c","cron":"0 30 2 * * *","timeZone":"Europe/Berlin","maxOccurrences":5,"endAt":"2030-01-01T00:00:00Z"}"#
            .to_string()
    } else if rng.below(2) == 0 {
        r#"{"type":"CancelTimer","tenantId":"t","payload":{"serviceCallId":"c"}}"#.to_string()
    } else {
        r#"{"type":"ScheduleTimer","tenantId":"t","correlationId":"x","payload":{"serviceCallId":"c","dueAt":"2027-01-15T10:00:00.123+02:00"}}"#
            .to_string()
    }
}

/// One generated input.
fn input(rng: &mut Rng) -> Vec<u8> {
    match rng.below(5) {
        // Arbitrary bytes.
        0 => (0..rng.below(256)).map(|_| rng.next() as u8).collect(),
        // Structured but random.
        1 | 2 => object(rng, 0).into_bytes(),
        // A valid command, mutated at the byte level.
        _ => {
            let mut bytes = valid(rng).into_bytes();
            for _ in 0..=rng.below(4) {
                let at = rng.below(bytes.len());
                match rng.below(4) {
                    0 => bytes[at] = rng.next() as u8,
                    1 => bytes.truncate(at),
                    2 => bytes.insert(at, [b'"', b'{', b'[', 0xff, 0x00, b'\\'][rng.below(6)]),
                    _ => bytes.splice(at..at, value(rng).into_bytes()).for_each(drop),
                }
                if bytes.is_empty() {
                    break;
                }
            }
            bytes
        }
    }
}

pub fn run(inputs: u64, seed: u64, limits: &Limits) -> anyhow::Result<()> {
    let mut rng = Rng(seed);
    let now = Timestamp::from_millis(1_800_000_000_000);
    let mut outcomes: BTreeMap<&'static str, u64> = BTreeMap::new();
    let bar = ProgressBar::with_draw_target(Some(inputs), ProgressDrawTarget::stderr());
    let started = Instant::now();
    for i in 0..inputs {
        let bytes = input(&mut rng);
        let result = catch_unwind(AssertUnwindSafe(|| decode_command(&bytes, limits, now)));
        let outcome = match result {
            Ok(Ok(_)) => "accepted",
            // Every refusal is one of the typed reasons (`Reason`), by construction.
            Ok(Err(rejection)) => rejection.reason.as_str(),
            Err(_) => bail!(
                "input {i} (seed {seed}) made the decoder panic: {:?}",
                String::from_utf8_lossy(&bytes)
            ),
        };
        *outcomes.entry(outcome).or_insert(0) += 1;
        if i % 10_000 == 0 {
            bar.set_position(i);
        }
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{inputs} inputs (seed {seed}) in {secs:.1} s ({:.0}/s): no panic, every answer typed",
        inputs as f64 / secs
    );
    for (outcome, n) in outcomes {
        println!("  {outcome:<18} {n}");
    }
    Ok(())
}
