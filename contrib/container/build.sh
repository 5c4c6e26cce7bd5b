#!/bin/sh
# Build the pg-outbox image (Containerfile, next to this script) from a
# binary built on this machine:
#
#   cargo build --release --features full
#   contrib/container/build.sh target/release/pg-outbox pg-outbox:0.1.0
#
# The image holds the binary (stripped), the shared libraries and dynamic
# loader `ldd` names for it (glibc, libgcc_s, zlib, OpenSSL: from this
# machine, so they are the ones it was linked against), the system CA bundle, and
# /etc/passwd, /etc/group and /etc/nsswitch.conf with a `nonroot` user
# (65532). Needs podman (`PODMAN` may add options, e.g.
# `PODMAN="podman --storage-driver vfs"`); no registry: the base is scratch.
set -eu
bin=${1:?usage: build.sh BINARY [TAG]}
tag=${2:-pg-outbox:latest}
here=$(cd "$(dirname "$0")" && pwd)
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs
mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs"
cp "$bin" "$root/usr/local/bin/pg-outbox"
if command -v strip >/dev/null 2>&1; then
  strip "$root/usr/local/bin/pg-outbox"
fi
# `ldd` lines: "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" and
# "/lib64/ld-linux-x86-64.so.2 (0x...)" (the loader, at the path the binary names).
libs=$(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
if [ -z "$libs" ]; then
  echo "build.sh: ldd names no libraries for $bin" >&2
  exit 1
fi
for lib in $libs; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
ca=/etc/ssl/certs/ca-certificates.crt
if [ ! -f "$ca" ]; then
  echo "build.sh: no CA bundle at $ca (Debian: apt-get install ca-certificates)" >&2
  exit 1
fi
cp -L "$ca" "$root/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/:/nonexistent\nnonroot:x:65532:65532:nonroot:/:/nonexistent\n' >"$root/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$root/etc/group"
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$root/etc/nsswitch.conf"
cp "$here/Containerfile" "$ctx/Containerfile"
${PODMAN:-podman} build -t "$tag" -f "$ctx/Containerfile" "$ctx"
