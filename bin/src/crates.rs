//! The rules between the crates (ARCHITECTURE.md, "must not depend on"), read from their
//! `Cargo.toml` files, and the engine's one way to the wall clock, read from its sources: a new
//! dependency or a stray `Utc::now()` that breaks one fails here, naming it.

use std::path::{Path, PathBuf};

/// The workspace's root (the binary's crate is `bin/`).
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("bin/ has a parent")
        .to_path_buf()
}

/// The names of a crate's normal dependencies (`[dependencies]`, also per target); not its
/// dev-dependencies, which tests may use freely.
fn dependencies(folder: &str) -> Vec<String> {
    let path = root().join(folder).join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let manifest: toml::Table = text
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut tables: Vec<&toml::Table> = manifest
        .get("dependencies")
        .and_then(|d| d.as_table())
        .into_iter()
        .collect();
    if let Some(targets) = manifest.get("target").and_then(|t| t.as_table()) {
        tables.extend(
            targets
                .values()
                .filter_map(|t| t.get("dependencies").and_then(|d| d.as_table())),
        );
    }
    tables
        .into_iter()
        .flat_map(|t| {
            t.iter().map(|(name, spec)| {
                // `alias = { package = "real-name", … }` depends on the real name.
                spec.get("package")
                    .and_then(|p| p.as_str())
                    .unwrap_or(name)
                    .to_owned()
            })
        })
        .collect()
}

/// The workspace's crates, by folder and name.
const CRATES: [(&str, &str); 5] = [
    ("timer", "timer-core"),
    ("stores", "timer-stores"),
    ("brokers", "timer-brokers"),
    ("bin", "timer-service"),
    ("tests", "timer-conformance"),
];
const STORE_SDKS: [&str; 3] = ["sqlx", "rusqlite", "tokio-postgres"];
const BROKER_SDKS: [&str; 3] = ["rdkafka", "lapin", "async-nats"];
const HTTP_SERVERS: [&str; 3] = ["axum", "hyper", "tower-http"];
/// The webhook caller's SDK (`brokers/src/webhook/`): a broker plugin may call out over HTTP, as
/// it talks to its broker, but serves nothing.
const HTTP_CLIENTS: [&str; 1] = ["reqwest"];

/// What each crate (by folder) must not depend on, as ARCHITECTURE.md's table of the crates
/// says.
fn forbidden() -> Vec<(&'static str, Vec<&'static str>)> {
    // The crates in `folders`, and the names in `more`.
    let of = |folders: &[&str], more: &[&[&'static str]]| -> Vec<&'static str> {
        let mut names: Vec<&'static str> = CRATES
            .iter()
            .filter(|(folder, _)| folders.contains(folder))
            .map(|(_, name)| *name)
            .collect();
        names.extend(more.iter().flat_map(|m| m.iter().copied()));
        names
    };
    vec![
        (
            "timer",
            of(
                &["stores", "brokers", "bin", "tests"],
                &[
                    &STORE_SDKS,
                    &BROKER_SDKS,
                    &HTTP_SERVERS,
                    &HTTP_CLIENTS,
                    &["figment"],
                ],
            ),
        ),
        (
            "stores",
            of(
                &["brokers", "bin"],
                &[&BROKER_SDKS, &HTTP_SERVERS, &HTTP_CLIENTS],
            ),
        ),
        (
            "brokers",
            of(&["stores", "bin"], &[&STORE_SDKS, &HTTP_SERVERS]),
        ),
        ("tests", of(&["bin"], &[])),
    ]
}

#[test]
fn no_crate_depends_on_what_the_architecture_forbids_it() {
    let mut broken = Vec::new();
    for (folder, forbidden) in forbidden() {
        for dependency in dependencies(folder) {
            if forbidden.contains(&dependency.as_str()) {
                broken.push(format!("{folder}/Cargo.toml depends on {dependency}"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// Reads of the wall clock; the engine takes the time from its `Clock` (`timer/src/clock.rs`
/// is the one place that reads it), so a `ManualClock` drives every decision in tests.
const WALL_CLOCK_READS: [&str; 4] = [
    "SystemTime::now",
    "Utc::now",
    "Local::now",
    "OffsetDateTime::now",
];

/// Every `.rs` file below `dir`, into `out`.
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The lines of `text` that read the wall clock, as `file:line: text`.
fn wall_clock_reads(file: &str, text: &str) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim_start().starts_with("//"))
        .filter(|(_, line)| WALL_CLOCK_READS.iter().any(|read| line.contains(read)))
        .map(|(n, line)| format!("{file}:{}: {}", n + 1, line.trim()))
        .collect()
}

#[test]
fn timer_core_reads_the_wall_clock_only_through_its_clock() {
    let src = root().join("timer").join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut reads = Vec::new();
    for file in files {
        if file == src.join("clock.rs") {
            continue;
        }
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let shown = file
            .strip_prefix(root())
            .unwrap_or(&file)
            .display()
            .to_string();
        reads.extend(wall_clock_reads(&shown, &text));
    }
    assert!(
        reads.is_empty(),
        "read the time from the Clock:\n{}",
        reads.join("\n")
    );
}

#[test]
fn a_wall_clock_read_is_found_and_a_comment_is_not() {
    let text = "// Utc::now() in a comment\nlet now = chrono::Utc::now();\n";
    assert_eq!(
        wall_clock_reads("x.rs", text),
        ["x.rs:2: let now = chrono::Utc::now();"]
    );
}
