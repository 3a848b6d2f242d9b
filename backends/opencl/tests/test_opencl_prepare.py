"""`llmc backends --prepare` for OpenCL (llmc_opencl.prepare), and `--backend auto` on an OpenCL CPU device: after
prepare, a first training run and a first sample compile nothing (PoCL's kernel cache gains no entry); on a CPU
device auto takes the cpu backend, measured faster on the same cores (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from llmc_cli.formats.shards import write_shard

llmc_opencl = pytest.importorskip("llmc_opencl", reason="llmc-opencl is not installed")
cl = pytest.importorskip("pyopencl")
from llmc_cpu import CpuPlugin  # noqa: E402


def _fake_device(kind):
    dev = types.SimpleNamespace(type=kind, name="fake device ")
    return (0, 0, types.SimpleNamespace(name="fake platform "), dev)


@pytest.mark.parametrize("kind, above_cpu", [(cl.device_type.CPU, False), (cl.device_type.GPU, True),
                                             (cl.device_type.ACCELERATOR, True)])
def test_auto_prefers_cpu_over_opencl_on_a_cpu_device(monkeypatch, kind, above_cpu):
    d = _fake_device(kind)
    monkeypatch.setattr(llmc_opencl, "_all_devices", lambda: [d])
    monkeypatch.setattr(llmc_opencl, "_why_not", lambda dev: "")
    monkeypatch.setattr(llmc_opencl, "select_device", lambda device: (d[2], d[3]))
    plugin = llmc_opencl.OpenCLPlugin()
    assert plugin.probe() == (True, "fake device on fake platform (1 device(s))")
    assert (plugin.priority > CpuPlugin.priority) == above_cpu


@pytest.mark.opencl
def test_auto_takes_cpu_where_the_opencl_device_is_this_cpu():
    from llmc_cli.registry import discover
    plugin = llmc_opencl.OpenCLPlugin()
    assert plugin.probe()[0]
    _, dev = llmc_opencl.select_device(None)
    if not dev.type & cl.device_type.CPU:
        pytest.skip(f"the OpenCL device is not a CPU ({dev.name.strip()})")
    order = [p.name for p in discover() if p.usable and p.name in ("cpu", "opencl")]
    assert order == ["cpu", "opencl"]


def _kernel_cache(root: Path) -> set[str]:
    """PoCL's cached builds: a program per folder, a folder per kernel and launch geometry under it."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir() and not p.name.startswith("tempfile")}


def _llmc(*args, env) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "llmc_cli", *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.opencl
@pytest.mark.slow
def test_after_prepare_a_first_run_compiles_nothing(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), LLMC_CACHE_DIR=str(tmp_path / "llmc"),
               POCL_CACHE_DIR=str(tmp_path / "pocl"), LLMC_OPENCL_TUNE="off")  # (the tune cache: test_opencl.py)
    out = json.loads(_llmc("backends", "--prepare", "--json", env=env).stdout)
    ocl = next(r for r in out if r["name"] == "opencl")
    assert ocl["prepared"] and ocl["line"].startswith("programs built, SGEMM tuned and every kernel"), ocl
    before = _kernel_cache(tmp_path / "pocl")
    assert len(before) > 20, before  # the programs and their kernels, each at its launch's work-group size
    write_shard(tmp_path / "x_train_000000.bin", np.random.default_rng(0).integers(0, 50257, 5000))
    write_shard(tmp_path / "x_val_000000.bin", np.random.default_rng(1).integers(0, 50257, 2000))
    _llmc("train", "--backend", "opencl", "--model", "d2", "-b", 4, "-t", 64, "--steps", 2, "--val-every", 2,
          "--sample-every", 0, "--data", tmp_path, "--out", tmp_path / "run", env=env)
    _llmc("sample", "--backend", "opencl", "--checkpoint", tmp_path / "run", "--max-new-tokens", 5, env=env)
    assert _kernel_cache(tmp_path / "pocl") - before == set()
