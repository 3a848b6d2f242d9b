"""The OpenCL side of `llmc bench overlap` (CAP_COPY_OVERLAP): "pinned" host arrays are CL_MEM_ALLOC_HOST_PTR
buffers mapped into the host (what the vendors' guides recommend for fast transfers), and the layernorm forward
with its copies runs either in order on the backend's queue or in chunks, each chunk's copy in, kernel and copies
out on its own in-order command queue. The kernels are in overlap.cl."""

from __future__ import annotations

import time

import numpy as np
import pyopencl as cl

from llmc_cli.kernels import OVERLAP_CHUNKED, OVERLAP_SYNC

from .programs import bo as _bo
from .programs import build_program


class Overlap:
    """The experiment on one backend: its command queues, made once."""

    def __init__(self, backend):
        self.backend = backend
        self._queues: list = []

    def host_alloc(self, shape, pinned: bool) -> np.ndarray:
        if not pinned:
            return np.empty(shape, np.float32)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = max(4, 4 * int(np.prod(shape)))
        buf = cl.Buffer(self.backend.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, nbytes)
        # the mapped array keeps its mapping, and the mapping its buffer, alive; unmapped when it is collected
        arr, _ = cl.enqueue_map_buffer(self.backend.queue, buf, cl.map_flags.READ | cl.map_flags.WRITE, 0, shape,
                                       np.float32, is_blocking=True)
        return arr

    def queues(self, n: int) -> list:
        while len(self._queues) < n:
            self._queues.append(cl.CommandQueue(self.backend.ctx))
        return self._queues[:n]

    def layernorm(self, out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias, *, mode: str,
                  streams: int, block: int) -> float:
        C = inp.shape[-1]
        N = inp.size // C
        for name, a, n in (("out", out, N * C), ("mean", mean, N), ("rstd", rstd, N), ("inp", inp, N * C),
                           ("d_out", d_out, N * C), ("d_mean", d_mean, N), ("d_rstd", d_rstd, N),
                           ("d_inp", d_inp, N * C), ("d_weight", d_weight, C), ("d_bias", d_bias, C)):
            if a.dtype != np.float32 or a.size != n or not a.flags.c_contiguous:
                raise ValueError(f"overlap_layernorm: {name} must be {n} contiguous float32 (got {a.size} {a.dtype})")
        limit = self.backend.device.max_work_group_size
        if not (32 <= block <= min(1024, limit) and block & (block - 1) == 0):
            raise ValueError(f"overlap_layernorm: block {block} is not a power of two in 32..{min(1024, limit)} "
                             "(this device's work-group limit)")
        if mode == OVERLAP_SYNC:
            qs, rows_per_group = [self.backend.queue], block // 32
            _, ks = build_program(self.backend.ctx, "overlap.cl", f"-DLS={block}")
            kern = ks["overlap_layernorm_rows"]
        elif mode == OVERLAP_CHUNKED:
            if not 1 <= streams <= N:
                raise ValueError(f"overlap_layernorm: {streams} queues for {N} rows")
            qs, rows_per_group = self.queues(streams), block
            _, ks = build_program(self.backend.ctx, "overlap.cl")
            kern = ks["overlap_layernorm_naive"]
        else:
            raise ValueError(f"overlap_layernorm: unknown mode {mode!r}")
        chunks = [(i * N // len(qs), (i + 1) * N // len(qs)) for i in range(len(qs))]
        (bo, oo), (bm, mo), (br, ro), (bi, io) = (_bo(d) for d in (d_out, d_mean, d_rstd, d_inp))
        self.backend.synchronize()  # the poison the bench filled in lands before the clock starts
        t0 = time.perf_counter()
        # breadth first, as the CUDA backend: every chunk's copy in, every kernel, every copy out; each queue is
        # flushed after each round, so the device starts on it while the host queues the next
        for q, (a, b) in zip(qs, chunks):
            cl.enqueue_copy(q, bi, inp[a:b], dst_offset=4 * (io + a * C), is_blocking=False)
            q.flush()
        for q, (a, b) in zip(qs, chunks):
            groups = (b - a + rows_per_group - 1) // rows_per_group
            kern(q, (groups * block,), (block,), bo, oo + a * C, bm, mo + a, br, ro + a, bi, io + a * C,
                 *_bo(d_weight), *_bo(d_bias), b - a, C)
            q.flush()
        for q, (a, b) in zip(qs, chunks):
            cl.enqueue_copy(q, out[a:b], bo, src_offset=4 * (oo + a * C), is_blocking=False)
            cl.enqueue_copy(q, mean[a:b], bm, src_offset=4 * (mo + a), is_blocking=False)
            cl.enqueue_copy(q, rstd[a:b], br, src_offset=4 * (ro + a), is_blocking=False)
            q.flush()
        for q in qs:
            q.finish()
        return time.perf_counter() - t0
