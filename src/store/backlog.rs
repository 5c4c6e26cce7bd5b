//! The backlog figures in bounded time, whatever the backlog's size: exact
//! where counting is cheap, estimated from a sample where it is not.
//!
//! The unpublished rows fall into four classes, each a range of one partial
//! index: fresh (`outbox_fresh_order_idx`, by id), due retries and rows
//! waiting for a retry (`outbox_retry_due_idx`, by `next_retry_at`), and
//! dead letters (`outbox_dead_letter_idx`, by id). The first statement
//! ([`exact_sql`]) reads at most [`STATUS_EXACT_ROWS`] + 1 rows of each
//! class, in its index's order. A class with no more rows than that is
//! counted exactly. A class with more is estimated by the second statement
//! ([`sample_sql`]), run only then: [`STATUS_SAMPLE_IDS`] ids drawn
//! uniformly in each stratum, each looked up by primary key. A stratum is
//! the ids past the rows read: for fresh rows and dead letters (ordered by
//! id), from the last id read to the kind's last id; for retries (ordered
//! by due time), every unpublished id, counting only rows due after the
//! last due time read. The rows read are counted exactly, and the sampled
//! rows of the stratum's kind are scaled by its span over the sample's
//! size. An estimate is never below the rows read. The standard error on a
//! share `p` of a stratum's ids is `sqrt(p (1 - p) / 500)` of its span, at
//! most 2.2 % (docs/operations.md, "How `status` estimates").

use std::collections::BTreeMap;

use tokio_postgres::GenericClient;

use super::fetch::HELD_BACK;

/// Rows of each class (fresh, due retries, waiting for a retry, dead
/// letters) counted exactly before that class's figures are estimated:
/// 2 000. Reading them costs at most about four buffers a row (measured:
/// 16 ms for all four classes at 10 000 000 unpublished rows and 1 000 000
/// dead letters, `cargo bench --features full --bench console`).
pub(crate) const STATUS_EXACT_ROWS: i64 = 2_000;

/// Ids an estimate draws and looks up by primary key in each stratum (fresh
/// rows, dead letters, retries; only those estimated): 500, about 15 ms a
/// stratum on a table that does not fit in shared buffers. See the module
/// docs for the error this gives.
pub(crate) const STATUS_SAMPLE_IDS: i64 = 500;

/// The held-back probe of a due row `o`, skipped (false) when no unpublished
/// row has failed at all: see `NOT_HELD_BACK_IF_ANY_FAILED` in `fetch.rs`.
/// `CASE` evaluates its branches in order, only when reached.
const HELD_IF_ANY_FAILED: &str = "CASE WHEN (SELECT 1 FROM events.outbox f \
       WHERE f.published_at IS NULL AND f.next_retry_at IS NOT NULL ORDER BY f.next_retry_at LIMIT 1) IS NULL \
     THEN false ELSE ";

/// The columns both statements group by and return, over rows `c` with a
/// `class`, the type columns, `held`, `occurred_at`, `next_retry_at` and
/// `id`: per class and type, the rows, the held-back ones, the waiting ones
/// by due time (within a minute, within the hour, later), the age of the
/// oldest in seconds, the highest id and the latest `next_retry_at` (as
/// seconds since 1970, so `-infinity` reads as a float), and `tail`: whether
/// these rows are due at the last due time a class ordered by due time read
/// (the rows of that time it did not read are counted by the sample).
const GROUPED: &str = "c.class, c.event_type, c.aggregate_type, count(*) AS n, \
       count(*) FILTER (WHERE c.held) AS held, \
       count(*) FILTER (WHERE c.next_retry_at <= now() + interval '1 minute') AS within_1m, \
       count(*) FILTER (WHERE c.next_retry_at > now() + interval '1 minute' \
                          AND c.next_retry_at <= now() + interval '1 hour') AS within_1h, \
       count(*) FILTER (WHERE c.next_retry_at > now() + interval '1 hour') AS later, \
       EXTRACT(EPOCH FROM (now() - min(c.occurred_at)))::float8 AS oldest_age, \
       max(c.id) AS max_id, \
       EXTRACT(EPOCH FROM max(c.next_retry_at) FILTER (WHERE c.next_retry_at < 'infinity'))::float8 AS max_due, \
       c.tail";

/// One class's first $1 rows in the order of its index (the only plan
/// without a sort: see [`crate::connect::PLANNER_SETTINGS`]), each marked
/// `tail` when the class is ordered by `next_retry_at` and the row is due at
/// the last due time read.
fn class_rows(class: &str, filter: &str, order: &str, held: &str) -> String {
    let tail =
        if order == "o.next_retry_at" { "(x.next_retry_at = max(x.next_retry_at) OVER ()) IS TRUE" } else { "false" };
    format!(
        "(SELECT x.*, {tail} AS tail FROM ( \
           SELECT '{class}'::text AS class, o.id, o.event_type, o.aggregate_type, o.occurred_at, o.next_retry_at, \
             {held} AS held \
           FROM events.outbox o WHERE o.published_at IS NULL AND {filter} ORDER BY {order} LIMIT $1) x)"
    )
}

/// The exact part: each class's first $1 rows (one more than
/// [`STATUS_EXACT_ROWS`], to tell a class that has more), grouped by class
/// and type ([`GROUPED`]). Due rows carry the hold-back probe.
pub(crate) fn exact_sql() -> String {
    let held = format!("{HELD_IF_ANY_FAILED}{HELD_BACK} END");
    format!(
        "SELECT {GROUPED} FROM ({} UNION ALL {} UNION ALL {} UNION ALL {}) c \
         GROUP BY c.class, c.event_type, c.aggregate_type, c.tail",
        class_rows("fresh", "o.next_retry_at IS NULL", "o.id + 0", &held),
        class_rows("due", "o.next_retry_at IS NOT NULL AND o.next_retry_at <= now()", "o.next_retry_at", HELD_BACK),
        class_rows("waiting", "o.next_retry_at > now() AND o.next_retry_at < 'infinity'", "o.next_retry_at", "false"),
        class_rows("dead", "o.next_retry_at = 'infinity'", "o.id + 0", "false"),
    )
}

/// The sample, one stratum per estimated kind of rows, $1 ids drawn
/// uniformly in each, each looked up by primary key (a lateral subquery per
/// id, kept apart by `OFFSET 0`, so the planner cannot turn it into a join
/// that scans the table), grouped by class, type and stratum ([`GROUPED`],
/// and the stratum's `span`: how many ids it draws from). The strata start
/// past what [`exact_sql`] read:
/// - fresh rows, when $2 (the last fresh id read) is not NULL: ids above
///   it, up to the last entry of `outbox_fresh_order_idx`;
/// - dead letters, when $3 is not NULL: the same in `outbox_dead_letter_idx`;
/// - retries, when $4 (the last due retry's due time read, in seconds since
///   1970) or $5 (the last waiting one's) is not NULL: every id from the
///   first entry of `outbox_unpublished_idx` to the last of `outbox_pkey`,
///   counting a due retry due at or after $4 and a waiting one at or after
///   $5 (the rows read at those times are left out of the exact part).
///
/// A stratum counts only its own kind's rows.
pub(crate) fn sample_sql() -> String {
    format!(
        "WITH r AS ( \
           SELECT 'fresh'::text AS kind, $2::int8 + 1 AS lo, \
                  (SELECT o.id + 0 FROM events.outbox o WHERE o.published_at IS NULL AND o.next_retry_at IS NULL \
                   ORDER BY o.id + 0 DESC LIMIT 1) AS hi WHERE $2::int8 IS NOT NULL \
           UNION ALL \
           SELECT 'dead', $3::int8 + 1, \
                  (SELECT o.id + 0 FROM events.outbox o WHERE o.published_at IS NULL AND o.next_retry_at = 'infinity' \
                   ORDER BY o.id + 0 DESC LIMIT 1) WHERE $3::int8 IS NOT NULL \
           UNION ALL \
           SELECT 'retry', (SELECT o.id FROM events.outbox o WHERE o.published_at IS NULL ORDER BY o.id LIMIT 1), \
                  (SELECT o.id FROM events.outbox o ORDER BY o.id DESC LIMIT 1) \
           WHERE $4::float8 IS NOT NULL OR $5::float8 IS NOT NULL), \
         s AS (SELECT r.kind, r.hi - r.lo + 1 AS span, r.lo + floor(random() * (r.hi - r.lo + 1))::int8 AS id \
               FROM r, generate_series(1, $1::int8) WHERE r.hi >= r.lo) \
         SELECT {GROUPED}, c.span FROM s CROSS JOIN LATERAL ( \
           SELECT CASE WHEN o.next_retry_at IS NULL THEN 'fresh' WHEN o.next_retry_at = 'infinity' THEN 'dead' \
                       WHEN o.next_retry_at <= now() THEN 'due' ELSE 'waiting' END AS class, \
                  o.id, o.event_type, o.aggregate_type, o.occurred_at, o.next_retry_at, s.span, false AS tail, \
                  CASE WHEN o.next_retry_at IS NULL OR o.next_retry_at <= now() THEN {HELD_BACK} ELSE false END AS held \
           FROM events.outbox o WHERE o.id = s.id AND o.published_at IS NULL \
             AND CASE s.kind WHEN 'fresh' THEN o.next_retry_at IS NULL \
                             WHEN 'dead' THEN o.next_retry_at = 'infinity' \
                             ELSE (o.next_retry_at <= now() AND o.next_retry_at >= to_timestamp($4)) \
                               OR (o.next_retry_at > now() AND o.next_retry_at < 'infinity' \
                                   AND o.next_retry_at >= to_timestamp($5)) END \
           OFFSET 0) c \
         GROUP BY c.class, c.event_type, c.aggregate_type, c.span, c.tail"
    )
}

/// A class of unpublished rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Class {
    Fresh,
    Due,
    Waiting,
    Dead,
}

impl Class {
    const ALL: [Class; 4] = [Class::Fresh, Class::Due, Class::Waiting, Class::Dead];

    fn parse(s: &str) -> Option<Class> {
        match s {
            "fresh" => Some(Class::Fresh),
            "due" => Some(Class::Due),
            "waiting" => Some(Class::Waiting),
            "dead" => Some(Class::Dead),
            _ => None,
        }
    }
}

/// Figures of one class and type: rows, held back, waiting by due time
/// (within a minute, within the hour, later). Floats: a sample scales them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    pub(crate) n: f64,
    pub(crate) held: f64,
    pub(crate) within_1m: f64,
    pub(crate) within_1h: f64,
    pub(crate) later: f64,
}

impl Counts {
    fn add(&mut self, o: &Counts, scale: f64) {
        self.n += o.n * scale;
        self.held += o.held * scale;
        self.within_1m += o.within_1m * scale;
        self.within_1h += o.within_1h * scale;
        self.later += o.later * scale;
    }
}

/// One grouped row of either statement.
struct Group {
    class: Class,
    types: (String, String),
    counts: Counts,
    oldest_age: Option<f64>,
    max_id: i64,
    max_due: Option<f64>,
    tail: bool,
}

fn read_group(r: &tokio_postgres::Row) -> Result<Option<Group>, tokio_postgres::Error> {
    let class: String = r.try_get("class")?;
    let Some(class) = Class::parse(&class) else { return Ok(None) };
    let f = |c: &str| -> Result<f64, tokio_postgres::Error> { Ok(r.try_get::<_, i64>(c)? as f64) };
    Ok(Some(Group {
        class,
        types: (r.try_get("event_type")?, r.try_get("aggregate_type")?),
        counts: Counts {
            n: f("n")?,
            held: f("held")?,
            within_1m: f("within_1m")?,
            within_1h: f("within_1h")?,
            later: f("later")?,
        },
        oldest_age: r.try_get("oldest_age")?,
        max_id: r.try_get("max_id")?,
        max_due: r.try_get("max_due")?,
        tail: r.try_get("tail")?,
    }))
}

/// The backlog by class and type, and which classes are estimated.
#[derive(Debug, Clone, Default)]
pub(crate) struct Backlog {
    /// Per class and `(event_type, aggregate_type)`.
    pub(crate) by: BTreeMap<(Class, String, String), Counts>,
    /// Classes whose figures are estimated (more than [`STATUS_EXACT_ROWS`]).
    pub(crate) estimated: Vec<Class>,
    /// Rows each class holds for sure (those read); an estimate is never
    /// below it.
    read: BTreeMap<Class, f64>,
    /// Age in seconds of the oldest row read that is not a dead letter.
    pub(crate) oldest_age: Option<f64>,
    /// The same per `(event_type, aggregate_type)`, over the rows read and
    /// the sample.
    oldest_by_type: BTreeMap<(String, String), f64>,
}

impl Backlog {
    /// Rows of `class`, rounded; never below the rows read.
    pub(crate) fn total(&self, class: Class) -> i64 {
        let sum: f64 = self.by.iter().filter(|((c, _, _), _)| *c == class).map(|(_, v)| v.n).sum();
        sum.max(self.read.get(&class).copied().unwrap_or(0.0)).round() as i64
    }

    /// The sum of `pick` over the rows of `class`, rounded.
    pub(crate) fn sum(&self, class: Class, pick: impl Fn(&Counts) -> f64) -> i64 {
        self.by.iter().filter(|((c, _, _), _)| *c == class).map(|(_, v)| pick(v)).sum::<f64>().round() as i64
    }

    /// Age in seconds of the oldest row of a type that is not a dead letter,
    /// among the rows read and sampled.
    pub(crate) fn oldest_age_of(&self, event_type: &str, aggregate_type: &str) -> Option<f64> {
        self.oldest_by_type.get(&(event_type.to_string(), aggregate_type.to_string())).copied()
    }

    /// Count the oldest age of group `g`.
    fn note_oldest(&mut self, g: &Group) {
        if let (false, Some(age)) = (g.class == Class::Dead, g.oldest_age) {
            let e = self.oldest_by_type.entry(g.types.clone()).or_insert(age);
            *e = e.max(age);
        }
    }

    /// Whether `class` is estimated.
    pub(crate) fn is_estimated(&self, class: Class) -> bool {
        self.estimated.contains(&class)
    }
}

/// The larger of two optional floats.
fn max_f64(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Read the backlog: [`exact_sql`], then [`sample_sql`] if some class has
/// more than [`STATUS_EXACT_ROWS`] rows. Two statements, each bounded by its
/// limits, whatever the table holds.
pub(crate) async fn read<C: GenericClient + Sync>(client: &C) -> Result<Backlog, tokio_postgres::Error> {
    let limit = STATUS_EXACT_ROWS + 1;
    let mut b = Backlog::default();
    // Per class, the highest id and the latest due time read.
    let mut read_to: BTreeMap<Class, (i64, Option<f64>)> = BTreeMap::new();
    // Groups of the rows at a class's last due time read.
    let mut tails: Vec<(Class, String, String, Counts)> = Vec::new();
    for row in client.query(&exact_sql(), &[&limit]).await? {
        let Some(g) = read_group(&row)? else { continue };
        *b.read.entry(g.class).or_default() += g.counts.n;
        let e = read_to.entry(g.class).or_insert((g.max_id, g.max_due));
        *e = (e.0.max(g.max_id), max_f64(e.1, g.max_due));
        if g.class != Class::Dead {
            b.oldest_age = max_f64(b.oldest_age, g.oldest_age);
        }
        b.note_oldest(&g);
        let (event_type, aggregate_type) = g.types;
        if g.tail {
            tails.push((g.class, event_type.clone(), aggregate_type.clone(), g.counts));
        }
        b.by.entry((g.class, event_type, aggregate_type)).or_default().add(&g.counts, 1.0);
    }
    b.estimated = Class::ALL.into_iter().filter(|c| b.read.get(c).copied().unwrap_or(0.0) >= limit as f64).collect();
    if b.estimated.is_empty() {
        return Ok(b);
    }
    // An estimated class keeps the rows read (every row up to the last one
    // read, in its index's order) and adds the sample past them; a class
    // counted exactly takes nothing from the sample (NULL bounds). For a
    // class ordered by due time, rows at the last due time read may be left
    // unread (ties), so the sample counts that time too, and the rows read
    // at it leave the exact part.
    for (class, event_type, aggregate_type, counts) in &tails {
        if b.estimated.contains(class)
            && let Some(c) = b.by.get_mut(&(*class, event_type.clone(), aggregate_type.clone()))
        {
            c.add(counts, -1.0);
        }
    }
    let past = |c: Class| b.estimated.contains(&c).then(|| read_to.get(&c).copied()).flatten();
    let id_past = |c: Class| past(c).map(|(id, _)| id);
    let due_past = |c: Class| past(c).and_then(|(_, due)| due);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
        &STATUS_SAMPLE_IDS,
        &id_past(Class::Fresh),
        &id_past(Class::Dead),
        &due_past(Class::Due),
        &due_past(Class::Waiting),
    ];
    for row in client.query(&sample_sql(), &params).await? {
        let span: i64 = row.try_get("span")?;
        let Some(g) = read_group(&row)? else { continue };
        let scale = span as f64 / STATUS_SAMPLE_IDS as f64;
        b.note_oldest(&g);
        let (event_type, aggregate_type) = g.types;
        b.by.entry((g.class, event_type, aggregate_type)).or_default().add(&g.counts, scale);
    }
    Ok(b)
}
