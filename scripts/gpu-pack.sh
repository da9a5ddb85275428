#!/usr/bin/env bash
# Build what scripts/gpu-tests.sh runs and pack it, stripped, into .gpu/
# (git-ignored), for a GPU machine that has no Rust toolchain or network:
# carry .gpu there and run `WEFT_PREBUILT=.gpu bash scripts/gpu-tests.sh`.
# CUDA is loaded at run time, so this builds on a machine without it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p weft-cli -p weft-tests
test_bin=$(cargo test --release -q -p weft-tests --test cuda --no-run --message-format=json \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >>.git/info/exclude; }
strip -o .gpu/weft target/release/weft
strip -o .gpu/weft-test-worker target/release/weft-test-worker
strip -o .gpu/cuda-test "$test_bin"
ls -l .gpu
