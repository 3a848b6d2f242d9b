"""Matmuls through cuBLASLt, driven with raw device pointers via `nvmath.bindings.cublasLt`.

Row-major (N, C) buffers are column-major (C, N) matrices to cuBLASLt, so every product is written for the
transposed problem (as llm.c does). Descriptors, layouts and the heuristic's algorithm are cached per
(problem, epilogue); a call sets only the pointers (bias, aux) and runs. Epilogues used:

  forward    BIAS (out = x W^T + b), GELU_AUX_BIAS (pre_gelu = x W^T + b, out = gelu(pre_gelu)), GELU_AUX
  backward   DGELU (dinp = (dout W) * gelu'(pre_gelu)), BGRADB (dbias = column sums of dout, from the
             weight-gradient product), dweight accumulated in place with beta = 1.

`plan(...)` returns None when cuBLASLt has no algorithm for a combination; the backend then uses plain
products and its own kernels for the rest.
"""

from __future__ import annotations

import numpy as np

from nvmath.bindings import cublasLt as lt

CUDA_R_32F = 0
CUDA_R_16BF = 14
COMPUTE_32F = 68
OP_N, OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20

_DESC = lt.MatmulDescAttribute
_EPI = lt.Epilogue


def _set(desc, attr, value, dtype):
    buf = np.array([value], dtype=dtype)
    lt.matmul_desc_set_attribute(desc, attr, buf.ctypes.data, buf.nbytes)


def _al(ptr: int) -> int:
    a = 256
    while a > 1 and ptr % a:
        a //= 2
    return a


def _align(a, b, c, d, *extra):
    """Alignments of the A, B, C, D pointers (256 at most); epilogue pointers (bias, aux) lower them all."""
    e = min([_al(x) for x in extra if x] or [256])
    return (min(_al(a), e), min(_al(b), e), min(_al(c), e), min(_al(d), e))


class Plan:
    """One cached cuBLASLt problem: D (m,n) = op(A) (m,k) @ op(B) (k,n) [+ beta C], column-major."""

    def __init__(self, handle, m, n, k, transa, transb, lda, ldb, ldd, dtype, epilogue, aux_ld, bias_dtype,
                 align=(256, 256, 256, 256)):
        self.handle = handle
        self.epilogue = epilogue
        self.desc = lt.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)
        _set(self.desc, _DESC.TRANSA, transa, np.int32)
        _set(self.desc, _DESC.TRANSB, transb, np.int32)
        _set(self.desc, _DESC.EPILOGUE, int(epilogue), np.uint32)
        if aux_ld is not None:
            _set(self.desc, _DESC.EPILOGUE_AUX_LD, aux_ld, np.int64)
        if bias_dtype is not None:
            _set(self.desc, _DESC.BIAS_DATA_TYPE, bias_dtype, np.int32)
        a_rows, a_cols = (k, m) if transa == OP_T else (m, k)
        b_rows, b_cols = (n, k) if transb == OP_T else (k, n)
        self.a = lt.matrix_layout_create(dtype, a_rows, a_cols, lda)
        self.b = lt.matrix_layout_create(dtype, b_rows, b_cols, ldb)
        self.d = lt.matrix_layout_create(dtype, m, n, ldd)
        pref = lt.matmul_preference_create()
        ws = np.array([WORKSPACE_BYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, ws.ctypes.data,
                                           ws.nbytes)
        # the heuristic assumes 256-byte aligned pointers unless told otherwise (views into packed buffers)
        PA = lt.MatmulPreferenceAttribute
        for attr, a in zip((PA.MIN_ALIGNMENT_A_BYTES, PA.MIN_ALIGNMENT_B_BYTES, PA.MIN_ALIGNMENT_C_BYTES,
                            PA.MIN_ALIGNMENT_D_BYTES), align):
            v = np.array([a], dtype=np.uint32)
            lt.matmul_preference_set_attribute(pref, attr, v.ctypes.data, v.nbytes)
        self.heur = lt.MatmulHeuristicResult(1)
        count = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref, 1, self.heur.ptr,
                                         count.ctypes.data)
        except Exception:  # CUBLAS_STATUS_NOT_SUPPORTED and friends: no algorithm
            count[0] = 0
        finally:
            lt.matmul_preference_destroy(pref)
        self.ok = int(count[0]) > 0 and int(self.heur.state) == 0

    def run(self, a_ptr, b_ptr, d_ptr, alpha_ptr, beta_ptr, workspace_ptr, stream, bias_ptr=0, aux_ptr=0):
        if bias_ptr:
            _set(self.desc, _DESC.BIAS_POINTER, bias_ptr, np.uint64)
        if aux_ptr:
            _set(self.desc, _DESC.EPILOGUE_AUX_POINTER, aux_ptr, np.uint64)
        lt.matmul(self.handle, self.desc, alpha_ptr, a_ptr, self.a, b_ptr, self.b, beta_ptr, d_ptr, self.d, d_ptr,
                  self.d, self.heur.ptr, workspace_ptr, WORKSPACE_BYTES, stream)


class CublasLt:
    """The plan cache and the constants (alpha = 1, beta = 0 / 1 live in host memory)."""

    def __init__(self, cupy):
        self.handle = lt.create()
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        self.plans: dict[tuple, Plan | None] = {}

    def plan(self, key, *args, align=(256, 256, 256, 256)):
        key = key + align
        p = self.plans.get(key)
        if p is None and key not in self.plans:
            p = Plan(self.handle, *args, align=align)
            if not p.ok:
                p = None
            self.plans[key] = p
        return p

    def matmul(self, plan: Plan, a, b, d, stream, accumulate=False, bias=0, aux=0):
        plan.run(a, b, d, self._one.ctypes.data, (self._one if accumulate else self._zero).ctypes.data,
                 self.workspace.data.ptr, stream, bias_ptr=bias, aux_ptr=aux)

    # ---- the three products of a linear layer, for row-major buffers ---------------------------------------
    def forward(self, out, inp, weight, N, C, OC, dtype, stream, bias=0, aux=0, epilogue=None):
        """out (N,OC) = inp (N,C) @ weight (OC,C)^T [+ bias] [gelu with aux = pre-activation]; False if no plan."""
        epi = epilogue if epilogue is not None else (_EPI.BIAS if bias else _EPI.DEFAULT)
        has_aux = epi in (_EPI.GELU_AUX, _EPI.GELU_AUX_BIAS)
        key = ("fwd", N, C, OC, dtype, int(epi))
        p = self.plan(key, OC, N, C, OP_T, OP_N, C, C, OC, dtype, epi, OC if has_aux else None, None,
                      align=_align(weight, inp, out, out, bias, aux))
        if p is None:
            return False
        self.matmul(p, weight, inp, out, stream, bias=bias, aux=aux)
        return True

    def backward_input(self, dinp, dout, weight, N, C, OC, dtype, stream, pre_gelu=0):
        """dinp (N,C) = dout (N,OC) @ weight (OC,C) [* gelu'(pre_gelu)]; False if no plan."""
        epi = _EPI.DGELU if pre_gelu else _EPI.DEFAULT
        key = ("bwd_in", N, C, OC, dtype, int(epi))
        p = self.plan(key, C, N, OC, OP_N, OP_N, C, OC, C, dtype, epi, C if pre_gelu else None, None,
                      align=_align(weight, dout, dinp, dinp, pre_gelu))
        if p is None:
            return False
        self.matmul(p, weight, dout, dinp, stream, aux=pre_gelu)
        return True

    def backward_weight(self, dweight, dout, inp, N, C, OC, dtype, stream, dbias_tmp=0):
        """dweight (OC,C) += dout^T @ inp; with dbias_tmp, dbias_tmp (OC,) = column sums of dout (BGRADB)."""
        epi = _EPI.BGRADB if dbias_tmp else _EPI.DEFAULT
        key = ("bwd_w", N, C, OC, dtype, int(epi))
        p = self.plan(key, C, OC, N, OP_N, OP_T, C, OC, C, dtype, epi, None, None,
                      align=_align(inp, dout, dweight, dweight, dbias_tmp))
        if p is None:
            return False
        self.matmul(p, inp, dout, dweight, stream, accumulate=True, bias=dbias_tmp)
        return True
