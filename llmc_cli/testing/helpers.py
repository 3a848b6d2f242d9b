"""Device and tolerance helpers for kernel tests (no torch here): moving data to and from a backend, poisoning
outputs, comparing with a relative bound fit for the dtype, bfloat16 rounding on the host."""

from __future__ import annotations

import math

import numpy as np

from llmc_cli.kernels import BFLOAT16, FLOAT32, INT32, TF32, Backend

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


TOLERANCES = {
    FLOAT32: {"elementwise": 1e-5, "reduction": 1e-4},
    BFLOAT16: {"elementwise": 1e-2, "reduction": 2e-2},
}
# FP8 matmuls (relative Frobenius error): e4m3 keeps 3 mantissa bits (rounding error up to 2^-4, RMS about 3.6 % for
# values spread over a binade), e5m2 2 bits (2^-3, about 7.2 %); a product of two rounded operands carries both.
FP8_TOL = {"forward": 0.08, "backward": 0.12}


# a float32 backend whose matmuls run on TF32 tensor cores (matmul_dtype TF32): operands rounded to 10 mantissa
# bits (relative error up to 2^-11 each), accumulated in float32
TF32_TOL = 2e-3


def tol(backend: Backend, kind: str = "elementwise") -> float:
    """The bound for `kind` ("elementwise", "reduction", or "matmul": a product's outputs) on this backend."""
    if kind == "matmul":
        return TF32_TOL if getattr(backend, "matmul_dtype", None) == TF32 else TOLERANCES[backend.dtype]["reduction"]
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


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    """Random normal values with no exact zeros."""
    x = rng.standard_normal(shape) * scale + shift
    x[x == 0] = 0.5
    return x


def prefill(backend: Backend, rng: np.random.Generator, shape, scale: float = 1.0):
    """An accumulated-into buffer pre-filled with random values: (buffer, values held)."""
    return to_device(backend, randn(rng, *shape, scale=scale))


def check_accumulated(backend: Backend, buf, before: np.ndarray, delta_ref: np.ndarray, rtol: float, what: str) -> None:
    """buf must now hold before + delta_ref: compare the delta so errors in it are not masked."""
    got = from_device(backend, buf)
    assert_close(got - before, delta_ref, rtol, what + " (accumulated delta)")
