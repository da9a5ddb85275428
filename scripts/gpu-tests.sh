#!/usr/bin/env bash
# The CUDA backends on a real GPU: the CUDA tests (threads and processes),
# the conformance suite with 2 and 4 processes sharing the GPU on both CUDA
# backends, and the all_reduce benchmark against the device-to-device copy
# bandwidth and the unpipelined (Gloo-style) staging. Run on a machine with
# an NVIDIA GPU, its driver and NVRTC: `bash scripts/gpu-tests.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
export WEFT_TIMEOUT_SECONDS=${WEFT_TIMEOUT_SECONDS:-120}
unset WEFT_CUDA_EMULATION

nvidia-smi || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
cargo build --release -q -p weft-cli -p weft-tests
weft=target/release/weft
"$weft" info

echo "== CUDA tests on the real GPU"
WEFT_TEST_REAL_GPU=1 cargo test --release -q -p weft-tests --test cuda -- --test-threads=1

for n in 2 4; do
  for be in cuda-device cuda-host-staging; do
    echo "== conformance: $n processes, cpu:shm,cuda:$be"
    "$weft" conformance -n "$n" --device cuda --backend "cpu:shm,cuda:$be" --count 1031 | tail -1
  done
done

size=${GPU_BENCH_SIZE:-256M}
for n in 2 4; do
  echo "== bench: $n processes, all_reduce $size f32 (device_copy = the copy-bandwidth reference)"
  "$weft" bench --world "$n" --device cuda --backend cpu:shm,cuda:cuda-device --ops device_copy,all_reduce -b "$size" -e "$size" -n 20
  "$weft" bench --world "$n" --device cuda --backend cpu:shm,cuda:cuda-host-staging --ops all_reduce -b "$size" -e "$size" -n 10
  "$weft" bench --world "$n" --device cuda --backend cpu:shm,cuda:cuda-host-staging --hint staging=whole --ops all_reduce -b "$size" -e "$size" -n 10
done
