#!/usr/bin/env bash
# Build what scripts/gpu-tests.sh runs and pack it, stripped, into .gpu/
# (git-ignored), for a GPU machine that has no Rust toolchain or network:
# carry .gpu there and run `WEFT_PREBUILT=.gpu bash scripts/gpu-tests.sh`.
# CUDA is loaded at run time, so this builds on a machine without it. The
# Python extension (abi3: any CPython from 3.10) is built with maturin,
# from PATH or $MATURIN.
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
wheels=$(mktemp -d)
(cd python && "${MATURIN:-maturin}" build --release -q -o "$wheels")
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("weft/_weft.abi3.so", sys.argv[2])' "$wheels"/weft-*.whl "$wheels"
strip -o .gpu/_weft.abi3.so "$wheels/weft/_weft.abi3.so"
rm -rf "$wheels"
ls -l .gpu
