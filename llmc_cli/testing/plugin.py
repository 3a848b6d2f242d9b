"""The kit's pytest fixtures and hooks: `backend` runs a test once per chosen backend (testing.backends),
`bf16_backend` the same backend computing in bfloat16, `fp8_backend` it with FP8 matmuls, `kv_backend` it where it can
decode over a key/value cache, `rng` a generator seeded from the test's id. A test
carrying a backend's marker (cpu, opencl, cuda, or the backend's own name) skips with that backend's reason
where it cannot run. Load it with ``from llmc_cli.testing.plugin import *`` in a conftest.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from llmc_cli.kernels import BFLOAT16, CAP_BF16, CAP_KV_CACHE, FP8, Backend
from llmc_cli.testing.backends import backend_names, make_backend, requested_problems, unusable_reason

BACKEND_MARKERS = ("cpu", "opencl", "cuda")  # pytest markers: a test that needs that backend

__all__ = ["pytest_configure", "pytest_collection_modifyitems", "pytest_runtest_setup", "backend_name", "backend",
           "bf16_backend", "fp8_backend", "kv_backend", "cpu", "rng"]


def pytest_configure(config):
    for name in BACKEND_MARKERS:
        config.addinivalue_line("markers", f"{name}: needs the {name} backend (skipped with its reason elsewhere)")


def pytest_collection_modifyitems(config, items):
    """Tests run over the `backend` fixture carry their backend's marker, so `-m opencl` selects them too. A
    backend asked for by name (LLMC_TEST_BACKENDS, LLMC_TEST_PLUGIN) that is missing or breaks the contract ends
    the run here with one line per backend (pytest's usage error, exit status 4): its cases skipped one by one
    would pass for a green run."""
    kit = any("backend_name" in getattr(item, "fixturenames", ()) for item in items)
    if kit and (problems := requested_problems()):
        raise pytest.UsageError("the conformance kit cannot test what was asked for:\n  " + "\n  ".join(problems))
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend_name") in BACKEND_MARKERS:
            item.add_marker(getattr(pytest.mark, params["backend_name"]))


def pytest_runtest_setup(item):
    """A test marked with a backend that cannot run here skips with that backend's reason, never fails."""
    for name in BACKEND_MARKERS:
        if item.get_closest_marker(name) is not None and (why := unusable_reason(name)):
            pytest.skip(why)


@pytest.fixture(scope="session", params=backend_names())
def backend_name(request) -> str:
    if request.param is None:
        pytest.skip("no backend is installed in the entry-point group llmc.backends")
    return request.param


@pytest.fixture(scope="session")
def backend(backend_name) -> Backend:
    """Every installed backend, created with its default dtype (ids = backend name)."""
    return make_backend(backend_name, None)


@pytest.fixture(scope="session")
def bf16_backend(backend_name, backend) -> Backend:
    """The same backend computing in bfloat16 (skipped where it has no bf16 capability)."""
    if backend.dtype == BFLOAT16:
        return backend
    if CAP_BF16 not in backend.capabilities:
        pytest.skip(f"backend '{backend_name}' does not announce the bf16 capability")
    return make_backend(backend_name, BFLOAT16)


@pytest.fixture(scope="session")
def fp8_backend(backend_name, backend) -> Backend:
    """The same backend created with dtype=FP8 (bf16 buffers, FP8 matmuls); skipped, with the plugin's reason,
    where it refuses FP8 (every backend but one on a GPU with FP8 tensor cores)."""
    return make_backend(backend_name, FP8)


@pytest.fixture(scope="session")
def kv_backend(backend_name, backend) -> Backend:
    """The backend, where it announces the optional KV-cache capability (attention_decode); skipped elsewhere."""
    if CAP_KV_CACHE not in backend.capabilities:
        pytest.skip(f"backend '{backend_name}' does not announce the {CAP_KV_CACHE} capability")
    return backend


@pytest.fixture(scope="session")
def cpu() -> Backend:
    """The reference numpy backend."""
    return make_backend("cpu", None)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy generator seeded from the test's id, so every test is reproducible on its own."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
