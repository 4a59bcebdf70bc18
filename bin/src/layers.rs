//! The binary's modules form layers: no module reaches, through the items it uses, back to
//! itself. Read from the source files, so a new import that closes a circle fails here, naming
//! the modules of the circle.
//!
//! A module's edges are the modules whose items it names (`use crate::http::state::AppState`,
//! `super::Principal`, `crate::server::app(…)`). A parent naming its own children is not an
//! edge (it is made of them); a child naming its parent is. Test code (`tests.rs`, the docs
//! checks in `reference`) is left out: tests may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path, `["http", "auth", "guard"]`; `[]` is the crate root (`main.rs`).
type Module = Vec<String>;

fn module(path: &[&str]) -> Module {
    path.iter().map(|s| s.to_string()).collect()
}

/// What a leaf (`config`, `http/error`, `http/counted`, `http/state`) may name: the leaves under
/// the state, and access (the state holds the `Auth`).
const BELOW_THE_LEAVES: [&[&str]; 4] = [
    &["config"],
    &["http", "error"],
    &["http", "counted"],
    &["http", "auth"],
];

fn modules(dir: &Path, path: &Module, out: &mut BTreeMap<Module, PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    entries.sort();
    for file in entries {
        let name = file
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        if file.is_dir() {
            if name == "tests" || name == "reference" {
                continue;
            }
            let mut child = path.clone();
            child.push(name);
            modules(&file, &child, out);
        } else if file.extension().is_some_and(|e| e == "rs") {
            if name == "tests" || name == "layers" || name == "reference" {
                continue;
            }
            let mut module = path.clone();
            if name != "mod" && !(path.is_empty() && name == "main") {
                module.push(name);
            }
            out.insert(module, file);
        }
    }
}

/// Every path a `use` statement names, its `{…}` groups expanded: `a::{b, c::d}` → `a::b`,
/// `a::c::d`.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap_or(tree).trim().to_owned()];
    };
    let prefix = &tree[..open];
    let inner = tree[open + 1..].trim_end().trim_end_matches('}');
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand)
        .map(|p| format!("{prefix}{p}"))
        .collect()
}

/// The paths a file names from `crate::` or `super::`: those of its `use` statements, and
/// those written in its code.
fn named_paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut paths = Vec::new();
    for statement in code.split(';') {
        let statement = statement.trim();
        let body = statement
            .strip_prefix("pub use ")
            .or_else(|| statement.strip_prefix("pub(crate) use "))
            .or_else(|| statement.strip_prefix("use "));
        if let Some(body) = body {
            paths.extend(expand(body));
        }
    }
    for start in ["crate::", "super::"] {
        for (at, _) in code.match_indices(start) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            // `use crate::{…}`: its paths came from the statement.
            if path.len() > start.len() {
                paths.push(path);
            }
        }
    }
    paths
}

/// The module a path names (its longest prefix that is a module), from `module`.
fn resolve(
    path: &str,
    module: &Module,
    is_dir: bool,
    known: &BTreeMap<Module, PathBuf>,
) -> Option<Module> {
    let mut segments = path.split("::").filter(|s| !s.is_empty());
    let mut at: Module = match segments.next()? {
        "crate" => Vec::new(),
        "super" => {
            // `super` of `http/mod.rs` is the root; of `http/state.rs`, `http`.
            let mut parent = module.clone();
            if !is_dir || !module.is_empty() {
                parent.pop();
            }
            parent
        }
        _ => return None,
    };
    for segment in segments {
        if segment == "super" {
            at.pop();
            continue;
        }
        let mut next = at.clone();
        next.push(segment.to_owned());
        if !known.contains_key(&next) {
            break;
        }
        at = next;
    }
    Some(at)
}

/// The cycles of a graph, each as `a → b → a`: a depth-first walk, where a module met again
/// while still on the walk's path closes one.
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<String> {
    fn visit(
        module: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        path: &mut Vec<Module>,
        done: &mut BTreeSet<Module>,
        cycles: &mut Vec<String>,
    ) {
        if done.contains(module) {
            return;
        }
        if let Some(at) = path.iter().position(|m| m == module) {
            let cycle: Vec<String> = path[at..].iter().chain([module]).map(show).collect();
            cycles.push(cycle.join(" → "));
            return;
        }
        path.push(module.clone());
        for next in edges.get(module).into_iter().flatten() {
            visit(next, edges, path, done, cycles);
        }
        path.pop();
        done.insert(module.clone());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for module in edges.keys() {
        visit(module, edges, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

fn show(module: &Module) -> String {
    if module.is_empty() {
        "main".into()
    } else {
        module.join("::")
    }
}

#[test]
fn the_modules_of_the_binary_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut known = BTreeMap::new();
    modules(&src, &Vec::new(), &mut known);
    assert!(known.len() > 20, "the modules were found: {known:?}");
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &known {
        let text = std::fs::read_to_string(file).expect("a source file");
        let is_dir = file.file_name().is_some_and(|n| n == "mod.rs");
        let targets = edges.entry(module.clone()).or_default();
        for path in named_paths(&text) {
            let Some(target) = resolve(&path, module, is_dir, &known) else {
                continue;
            };
            // Itself, one of its own parts, or the root (nothing names `main`'s items).
            if target.starts_with(module) || target.is_empty() {
                continue;
            }
            targets.insert(target);
        }
    }
    let cycles = cycles(&edges);
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
    // The leaves name nothing of the binary outside themselves, or only the leaves below them.
    let leaves: [&[&str]; 4] = [
        &["config"],
        &["http", "error"],
        &["http", "counted"],
        &["http", "state"],
    ];
    for leaf in leaves {
        let leaf = module(leaf);
        for target in edges.get(&leaf).into_iter().flatten() {
            let below = BELOW_THE_LEAVES
                .iter()
                .any(|path| target.starts_with(&module(path)));
            assert!(
                below,
                "{} is a leaf but names {}",
                show(&leaf),
                show(target)
            );
        }
    }
}

/// The check can fail: paths resolve to their modules, and a circle is found.
#[test]
fn a_cycle_is_found() {
    let mut known = BTreeMap::new();
    for m in [vec![], vec!["a".to_owned()], vec!["b".to_owned()]] {
        known.insert(m, PathBuf::new());
    }
    let a = vec!["a".to_owned()];
    let b = vec!["b".to_owned()];
    assert_eq!(
        resolve("crate::b::Thing", &a, false, &known),
        Some(b.clone())
    );
    assert_eq!(resolve("super::a::f", &b, false, &known), Some(a.clone()));
    let paths = named_paths("use crate::{a::X, b::{Y, Z as W}};\nfn f() { crate::a::g(); }");
    assert_eq!(
        paths,
        ["crate::a::X", "crate::b::Y", "crate::b::Z", "crate::a::g"]
    );
    let mut edges = BTreeMap::new();
    edges.insert(a.clone(), BTreeSet::from([b.clone()]));
    edges.insert(b.clone(), BTreeSet::new());
    assert!(cycles(&edges).is_empty());
    edges.insert(b.clone(), BTreeSet::from([a.clone()]));
    assert_eq!(cycles(&edges), ["a → b → a"]);
}
