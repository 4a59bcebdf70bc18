//! The sizes the project keeps so its shape stays readable: a file of the binary holds one
//! concern (450 lines at most, `main.rs` 100), no source file outside tests grows past 700 lines,
//! and the front-door documents stay short enough to read (the rest belongs in the book). A file
//! that outgrows its bound fails here, naming it: split it by concern, or move the text to the
//! book.

use std::path::Path;

use crate::crates::{root, rust_files};

/// The line count of a file under the workspace's root.
fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .count()
}

/// Those of `files` longer than `most` lines, as `path: N lines (most M)`.
fn over(files: impl IntoIterator<Item = std::path::PathBuf>, most: usize) -> Vec<String> {
    files
        .into_iter()
        .filter_map(|file| {
            let n = lines(&file);
            let shown = file.strip_prefix(root()).unwrap_or(&file).display();
            (n > most).then(|| format!("{shown}: {n} lines (most {most})"))
        })
        .collect()
}

/// A file of tests: `tests.rs`, `doc_tests.rs`, or anything in a `tests` folder.
fn is_tests(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name == "tests.rs" || name == "doc_tests.rs")
        || path.components().any(|c| c.as_os_str() == "tests")
}

#[test]
fn files_keep_their_sizes() {
    let root = root();
    let mut binary = Vec::new();
    rust_files(&root.join("bin").join("src"), &mut binary);
    let mut broken = over(binary, 450);
    broken.extend(over([root.join("bin/src/main.rs")], 100));

    let mut sources = Vec::new();
    for crate_src in ["timer/src", "stores/src", "brokers/src", "bin/src"] {
        rust_files(&root.join(crate_src), &mut sources);
    }
    broken.extend(over(sources.into_iter().filter(|f| !is_tests(f)), 700));

    for (doc, most) in [
        ("README.md", 150),
        ("ARCHITECTURE.md", 300),
        ("bin/README.md", 200),
        ("BENCHMARKS.md", 300),
    ] {
        broken.extend(over([root.join(doc)], most));
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn test_files_are_told_apart() {
    assert!(is_tests(Path::new("timer/src/wire/tests.rs")));
    assert!(is_tests(Path::new("bin/src/reference/tests/links.rs")));
    assert!(!is_tests(Path::new("timer/src/engine/fire.rs")));
}
