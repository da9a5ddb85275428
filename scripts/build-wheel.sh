#!/usr/bin/env bash
# Build weft's Python wheel: the extension module for the stable ABI of
# CPython 3.10+ (abi3, manylinux) with the `weft` command inside, for
# machines without Rust. The wheel lands in target/wheels/.
#
#   scripts/build-wheel.sh            # needs cargo and maturin (pip install maturin)
#   pip install target/wheels/weft-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p weft-cli
# The command travels as package data (python/weft/bin/, not tracked) and
# the `weft` entry point runs it (weft/_cli.py).
mkdir -p python/weft/bin
cp target/release/weft python/weft/bin/weft
strip python/weft/bin/weft
rm -f target/wheels/weft-*.whl
maturin build --release --strip -q -m python/Cargo.toml -o target/wheels
rm -rf python/weft/bin
ls target/wheels/weft-*.whl
