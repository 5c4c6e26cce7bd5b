//! Cost of the stdout sink writing to a pipe (`pg-outbox relay | consumer`):
//! time per delivered event with [`pg_outbox::relay::StdoutSink`], against
//! the way it wrote before, measured in the same run: `write_all` and
//! `flush` on `tokio::io::Stdout`, which hands every write to a blocking
//! thread. No database.
//!
//! Run it with `cargo bench --features relay --bench stdout_sink`. The bench starts itself
//! again as a child process whose standard output is a pipe that the parent
//! reads and discards; the child writes `BENCH_EVENTS` events (default
//! 100 000) of about 300 bytes each way, alternating, three rounds, and
//! prints microseconds per event and the ratio on stderr.

use std::process::Stdio;
use std::time::Instant;

use pg_outbox::Event;
use pg_outbox::relay::{DEFAULT_CLOUDEVENTS_SOURCE, Format, Message, Sink, StdoutSink};
use pg_outbox_testkit::bench::{self, BenchResult};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Set in the child's environment.
const CHILD: &str = "PG_OUTBOX_BENCH_STDOUT_CHILD";

/// An event of about 300 bytes as a sink record.
fn event() -> Event {
    Event {
        id: 1,
        aggregate_type: "bench".into(),
        aggregate_id: uuid::Uuid::new_v4(),
        event_type: "Inserted".into(),
        payload: serde_json::json!({"version": 1, "data": {"amount": 990, "note": "x".repeat(120)}}),
        occurred_at: chrono::Utc::now(),
        retry_count: 0,
        last_error: None,
    }
}

/// The child: write `n` events each way, three rounds (the baseline first
/// in odd rounds, the sink first in even ones); report on stderr.
async fn child(n: usize) -> BenchResult<()> {
    let ev = event();
    let sink = StdoutSink::new();
    let line = {
        let mut l = serde_json::to_vec(&pg_outbox::relay::SinkRecord::new(&ev))?;
        l.push(b'\n');
        l
    };
    let mut baseline = tokio::io::stdout();
    for round in 1..=3 {
        let (mut base_us, mut sink_us) = (0.0, 0.0);
        for sink_turn in [round % 2 == 0, round % 2 == 1] {
            let t = Instant::now();
            if sink_turn {
                // As the relay delivers: encode the event, then send it.
                for _ in 0..n {
                    let message = Message::new(&ev, Format::Record, DEFAULT_CLOUDEVENTS_SOURCE)?;
                    sink.send(&message, &ev).await?;
                }
                sink_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            } else {
                for _ in 0..n {
                    baseline.write_all(&line).await?;
                    baseline.flush().await?;
                }
                base_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            }
        }
        eprintln!(
            "stdout_sink round {round}: {} bytes/event; tokio::io::Stdout {base_us:.2} us/event, StdoutSink \
             {sink_us:.2} us/event: {:.3}x the baseline's time",
            line.len(),
            sink_us / base_us
        );
    }
    Ok(())
}

async fn run() -> BenchResult<()> {
    let n: usize = std::env::var("BENCH_EVENTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if bench::is_bench_run() { 100_000 } else { 1_000 });
    if std::env::var_os(CHILD).is_some() {
        return child(n).await;
    }
    let mut proc = tokio::process::Command::new(std::env::current_exe()?)
        .args(std::env::args().skip(1))
        .env(CHILD, "1")
        .env("BENCH_EVENTS", n.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let mut out = proc.stdout.take().ok_or("child stdout is not piped")?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut bytes = 0u64;
    loop {
        let k = out.read(&mut buf).await?;
        if k == 0 {
            break;
        }
        bytes += k as u64;
    }
    let status = proc.wait().await?;
    if !status.success() {
        return Err(format!("the writing child failed: {status}").into());
    }
    eprintln!("stdout_sink: the parent read {bytes} bytes through the pipe");
    Ok(())
}

fn main() -> std::process::ExitCode {
    bench::main_with(run)
}
