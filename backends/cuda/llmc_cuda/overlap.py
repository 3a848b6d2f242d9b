"""The CUDA side of `llmc bench overlap` (CAP_COPY_OVERLAP): pinned host arrays, and a float32 layernorm forward
timed with its copies, either in order on the backend's stream (the warp-per-row kernel) or in chunks, each
chunk's copy in, kernel (the naive thread-per-row one) and copies out on its own stream. The kernels are in
overlap.cu, compiled on first use."""

from __future__ import annotations

import time
from pathlib import Path

import cupy as cp
import cupyx
import numpy as np

from llmc_cli.kernels import OVERLAP_CHUNKED, OVERLAP_SYNC

OVERLAP_SOURCE = Path(__file__).with_name("overlap.cu")


def host_alloc(shape, pinned: bool) -> np.ndarray:
    """float32 host memory: page-locked through CuPy's pinned pool (the copy engines reach it by DMA), or numpy's."""
    return cupyx.empty_pinned(shape, np.float32) if pinned else np.empty(shape, np.float32)


def _ptr(d: cp.ndarray, elements: int) -> np.uint64:
    return np.uint64(d.data.ptr + 4 * elements)


class Overlap:
    """The experiment on one backend: its compiled kernels and the streams of the chunked mode, made once."""

    def __init__(self, backend):
        self.backend = backend
        self._kernels: dict[str, object] = {}
        self._streams: list[cp.cuda.Stream] = []

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            with self.backend.device:
                m = cp.RawModule(code=OVERLAP_SOURCE.read_text(), options=("--std=c++17",))
                for n in ("overlap_layernorm_naive", "overlap_layernorm_warp"):
                    self._kernels[n] = m.get_function(n)
            k = self._kernels[name]
        return k

    def streams(self, n: int) -> list[cp.cuda.Stream]:
        while len(self._streams) < n:
            self._streams.append(cp.cuda.Stream(non_blocking=True))
        return self._streams[:n]

    def layernorm(self, out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias, *, mode: str,
                  streams: int, block: int) -> float:
        C = inp.shape[-1]
        N = inp.size // C
        for name, a, n in (("out", out, N * C), ("mean", mean, N), ("rstd", rstd, N), ("inp", inp, N * C)):
            if a.dtype != np.float32 or a.size != n or not a.flags.c_contiguous:
                raise ValueError(f"overlap_layernorm: host {name} must be {n} contiguous float32 (got {a.size} "
                                 f"{a.dtype})")
        for name, d, n in (("d_out", d_out, N * C), ("d_mean", d_mean, N), ("d_rstd", d_rstd, N),
                           ("d_inp", d_inp, N * C), ("d_weight", d_weight, C), ("d_bias", d_bias, C)):
            if d.dtype != np.float32 or d.size != n or not d.flags.c_contiguous:
                raise ValueError(f"overlap_layernorm: {name} must be {n} contiguous float32 on the device (got "
                                 f"{d.size} {d.dtype})")
        if not (32 <= block <= 1024 and block & (block - 1) == 0):
            raise ValueError(f"overlap_layernorm: block {block} is not a power of two in 32..1024")
        if mode == OVERLAP_SYNC:
            ss, kern, rows_per_block = [self.backend.stream], self.kernel("overlap_layernorm_warp"), block // 32
        elif mode == OVERLAP_CHUNKED:
            if not 1 <= streams <= N:
                raise ValueError(f"overlap_layernorm: {streams} streams for {N} rows")
            ss, kern, rows_per_block = self.streams(streams), self.kernel("overlap_layernorm_naive"), block
        else:
            raise ValueError(f"overlap_layernorm: unknown mode {mode!r}")
        chunks = [(i * N // len(ss), (i + 1) * N // len(ss)) for i in range(len(ss))]
        hp = {name: a.ctypes.data for name, a in (("out", out), ("mean", mean), ("rstd", rstd), ("inp", inp))}
        self.backend.synchronize()  # the poison the bench filled in lands before the clock starts
        t0 = time.perf_counter()
        # breadth first: every chunk's copy in, then every kernel, then every copy out (each stream still runs its
        # own in order). A copy to pageable memory holds the host until it is done, so issued chunk by chunk it
        # would keep the next chunks' copies in and kernels from being queued behind it
        for s, (a, b) in zip(ss, chunks):
            (d_inp.data + 4 * a * C).copy_from_host_async(hp["inp"] + 4 * a * C, 4 * (b - a) * C, s)
        for s, (a, b) in zip(ss, chunks):
            with s:
                kern(((b - a + rows_per_block - 1) // rows_per_block,), (block,),
                     (_ptr(d_out, a * C), _ptr(d_mean, a), _ptr(d_rstd, a), _ptr(d_inp, a * C), d_weight, d_bias,
                      np.int32(b - a), np.int32(C)))
        for s, (a, b) in zip(ss, chunks):
            (d_out.data + 4 * a * C).copy_to_host_async(hp["out"] + 4 * a * C, 4 * (b - a) * C, s)
            (d_mean.data + 4 * a).copy_to_host_async(hp["mean"] + 4 * a, 4 * (b - a), s)
            (d_rstd.data + 4 * a).copy_to_host_async(hp["rstd"] + 4 * a, 4 * (b - a), s)
        for s in ss:
            s.synchronize()
        return time.perf_counter() - t0
