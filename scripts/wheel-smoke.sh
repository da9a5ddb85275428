#!/usr/bin/env bash
# Install a built wheel (target/wheels/) into a fresh virtual environment
# with no Rust toolchain on PATH, and smoke-test it: a two-rank torch job on
# weft under torchrun, `weft info`, and `weft bench` on two local ranks.
#
#   scripts/wheel-smoke.sh TORCH_SITE_PACKAGES
#
# torch is not installed again (3 GB): the fresh environment sees the
# site-packages named (where torch is installed, and weft must not be)
# after its own.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_site=$1
wheel=$(ls target/wheels/weft-*.whl)
fresh=$(mktemp -d)/venv
python3 -m venv "$fresh"
site=$("$fresh/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$torch_site" > "$site/zz-torch.pth"
# No cargo, rustc or maturin from here on.
export PATH="$fresh/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
if command -v cargo >/dev/null; then echo "cargo is still on PATH: $(command -v cargo)"; exit 1; fi
if python -c "import weft" 2>/dev/null; then echo "weft is importable before the wheel is installed"; exit 1; fi
pip install -q --no-deps "$wheel"
cd "$(mktemp -d)"  # away from the checkout's python/ folder
cat > smoke.py <<'PY'
import sys, torch, torch.distributed as dist
dist.init_process_group("weft")
import weft
assert weft.__file__.startswith(sys.prefix), (weft.__file__, sys.prefix)
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 4, t
assert "cpu" in [d.type for d in dist.group.WORLD._device_types]
dist.destroy_process_group()
print("smoke ok")
PY
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
out=$(python -m torch.distributed.run --nproc-per-node 2 --master-port "$port" smoke.py 2>&1) || { echo "$out"; exit 1; }
[ "$(grep -o "smoke ok" <<<"$out" | wc -l)" = 2 ] || { echo "$out"; exit 1; }
weft info > info.txt && head -3 info.txt
weft bench --world 2 --ops all_reduce -b 8 -e 1K -n 20 > bench.txt && tail -3 bench.txt
echo "wheel smoke test passed: $wheel"
