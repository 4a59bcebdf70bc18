//! The docs' links, anchors and book includes resolve.

use std::collections::BTreeSet;

use super::*;

/// GitHub's anchors of a Markdown text's headings (`## Events: at least once` →
/// `events-at-least-once`; a repeated heading gets `-1`, `-2`).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line, in_block) in lines_in_blocks(text) {
        let Some(heading) = line.strip_prefix('#').filter(|_| !in_block) else {
            continue;
        };
        let slug: String = heading
            .trim_start_matches('#')
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 0;
        while !seen.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
    }
    seen
}

/// Every relative link in the docs reaches a file of the repository, and its `#anchor` a
/// heading of that file.
#[test]
fn every_link_in_the_docs_resolves() {
    let root = root();
    let files = markdown_files();
    let mut checked = 0;
    let mut broken = Vec::new();
    for (file, text) in &files {
        let dir = Path::new(file).parent().unwrap_or(Path::new(""));
        for (n, line, _) in lines_in_blocks(text).filter(|(_, _, in_block)| !in_block) {
            for piece in line.split("](").skip(1) {
                let Some(target) = piece.split(')').next() else {
                    continue;
                };
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target, None),
                };
                let resolved = if path.is_empty() {
                    root.join(file)
                } else {
                    root.join(dir).join(path)
                };
                let at = format!("{file}:{}: {target}", n + 1);
                if !resolved.exists() {
                    broken.push(format!("{at}: no such file"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    if resolved.extension().is_some_and(|e| e == "md")
                        && !anchors(&read(&resolved)).contains(anchor)
                    {
                        broken.push(format!("{at}: no heading with this anchor"));
                    }
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every `{{#include path}}` of the book names a file (mdbook only warns of a missing one).
#[test]
fn every_include_of_the_book_resolves() {
    let root = root();
    let mut found = 0;
    let mut missing = Vec::new();
    for (file, text) in markdown_files() {
        if !file.starts_with("docs/") {
            continue;
        }
        let dir = root.join(&file);
        let dir = dir.parent().expect("a file in a folder");
        for (n, line) in text.lines().enumerate() {
            let Some(rest) = line.trim().strip_prefix("{{#include ") else {
                continue;
            };
            let target = rest.trim_end_matches("}}").trim();
            // `file.md:2:10` or `file.rs:anchor` take a part of the file.
            let target = target.split(':').next().unwrap_or(target);
            found += 1;
            if !dir.join(target).is_file() {
                missing.push(format!("{file}:{}: {target}", n + 1));
            }
        }
    }
    assert!(found > 5, "the book includes the pages beside the code");
    assert!(
        missing.is_empty(),
        "includes that name no file:\n{}",
        missing.join("\n")
    );
}
