"""How a program gets a weft group: torchrun with no import (the entry
point), init methods, explicit stores, device specs, backend options."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from harness import free_port, run, weft_backend

import weft

# A program that never imports weft: the entry point registers it.
PROGRAM = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    assert "weft" not in sys.modules
    dist.init_process_group("weft")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0, 3.0], t
    assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__module__ == "weft._backend"
    dist.destroy_process_group()
    print("rank", dist.get_rank() if dist.is_initialized() else "ok", "done")
    """
)


def test_torchrun_without_importing_weft(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("done") == 2, out.stdout


def init_method(rank, world, how, where):
    if how == "tcp":
        dist.init_process_group("weft", init_method=f"tcp://127.0.0.1:{where}", rank=rank, world_size=world)
    elif how == "file":
        dist.init_process_group("weft", init_method=f"file://{where}", rank=rank, world_size=world)
    elif how == "store":
        store = dist.FileStore(where, world)
        dist.init_process_group("weft", store=store, rank=rank, world_size=world)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist()


@pytest.mark.parametrize("how", ["tcp", "file", "store"])
def test_init_methods(how, tmp_path):
    where = free_port() if how == "tcp" else str(tmp_path / "rendezvous")
    assert run(init_method, 2, how, where, init=False) == [[2.0] * 4] * 2


def device_spec(rank, world, spec):
    dist.init_process_group(spec)
    t = torch.ones(5)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    done = w.is_completed()
    group = type(dist.group.WORLD).__module__ + "." + type(dist.group.WORLD).__name__
    backend = type(weft_backend())
    types = sorted(d.type for d in dist.group.WORLD._device_types)
    dist.destroy_process_group()
    return t[0].item(), done, group, backend.__name__, [b.__module__ for b in backend.__mro__], types


def test_device_specs():
    """Where weft serves every device it is the whole group (its ops skip
    torch's dispatcher), with its Backend (over weft's C++ backend)
    registered for each device weft serves (CPU always); in a mixed spec,
    and for every spec with WEFT_TORCH_HOOKS=1, torch's own group holds
    weft's Backend, and its Works are whole (``is_completed()``)."""
    torch_group = "torch.distributed.distributed_c10d.ProcessGroup"
    for spec, env, group_type in (
        ("weft", {}, "weft._backend.ProcessGroup"),
        ("cpu:weft", {}, "weft._backend.ProcessGroup"),
        ("cpu:weft,cuda:gloo", {}, torch_group),
        ("weft", {"WEFT_TORCH_HOOKS": "1"}, torch_group),
    ):
        value, done, group, backend, bases, types = run(device_spec, 2, spec, init=False, env=env)[0]
        assert (value, done, group, backend) == (2.0, True, group_type, "Backend"), (spec, env, group)
        assert "_weft_c10d" in bases and "cpu" in types, (spec, bases, types)


def test_device_specs_on_the_python_api():
    """Without the C++ backend (``WEFT_TORCH_CPP=0``: no compiler) the
    shapes are the same, but in a mixed spec torch wraps the Python
    Backend's Works, forwarding only wait() and get_future()."""
    env = {"WEFT_TORCH_CPP": "0"}
    for spec in ("cpu:weft", "cuda:weft"):
        value, done, group, backend, bases, types = run(device_spec, 2, spec, init=False, env=env)[0]
        assert (value, done, group, backend) == (2.0, True, "weft._backend.ProcessGroup", "Backend") and "cpu" in types
        assert "_weft_c10d" not in bases
    value, done, group, backend, bases, types = run(device_spec, 2, "cpu:weft,cuda:gloo", init=False, env=env)[0]
    assert (value, backend) == (2.0, "Backend") and group.endswith("ProcessGroup") and not group.startswith("weft")
    assert not done, "torch's wrapper of a Python backend's Work forwards only wait() and get_future()"


def options(rank, world):
    dist.init_process_group("weft", pg_options=weft.Options(backend="cpu-tcp", hints={"algorithm": "all_reduce=ring"}))
    name = weft_backend().weft_backend_name()
    sub = dist.new_group([0, 1], backend="weft", pg_options=weft.Options(backend="shm"))
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    sub_name = weft_backend(sub).weft_backend_name()
    dist.destroy_process_group()
    return name, sub_name, t.tolist()


def test_backend_options_pick_the_inner_backend_per_group():
    assert run(options, 2, init=False) == [("cpu-tcp", "shm", [2.0, 2.0])] * 2


def test_a_bad_timeout_is_refused_as_weft_refuses_it():
    """WEFT_TIMEOUT_SECONDS goes through weft's one parser: 0, a negative
    number or text is a ValueError naming it (as for Rust programs and
    weft.new_comm), not a timeout of 1 ms."""
    for value in ("0", "-1", "soon"):
        out = run(lambda r, w: dist.init_process_group("weft"), 2, init=False, env={"WEFT_TIMEOUT_SECONDS": value}, allow_fail=True)
        for kind, text in out:
            assert kind == "err" and "ValueError" in text and "WEFT_TIMEOUT_SECONDS" in text, (value, text)


def test_an_unknown_inner_backend_fails_setup_clearly():
    out = run(lambda r, w: dist.init_process_group("weft"), 2, init=False, env={"WEFT_BACKEND": "no-such-backend"}, allow_fail=True)
    for kind, text in out:
        assert kind == "err" and "no-such-backend" in text, text


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plugin_all_reduce(rank, world):
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    outs = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    return weft_backend().weft_backend_name(), t[0].item(), [o[0].item() for o in outs]


def test_a_plugin_from_weft_plugin_path(tmp_path):
    """The C example plugin, loaded through WEFT_PLUGIN_PATH as in Rust."""
    lib = tmp_path / "libweft-backend-c-uds.so"
    src = os.path.join(REPO, "examples", "plugins", "c-uds", "weft_uds.c")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I", os.path.join(REPO, "core", "include"), "-o", str(lib), src], check=True)
    out = run(plugin_all_reduce, 2, env={"WEFT_PLUGIN_PATH": str(lib), "WEFT_BACKEND": "c-uds"})
    assert out == [("c-uds", 3.0, [0.0, 1.0])] * 2
