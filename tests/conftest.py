"""Shared fixtures and helpers for llmc's tests.

`backend` is parametrised over every backend installed through the entry-point group ``llmc.backends``
(`llmc_cli.registry.discover()`), so a new plugin (OpenCL, CUDA, a third party's) is tested as soon as it is
installed. A backend that is installed but cannot run here is reported as a skip with its reason, never
silently dropped.

Helpers (import them with ``from conftest import ...``):

* `to_device(backend, host, dtype=None)` -> (buffer, the values as the backend actually holds them, float64)
* `from_device(backend, buf)` -> float64 host copy
* `empty(backend, shape, dtype=None)` -> a freshly allocated buffer, poisoned
* `poison(backend, *bufs)` fills outputs with NaN so elements a kernel forgets to write are caught
* `assert_close(got, ref, rtol)`: ||got - ref|| / ||ref|| <= rtol, and no NaN / inf left in `got`
* `tol(backend, kind)`: the relative tolerance for "elementwise" or "reduction" kernels at the backend's dtype
* `bf16_round(x)`: float32 -> nearest bfloat16 (ties to even), returned as float32
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmc_cli import registry
from llmc_cli.kernels import (
    BFLOAT16,
    CAP_BF16,
    FLOAT32,
    INT32,
    Backend,
    BackendUnavailable,
)

# ---------------------------------------------------------------------------------------------------------------
# backend discovery

_DISCOVERED: list[registry.PluginInfo] | None = None
_CREATED: dict[tuple[str, str | None], object] = {}  # (name, dtype) -> backend, skip reason, or exception


def _discovered() -> list[registry.PluginInfo]:
    global _DISCOVERED
    if _DISCOVERED is None:
        _DISCOVERED = registry.discover()
    return _DISCOVERED


def _info(name: str) -> registry.PluginInfo:
    for p in _discovered():
        if p.name == name:
            return p
    pytest.skip(f"backend '{name}' is not installed (entry-point group {registry.GROUP})")


def make_backend(name: str, dtype: str | None = None) -> Backend:
    """The installed backend `name` in `dtype` (None = its default), created once per session; skips the
    calling test with the plugin's own reason when it cannot run here."""
    key = (name, dtype)
    if key not in _CREATED:
        info = _info(name)
        if info.plugin is None or not info.usable:
            _CREATED[key] = f"backend '{name}' ({info.distribution}) is installed but not usable here: {info.reason}"
        else:
            try:
                _CREATED[key] = info.plugin.create(dtype=dtype)
            except BackendUnavailable as e:
                _CREATED[key] = f"backend '{name}' could not be created (dtype={dtype}): {e}"
            except Exception as e:  # a usable backend that fails to start is an error, reported once in full
                _CREATED[key] = e
                raise
    b = _CREATED[key]
    if isinstance(b, str):
        pytest.skip(b)
    if isinstance(b, Exception):
        pytest.fail(f"creating backend '{name}' (dtype={dtype}) raised {type(b).__name__}: {b}", pytrace=False)
    return b


BACKEND_MARKERS = ("cpu", "opencl", "cuda")  # pytest markers (pyproject.toml): a test that needs that backend


def unusable_reason(name: str) -> str | None:
    """Why the backend `name` cannot run here (not installed, or its plugin's own probe line), else None."""
    info = next((p for p in _discovered() if p.name == name), None)
    if info is None:
        return f"backend '{name}' is not installed (entry-point group {registry.GROUP})"
    if info.plugin is None or not info.usable:
        return f"backend '{name}' ({info.distribution}) is installed but not usable here: {info.reason}"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests run over the `backend` fixture carry their backend's marker, so `-m opencl` selects them too."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend_name") in BACKEND_MARKERS:
            item.add_marker(getattr(pytest.mark, params["backend_name"]))


def pytest_runtest_setup(item):
    """A test marked with a backend that cannot run here skips with that backend's reason, never fails."""
    for name in BACKEND_MARKERS:
        if item.get_closest_marker(name) is not None and (why := unusable_reason(name)):
            pytest.skip(why)


def _backend_names() -> list:
    names = [p.name for p in _discovered()]
    if not names:  # still collect one (skipped) case so the absence is visible
        return [pytest.param(None, id="no-backend")]
    return names


@pytest.fixture(scope="session", params=_backend_names())
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
def cpu() -> Backend:
    """The reference numpy backend."""
    return make_backend("cpu", None)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy generator seeded from the test's id, so every test is reproducible on its own."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ---------------------------------------------------------------------------------------------------------------
# moving data

POISON = {FLOAT32: math.nan, BFLOAT16: math.nan, INT32: -2_000_000_011}


def _dtype_of(backend: Backend, host: np.ndarray, dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    return INT32 if np.issubdtype(np.asarray(host).dtype, np.integer) else backend.dtype


def empty(backend: Backend, shape, dtype: str | None = None, tag: str = "test"):
    """A new buffer of `shape` (dtype None = the backend's compute dtype), poisoned."""
    dtype = dtype or backend.dtype
    buf = backend.alloc(shape, dtype, tag=tag)
    backend.fill(buf, POISON[dtype])
    return buf


def to_device(backend: Backend, host, dtype: str | None = None, tag: str = "test"):
    """Upload `host` into a new buffer (float -> the backend's compute dtype unless `dtype`, ints -> int32).
    Returns (buffer, float64/int64 copy of what the backend actually holds), so references are computed from
    the exact (possibly bf16-rounded) inputs."""
    host = np.asarray(host)
    dt = _dtype_of(backend, host, dtype)
    buf = backend.alloc(host.shape, dt, tag=tag)
    backend.upload(buf, host.astype(np.int32 if dt == INT32 else np.float32))
    return buf, from_device(backend, buf)


def from_device(backend: Backend, buf) -> np.ndarray:
    backend.synchronize()
    a = np.asarray(backend.download(buf))
    return a.astype(np.int64 if np.issubdtype(a.dtype, np.integer) else np.float64)


def poison(backend: Backend, *bufs) -> None:
    """Fill output buffers with NaN (a sentinel for int32) before a kernel writes them."""
    for b in bufs:
        backend.fill(b, POISON[INT32] if _is_int32(b) else math.nan)


def _is_int32(buf) -> bool:
    try:
        return np.dtype(buf.dtype) == np.int32
    except TypeError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# comparing

TOLERANCES = {
    FLOAT32: {"elementwise": 1e-5, "reduction": 1e-4},
    BFLOAT16: {"elementwise": 1e-2, "reduction": 2e-2},
}


def tol(backend: Backend, kind: str = "elementwise") -> float:
    return TOLERANCES[backend.dtype][kind]


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((got - ref).ravel())
    return float(num / den) if den > 0 else float(num)


def assert_close(got, ref, rtol: float, what: str = "") -> None:
    """||got - ref|| / ||ref|| <= rtol, and every element of `got` finite (poisoned elements left unwritten
    show up as NaN)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    label = f"{what}: " if what else ""
    assert got.shape == ref.shape or got.size == ref.size, f"{label}shape {got.shape} != {ref.shape}"
    got = got.reshape(ref.shape)
    bad = ~np.isfinite(got)
    if bad.any():
        idx = np.argwhere(bad)
        raise AssertionError(f"{label}{int(bad.sum())} of {got.size} elements not finite (unwritten?), "
                             f"first at {tuple(idx[0])}")
    e = rel_err(got, ref)
    if not e <= rtol:
        i = np.unravel_index(np.argmax(np.abs(got - ref)), ref.shape)
        raise AssertionError(f"{label}relative error {e:.3e} > {rtol:.1e} (worst at {i}: got {got[i]!r}, "
                             f"expected {ref[i]!r})")


# ---------------------------------------------------------------------------------------------------------------
# bfloat16 on the host

def bf16_round(x) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32. NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    out = b.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


def bf16_neighbours(x) -> tuple[np.ndarray, np.ndarray]:
    """The two bfloat16 values around float32 `x`: (toward zero, away from zero); equal where x is one."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32)
    lo = (b & np.uint32(0xFFFF0000))
    exact = (b & np.uint32(0xFFFF)) == 0
    hi = np.where(exact, lo, lo + np.uint32(0x10000)).astype(np.uint32)
    return lo.view(np.float32), hi.view(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# the command line on a tiny GPT-2 (tests of train / eval / sample / convert / faults)

TINY = ["train", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "-b", "2", "-t", "32", "--val-every", "0",
        "--sample-every", "0"]


def phrase_tokens(repeats: int, seed: int = 0, vocab: int = 50257) -> np.ndarray:
    """A 40-token random phrase rolled `repeats` times: a little structure, so a tiny model's loss can fall."""
    phrase = np.random.default_rng(seed).integers(0, vocab, 40)
    return np.concatenate([np.roll(phrase, k) for k in range(repeats)])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder with tiny_val_000000.bin (2,000 tokens) and tiny_train_000001.bin (4,800 tokens)."""
    from llmc_cli.formats.shards import write_shard
    d = tmp_path_factory.mktemp("data")
    tokens = phrase_tokens(120)
    write_shard(d / "tiny_val_000000.bin", tokens[:2000])
    write_shard(d / "tiny_train_000001.bin", tokens)
    return d


def run(*args, ok: bool = True):
    """`llmc ARGS` in-process through click's runner; raises with the output unless it exits 0 (or ok=False)."""
    from click.testing import CliRunner

    from llmc_cli.commands import main
    r = CliRunner().invoke(main, [str(a) for a in args])
    if ok and r.exit_code != 0:
        raise AssertionError(f"exit {r.exit_code}: {r.output}\n{r.exception!r}")
    return r


def losses(log) -> list[float]:
    """The training losses of a --log JSONL file, in order."""
    import json
    return [json.loads(line)["loss"] for line in open(log) if "loss" in json.loads(line)]


def rewind_run(run_dir, died_after: int, dropped: int, log=None) -> None:
    """Make a run directory look as if the run died after its step `died_after` checkpoint: the later checkpoint
    step_`dropped` is gone and `latest` points back; with `log`, that JSONL log ends at step `died_after` too."""
    import shutil
    from pathlib import Path
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / f"step_{dropped:08d}")
    (run_dir / "latest").write_text(f"step_{died_after:08d}\n")
    if log is not None:
        lines = Path(log).read_text().splitlines()[:died_after]
        Path(log).write_text("\n".join(lines) + "\n")
