"""Optional CLBlast (a maintained, tuned OpenCL BLAS: Debian's libclblast1, or pyclblast's library) for the
forward matmul, opt-in with ``LLMC_OPENCL_BLAS=clblast``.

Measured on PoCL (2-core Xeon, CLBlast 1.5.3 from Debian): 4-5 GFLOP/s against 35-41 GFLOP/s for llmc's own
direct SGEMM, and a 36 s first-call compile, so it is off by default; on GPUs it is worth comparing
(backends/opencl/bench/opencl_gpu.sh). Called through ctypes on the raw cl_mem / cl_command_queue handles of PyOpenCL's objects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_ROW_MAJOR, _NO, _YES = 101, 111, 112


class CLBlast:
    def __init__(self, lib, be):
        self.lib, self.be = lib, be
        self.version = "(libclblast via ctypes)"
        f = lib.CLBlastSgemm
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int] * 3 + [ctypes.c_size_t] * 3
                      + [ctypes.c_float, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_float,
                         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p])
        self._sgemm = f
        self._q = ctypes.c_void_p(be.queue.int_ptr)

    def matmul_forward(self, target, inp, weight, N, OC, C) -> bool:
        """target (N,OC) = inp (N,C) @ weight (OC,C)^T; False when CLBlast refused (the caller falls back)."""
        st = self._sgemm(_ROW_MAJOR, _NO, _YES, N, OC, C, 1.0,
                         inp.base_data.int_ptr, inp.offset // 4, C,
                         weight.base_data.int_ptr, weight.offset // 4, C, 0.0,
                         target.base_data.int_ptr, target.offset // 4, OC, ctypes.byref(self._q), None)
        return st == 0


def maybe_load(be, choice: str | None = None):
    """CLBlast when chosen (the backend option blas=clblast, else LLMC_OPENCL_BLAS) and its library loads."""
    if (choice or os.environ.get("LLMC_OPENCL_BLAS", "")).lower() != "clblast":
        return None
    name = ctypes.util.find_library("clblast") or "libclblast.so.1"
    try:
        return CLBlast(ctypes.CDLL(name), be)
    except OSError:
        return None
