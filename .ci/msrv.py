#!/usr/bin/env python3
"""Check Cargo.toml's rust-version against the dependency graph.

Only one toolchain is installed where CI runs, so the minimum supported
Rust version cannot be built here. This checks the next best thing: no
dependency (normal, all features, Linux) declares a `rust-version` above
ours, so ours is the floor the dependencies allow.
"""
import json
import subprocess
import sys
import tomllib

def ver(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

ours = tomllib.load(open("Cargo.toml", "rb"))["package"]["rust-version"]
meta = json.loads(subprocess.check_output(["cargo", "metadata", "--format-version", "1", "--all-features"]))
tree = subprocess.check_output(
    ["cargo", "tree", "-e", "normal", "--prefix", "none", "--all-features",
     "--target", "x86_64-unknown-linux-gnu", "-f", "{p}"], text=True)
used = {tuple(l.replace(" (*)", "").replace(" (proc-macro)", "").split()[:2]) for l in tree.splitlines() if l.strip()}
worst = []
for p in meta["packages"]:
    rv = p.get("rust_version")
    if (p["name"], "v" + p["version"]) in used and rv and ver(rv) > ver(ours):
        worst.append(f"{p['name']} {p['version']} needs Rust {rv}")
if worst:
    sys.exit(f"rust-version {ours} is below what dependencies need: " + "; ".join(worst))
print(f"msrv: rust-version {ours}; no dependency declares a higher one")
