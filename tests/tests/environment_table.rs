//! `docs/environment.md` lists every `BRAID_*` environment variable; this
//! test keeps the list and the code in step. The rule (also at the top of
//! that file):
//!
//! - *Source* is every `.rs` and `.sh` file under `crates/`, `tools/`,
//!   `tests/`, `fuzz/` and `scripts/`, every `.py` file under `python/`
//!   (the package and its tests), and `.ci/run` (`target/` folders
//!   skipped; this file is not source).
//! - Names in [`NOT_VARIABLES`] are no variables (a Python table, a
//!   placeholder in a usage line) and are skipped.
//! - Every name `BRAID_[A-Z0-9_]*` in source (code, strings, comments,
//!   tests alike) that does not end in `_` needs a row in the table, and
//!   every row must name a variable that occurs in source.
//! - A name that ends in `_` is a prefix in prose (`BRAID_IB_*`,
//!   `BRAID_<NAME>_DISABLE`) and is skipped, unless a `{` follows it: then
//!   it is a name built at run time (`format!("BRAID_{}_DISABLE", ..)`),
//!   which must be one of [`templates`] below, and each of its expansions
//!   needs a row.
//! - A row is a table line whose first cell is exactly one backticked
//!   `BRAID_*` name, with four cells: name, default, meaning, read by.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const TABLE: &str = "docs/environment.md";

/// `BRAID_*` words in source that name no environment variable, with where
/// they are and what they are.
const NOT_VARIABLES: &[(&str, &str)] = &[
    (
        "BRAID_OP",
        "python/braid/_torch/tables.py: the table of torch's ReduceOps as braid's operator names",
    ),
    (
        "BRAID_FILE",
        "python/tests/upstream_compare.py: a placeholder for a file name in its usage line",
    ),
];

/// Names built at run time: the template as written in source (braces
/// emptied) and the names it stands for.
fn templates() -> Vec<(&'static str, Vec<String>)> {
    use braid_core::transport::TransportKind;
    vec![(
        // crates/core/src/transport/kind.rs: one per transport.
        "BRAID_{}_DISABLE",
        TransportKind::ALL.iter().map(|t| t.disable_var()).collect(),
    )]
}

/// What the scan of one text found.
#[derive(Debug, Default, PartialEq)]
struct Found {
    /// Variable names, with the 1-based line of each occurrence.
    names: Vec<(String, usize)>,
    /// Templates (braces emptied), with their lines.
    templates: Vec<(String, usize)>,
}

fn scan(text: &str) -> Found {
    const PREFIX: &str = "BRAID_";
    let mut found = Found::default();
    for (i, line) in text.lines().enumerate() {
        let b = line.as_bytes();
        let mut from = 0;
        while let Some(at) = line[from..].find(PREFIX).map(|k| k + from) {
            let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
            let mut end = at + PREFIX.len();
            while end < b.len()
                && (b[end].is_ascii_uppercase() || b[end].is_ascii_digit() || b[end] == b'_')
            {
                end += 1;
            }
            from = end;
            if at > 0 && ident(b[at - 1]) {
                continue; // part of a longer identifier (XBRAID_...)
            }
            let name = &line[at..end];
            if b.get(end) == Some(&b'{') {
                // A template: read on through braces and name characters,
                // emptying every {...}.
                let mut t = name.to_string();
                let mut j = end;
                while j < b.len() {
                    if b[j] == b'{' {
                        match line[j..].find('}') {
                            Some(k) => {
                                t.push_str("{}");
                                j += k + 1;
                            }
                            None => break,
                        }
                    } else if ident(b[j]) {
                        t.push(b[j] as char);
                        j += 1;
                    } else {
                        break;
                    }
                }
                from = j;
                found.templates.push((t, i + 1));
            } else if !name.ends_with('_') {
                found.names.push((name.to_string(), i + 1));
            }
        }
    }
    found
}

/// The table's rows: name -> line in the file.
fn rows(text: &str) -> Result<BTreeMap<String, usize>, Vec<String>> {
    let mut rows = BTreeMap::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if !line.starts_with('|') {
            continue;
        }
        let unescaped = line.replace("\\|", "");
        let cells: Vec<&str> = unescaped
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let first = cells[0];
        if !first.contains("BRAID_") {
            continue;
        }
        let name = first
            .strip_prefix('`')
            .and_then(|s| s.strip_suffix('`'))
            .filter(|n| {
                n.len() > 6
                    && n.starts_with("BRAID_")
                    && !n.ends_with('_')
                    && n.bytes()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b'_')
            });
        let Some(name) = name else {
            errors.push(format!(
                "{TABLE}:{}: the first cell must be one backticked variable name, got {first:?}",
                i + 1
            ));
            continue;
        };
        if cells.len() != 4 || cells.iter().any(|c| c.is_empty()) {
            errors.push(format!(
                "{TABLE}:{}: {name}: a row has four non-empty cells (name | default | meaning | read by), found {}",
                i + 1,
                cells.len()
            ));
        }
        if let Some(before) = rows.insert(name.to_string(), i + 1) {
            errors.push(format!(
                "{TABLE}:{}: {name} already has a row (line {before})",
                i + 1
            ));
        }
    }
    if errors.is_empty() {
        Ok(rows)
    } else {
        Err(errors)
    }
}

/// Every source file, relative to `root`, sorted.
fn source_files(root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if p.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    walk(&p, out);
                }
            } else if [".rs", ".sh", ".py"].iter().any(|x| name.ends_with(x)) {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for d in ["crates", "tools", "tests", "fuzz", "scripts", "python"] {
        walk(&root.join(d), &mut out);
    }
    out.push(root.join(".ci/run"));
    let mut out: Vec<PathBuf> = out
        .into_iter()
        .filter(|p| p.is_file() && !p.ends_with("tests/tests/environment_table.rs"))
        .map(|p| p.strip_prefix(root).unwrap_or(&p).to_path_buf())
        .collect();
    out.sort();
    out
}

#[test]
fn every_braid_variable_has_a_row_and_every_row_a_variable() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies in the repository");
    let table =
        std::fs::read_to_string(root.join(TABLE)).unwrap_or_else(|e| panic!("{TABLE}: {e}"));
    let rows = rows(&table).unwrap_or_else(|e| panic!("{}", e.join("\n")));
    assert!(rows.len() > 10, "{TABLE}: only {} rows found", rows.len());

    let known: BTreeMap<&str, Vec<String>> = templates().into_iter().collect::<BTreeMap<_, _>>();
    // Every variable in source, with where it first occurs.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut skipped: Vec<&str> = Vec::new();
    let mut errors = Vec::new();
    let files = source_files(root);
    assert!(
        files.len() > 50,
        "only {} source files found under {}",
        files.len(),
        root.display()
    );
    for f in &files {
        let Ok(text) = std::fs::read_to_string(root.join(f)) else {
            continue; // not UTF-8: not source we write
        };
        let found = scan(&text);
        for (n, line) in found.names {
            if let Some((x, _)) = NOT_VARIABLES.iter().find(|(x, _)| *x == n) {
                skipped.push(x);
                continue;
            }
            seen.entry(n)
                .or_insert_with(|| format!("{}:{line}", f.display()));
        }
        for (t, line) in found.templates {
            match known.get(t.as_str()) {
                Some(names) => {
                    for n in names {
                        seen.entry(n.clone())
                            .or_insert_with(|| format!("{}:{line} ({t})", f.display()));
                    }
                }
                None => errors.push(format!(
                    "{}:{line}: `{t}` builds variable names at run time: add it to templates() in \
                     tests/tests/environment_table.rs with the names it stands for, and give each \
                     a row in {TABLE}",
                    f.display()
                )),
            }
        }
    }
    for (n, at) in &seen {
        if !rows.contains_key(n) {
            errors.push(format!(
                "{at}: {n} is not in {TABLE}: add a row (name | default | meaning | read by) to its group"
            ));
        }
    }
    for (n, what) in NOT_VARIABLES {
        if !skipped.contains(n) {
            errors.push(format!(
                "NOT_VARIABLES in tests/tests/environment_table.rs: {n} ({what}) occurs nowhere in \
                 source any more: remove it"
            ));
        }
        if rows.contains_key(*n) {
            errors.push(format!(
                "{TABLE}: {n} has a row but NOT_VARIABLES says it is no variable"
            ));
        }
    }
    for (n, line) in &rows {
        if !seen.contains_key(n) {
            errors.push(format!(
                "{TABLE}:{line}: {n} occurs nowhere in source any more: remove its row (or fix its spelling)"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "{} problem(s):\n{}",
        errors.len(),
        errors.join("\n")
    );
}

#[test]
fn the_scanner_sees_names_templates_and_prefixes() {
    let text = "let a = env(\"BRAID_FOO_2\"); // and BRAID_BAR=1\n\
                format!(\"BRAID_{}_DISABLE\", x); `BRAID_{NAME}_OFF`\n\
                see BRAID_IB_* and BRAID_<NAME>_DISABLE, not XBRAID_NO or BRAID_";
    let f = scan(text);
    assert_eq!(
        f.names,
        vec![("BRAID_FOO_2".to_string(), 1), ("BRAID_BAR".to_string(), 1)]
    );
    assert_eq!(
        f.templates,
        vec![
            ("BRAID_{}_DISABLE".to_string(), 2),
            ("BRAID_{}_OFF".to_string(), 2)
        ]
    );
    let table = "| name | default | meaning | read by |\n|---|---|---|---|\n\
                 | **Group** | | | |\n| `BRAID_FOO_2` | 1 | a | b |\n";
    assert_eq!(
        rows(table).unwrap().into_iter().collect::<Vec<_>>(),
        vec![("BRAID_FOO_2".to_string(), 4)]
    );
    assert!(rows("| `BRAID_A`, `BRAID_B` | 1 | a | b |").is_err());
    assert!(rows("| `BRAID_A` | 1 | a |").is_err());
    assert!(rows("| `BRAID_A` | 1 | a | b |\n| `BRAID_A` | 1 | a | b |").is_err());
}
