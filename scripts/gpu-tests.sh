#!/usr/bin/env bash
# The CUDA backends on a real GPU: the CUDA tests (threads and processes;
# device windows included),
# the conformance suite with 2 and 4 processes sharing the GPU on both CUDA
# backends, the Python package's CUDA tests (CUDA tensors through
# torch.distributed, device windows through TorchComm's API) where python3
# has torch, and the all_reduce benchmark (cuda-device direct, its ring)
# against the device-to-device copy bandwidth and the unpipelined
# (Gloo-style) staging. Run on a machine with
# an NVIDIA GPU, its driver and NVRTC: `bash scripts/gpu-tests.sh`.
#
# Without a Rust toolchain there: pack the binaries with scripts/gpu-pack.sh
# on any x86-64 Linux machine, carry .gpu/, and run
# `WEFT_PREBUILT=.gpu bash scripts/gpu-tests.sh`.
#
# GPU_WORLDS (default "2 4") picks the benchmark's world sizes, GPU_MPS=0
# skips the second round of benchmarks under MPS.
#
# Every step runs under `timeout`; a failing step is reported and the rest
# still run; the exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export WEFT_TIMEOUT_SECONDS=${WEFT_TIMEOUT_SECONDS:-120}
unset WEFT_CUDA_EMULATION
step_limit=${GPU_STEP_SECONDS:-300}
source scripts/gpu-steps.sh

nvidia-smi || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
if [[ -n ${WEFT_PREBUILT:-} ]]; then
  mkdir -p target/release
  cp "$WEFT_PREBUILT/weft" "$WEFT_PREBUILT/weft-test-worker" target/release/
  cp "$WEFT_PREBUILT/_weft.abi3.so" python/weft/
  export WEFT_TEST_WORKER=$PWD/target/release/weft-test-worker
  cuda_tests=(bash -c 'for t in "$0"/cuda-test "$0"/cuda-device-conformance "$0"/cuda-host-staging-conformance; do
    "$t" --test-threads=1 || exit 1; done' "$WEFT_PREBUILT")
else
  cargo build --release -q -p weft-cli -p weft-tests || exit 1
  cuda_tests=(cargo test --release -q -p weft-tests -p weft-cuda-device -p weft-cuda-host-staging --test cuda --test conformance
    -- --test-threads=1)
fi
weft=target/release/weft
"$weft" info

step "CUDA tests on the real GPU" env WEFT_TEST_REAL_GPU=1 "${cuda_tests[@]}"

# The package as built here (prebuilt: from python/) or installed.
pypath=${PYTHONPATH:-}
if [[ -f python/weft/_weft.abi3.so ]]; then
  pypath="$PWD/python${pypath:+:$pypath}"
fi
if PYTHONPATH=$pypath python3 -c 'import weft' 2>/dev/null; then
  step "Python: CUDA tensors and device windows" env PYTHONPATH="$pypath" \
    python3 -m pytest -q -p no:cacheprovider python/tests/test_cuda.py python/tests/test_window.py
else
  echo "== Python: skipped (no weft package here; pip install ./python, or pack it with scripts/gpu-pack.sh)"
fi

for n in 2 4; do
  for be in cuda-device cuda-host-staging; do
    step "conformance: $n processes, cpu:shm,cuda:$be" \
      "$weft" conformance -n "$n" --device cuda --backend "cpu:shm,cuda:$be" --count 1031
  done
done

# bench LABEL ARGS...: one `weft bench` run as a step; its table is kept
# in $log/LABEL for `field`.
log=$(mktemp -d)
bench() {
  local label=$1
  shift
  step "bench $label" bash -c 'set -o pipefail; "$@" | tee "$0"' "$log/$label" "$weft" bench "$@"
}

size=${GPU_BENCH_SIZE:-256M}
# Processes sharing a GPU time-slice it unless MPS merges their contexts:
# measure both where MPS is there (started here, stopped at the end).
modes=(plain)
if [[ ${GPU_MPS:-1} != 0 ]] && command -v nvidia-cuda-mps-control >/dev/null && ! pgrep -x nvidia-cuda-mps >/dev/null; then
  modes+=(mps)
fi
summary=()
for mode in "${modes[@]}"; do
  if [[ $mode == mps ]]; then
    nvidia-cuda-mps-control -d && sleep 1
  fi
  for n in ${GPU_WORLDS:-2 4}; do
    common=(--world "$n" --device cuda -b "$size" -e "$size")
    bench "$mode-$n-device" "${common[@]}" --backend cpu:shm,cuda:cuda-device --ops device_copy,all_reduce -n 20 --time-per-size 3
    bench "$mode-$n-ring" "${common[@]}" --backend cpu:shm,cuda:cuda-device --hint cuda_algorithm=ring --ops all_reduce -n 20 --time-per-size 3
    bench "$mode-$n-staging" "${common[@]}" --backend cpu:shm,cuda:cuda-host-staging --ops all_reduce -n 10 --time-per-size 3
    bench "$mode-$n-whole" "${common[@]}" --backend cpu:shm,cuda:cuda-host-staging --hint staging=whole --ops all_reduce -n 10 --time-per-size 3
    copy=$(field "$log/$mode-$n-device" device_copy 12)
    direct=$(field "$log/$mode-$n-device" all_reduce 12)
    ring=$(field "$log/$mode-$n-ring" all_reduce 12)
    piped=$(field "$log/$mode-$n-staging" all_reduce 7)
    whole=$(field "$log/$mode-$n-whole" all_reduce 7)
    summary+=("$mode W=$n all_reduce $size: cuda-device busbw $direct GB/s = $(ratio "$direct" "$copy") x device_copy ($copy GB/s; the ring: $ring GB/s); cuda-host-staging $piped us = $(ratio "$whole" "$piped") x faster than staging=whole ($whole us)")
  done
  if [[ $mode == mps ]]; then
    echo quit | nvidia-cuda-mps-control
  fi
done
# One-sided windows in device memory: put + signal + wait_signal at 64 MiB
# against a device copy of the same size.
bench "put-2" --world 2 --device cuda -b 64M -e 64M --backend cpu:shm,cuda:cuda-device --ops device_copy,put -n 20 --time-per-size 3
summary+=("W=2 put 64M: $(field "$log/put-2" put 7) us against a device copy's $(field "$log/put-2" device_copy 7) us")
echo "== summary (targets: cuda-device >= 0.50 x device_copy; staging >= 1.5 x faster than whole)"
printf '%s\n' "${summary[@]}"

finish
