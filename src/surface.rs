//! The crate root's public names, listed in `docs/public-api.txt`: a
//! change to the surface shows in review as a change to that file.
//!
//! The target is a root a newcomer takes in at a glance, the size of
//! tokio-postgres's (about 25) and sqlx-postgres's (about 30): **at most 35
//! names** that are not hidden, modules counted. What a first-day user
//! types stays at the root (the consumer, the publisher, events, errors,
//! connect options); the rest sits in a documented module (`status`,
//! `health`, `secret`, `tls`, `metrics`, ...), and defaults are associated
//! constants of the type they configure.

/// Most names the crate root shows (hidden ones not counted).
const MAX_ROOT_NAMES: usize = 35;

/// The public names the crate root declares (`pub mod`, `pub use`),
/// sorted, each with its kind; `#[doc(hidden)]` ones marked hidden, and
/// those behind a Cargo feature marked with it.
fn root_names(lib: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut hidden = false;
    let mut feature: Option<&str> = None;
    let mut items = lib.lines().map(str::trim).peekable();
    while let Some(line) = items.next() {
        if line == "#[doc(hidden)]" {
            hidden = true;
            continue;
        }
        if let Some(f) = line.strip_prefix("#[cfg(feature = \"").and_then(|f| f.strip_suffix("\")]")) {
            feature = Some(f);
            continue;
        }
        if line.starts_with("#[") || line.starts_with("///") {
            continue;
        }
        let mark = match (std::mem::take(&mut hidden), feature.take()) {
            (true, Some(f)) => format!(" (hidden, feature {f})"),
            (true, None) => " (hidden)".to_string(),
            (false, Some(f)) => format!(" (feature {f})"),
            (false, None) => String::new(),
        };
        if let Some(m) = line.strip_prefix("pub mod ") {
            out.push(format!("mod {}{mark}", m.trim_end_matches(';')));
        } else if let Some(u) = line.strip_prefix("pub use ") {
            let mut text = u.to_string();
            while !text.ends_with(';') {
                match items.next() {
                    Some(next) => text.push_str(next),
                    None => break,
                }
            }
            let text = text.trim_end_matches(';');
            let names = match text.split_once('{') {
                Some((_, list)) => list.trim_end_matches('}').split(',').map(str::trim).collect::<Vec<_>>(),
                None => vec![text.rsplit("::").next().unwrap_or(text)],
            };
            out.extend(names.into_iter().filter(|n| !n.is_empty()).map(|n| format!("use {n}{mark}")));
        }
    }
    out.sort();
    out
}

#[test]
fn the_crate_roots_public_names_are_those_docs_public_api_lists() {
    let names = root_names(include_str!("lib.rs"));
    let listed: Vec<&str> = include_str!("../docs/public-api.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    let printed = names.join("\n");
    assert_eq!(
        names.iter().map(String::as_str).collect::<Vec<_>>(),
        listed,
        "the crate root's public names changed; if meant, write these {} lines (below the comment) to \
         docs/public-api.txt:\n{printed}",
        names.len()
    );
}

#[test]
fn the_crate_root_shows_at_most_35_names() {
    let names = root_names(include_str!("lib.rs"));
    let shown: Vec<&String> = names.iter().filter(|n| !n.contains("hidden")).collect();
    assert!(
        shown.len() <= MAX_ROOT_NAMES,
        "{} names at the crate root, {MAX_ROOT_NAMES} at most: {shown:?}",
        shown.len()
    );
}
