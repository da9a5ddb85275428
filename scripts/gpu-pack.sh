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
# The CUDA test binaries: tests/tests/cuda.rs and each CUDA backend
# crate's conformance tests, as NAME PATH lines.
bins=$(cargo test --release -q -p weft-tests -p weft-cuda-device -p weft-cuda-host-staging --test cuda --test conformance --no-run \
  --message-format=json | python3 -c 'import json,sys
names = {"tests/tests/cuda.rs": "cuda-test", "cuda-device/tests/conformance.rs": "cuda-device-conformance",
         "cuda-host-staging/tests/conformance.rs": "cuda-host-staging-conformance"}
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        for suffix, name in names.items():
            if m["target"]["src_path"].endswith("/" + suffix):
                print(name, m["executable"])')
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >>.git/info/exclude; }
strip -o .gpu/weft target/release/weft
strip -o .gpu/weft-test-worker target/release/weft-test-worker
while read -r name path; do
  strip -o ".gpu/$name" "$path"
done <<<"$bins"
wheels=$(mktemp -d)
(cd python && "${MATURIN:-maturin}" build --release -q -o "$wheels")
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("weft/_weft.abi3.so", sys.argv[2])' "$wheels"/weft-*.whl "$wheels"
strip -o .gpu/_weft.abi3.so "$wheels/weft/_weft.abi3.so"
rm -rf "$wheels"
ls -l .gpu
