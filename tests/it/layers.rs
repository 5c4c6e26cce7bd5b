//! The library's layers (docs/architecture.md, "Layers"), read from the
//! `crate::` paths of `src/` (the binary, `src/bin/`, is a crate of its own
//! on top): the connection layer (`connect`) and the store (`store`) use
//! nothing above them, and no two parts of `src/` use each other, however
//! far round. A part is a top-level module: a folder (`src/store/`) or a
//! file (`src/retry.rs`). A name the crate root re-exports (`crate::Term`)
//! counts as the part that defines it. Test modules (`#[cfg(test)] mod`)
//! are left out: a test may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The parts below everything, from the ground up: what `connect` and
/// `store` may use. Each uses only parts before it in this list.
const GROUND: &[&str] = &["error", "metrics", "term", "event", "retry"];

/// The parts whose every import must run down, each with what it may use
/// besides [`GROUND`], in the layer order: `connect` opens sessions, and
/// `store` runs the SQL on them.
const LOW: &[(&str, &[&str])] = &[("connect", &[]), ("store", &["connect"])];

/// Circles between parts that are known and still to be broken, each
/// sorted: the check fails on any other, and on one of these once it is
/// gone (so that the list only shrinks). None is left.
const KNOWN_CIRCLES: &[&[&str]] = &[];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("read src/").map(|e| e.expect("a directory entry").path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` with comments, string and character literals blanked (line
/// breaks kept), so that only code is read.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |s: &str, out: &mut String| out.extend(s.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
    while i < b.len() {
        let rest = &text[i..];
        let end = if rest.starts_with("//") {
            rest.find('\n').unwrap_or(rest.len())
        } else if rest.starts_with("/*") {
            let (mut depth, mut j) = (0usize, 0);
            while j < rest.len() {
                if rest[j..].starts_with("/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with("*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += rest[j..].chars().next().map_or(1, char::len_utf8);
                }
            }
            j
        } else if let Some(hashes) = raw_string_start(text, i) {
            let close = format!("\"{}", "#".repeat(hashes));
            let open = rest.find('"').unwrap_or(0) + 1;
            rest[open..].find(&close).map_or(rest.len(), |k| open + k + close.len())
        } else if rest.starts_with('"') {
            let mut j = 1;
            while j < rest.len() && !rest[j..].starts_with('"') {
                j += if rest[j..].starts_with('\\') { 2 } else { 1 };
                while !rest.is_char_boundary(j.min(rest.len())) {
                    j += 1;
                }
            }
            (j + 1).min(rest.len())
        } else if rest.starts_with('\'') {
            // A character literal ('x', '\n', '\''), not a lifetime.
            let mut chars = rest.char_indices().skip(1);
            match chars.next() {
                Some((_, '\\')) => rest[2..].find('\'').map_or(1, |k| k + 3),
                Some((k, c)) if rest[k + c.len_utf8()..].starts_with('\'') => k + c.len_utf8() + 1,
                _ => 1,
            }
        } else {
            0
        };
        if end == 0 || (end == 1 && rest.starts_with('\'')) {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        } else {
            blank(&rest[..end], &mut out);
            i += end;
        }
    }
    out
}

/// The number of `#` of a raw string literal (`r"`, `r#"`, `br"`) that
/// starts at byte `i`, if one does.
fn raw_string_start(text: &str, i: usize) -> Option<usize> {
    let before = text[..i].chars().next_back();
    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
        return None;
    }
    let rest = text[i..].strip_prefix('b').unwrap_or(&text[i..]);
    let rest = rest.strip_prefix('r')?;
    let hashes = rest.len() - rest.trim_start_matches('#').len();
    rest[hashes..].starts_with('"').then_some(hashes)
}

/// `code` without its test modules (`#[cfg(test)]` on a `mod` with a body).
fn without_tests(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let after = &out[at + "#[cfg(test)]".len()..];
        let item = after.trim_start();
        let starts_mod = item.starts_with("mod ") || item.starts_with("pub(crate) mod ");
        let open = after.find(['{', ';']);
        let end = match open {
            Some(k) if starts_mod && after[k..].starts_with('{') => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (j, c) in after[k..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = k + j + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            // An attribute on anything else: only the attribute goes.
            _ => 0,
        };
        let cut = at + "#[cfg(test)]".len() + end;
        out.replace_range(at..cut, "");
    }
    out
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first identifiers of each path in a `{...}` group at the start of
/// `s` (`{a, b::c, d::{e, f}}` gives `a`, `b`, `d`).
fn group_heads(s: &str) -> Vec<&str> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut start = true;
    for (i, c) in s.char_indices() {
        match c {
            '{' => {
                depth += 1;
                start = depth == 1;
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => start = true,
            c if start && depth == 1 && !c.is_whitespace() => {
                heads.push(ident(&s[i..]));
                start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The parts of `src/`: its folders and files, by module name.
fn part_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src/");
    let first = rel.components().next().expect("a component").as_os_str().to_string_lossy();
    first.strip_suffix(".rs").unwrap_or(&first).to_string()
}

/// The crate root's re-exports: each name, with the part that defines it.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let code = code_only(lib);
    let mut names = BTreeMap::new();
    for (at, _) in code.match_indices("pub use ") {
        let path = &code[at + "pub use ".len()..];
        let part = ident(path);
        let rest = &path[part.len()..];
        let Some(rest) = rest.strip_prefix("::") else { continue };
        let list = if rest.starts_with('{') { group_heads(rest) } else { vec![ident(rest)] };
        for name in list {
            names.insert(name.to_string(), part.to_string());
        }
    }
    names
}

/// Which parts each part uses, with the names it takes from each.
type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// The uses between the parts of the library under `src`.
fn edges(src: &Path) -> Edges {
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read src/lib.rs");
    let roots = root_names(&lib);
    let mut files = Vec::new();
    sources(src, &mut files);
    let parts: BTreeSet<String> =
        files.iter().filter(|f| !f.starts_with(src.join("bin"))).map(|f| part_of(src, f)).collect();
    let mut edges = Edges::new();
    for file in files.iter().filter(|f| !f.starts_with(src.join("bin")) && !f.ends_with("lib.rs")) {
        let from = part_of(src, file);
        let text = std::fs::read_to_string(file).expect("read a source file");
        let code = without_tests(&code_only(&text));
        for (at, _) in code.match_indices("crate::") {
            if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue; // `$crate::`, `pg_outbox_crate::`
            }
            let rest = &code[at + "crate::".len()..];
            let heads = if rest.starts_with('{') { group_heads(rest) } else { vec![ident(rest)] };
            for head in heads {
                let to = if parts.contains(head) {
                    head.to_string()
                } else if let Some(part) = roots.get(head) {
                    part.clone()
                } else {
                    continue;
                };
                if to != from {
                    let name = ident(rest.strip_prefix(head).and_then(|r| r.strip_prefix("::")).unwrap_or(head));
                    let name = if name.is_empty() { head } else { name };
                    edges.entry(from.clone()).or_default().entry(to).or_default().insert(name.to_string());
                }
            }
        }
    }
    edges
}

/// The sets of parts that use each other, however far round (the strongly
/// connected components of more than one part), each sorted.
fn circles(edges: &Edges) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(p) = todo.pop() {
            for next in edges.get(&p).into_iter().flat_map(|m| m.keys()) {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let mut found: BTreeSet<Vec<String>> = BTreeSet::new();
    for part in edges.keys() {
        let from = reach(part);
        if !from.contains(part) {
            continue;
        }
        let circle: Vec<String> = from.iter().filter(|o| reach(o).contains(part)).cloned().collect();
        found.insert(circle);
    }
    found.into_iter().collect()
}

/// What `edges` breaks of the layer rules, one line each.
fn broken(edges: &Edges) -> Vec<String> {
    let mut out = Vec::new();
    for (low, may) in LOW {
        for (to, names) in edges.get(*low).into_iter().flatten() {
            let below = GROUND.contains(&to.as_str()) || may.contains(&to.as_str());
            if !below {
                out.push(format!(
                    "src/{low}/ uses {to}, a part above it: {}",
                    names.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    for (i, part) in GROUND.iter().enumerate() {
        for to in edges.get(*part).into_iter().flat_map(|m| m.keys()) {
            if !GROUND[..i].contains(&to.as_str()) {
                out.push(format!("{part} uses {to}, which is not below it in the ground layers"));
            }
        }
    }
    let found = circles(edges);
    for circle in &found {
        if !KNOWN_CIRCLES.iter().any(|k| k == circle) {
            out.push(format!("parts that use each other in a circle: {}", circle.join(", ")));
        }
    }
    for known in KNOWN_CIRCLES {
        let within = |c: &Vec<String>| known.iter().all(|k| c.iter().any(|p| p == k));
        if !found.iter().any(within) && edges.contains_key("consumer") {
            out.push(format!("the circle {} is gone: take it out of KNOWN_CIRCLES", known.join(", ")));
        }
    }
    out
}

#[test]
fn imports_of_the_store_and_connect_run_down_and_no_parts_use_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = edges(&src);
    assert!(edges.contains_key("store") && edges.contains_key("consumer"), "the parts were read: {edges:?}");
    let broken = broken(&edges);
    assert!(broken.is_empty(), "the layers are broken (docs/architecture.md, \"Layers\"):\n{}", broken.join("\n"));
}

#[test]
fn the_check_sees_a_use_that_runs_back_up_and_a_circle() {
    let code = "use crate::relay::Sink; // crate::console\n#[cfg(test)]\nmod tests { use crate::consumer::X; }\n\
                fn f() { let _ = \"crate::migrate\"; crate::Term::ZERO; }";
    let code = without_tests(&code_only(code));
    assert!(code.contains("crate::relay::Sink") && code.contains("crate::Term"), "{code}");
    assert!(!code.contains("crate::console") && !code.contains("crate::consumer") && !code.contains("crate::migrate"));
    let mut edges = Edges::new();
    fn add(edges: &mut Edges, from: &str, to: &str) {
        edges.entry(from.into()).or_default().entry(to.into()).or_default().insert("X".into());
    }
    add(&mut edges, "store", "connect");
    add(&mut edges, "store", "term");
    assert!(broken(&edges).is_empty(), "{:?}", broken(&edges));
    add(&mut edges, "connect", "store");
    let b = broken(&edges);
    assert!(b.iter().any(|l| l.starts_with("src/connect/ uses store")), "{b:?}");
    assert!(b.iter().any(|l| l == "parts that use each other in a circle: connect, store"), "{b:?}");
    assert_eq!(group_heads("{a, b::c, d::{e, f}}"), ["a", "b", "d"]);
    let roots = root_names("pub use term::{Term, TermFilter};\npub use error::Error;");
    assert_eq!(roots.get("TermFilter").map(String::as_str), Some("term"));
    assert_eq!(roots.get("Error").map(String::as_str), Some("error"));
}
