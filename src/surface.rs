//! The crate root's public names, listed in `docs/public-api.txt`: a
//! change to the surface shows in review as a change to that file.

/// The public names the crate root declares (`pub mod`, `pub use`),
/// sorted, each with its kind; `#[doc(hidden)]` ones marked hidden.
fn root_names(lib: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut hidden = false;
    let mut items = lib.lines().map(str::trim).peekable();
    while let Some(line) = items.next() {
        if line == "#[doc(hidden)]" {
            hidden = true;
            continue;
        }
        let mark = if std::mem::take(&mut hidden) { " (hidden)" } else { "" };
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
