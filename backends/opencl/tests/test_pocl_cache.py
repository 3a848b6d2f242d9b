"""PoCL's cache folder: one it cannot make (a HOME that is a file, a read-only HOME) makes PoCL list its platform
with no device, silently; the backend names the folder and what to set, not a driver to install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmc_opencl import probe


@pytest.fixture
def no_cache_vars(monkeypatch):
    for name in ("POCL_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, folder", [
    ({"POCL_CACHE_DIR": "/p", "XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/p"),
    ({"POCL_CACHE_DIR": "", "XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/pocl/kcache"),
    ({"XDG_CACHE_HOME": "", "HOME": "/h"}, "/h/.cache/pocl/kcache"),
    ({}, None),
])
def test_the_cache_folder_is_the_one_pocl_makes(no_cache_vars, env, folder):
    for name, value in env.items():
        no_cache_vars.setenv(name, value)
    assert probe.pocl_cache_dir() == (None if folder is None else probe.Path(folder))


def test_a_cache_folder_under_a_file_is_named_with_what_to_set(no_cache_vars, tmp_path):
    (tmp_path / "home").write_text("a file where HOME belongs\n")
    no_cache_vars.setenv("HOME", str(tmp_path / "home"))
    why = probe.pocl_cache_problem()
    assert why == (f"PoCL cannot make its cache folder {tmp_path}/home/.cache/pocl/kcache ({tmp_path}/home is not a "
                   "folder); set POCL_CACHE_DIR to a writable folder, or fix HOME or XDG_CACHE_HOME")
    platform = type("Platform", (), {"name": "Portable Computing Language"})()
    assert probe.no_device_reason([platform]) == why
    assert probe.no_device_reason([type("Platform", (), {"name": "NVIDIA CUDA"})()]) == probe.NO_DEVICE


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")
def test_a_read_only_home_is_named(no_cache_vars, tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    no_cache_vars.setenv("HOME", str(home))
    assert f"({home} is not writable)" in probe.pocl_cache_problem()


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: None])
def test_a_folder_that_can_be_made_is_no_problem(no_cache_vars, tmp_path, make):
    make(tmp_path / "cache")
    no_cache_vars.setenv("POCL_CACHE_DIR", str(tmp_path / "cache" / "deeper"))
    assert probe.pocl_cache_problem() is None


def test_pocl_with_a_home_that_is_a_file_is_said_so(tmp_path):
    """The real thing, in a fresh process (PoCL reads its environment once): the plugin's reason names the cache."""
    if probe.pocl_cache_dir() is None:
        pytest.skip("no HOME to move")
    listed = subprocess.run([sys.executable, "-c", "import pyopencl as cl; print(any('Portable' in p.name for p in "
                             "cl.get_platforms()))"], capture_output=True, text=True)
    if listed.stdout.strip() != "True":
        pytest.skip(f"no PoCL platform here: {listed.stdout.strip() or listed.stderr.strip()[-200:]}")
    (tmp_path / "home").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("POCL_CACHE_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-c", "import llmc_opencl; print(llmc_opencl.OpenCLPlugin().probe())"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert "PoCL cannot make its cache folder" in r.stdout and "install a driver" not in r.stdout, r.stdout + r.stderr
