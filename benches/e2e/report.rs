//! The suite's report: one section per scenario (a table, notes, targets),
//! printed as Markdown and written as Markdown and JSON.

use serde::Serialize;

/// An issue target and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What the target says, e.g. "stream p50 <= 2x floor at 100/s".
    pub what: String,
    /// Whether the measured ratio meets it.
    pub met: bool,
    /// The measured figure, e.g. "1.42x".
    pub measured: String,
}

/// One scenario's results.
#[derive(Debug, Clone, Serialize)]
pub struct Section {
    /// Scenario name as given on the command line (`latency`, `drain`, ...).
    pub scenario: &'static str,
    /// Heading.
    pub title: String,
    /// Column names.
    pub columns: Vec<String>,
    /// Rows of formatted cells.
    pub rows: Vec<Vec<String>>,
    /// Lines printed under the table (baselines, caveats).
    pub notes: Vec<String>,
    /// Issue targets with their outcome.
    pub targets: Vec<Target>,
    /// Raw figures for the JSON report.
    pub data: serde_json::Value,
}

impl Section {
    /// An empty section.
    pub fn new(scenario: &'static str, title: &str, columns: &[&str]) -> Self {
        Section {
            scenario,
            title: title.into(),
            columns: columns.iter().map(|c| (*c).to_string()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
            targets: Vec::new(),
            data: serde_json::Value::Null,
        }
    }

    /// Record a target: `ratio` against `limit`, met when `ratio <= limit`
    /// (`at_most`) or `ratio >= limit` (otherwise).
    pub fn target(&mut self, what: String, ratio: Option<f64>, limit: f64, at_most: bool) {
        let (met, measured) = match ratio {
            Some(r) if r.is_finite() => (if at_most { r <= limit } else { r >= limit }, format!("{r:.2}x")),
            _ => (false, "not measured".into()),
        };
        self.targets.push(Target { what, met, measured });
    }

    /// This section as Markdown.
    pub fn markdown(&self) -> String {
        let mut out = format!("## {}\n\n", self.title);
        out.push_str(&format!("| {} |\n", self.columns.join(" | ")));
        let aligns: Vec<&str> =
            self.columns.iter().enumerate().map(|(i, _)| if i == 0 { "---" } else { "---:" }).collect();
        out.push_str(&format!("|{}|\n", aligns.join("|")));
        for row in &self.rows {
            out.push_str(&format!("| {} |\n", row.join(" | ")));
        }
        if !self.notes.is_empty() {
            out.push('\n');
            for n in &self.notes {
                out.push_str(&format!("- {n}\n"));
            }
        }
        if !self.targets.is_empty() {
            out.push_str("\nTargets:\n");
            for t in &self.targets {
                out.push_str(&format!(
                    "- {} {}: measured {}\n",
                    if t.met { "MET    " } else { "NOT MET" },
                    t.what,
                    t.measured
                ));
            }
        }
        out.push('\n');
        out
    }
}

/// `value / base` when both are usable.
pub fn ratio(value: f64, base: f64) -> Option<f64> {
    if base > 0.0 && value.is_finite() { Some(value / base) } else { None }
}

/// A ratio as `"1.23x"`, or `"n/a"`.
pub fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) => format!("{r:.2}x"),
        None => "n/a".into(),
    }
}

/// A count with thousands separators: `1 234 567`.
pub fn fmt_count(n: f64) -> String {
    let s = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// Milliseconds with sensible precision.
pub fn fmt_ms(ms: f64) -> String {
    if ms < 10.0 { format!("{ms:.2}") } else { format!("{ms:.1}") }
}
