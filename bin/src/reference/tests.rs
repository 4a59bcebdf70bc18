//! The docs against the code: generated parts are current, every config key a doc names exists,
//! every TOML example loads, every JSON example parses. They need every plugin compiled in
//! (`--all-features`, as the test command builds), since the docs cover every plugin.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::*;

/// The repository root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every Markdown file of the repository (not under `target/`, `docs/book/` or a hidden folder),
/// with its path relative to the root.
fn markdown_files() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" && !path.ends_with("docs/book") {
                    walk(&path, root, out);
                }
            } else if name.ends_with(".md") {
                let relative = path
                    .strip_prefix(root)
                    .expect("under the root")
                    .display()
                    .to_string();
                out.push((relative, read(&path)));
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    walk(&root, &root, &mut out);
    out
}

/// The fenced code blocks of a Markdown text: (info string, body, line of the fence).
fn code_blocks(text: &str) -> Vec<(String, String, usize)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String, usize)> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    open = Some((info.trim().to_owned(), String::new(), n + 1));
                }
            }
            Some((info, mut body, at)) => {
                if trimmed.starts_with("```") {
                    blocks.push((info, body, at));
                } else {
                    body.push_str(line);
                    body.push('\n');
                    open = Some((info, body, at));
                }
            }
        }
    }
    blocks
}

/// Each line of a Markdown text with its number (from 0) and whether it is inside a fenced code
/// block (an opening fence counts as inside, a closing one as outside).
fn lines_in_blocks(text: &str) -> impl Iterator<Item = (usize, &str, bool)> {
    let mut in_block = false;
    text.lines().enumerate().map(move |(n, line)| {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        }
        (n, line, in_block)
    })
}

/// Compares `generated` with the part of `path` between `begin` and `end` (the whole file when
/// there are no markers); with `UPDATE_DOCS=1` writes it instead. Returns a complaint, if any.
fn check_generated(path: &Path, markers: Option<(&str, &str)>, generated: &str) -> Option<String> {
    let text = read(path);
    let (before, current, after) = match markers {
        None => ("", text.as_str(), ""),
        Some((begin, end)) => {
            let (Some(b), Some(e)) = (text.find(begin), text.find(end)) else {
                return Some(format!("{}: no {begin} … {end} markers", path.display()));
            };
            let b = b + begin.len();
            (&text[..b], &text[b..e], &text[e..])
        }
    };
    let wanted = match markers {
        None => generated.to_owned(),
        Some(_) => format!("\n{generated}"),
    };
    if current == wanted {
        return None;
    }
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(path, format!("{before}{wanted}{after}"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return None;
    }
    Some(format!(
        "{} is not what the code generates; run `UPDATE_DOCS=1 cargo test -p timer-service \
         --all-features reference` and review the diff",
        path.display()
    ))
}

#[test]
fn generated_docs_are_current() {
    let root = root();
    let sections = sections();
    let complaints: Vec<String> = [
        check_generated(
            &root.join("config/README.md"),
            Some((
                "<!-- generated:config:begin -->",
                "<!-- generated:config:end -->",
            )),
            &markdown(&sections),
        ),
        check_generated(
            &root.join("config/timer-service.example.toml"),
            None,
            &example_toml(&sections),
        ),
        check_generated(
            &root.join("docs/src/operations/metrics.md"),
            Some((
                "<!-- generated:metrics:begin -->",
                "<!-- generated:metrics:end -->",
            )),
            &metrics_markdown(),
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(complaints.is_empty(), "{}", complaints.join("\n"));
}

#[test]
fn every_key_is_documented() {
    for section in sections() {
        for key in &section.keys {
            assert!(
                key.doc.len() >= 10,
                "{}.{} has no doc comment: document it on its config struct",
                section.heading(),
                key.name
            );
        }
        assert!(
            !section.doc.is_empty(),
            "[{}] has no doc comment on its config struct",
            section.heading()
        );
    }
}

/// Every `section.key` a doc names in backticks (outside code blocks, where a typo may be the
/// point of an example), and every `TIMER_SECTION__KEY` anywhere, is a key of that section in
/// some kind.
#[test]
fn every_config_key_named_in_the_docs_exists() {
    let sections = sections();
    let mut known: BTreeSet<String> = sections
        .iter()
        .flat_map(|s| s.keys.iter().map(|k| format!("{}.{}", s.table, k.name)))
        .collect();
    known.insert("store.kind".into());
    known.insert("broker.kind".into());
    let tables = [
        "store",
        "broker",
        "engine",
        "limits",
        "targets",
        "http",
        "log",
        "telemetry",
    ];
    // Tables inside a table (`limits.rate`): their keys are named in full.
    let nested: BTreeSet<&str> = sections
        .iter()
        .map(|s| s.table)
        .filter(|t| t.contains('.'))
        .collect();
    let mut named = 0;
    let mut unknown = Vec::new();
    for (file, text) in markdown_files() {
        for (n, line, in_block) in lines_in_blocks(&text) {
            let mut keys: Vec<String> = line
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter_map(|word| word.strip_prefix("TIMER_")?.split_once("__"))
                .map(|(table, key)| {
                    format!("{table}.{}", key.replace("__", ".")).to_ascii_lowercase()
                })
                .collect();
            if !in_block {
                // The odd pieces of a line split at backticks are the code spans.
                keys.extend(line.split('`').skip(1).step_by(2).map(|span| {
                    let end = span
                        .find(|c: char| !(c.is_ascii_lowercase() || c == '_' || c == '.'))
                        .unwrap_or(span.len());
                    span[..end].to_owned()
                }));
            }
            for key in keys {
                let Some((table, rest)) = key.split_once('.') else {
                    continue;
                };
                // `broker.properties.…` entries are librdkafka's, not ours.
                let mut parts = rest.split('.');
                let name = parts.next().unwrap_or_default();
                if !tables.contains(&table) || name.is_empty() {
                    continue;
                }
                named += 1;
                let mut full = format!("{table}.{name}");
                if nested.contains(full.as_str()) {
                    match parts.next().filter(|sub| !sub.is_empty()) {
                        Some(sub) => full = format!("{full}.{sub}"),
                        None => continue, // the table itself
                    }
                }
                if !known.contains(&full) {
                    unknown.push(format!("{file}:{}: {full}", n + 1));
                }
            }
        }
    }
    assert!(named > 100, "only {named} config keys found in the docs");
    assert!(
        unknown.is_empty(),
        "config keys named in the docs that no section has:\n{}",
        unknown.join("\n")
    );
}

/// Every ```toml block in the docs is a config the service loads (with every plugin).
#[test]
fn every_toml_example_in_the_docs_loads() {
    use figment::providers::{Format, Toml};
    let mut failures = Vec::new();
    let mut count = 0;
    for (file, text) in markdown_files() {
        for (info, body, line) in code_blocks(&text) {
            if info != "toml" {
                continue;
            }
            count += 1;
            let figment = figment::Figment::from(Toml::string(&body));
            if let Err(e) = crate::config::load(&figment) {
                failures.push(format!("{file}:{line}: {}", e.chain()));
            }
        }
    }
    assert!(count > 0, "no TOML examples found");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every ```json block outside the wire contract (whose examples `timer_core::wire`'s tests
/// decode) is JSON: one value, or one value per line.
#[test]
fn every_json_example_in_the_docs_parses() {
    let mut failures = Vec::new();
    for (file, text) in markdown_files() {
        if file.starts_with("timer/src/wire/") {
            continue;
        }
        for (info, body, line) in code_blocks(&text) {
            if info != "json" {
                continue;
            }
            let whole = serde_json::from_str::<Value>(&body);
            let per_line = body
                .lines()
                .filter(|l| !l.trim().is_empty())
                .try_for_each(|l| serde_json::from_str::<Value>(l).map(drop));
            if let (Err(e), Err(_)) = (whole, per_line) {
                failures.push(format!("{file}:{line}: {e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The keys of every object in `value` (nested ones too) that `is_wanted`, with the path.
fn objects<'a>(
    value: &'a Value,
    is_wanted: &dyn Fn(&serde_json::Map<String, Value>) -> bool,
    out: &mut Vec<&'a serde_json::Map<String, Value>>,
) {
    match value {
        Value::Object(map) => {
            if is_wanted(map) {
                out.push(map);
            }
            map.values().for_each(|v| objects(v, is_wanted, out));
        }
        Value::Array(items) => items.iter().for_each(|v| objects(v, is_wanted, out)),
        _ => {}
    }
}

/// Every timer resource shown in the docs (an object with `serviceCallId` and `registeredAt`)
/// has the fields `GET /v1/tenants/{tenant}/timers/{id}` answers with (and `nextOccurrences`,
/// which `?next=` adds), no more and no fewer;
/// so has its `recurrence` when it is not null.
#[test]
fn every_timer_resource_in_the_docs_has_the_api_fields() {
    use timer_core::{NewTimer, Recurrence, Timer, TimerKey, Timestamp};
    let recurrence: Recurrence =
        serde_json::from_value(serde_json::json!({"cron": "* * * * *", "timeZone": "UTC"}))
            .expect("a recurrence");
    let new = NewTimer {
        recurrence: Some(recurrence),
        ..NewTimer::new(TimerKey::new("t", "s"), Timestamp::EPOCH)
    };
    let timer = Timer::registered(new, Timestamp::EPOCH);
    let view = serde_json::to_value(crate::http::views::TimerView::of(&timer)).expect("serializes");
    let keys = |map: &serde_json::Map<String, Value>| map.keys().cloned().collect::<BTreeSet<_>>();
    let wanted = view.as_object().map(keys).expect("an object");
    let wanted_recurrence = view["recurrence"].as_object().map(keys).expect("an object");
    let mut found = 0;
    let mut failures = Vec::new();
    for (file, text) in markdown_files() {
        for (info, body, line) in code_blocks(&text) {
            if info != "json" {
                continue;
            }
            let values: Vec<Value> = match serde_json::from_str::<Value>(&body) {
                Ok(value) => vec![value],
                Err(_) => body
                    .lines()
                    .filter_map(|l| serde_json::from_str(l).ok())
                    .collect(),
            };
            let mut timers = Vec::new();
            let is_timer = |m: &serde_json::Map<String, Value>| {
                m.contains_key("serviceCallId") && m.contains_key("registeredAt")
            };
            values
                .iter()
                .for_each(|v| objects(v, &is_timer, &mut timers));
            for timer in timers {
                found += 1;
                // `nextOccurrences` is there when asked for with `?next=`.
                let mut fields = keys(timer);
                fields.remove("nextOccurrences");
                if fields != wanted {
                    failures.push(format!(
                        "{file}:{line}: fields {:?}, the API has {wanted:?}",
                        keys(timer)
                    ));
                }
                if let Some(r) = timer.get("recurrence").and_then(Value::as_object) {
                    if keys(r) != wanted_recurrence {
                        failures.push(format!("{file}:{line}: recurrence fields {:?}, the API has {wanted_recurrence:?}", keys(r)));
                    }
                }
            }
        }
    }
    assert!(found > 0, "no timer resource found in the docs");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

mod links;
