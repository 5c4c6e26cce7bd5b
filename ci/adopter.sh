#!/usr/bin/env bash
# Build and run ci/adopter: an application outside pg-outbox's package that
# depends on it by path (default features plus `sqlx`), publishes through
# sqlx and through tokio-postgres, and consumes the stream. It needs a
# PostgreSQL at DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres),
# where it creates, and drops again, a scratch database.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
adopter="$root/ci/adopter"

# The library's own lock file, so the adopter builds the versions the
# library is tested with (cargo adds the adopter and drops what it does not use).
cp "$root/Cargo.lock" "$adopter/Cargo.lock"
# The library's target directory: with the same lock file, the
# dependencies the adopter shares with the tests are built once.
export CARGO_TARGET_DIR="${ADOPTER_TARGET_DIR:-$root/target}"
cd "$adopter"

echo "adopter: cargo tree -e normal | wc -l: $(cargo tree -e normal | wc -l)"
echo "adopter: distinct crates in the normal dependency tree: $(cargo tree -e normal --prefix none --no-dedupe | sort -u | wc -l)"
start=$(date +%s)
cargo build
echo "adopter: built in $(($(date +%s) - start)) s"
"$CARGO_TARGET_DIR/debug/pg-outbox-adopter"
