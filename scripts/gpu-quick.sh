#!/usr/bin/env bash
# The first thing to run on a lent GPU (a budget of minutes): about 8
# minutes of the checks that matter most for cuda-device, from binaries
# packed beforehand with scripts/gpu-pack.sh (no build on the GPU machine):
#
#   WEFT_PREBUILT=.gpu bash scripts/gpu-quick.sh
#
# 1. CUDA graph capture: collectives and sendrecv captured and replayed,
#    in-process and across processes, and the capture refusals;
# 2. point-to-point on the device across processes (every pattern, sizes
#    and order that disagree);
# 3. one conformance pass, 2 processes sharing the GPU, on cuda-device;
# 4. `weft bench` at 8 B, 1 MiB and 64 MiB, W = 2: every op on cuda-device,
#    then on cuda-host-staging (the path it replaces), and the
#    device-to-device copy as the ceiling, with a summary of ratios.
#
# scripts/gpu-tests.sh is the full run, for when time is left. Every step
# runs under `timeout` (GPU_STEP_SECONDS, default 120; the cross-process
# tests twice that); the exit status is non-zero if any step failed. The
# benchmark tables are kept under $OUT (else a temporary folder).
#
# Not covered here (no script yet): torch's own CUDA graph capture through
# `torch.cuda.graph`, which python/tests/test_cuda.py would need to grow.
set -uo pipefail
cd "$(dirname "$0")/.."
export WEFT_TIMEOUT_SECONDS=${WEFT_TIMEOUT_SECONDS:-60}
unset WEFT_CUDA_EMULATION
step_limit=${GPU_STEP_SECONDS:-120}
source scripts/gpu-steps.sh

nvidia-smi -L || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
pre=${WEFT_PREBUILT:?pack the binaries first: bash scripts/gpu-pack.sh, then WEFT_PREBUILT=.gpu}
pre=$(cd "$pre" && pwd)
export WEFT_TEST_WORKER=$pre/weft-test-worker
weft=$pre/weft
"$weft" info

export WEFT_TEST_REAL_GPU=1
step "capture, in-process" "$pre/cuda-device-conformance" --test-threads=1 capture
step_limit=$((2 * step_limit)) step "capture and point-to-point, across processes" "$pre/cuda-test" --test-threads=1 \
  captured point_to_point_on_the_device cuda_device_direct_and_ring
unset WEFT_TEST_REAL_GPU
step "conformance: 2 processes, cpu:shm,cuda:cuda-device" \
  "$weft" conformance -n 2 --device cuda --backend cpu:shm,cuda:cuda-device --count 257

log=${OUT:-$(mktemp -d)}
ops=all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,reduce,gather,scatter,sendrecv
for be in cuda-device cuda-host-staging; do
  for size in 8 1M 64M; do
    step "bench $be $size" bash -c 'set -o pipefail; "$@" | tee "$0"' "$log/$be-$size" \
      "$weft" bench --world 2 --device cuda --backend "cpu:shm,cuda:$be" --ops "device_copy,$ops" \
      -b "$size" -e "$size" -n 10 -w 3
  done
done
echo "== summary at 64 MiB (targets: busbw >= 0.6 x device_copy, >= 3 x faster than cuda-host-staging)"
copy=$(field "$log/cuda-device-64M" device_copy 12)
for op in ${ops//,/ }; do
  bw=$(field "$log/cuda-device-64M" "$op" 12)
  t=$(field "$log/cuda-device-64M" "$op" 7)
  staged=$(field "$log/cuda-host-staging-64M" "$op" 7)
  echo "$op: busbw $bw GB/s = $(ratio "$bw" "$copy") x device_copy ($copy GB/s); $t us = $(ratio "$staged" "$t") x faster than staged ($staged us)"
done
for size in 8 1M; do
  echo "-- $size: op, cuda-device us, cuda-host-staging us"
  for op in ${ops//,/ }; do
    echo "$op $(field "$log/cuda-device-$size" "$op" 7) $(field "$log/cuda-host-staging-$size" "$op" 7)"
  done
done

finish
