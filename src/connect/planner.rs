//! The planner policy of pg-outbox's sessions.

/// Planner settings sent with every pg-outbox session (as startup
/// `options`, before the URL's own, which therefore win):
///
/// * `enable_sort=off`: every ordered, limited statement pg-outbox runs on
///   `events.outbox` orders by a key that exactly one index provides (the
///   expression `id + 0` of `outbox_fresh_order_idx`, `outbox_holdback_idx`
///   and `outbox_dead_letter_idx`, or `next_retry_at` of
///   `outbox_retry_due_idx`), so the only plan without an explicit sort is
///   the walk of that index, which stops after the rows it returns. With
///   sorts discouraged (PostgreSQL docs, "Planner Method Configuration":
///   the planner avoids a sort "if there are other methods available"), the
///   planner takes that walk whatever the statistics say. Without it,
///   statistics taken before a backlog formed (no unpublished rows) make
///   every plan over unpublished rows look like one row, and the planner may
///   sort the whole backlog, or walk it once per candidate row.
/// * `jit=off`: the discouraged sort adds a large constant to the estimated
///   cost of a plan that must sort a few rows anyway, which would otherwise
///   pass `jit_above_cost` and compile every fetch.
/// * `max_parallel_workers_per_gather=0`: a fetch returns at most a batch;
///   starting workers costs more than it saves, and estimates from missing
///   statistics could ask for them.
pub(crate) const PLANNER_SETTINGS: &str = "-c enable_sort=off -c jit=off -c max_parallel_workers_per_gather=0";
