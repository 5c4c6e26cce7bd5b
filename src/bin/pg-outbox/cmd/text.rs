//! Text for tables printed to a terminal, shared by the commands.

use std::time::Duration;

/// `s` safe to print in a table: a line break becomes a space; other
/// control characters (ESC, C1 controls such as CSI, DEL) and bidirectional
/// overrides become escapes like `\u{1b}`, so stored text cannot drive the
/// terminal. (JSON output is escaped by serde.)
pub(crate) fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' | '\r' => out.push(' '),
            c if c.is_control()
                || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                out.extend(c.escape_default())
            }
            c => out.push(c),
        }
    }
    out
}

/// Seconds as a short human figure: `850 ms`, `42 s`, `3m 5s`, `2h 10m`.
pub(crate) fn short_secs(secs: f64) -> String {
    if !secs.is_finite() {
        return "-".into();
    }
    if secs < 1.0 {
        return format!("{:.0} ms", secs * 1000.0);
    }
    if secs < 60.0 {
        return format!("{secs:.0} s");
    }
    let whole = Duration::from_secs(secs as u64);
    let (h, m, s) = (whole.as_secs() / 3600, whole.as_secs() / 60 % 60, whole.as_secs() % 60);
    if h > 0 { format!("{h}h {m}m") } else { format!("{m}m {s}s") }
}
