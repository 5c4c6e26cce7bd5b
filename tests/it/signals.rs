//! The relay's log signals (docs/operations.md, "Logs"): the stable
//! `signal` field that supervisors and these tests wait on instead of a
//! line's wording. Every name the table lists is logged somewhere in
//! `src/`, and every `signal = "..."` in `src/` is in the table.

use std::collections::BTreeSet;
use std::path::Path;

/// The names in the table of docs/operations.md, "Logs".
fn documented() -> BTreeSet<String> {
    let doc = include_str!("../../docs/operations.md");
    let start = doc.find("| `signal` | level |").expect("the signal table in docs/operations.md");
    doc[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.trim_start().starts_with('|'))
        .filter_map(|l| l.trim_start().strip_prefix("| `")?.split('`').next().map(str::to_string))
        .collect()
}

/// Every `signal = "name"` under `dir`.
fn logged(dir: &Path, found: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            logged(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let code = std::fs::read_to_string(&path).expect("read a source file");
            for part in code.split("signal = \"").skip(1) {
                found.insert(part.split('"').next().unwrap_or_default().to_string());
            }
        }
    }
}

#[test]
fn every_log_signal_is_documented_and_every_documented_one_is_logged() {
    let documented = documented();
    let mut found = BTreeSet::new();
    logged(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut found);
    assert!(documented.len() >= 10, "the table lists the signals: {documented:?}");
    assert_eq!(documented, found, "docs/operations.md's signal table against the signal fields in src/");
    for name in [pg_outbox_testkit::process::STARTED, "leader", "standby", "deposed", "stranded_ended"] {
        assert!(documented.contains(name), "the tests wait on `{name}`");
    }
}
