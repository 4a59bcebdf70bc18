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

/// Every Markdown file of the repository (not under `target/` or a hidden folder), with its
/// path relative to the root.
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
                if !name.starts_with('.') && name != "target" {
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
            &root.join("bin/README.md"),
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
    let tables = ["store", "broker", "engine", "limits", "http", "log"];
    let mut named = 0;
    let mut unknown = Vec::new();
    for (file, text) in markdown_files() {
        let mut in_block = false;
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_block = !in_block;
            }
            let mut keys: Vec<String> = line
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter_map(|word| word.strip_prefix("TIMER_")?.split_once("__"))
                .map(|(table, key)| format!("{table}.{key}").to_ascii_lowercase())
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
                let name = rest.split('.').next().unwrap_or_default();
                if !tables.contains(&table) || name.is_empty() {
                    continue;
                }
                named += 1;
                if !known.contains(&format!("{table}.{name}")) {
                    unknown.push(format!("{file}:{}: {table}.{name}", n + 1));
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
