//! The console's pages as maud templates. maud escapes every spliced value,
//! so payloads, errors and type names always show as text.

use std::time::Duration;

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use pg_outbox::Event;
use pg_outbox::console::{DeliveryChart, EventDetail, EventState, Relays, Timeline};
use pg_outbox::status::OutboxStatus;

use super::{Action, Ctx, FilterForm, Reading, Target, chart};

/// A dead-letter page as read: rows, all that match, where it starts,
/// whether more follow.
pub(crate) struct DeadLetterPage {
    pub(crate) rows: Vec<EventDetail>,
    pub(crate) total: i64,
    pub(crate) after: i64,
    pub(crate) more: bool,
}

fn time(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt_time(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map_or("-".into(), time)
}

fn age(secs: Option<f64>) -> String {
    match secs {
        None => "-".into(),
        Some(s) if !s.is_finite() => "-".into(),
        Some(s) if s < 1.0 => format!("{:.0} ms", s * 1000.0),
        Some(s) if s < 120.0 => format!("{s:.1} s"),
        Some(s) if s < 7200.0 => format!("{:.0} min", s / 60.0),
        Some(s) => format!("{:.1} h", s / 3600.0),
    }
}

/// At most `n` characters of `s`, with an ellipsis when cut.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n { s.to_string() } else { format!("{}…", s.chars().take(n).collect::<String>()) }
}

fn state(s: EventState) -> Markup {
    let (class, text) = match s {
        EventState::Published => ("ok", "published"),
        EventState::Due => ("due", "due"),
        EventState::WaitingForRetry => ("wait", "waiting for retry"),
        EventState::DeadLetter => ("dead", "dead letter"),
        _ => ("", "unknown"),
    };
    html! { span class={"state " (class)} { (text) } }
}

fn layout(ctx: Option<&Ctx>, title: &str, refresh: Option<Duration>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(r) = refresh {
                    meta http-equiv="refresh" content=(r.as_secs().max(1));
                }
                title { (title) " · pg-outbox console" }
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/console.js" defer {}
            }
            body {
                nav {
                    strong { "pg-outbox" }
                    a href="/" { "Overview" }
                    a href="/dead-letters" { "Dead letters" }
                    @if let Some(ctx) = ctx {
                        @if ctx.read_only { span.badge id="read-only" { "read-only" } }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// A page that only says something.
pub(crate) fn message(title: &str, text: &str) -> Markup {
    layout(None, title, None, html! { h1 { (title) } p.message { (text) } p { a href="/" { "Back to the overview" } } })
}

/// A failed read or write.
pub(crate) fn error(ctx: &Ctx, text: &str) -> Markup {
    layout(Some(ctx), "Error", None, html! { h1 { "The database said no" } pre.error { (text) } })
}

fn stat(id: &str, label: &str, value: String, class: &str) -> Markup {
    html! { div class={"stat " (class)} { div.value id=(id) { (value) } div.label { (label) } } }
}

pub(crate) fn overview(
    ctx: &Ctx,
    reading: &Reading,
    relays: &Relays,
    chart_data: &DeliveryChart,
    refresh: Duration,
) -> Markup {
    let now = chart_data.now;
    let s: &OutboxStatus = &reading.status;
    let body = html! {
        h1 { "Overview" }
        p.note { "As of " (time(&now)) "; reloads every " (humantime::format_duration(refresh)) "." }
        @if reading.cached {
            p.note id="figures-age" {
                "Backlog figures from " (age(Some(reading.at.elapsed().as_secs_f64()))) " ago: counting them takes "
                (age(Some(reading.took.as_secs_f64()))) ", so they are counted again in the background."
            }
        }
        section.stats {
            (stat("unpublished", "unpublished", figure(s, "unpublished", s.unpublished), ""))
            (stat("due_now", "due now", figure(s, "due_now", s.due_now), ""))
            (stat("held_back", "held back", figure(s, "held_back", s.held_back), if s.held_back > 0 { "warn" } else { "" }))
            (stat("waiting_for_retry", "waiting for retry", figure(s, "waiting_for_retry", s.waiting_for_retry), if s.waiting_for_retry > 0 { "warn" } else { "" }))
            (stat("dead_letters", "dead letters", figure(s, "dead_letters", s.dead_letters), if s.dead_letters > 0 { "bad" } else { "" }))
            (stat("oldest_age", "oldest pending", format!("{}{}", mark(s, "oldest_unpublished_age_seconds"), age(s.oldest_unpublished_age_seconds)), ""))
        }
        @if s.estimated {
            p.note id="estimated" {
                "~ estimated: more than " (pg_outbox::status::OutboxStatus::EXACT_ROWS) " rows of a kind, so the figure is scaled from a sample of "
                (pg_outbox::status::OutboxStatus::SAMPLE_IDS) " ids of that kind (docs/operations.md, \"How status estimates\")."
            }
        }
        (leader(s.leader.as_ref(), !s.partitions.is_empty()))
        (partitions(&s.partitions))
        (subscriptions(&s.subscriptions))
        @if s.dead_letters > 0 {
            p { a href="/dead-letters" { "Review the " (figure(s, "dead_letters", s.dead_letters)) " dead letters" } }
        }
        section.charts {
            div {
                h2 { "Published per minute" }
                (chart::publish_rate(chart_data, now))
            }
            div {
                h2 { "Delivery lag per minute" }
                (chart::lag(chart_data, now))
                p.legend { span.mean { "mean" } " " span.max { "largest" } " (published_at − occurred_at)" }
            }
        }
        @if chart_data.capped {
            p.note id="chart-capped" { "The charts read the latest " (pg_outbox::console::DEFAULT_CHART_ROWS)
                " events only: earlier minutes of the hour may be missing." }
        }
        (relay_sessions(relays))
        (backlog_by_type(s))
        (next_retries(&s.retries))
    };
    layout(Some(ctx), "Overview", Some(refresh), body)
}

/// The overview's leader line: the live leader's pid, or "no live leader"
/// with the stranded holder of the outbox lock, or none (`partitioned`:
/// because partitioned relays hold partitions instead).
fn leader(l: Option<&pg_outbox::status::LeaderLock>, partitioned: bool) -> Markup {
    let Some(l) = l else {
        if partitioned {
            return html! { p.note id="leader" { "Leader: none (relays run in partitioned mode: see Partitions)." } };
        }
        return html! { p.note id="leader" { "Leader: none (no relay holds the outbox lock)." } };
    };
    let heartbeat = match l.heartbeat_age_seconds {
        Some(a) => format!("heartbeat {} ago", age(Some(a))),
        None => "no heartbeat".to_string(),
    };
    if l.live {
        let term = l.term.map_or(String::new(), |t| format!(", term {t}"));
        let relay = l
            .relay
            .as_ref()
            .map_or(String::new(), |r| format!(": relay {} on {} (pg-outbox {})", r.process_id, r.host, r.version));
        return html! { p id="leader" { "Leader: pid " (l.pid) " (live, " (heartbeat) (term) ")" (relay) "." } };
    }
    let client = l
        .client_addr
        .clone()
        .unwrap_or_else(|| if l.state.is_some() { "local socket".into() } else { "hidden".into() });
    let state = match (&l.state, l.state_seconds) {
        (Some(state), Some(secs)) => format!("{state} for {}", age(Some(secs))),
        _ => "state hidden".to_string(),
    };
    html! {
        p.warn id="leader" {
            "No live leader: the outbox lock is held by pid " (l.pid) " (client " (client) ", application_name \""
            (l.application_name.as_deref().unwrap_or("")) "\", " (state) ", " (heartbeat)
            "). Nothing is delivered until that session ends: pg_terminate_backend(" (l.pid)
            "), or a relay with --take-over-stranded."
        }
    }
}

/// The overview's partitions (partitioned mode): each held, with its
/// holder (backend pid, relay, heartbeat age) and term.
fn partitions(held: &[pg_outbox::status::PartitionHolder]) -> Markup {
    html! {
        @if !held.is_empty() {
            h2 { "Partitions" }
            table id="partitions" {
                thead { tr { th { "partition" } th { "term" } th { "pid" } th { "relay" } th { "heartbeat" } } }
                tbody {
                    @for h in held {
                        tr {
                            td { (h.partition) (h.partitions.map_or(String::new(), |n| format!("/{n}"))) }
                            td { (h.term.map_or("none".to_string(), |t| t.to_string())) }
                            td { (h.pid) }
                            td { (h.relay.as_ref().map_or("-".to_string(), |r| format!("{} on {} ({})", r.process_id, r.host, r.version))) }
                            td { (h.heartbeat_age_seconds.map_or("none".to_string(), |a| format!("{} ago", age(Some(a))))) }
                        }
                    }
                }
            }
        }
    }
}

/// The overview's named subscriptions (the figures above are the default
/// one's): state, cursor, backlog bound, lag (marked when past its
/// `--max-lag`), failures, dead letters, held events and leader.
fn subscriptions(all: &[pg_outbox::subscription::Subscription]) -> Markup {
    let n = |exact: bool, v: i64| if exact { v.to_string() } else { format!(">={v}") };
    html! {
        @if !all.is_empty() {
            h2 { "Subscriptions" }
            table id="subscriptions" {
                thead { tr {
                    th { "subscription" } th { "state" } th { "cursor" } th { "backlog ≤" } th { "lag" } th { "max lag" }
                    th { "failing" } th { "dead letters" } th { "held" } th { "leader" }
                } }
                tbody {
                    @for s in all {
                        tr {
                            td { (s.name) }
                            td { (s.state.as_str()) }
                            td { (s.cursor_id.map_or("-".to_string(), |c| c.to_string())) }
                            td { (s.backlog_upper_bound) }
                            @if s.behind {
                                td.bad { "behind: " (age(s.lag_seconds)) }
                            } @else {
                                td { (age(s.lag_seconds)) }
                            }
                            td { (s.max_lag_seconds.map_or("-".to_string(), |m| age(Some(m)))) }
                            td { (n(s.counts_exact, s.failing)) }
                            td class=(if s.dead_letters > 0 { "bad" } else { "" }) { (n(s.counts_exact, s.dead_letters)) }
                            td { (n(s.counts_exact, s.held)) }
                            td { (crate::cmd::subscription::leader_cell(s)) }
                        }
                    }
                }
            }
            p.note { "Each subscription's dead letters: pg-outbox dead-letters list --subscription NAME." }
        }
    }
}

/// The overview's relays: the notification queue and each relay session.
fn relay_sessions(relays: &Relays) -> Markup {
    html! {
        h2 { "Relays" }
        p.note { "Notification queue in use: " (format!("{:.2} %", relays.notification_queue_usage * 100.0)) }
        @if relays.sessions.is_empty() {
            p id="no-relays" { "No relay is connected to this database." }
        } @else {
            table id="relays" {
                thead { tr { th { "pid" } th { "session" } th { "role" } th { "client" } th { "since" } th { "state" } th { "wake-ups" } } }
                tbody {
                    @for r in &relays.sessions {
                        tr {
                            td { (r.pid) }
                            td { (r.application_name) }
                            td.role { (r.role()) }
                            td { (r.client_addr.as_deref().unwrap_or("local socket")) }
                            td { (opt_time(&r.backend_start)) }
                            td { (r.state) }
                            td { @match r.waiting {
                                Some(true) => "waiting for a notification",
                                Some(false) => "draining",
                                None => "-",
                            } }
                        }
                    }
                }
            }
        }
    }
}

/// `~` when `field` of `s` is estimated, else nothing.
fn mark(s: &OutboxStatus, field: &str) -> &'static str {
    if s.estimated_figures.contains(&field) { "~" } else { "" }
}

/// `v`, marked `~` when `field` of `s` is estimated.
fn figure(s: &OutboxStatus, field: &str, v: i64) -> String {
    format!("{}{v}", mark(s, field))
}

/// The overview's backlog by event type, if there is any.
fn backlog_by_type(s: &OutboxStatus) -> Markup {
    let m = mark(s, "by_type");
    html! {
        @if !s.by_type.is_empty() {
            h2 { "By event type" }
            table id="by-type" {
                thead { tr { th { "event type" } th { "aggregate type" } th.n { "unpublished" } th.n { "due now" } th.n { "held back" } th.n { "waiting" } th.n { "dead" } th { "oldest pending" } } }
                tbody {
                    @for t in &s.by_type {
                        tr {
                            td { (t.event_type) } td { (t.aggregate_type) }
                            td.n { (m) (t.unpublished) } td.n { (m) (t.due_now) } td.n { (m) (t.held_back) }
                            td.n { (m) (t.waiting_for_retry) }
                            td.n { @if t.dead_letters > 0 {
                                a href={"/dead-letters?" (FilterForm { event_type: t.event_type.clone(), aggregate_type: t.aggregate_type.clone(), ..Default::default() }.query())} { (m) (t.dead_letters) }
                            } @else { "0" } }
                            td { (age(t.oldest_unpublished_age_seconds)) }
                        }
                    }
                }
            }
            @if s.by_type_truncated { p.note { "Only the " (s.by_type.len()) " types with the most unpublished events are shown." } }
        }
    }
}

/// The overview's next retries, if any are waiting.
fn next_retries(r: &pg_outbox::status::RetryLadder) -> Markup {
    html! {
        @if !r.next.is_empty() {
            h2 { "Next retries" }
            table id="next-retries" {
                thead { tr { th { "id" } th { "event type" } th.n { "retries" } th { "due at" } th { "last error" } } }
                tbody {
                    @for p in &r.next {
                        tr {
                            td { a href={"/events/" (p.id)} { (p.id) } }
                            td { (p.event_type) }
                            td.n { (p.retry_count) }
                            td { (time(&p.due_at)) }
                            td.error { (clip(p.last_error.as_deref().unwrap_or_default(), 120)) }
                        }
                    }
                }
            }
        }
    }
}

fn filter_fields(form: &FilterForm) -> Markup {
    html! {
        input type="hidden" name="event_type" value=(form.event_type);
        input type="hidden" name="aggregate_type" value=(form.aggregate_type);
        input type="hidden" name="error" value=(form.error);
        input type="hidden" name="since" value=(form.since);
    }
}

pub(crate) fn dead_letters(
    ctx: &Ctx,
    form: &FilterForm,
    page: Option<&DeadLetterPage>,
    problem: Option<&str>,
) -> Markup {
    let body = html! {
        h1 { "Dead letters" }
        form.filters method="get" action="/dead-letters" id="filter" {
            label { "event type " input type="text" name="event_type" value=(form.event_type); }
            label { "aggregate type " input type="text" name="aggregate_type" value=(form.aggregate_type); }
            label { "error contains " input type="text" name="error" value=(form.error); }
            label { "occurred since (UTC) " input type="text" name="since" placeholder="2026-12-02T03:15" value=(form.since); }
            button type="submit" { "Filter" }
            @if !form.is_empty() { " " a href="/dead-letters" { "clear" } }
        }
        @if let Some(p) = problem { p.error { (p) } }
        @if let Some(page) = page {
            p id="match-count" { (page.total) " dead letters match" @if !form.is_empty() { " this filter" } "." }
            form method="post" action="/dead-letters/confirm" id="dead-letter-form" {
                input type="hidden" name="csrf" value=(ctx.csrf);
                (filter_fields(form))
                @if !ctx.read_only && page.total > 0 {
                    div.actions {
                        button type="submit" name="op" value="retry:selected" id="retry-selected" { "Retry selected" }
                        button type="submit" name="op" value="discard:selected" id="discard-selected" class="danger" { "Discard selected" }
                        span.sep {}
                        button type="submit" name="op" value="retry:all" id="retry-all" { "Retry all " (page.total) " matching" }
                        button type="submit" name="op" value="discard:all" id="discard-all" class="danger" { "Discard all " (page.total) " matching" }
                    }
                }
                table id="dead-letters" {
                    thead { tr {
                        @if !ctx.read_only { th { input type="checkbox" id="select-all" title="select all on this page"; } }
                        th { "id" } th { "event type" } th { "aggregate type" } th { "aggregate id" } th { "occurred at" } th.n { "retries" } th { "last error" }
                    } }
                    tbody {
                        @for r in &page.rows {
                            tr {
                                @if !ctx.read_only { td { input type="checkbox" name="id" value=(r.event.id) id={"select-" (r.event.id)}; } }
                                td { a href={"/events/" (r.event.id)} { (r.event.id) } }
                                td { (r.event.event_type) }
                                td { (r.event.aggregate_type) }
                                td.mono { (r.event.aggregate_id) }
                                td { (time(&r.event.occurred_at)) }
                                td.n { (r.event.retry_count) }
                                td.error { (clip(r.event.last_error.as_deref().unwrap_or_default(), 120)) }
                            }
                        }
                    }
                }
            }
            p.pages {
                @if page.after > 0 { a href={"/dead-letters?" (form.query())} { "First page" } " " }
                @if page.more {
                    @if let Some(last) = page.rows.last() {
                        a id="next-page" href={"/dead-letters?" (form.query()) "&after=" (last.event.id)} { "Next page" }
                    }
                }
            }
        }
    };
    layout(Some(ctx), "Dead letters", None, body)
}

fn detail_row(label: &str, value: Markup) -> Markup {
    html! { tr { th { (label) } td { (value) } } }
}

pub(crate) fn event(ctx: &Ctx, d: &EventDetail, t: &Timeline) -> Markup {
    let e = &d.event;
    let payload = serde_json::to_string_pretty(&e.payload).unwrap_or_else(|_| e.payload.to_string());
    let body = html! {
        h1 { "Event " (e.id) " " (state(d.state)) }
        table.detail id="event" {
            (detail_row("event type", html! { (e.event_type) }))
            (detail_row("aggregate", html! { (e.aggregate_type) " " span.mono { (e.aggregate_id) } }))
            (detail_row("occurred at", html! { (time(&e.occurred_at)) }))
            (detail_row("published at", html! { (opt_time(&d.published_at)) }))
            (detail_row("failed attempts", html! { span id="retry-count" { (e.retry_count) } }))
            (detail_row("next retry at", html! { @if d.state == EventState::DeadLetter { "never (dead letter)" } @else { (opt_time(&d.next_retry_at)) } }))
        }
        h2 { "Last error" }
        pre.error id="last-error" { (e.last_error.as_deref().unwrap_or("-")) }
        h2 { "Payload" }
        pre.payload id="payload" { (payload) }
        @if d.state == EventState::DeadLetter && !ctx.read_only {
            form method="post" action="/dead-letters/confirm" id="event-actions" {
                input type="hidden" name="csrf" value=(ctx.csrf);
                input type="hidden" name="id" value=(e.id);
                button type="submit" name="op" value="retry:selected" id="retry-one" { "Retry" }
                " "
                button type="submit" name="op" value="discard:selected" id="discard-one" class="danger" { "Discard" }
            }
        }
        h2 { "Timeline of the aggregate" }
        @if d.published_at.is_none() {
            p id="holds-back" { "While unpublished, it holds back " strong { (t.later_unpublished) } " later unpublished events of its aggregate." }
        }
        table id="timeline" {
            thead { tr { th { "id" } th { "event type" } th { "occurred at" } th { "published at" } th.n { "retries" } th { "state" } } }
            tbody {
                @for (r, held) in with_held(t.earlier.iter().rev().chain(std::iter::once(d)).chain(t.later.iter())) {
                    tr class=[(r.event.id == e.id).then_some("current")] {
                        td { @if r.event.id == e.id { (r.event.id) } @else { a href={"/events/" (r.event.id)} { (r.event.id) } } }
                        td { (r.event.event_type) }
                        td { (time(&r.event.occurred_at)) }
                        td { (opt_time(&r.published_at)) }
                        td.n { (r.event.retry_count) }
                        td { @if held { span class="state wait" { "held back" } } @else { (state(r.state)) } }
                    }
                }
            }
        }
    };
    layout(Some(ctx), &format!("Event {}", e.id), None, body)
}

/// The rows of a timeline, oldest first, each with whether it is held back:
/// due, behind an earlier unpublished event of the aggregate that failed
/// (as far as the rows shown tell).
fn with_held<'a>(rows: impl Iterator<Item = &'a EventDetail>) -> Vec<(&'a EventDetail, bool)> {
    let mut blocked = false;
    rows.map(|r| {
        let held = blocked && r.state == EventState::Due;
        blocked |= r.published_at.is_none() && r.event.retry_count > 0;
        (r, held)
    })
    .collect()
}

fn event_rows(rows: &[Event]) -> Markup {
    html! {
        table id="confirm-sample" {
            thead { tr { th { "id" } th { "event type" } th { "aggregate type" } th { "occurred at" } th { "last error" } } }
            tbody {
                @for r in rows {
                    tr {
                        td { (r.id) } td { (r.event_type) } td { (r.aggregate_type) } td { (time(&r.occurred_at)) }
                        td.error { (clip(r.last_error.as_deref().unwrap_or_default(), 120)) }
                    }
                }
            }
        }
    }
}

pub(crate) fn confirm(ctx: &Ctx, t: &Target, count: i64, sample: &[Event]) -> Markup {
    let verb = match t.action {
        Action::Retry => "Retry",
        Action::Discard => "Discard",
    };
    let body = html! {
        h1 { (verb) " dead letters?" }
        @if count == 0 {
            p id="confirm-count" { "Nothing to do: " strong { "0" } " of these are dead letters now." }
            p { a href="/dead-letters" { "Back to the dead letters" } }
        } @else {
            p id="confirm-count" {
                (verb) " " strong id="count" { (count) } " dead letters"
                @if t.ids.is_none() { @if t.form.is_empty() { " (all of them)" } @else { " (all that match the filter)" } }
                @else { " (those selected)" }
                "?"
            }
            @match t.action {
                Action::Retry => p.note { "They become due now; the relay delivers them with their aggregates' held-back events. Each gets one more attempt." },
                Action::Discard => p.warn { "They are deleted from events.outbox and never delivered. This cannot be undone." },
            }
            form method="post" action="/dead-letters/apply" id="confirm-form" {
                input type="hidden" name="csrf" value=(ctx.csrf);
                input type="hidden" name="action" value=(t.action.name());
                @match &t.ids {
                    Some(ids) => {
                        input type="hidden" name="scope" value="selected";
                        @for id in ids { input type="hidden" name="id" value=(id); }
                    }
                    None => {
                        input type="hidden" name="scope" value="all";
                        input type="hidden" name="expected" value=(count);
                        (filter_fields(&t.form))
                    }
                }
                button type="submit" id="confirm" class=[(t.action == Action::Discard).then_some("danger")] {
                    (verb) " " (count) " dead letters"
                }
                " "
                a href={"/dead-letters?" (t.form.query())} id="cancel" { "Cancel" }
            }
            @if count > sample.len() as i64 { h2 { "The first " (sample.len()) } } @else { h2 { "These" } }
            (event_rows(sample))
        }
    };
    layout(Some(ctx), "Confirm", None, body)
}

pub(crate) fn applied(ctx: &Ctx, action: Action, ids: &[i64]) -> Markup {
    let verb = match action {
        Action::Retry => "Retried",
        Action::Discard => "Discarded",
    };
    let body = html! {
        h1 { (verb) " " span id="applied-count" { (ids.len()) } " dead letters" }
        @if !ids.is_empty() {
            p.mono id="applied-ids" {
                @for (i, id) in ids.iter().take(200).enumerate() {
                    @if i > 0 { ", " }
                    @if action == Action::Retry { a href={"/events/" (id)} { (id) } } @else { (id) }
                }
                @if ids.len() > 200 { " and " (ids.len() - 200) " more" }
            }
        }
        p { a href="/dead-letters" { "Back to the dead letters" } " · " a href="/" { "Overview" } }
    };
    layout(Some(ctx), verb, None, body)
}

pub(crate) fn login(ctx: &Ctx, problem: Option<&str>) -> Markup {
    let body = html! {
        h1 { "Console token" }
        @if let Some(p) = problem { p.error id="login-error" { (p) } }
        form method="post" action="/login" id="login" {
            input type="hidden" name="csrf" value=(ctx.csrf);
            label { "Token " input type="password" name="token" autocomplete="current-password" autofocus; }
            " "
            button type="submit" { "Enter" }
        }
    };
    layout(None, "Login", None, body)
}
