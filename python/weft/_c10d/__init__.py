"""weft's C++ ``c10d::Backend`` (``backend.cpp``), built against the
installed torch the first time a group is made, then loaded from a cache.

torch's C++ API changes between releases, so the extension cannot ship in
weft's wheel (one wheel for every torch): it is compiled here, once per
torch build, Python and source, with the C++ compiler torch's own
extensions use (``CXX``, else ``g++``), about half a minute on 2 cores,
into ``WEFT_CACHE_DIR`` (default ``~/.cache/weft``). Ranks that start
together take turns on a lock file, so one compiles and the others load
its result. Without a compiler (or with ``WEFT_TORCH_CPP=0``) weft runs on
torch's Python backend API, with the limits ``python/README.md`` lists.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import warnings

import torch

ENV_SWITCH = "WEFT_TORCH_CPP"
ENV_CACHE = "WEFT_CACHE_DIR"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "backend.cpp")
# What it includes from here.
_HEADERS = (os.path.join(_HERE, "native.hpp"),)
_MODULE = "_weft_c10d"


@functools.cache
def load():
    """The compiled module (its ``Backend`` class), or None where it cannot
    be built here (the reason is warned once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        return _import(_build())
    except Exception as e:  # noqa: BLE001 - any failure falls back to the Python API
        warnings.warn(f"weft: torch's C++ backend API is not used ({e}); see python/README.md", RuntimeWarning, stacklevel=2)
        return None


def _key() -> str:
    """What the binary depends on: the source, torch's build, Python."""
    h = hashlib.sha256()
    for path in (_SOURCE, *_HEADERS):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(f"{torch.__version__} {torch.version.git_version} {sys.version} {sys.platform}".encode())
    return h.hexdigest()[:20]


def _build() -> str:
    """The path of the built extension, compiling it if this key has none."""
    cache = os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "weft")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, f"{_MODULE}-{_key()}.so")
    if os.path.exists(target):
        return target
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(target):
            partial = f"{target}.{os.getpid()}.tmp"
            _compile(partial)
            os.replace(partial, target)
    return target


def _compile(out: str) -> None:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    cmd = [
        os.environ.get("CXX", "g++"),
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DTORCH_EXTENSION_NAME={_MODULE}",
        *[f"-I{d}" for d in cpp_extension.include_paths()],
        f"-I{sysconfig.get_paths()['include']}",
        _SOURCE,
        "-o",
        out,
        *[f"-L{d}" for d in libs],
        *[f"-Wl,-rpath,{d}" for d in libs],
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]
    print(f"weft: building its torch backend for torch {torch.__version__} (once; cached in {os.path.dirname(out)})", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {_SOURCE} failed: {r.stderr.strip()[-2000:]}")


def _import(path: str):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, path)
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
