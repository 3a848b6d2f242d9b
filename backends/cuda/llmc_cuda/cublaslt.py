"""Matmuls through cuBLASLt, driven with raw device pointers via `nvmath.bindings.cublasLt`.

Row-major (N, C) buffers are column-major (C, N) matrices to cuBLASLt, so every product is written for the
transposed problem (as llm.c does). Descriptors, layouts and the heuristic's algorithm are cached per
(problem, epilogue); a call sets only the pointers (bias, aux) and runs. Epilogues used:

  forward    BIAS (out = x W^T + b), GELU_AUX_BIAS (pre_gelu = x W^T + b, out = gelu(pre_gelu)), GELU_AUX
  backward   DGELU (dinp = (dout W) * gelu'(pre_gelu)), BGRADB (dbias = column sums of dout, from the
             weight-gradient product), dweight accumulated in place with beta = 1.

`plan(...)` returns None when cuBLASLt has no algorithm for a combination; the backend then uses plain
products and its own kernels for the rest.

Algorithm choice: the heuristic's first algorithm is often not the fastest on a given GPU (the K=768 products of
GPT-2 leave 5-25% on the table), but taking the fastest by timing would make the bits of a run depend on timing
noise. So only the candidates that split each output's sum over k as the heuristic's first does (split-K count and
reduction scheme, both readable) may race. At a plan's 13th call each of them runs once on the real operands, and
those whose outputs are bit-identical to the first candidate's stay in the race. A match alone is not proof: FP8's
sums are often exact on one call's operands and not on the next's, and a split-K candidate can match that way and
differ later (backends/cuda/bench/tuner_identity.py replays the admitted candidates on later and random operands to
check this). The next calls of the plan (real calls, in the step, where the L2 state, the neighbours and the power
cap are what training sees) go to those candidates in turn, timed with events, and the fastest is kept. A run
computes exactly what it would with the heuristic's choice, whichever candidate wins (`--backend-opt tune=off`, or
`LLMC_CUBLASLT_TUNE=0`, keeps the heuristic's first).

The bit-identity checks are spaced (CHECK_SPACING calls apart), so a fresh run spreads them over its first steps,
and each decision is kept on disk (`decisions`, saved by the backend under llmc's cache directory, per GPU and
cuBLASLt version): a later run with the same problems takes them at once and never races. A decision is the
picked candidate's algorithm config, and it is kept and taken only where that config names one candidate alone
(configs that all read alike once brought every run after the first back to the heuristic's first, 1-1.3 % slower).
"""

from __future__ import annotations

import numpy as np
from nvmath.bindings import cublasLt as lt

from .options import CUBLASLT_WORKSPACE_BYTES as WORKSPACE_BYTES  # (the plugin plans --dry-run with it too)

CUDA_R_32F = 0
CUDA_R_16BF = 14
CUDA_R_8F_E4M3 = 28
CUDA_R_8F_E5M2 = 29
_SIZE = {CUDA_R_32F: 4, CUDA_R_16BF: 2, CUDA_R_8F_E4M3: 1, CUDA_R_8F_E5M2: 1}
COMPUTE_32F = 68
COMPUTE_32F_FAST_TF32 = 77
OP_N, OP_T = 0, 1
TUNE_AFTER = 12  # calls of a plan before its candidates are compared (d12: the first step runs untouched)
TRIAL_CALLS = 4  # timed real calls per bit-identical candidate (d12, 8 candidates: done within step 5)
TUNE_MARGIN = 0.02  # how much faster than the heuristic's first a candidate must be to be kept
# matmul calls between two bit-identity checks (each runs every candidate of one plan once and waits for them): a
# step holds a few checks, never all of them, so no step of a fresh run takes much longer than the others
CHECK_SPACING = 24
RACE_CALLS = 8 * TRIAL_CALLS  # the most calls a race takes once started (8 candidates: the heuristic's count)

_DESC = lt.MatmulDescAttribute
_EPI = lt.Epilogue
_CA = lt.MatmulAlgoConfigAttribute
_CONFIG = (_CA.ID, _CA.TILE_ID, _CA.STAGES_ID, _CA.SPLITK_NUM, _CA.REDUCTION_SCHEME, _CA.CTA_SWIZZLING,
           _CA.CUSTOM_OPTION, _CA.CLUSTER_SHAPE_ID, _CA.INNER_SHAPE_ID)
_SUM_ORDER = slice(3, 5)  # split-k and reduction scheme in a _CONFIG tuple: how each output's sum over k is split


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
                 align=(256, 256, 256, 256), candidates=1, scales=None, fast_accum=False, compute=COMPUTE_32F):
        self.handle = handle
        self.epilogue = epilogue
        a_dt, b_dt, dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype, dtype)  # FP8: A, B 8-bit, D bf16
        # `compute` (TF32 or not) only matters for float32 operands; bf16 and FP8 products use the float32 default
        self.desc = lt.matmul_desc_create(compute if a_dt == CUDA_R_32F else COMPUTE_32F, CUDA_R_32F)
        if scales is not None:  # FP8: D = (scale_a * scale_b) A B, the dequantizing scales read on the device
            _set(self.desc, _DESC.A_SCALE_POINTER, scales[0], np.uint64)
            _set(self.desc, _DESC.B_SCALE_POINTER, scales[1], np.uint64)
        if fast_accum:
            _set(self.desc, _DESC.FAST_ACCUM, 1, np.int8)
        _set(self.desc, _DESC.TRANSA, transa, np.int32)
        _set(self.desc, _DESC.TRANSB, transb, np.int32)
        _set(self.desc, _DESC.EPILOGUE, int(epilogue), np.uint32)
        if aux_ld is not None:
            _set(self.desc, _DESC.EPILOGUE_AUX_LD, aux_ld, np.int64)
        if bias_dtype is not None:
            _set(self.desc, _DESC.BIAS_DATA_TYPE, bias_dtype, np.int32)
        a_rows, a_cols = (k, m) if transa == OP_T else (m, k)
        b_rows, b_cols = (n, k) if transb == OP_T else (k, n)
        self.a = lt.matrix_layout_create(a_dt, a_rows, a_cols, lda)
        self.b = lt.matrix_layout_create(b_dt, b_rows, b_cols, ldb)
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
        self.heur = lt.MatmulHeuristicResult(candidates)
        count = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref, candidates,
                                         self.heur.ptr, count.ctypes.data)
        except Exception:  # CUBLAS_STATUS_NOT_SUPPORTED and friends: no algorithm
            count[0] = 0
        finally:
            lt.matmul_preference_destroy(pref)
        self.elsize = _SIZE[dtype]
        self.m, self.n = m, n
        # (type, bytes) of A and B, for backends/cuda/bench/tuner_identity.py to fill them
        self.operands = tuple((dt, (ld * (cols - 1) + rows) * _SIZE[dt])
                              for dt, ld, rows, cols in ((a_dt, lda, a_rows, a_cols), (b_dt, ldb, b_rows, b_cols)))
        self.tuned = False
        self.calls = 0
        self.trials = None  # the candidates under trial: the first's order of summation and its bits
        self.samples = []  # (candidate, start event, end event) of the trial calls
        self.count = int(count[0])
        self.ok = self.count > 0 and int(np.atleast_1d(self.heur.state)[0]) == 0
        self.choose(0)  # the heuristic's first choice unless the tuner picks another
        self.last = None  # the pointers of the last call, for backends/cuda/bench/cublaslt_algos.py to replay

    def config(self, i: int) -> tuple[int, ...]:
        """Candidate i's algorithm as (id, tile, stages, split-k, reduction, swizzle, custom, cluster, inner)."""
        algo = self._algo(i)
        out = []
        v = np.zeros(1, dtype=np.uint64)
        written = np.zeros(1, dtype=np.uint64)
        for attr in _CONFIG:
            # cuBLASLt answers only a buffer of the attribute's exact size (2, 4 or 8 bytes; a wrong size is
            # INVALID_VALUE), so each size is tried; the buffer is zeroed and little-endian, so any of them reads right
            for size in (4, 2, 8):
                v[0] = 0
                try:
                    lt.matmul_algo_config_get_attribute(algo, attr, v.ctypes.data, size, written.ctypes.data)
                    out.append(int(v[0]))
                    break
                except Exception:  # noqa: BLE001  (the wrong size, or an attribute unknown to this cuBLASLt)
                    continue
            else:
                out.append(-1)
        return tuple(out)

    def only(self, config) -> int | None:
        """The candidate whose config is `config`, or None where no candidate or several have it: a config that does
        not name exactly one candidate cannot carry a decision from one run to the next."""
        hits = [i for i in range(self.count) if list(self.config(i)) == list(config)]
        return hits[0] if len(hits) == 1 else None

    def same_order(self, i: int) -> bool:
        """Whether candidate i splits each output's sum over k (split-K count, reduction scheme) as the first does;
        fields this cuBLASLt does not answer (-1) count as another order."""
        mine = self.config(i)[_SUM_ORDER]
        return i == 0 or (-1 not in mine and mine == self.config(0)[_SUM_ORDER])

    def _algo(self, i: int) -> int:
        """Pointer to candidate i's algorithm (the first field of its heuristic result)."""
        return self.heur.ptr + i * lt.matmul_heuristic_result_dtype.itemsize

    def choose(self, i: int):
        self.choice, self.algo = i, self._algo(i)

    def run(self, a_ptr, b_ptr, d_ptr, alpha_ptr, beta_ptr, workspace_ptr, stream, bias_ptr=0, aux_ptr=0):
        if bias_ptr:
            _set(self.desc, _DESC.BIAS_POINTER, bias_ptr, np.uint64)
        if aux_ptr:
            _set(self.desc, _DESC.EPILOGUE_AUX_POINTER, aux_ptr, np.uint64)
        self.last = (a_ptr, b_ptr, d_ptr, alpha_ptr, beta_ptr, workspace_ptr, stream)
        lt.matmul(self.handle, self.desc, alpha_ptr, a_ptr, self.a, b_ptr, self.b, beta_ptr, d_ptr, self.d, d_ptr,
                  self.d, self.algo, workspace_ptr, WORKSPACE_BYTES, stream)


class CublasLt:
    """The plan cache and the constants (alpha = 1, beta = 0 / 1 live in host memory)."""

    def __init__(self, cupy, tune: bool = True, signature=None, decisions: dict | None = None, on_decided=None,
                 tf32: bool = False):
        """`signature`: the bits_signature kernel (kernels.cu); `decisions`: plan key (str) -> the chosen candidate's
        config, from earlier runs; `on_decided()` is called after a race adds one; `tf32`: float32 products on
        TF32 tensor cores (fp32 inputs, outputs and accumulation; 10-bit mantissa products)."""
        self.cp = cupy
        self.signature = signature
        self.decisions = decisions if decisions is not None else {}
        self.on_decided = on_decided
        self.compute_fp32 = COMPUTE_32F_FAST_TF32 if tf32 else COMPUTE_32F
        self.check_spacing = CHECK_SPACING
        self._since_check = CHECK_SPACING  # the first plan to reach its race may check at once
        self.handle = lt.create()
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        self.plans: dict[tuple, Plan | None] = {}
        self.tune = tune
        self.candidates = 8 if self.tune else 1  # heuristic results asked for per plan
        self.tune_after = TUNE_AFTER
        self._streams: dict[int, object] = {}
        self.capturing = False  # set by CudaBackend.capture while a graph is recorded
        self.tuning: dict[tuple, list] = {}  # key -> [(candidate, config, raced, ms or None)], for bench

    def plan(self, key, *args, align=(256, 256, 256, 256), **fp8):
        key = key + align
        p = self.plans.get(key)
        if p is None and key not in self.plans:
            p = Plan(self.handle, *args, align=align, candidates=self.candidates, compute=self.compute_fp32, **fp8)
            if p.ok:
                p.key = key
                self._decided(p)
            else:
                p = None
            self.plans[key] = p
        return p

    def _decided(self, p: Plan) -> None:
        """Take an earlier run's decision for this plan, if one of today's candidates has that exact config."""
        want = self.decisions.get(repr(p.key)) if self.tune else None
        if not isinstance(want, list):  # none yet, or a damaged cache's entry (a number, a string): raced again
            return
        i = p.only(want)
        # (else raced again: the candidates changed, the entry names none of them alone or one that sums otherwise)
        if i is not None and p.same_order(i):
            p.choose(i)
            p.tuned = True
            self.tuning[p.key] = [(i, p.config(i), True, None)]

    def matmul(self, plan: Plan, a, b, d, stream, accumulate=False, bias=0, aux=0, outputs=()):
        """D = op(A) op(B) [+ D]; `outputs`: the epilogue's other outputs as (pointer, bytes), for the tuner."""
        args = (a, b, d, self._one.ctypes.data, (self._one if accumulate else self._zero).ctypes.data,
                self.workspace.data.ptr, stream)
        if not plan.tuned and not self.capturing:  # (a graph being recorded must not hold a race's events)
            plan.calls += 1
            self._since_check += 1
            if plan.calls > self.tune_after and (plan.trials is not None or self._since_check >= self.check_spacing):
                return self._trial_call(plan, args, accumulate, bias, aux, outputs)
        plan.run(*args, bias_ptr=bias, aux_ptr=aux)

    def race_now(self, rerun) -> None:
        """Run the races of the products `rerun` makes to their end now (Backend.settle): each call of `rerun`
        is a real call of those products, and each product races from its next call on, as it would from its
        TUNE_AFTER-th (the first call compares the candidates' bits on the real operands, the next ones time the
        bit-identical candidates in turn). Stops once every product it called has settled, after RACE_CALLS calls
        at most."""
        if not self.tune or all(p is None or p.tuned for p in self.plans.values()):
            return
        saved, self.tune_after, self.check_spacing = (self.tune_after, self.check_spacing), 0, 0
        try:
            for _ in range(RACE_CALLS):
                before = {id(p): p.calls for p in self.plans.values() if p is not None}
                rerun()
                called = [p for p in self.plans.values() if p is not None and p.calls != before.get(id(p))]
                if all(p.tuned for p in called):
                    break
        finally:
            self.tune_after, self.check_spacing = saved

    def settle_all(self) -> None:
        """End every race now (before a graph is captured, which would freeze whichever candidate a plan under
        trial last ran): a plan keeps the fastest candidate timed so far if that beats the heuristic's first by
        TUNE_MARGIN, else the first; plans that never raced keep the first."""
        for p in self.plans.values():
            if p is None or p.tuned:
                continue
            times: dict[int, list] = {}
            if p.samples:
                p.samples[-1][2].synchronize()
                for c, s0, s1 in p.samples:
                    times.setdefault(c, []).append(self.cp.cuda.get_elapsed_time(s0, s1))
            self._settle(p, None, 0, 0, {c: float(np.median(t)) for c, t in times.items()})

    def _stream(self, ptr):
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = self.cp.cuda.ExternalStream(ptr)
        return s

    def _trial_call(self, plan, args, accumulate, bias, aux, outputs):
        """One real call during the race between the bit-identical candidates (see the top)."""
        cp = self.cp
        stream = self._stream(args[-1])
        if plan.trials is None:
            many = self.tune and plan.count > 1
            plan.trials = self._identical(plan, args, accumulate, bias, aux, outputs) if many else [0]
            if len(plan.trials) < 2:
                return self._settle(plan, args, bias, aux, {})
        k = len(plan.samples)
        i = plan.trials[k % len(plan.trials)]  # round robin: neighbouring calls (layers) try different ones
        plan.choose(i)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        plan.run(*args, bias_ptr=bias, aux_ptr=aux)
        e1.record(stream)
        plan.samples.append((i, e0, e1))
        if len(plan.samples) == len(plan.trials) * TRIAL_CALLS:
            e1.synchronize()
            times: dict[int, list] = {}
            for c, s0, s1 in plan.samples:
                times.setdefault(c, []).append(cp.cuda.get_elapsed_time(s0, s1))
            self._settle(plan, None, bias, aux, {c: float(np.median(t)) for c, t in times.items()})

    def _settle(self, plan, args, bias, aux, ms):
        """Keep the fastest candidate if it beats the heuristic's first by TUNE_MARGIN; run `args` if given."""
        base = ms.get(0)
        fast = [i for i in ms if base is not None and ms[i] < base * (1 - TUNE_MARGIN)]
        pick = min(fast, key=ms.get) if fast else 0
        plan.choose(pick)
        plan.tuned = True
        self.tuning[plan.key] = [(i, plan.config(i), i in (plan.trials or [0]), ms.get(i)) for i in range(plan.count)]
        # kept where a race was run (settle_all before any: nothing learned) and the pick's config names it alone:
        # a config shared by two candidates (or unreadable) would bring back the first of them, not the pick
        if (ms or plan.trials is not None) and plan.only(plan.config(pick)) == pick:
            self.decisions[repr(plan.key)] = list(plan.config(pick))
            if self.on_decided is not None:
                self.on_decided()
        plan.samples = []
        if args is not None:
            plan.run(*args, bias_ptr=bias, aux_ptr=aux)

    def _identical(self, plan, args, accumulate, bias, aux, outputs) -> list[int]:
        """The candidates whose outputs are bit-identical to the first candidate's, on these operands: each
        candidate's outputs are signed on the device (bits_signature) and the host waits once, for all of them.
        Leaves an accumulated output (beta = 1) as it found it."""
        cp = self.cp
        self._since_check = 0
        nbytes = plan.m * plan.n * plan.elsize
        outs = [(args[2], nbytes)] + list(outputs)
        wide = np.int32(plan.elsize == 4)
        with self._stream(args[-1]) as stream:
            def d2d(dst, src):
                cp.cuda.runtime.memcpyAsync(dst, src, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

            sigs = cp.zeros((plan.count, len(outs), 2), dtype=cp.uint64)
            before = cp.empty(nbytes, dtype=cp.uint8) if accumulate else None  # weight gradients: at most vocab x C
            if before is not None:
                d2d(before.data.ptr, args[2])
            ran = []
            for i in filter(plan.same_order, range(plan.count)):
                plan.choose(i)
                if before is not None:
                    d2d(args[2], before.data.ptr)
                try:
                    plan.run(*args, bias_ptr=bias, aux_ptr=aux)
                except Exception:  # a candidate this device cannot run after all
                    continue
                ran.append(i)
                for j, (ptr, n) in enumerate(outs):
                    words = n // plan.elsize
                    self.signature((min(1024, max(1, words // 4096)),), (256,),
                                   (sigs[i, j], np.uint64(ptr), np.int64(words), wide), stream=stream)
            plan.choose(0)
            if before is not None:
                d2d(args[2], before.data.ptr)
            host = sigs.get(stream=stream)  # the one wait of the check
            stream.synchronize()
            if before is not None:
                del before
                cp.get_default_memory_pool().free_all_blocks()  # the copy would stay in "device used"
        return [i for i in ran if ran and ran[0] == 0 and (host[i] == host[0]).all()]

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
        self.matmul(p, weight, inp, out, stream, bias=bias, aux=aux,
                    outputs=((aux, N * OC * p.elsize),) if has_aux else ())
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
        self.matmul(p, inp, dout, dweight, stream, accumulate=True, bias=dbias_tmp,
                    outputs=((dbias_tmp, OC * p.elsize),) if dbias_tmp else ())
        return True

    # ---- the same three products with FP8 operands (e4m3 weights and activations, e5m2 gradients) -----------
    # Hopper's FP8 matmuls take only "TN" problems: both operands with the summed dimension contiguous. The
    # forward product already is; the two backward ones take transposed copies the backend makes as it casts.
    # The scales are fixed device addresses (the backend's slots), so they are set once per plan.
    def forward_fp8(self, out, inp8, weight8, N, C, OC, stream, scales, bias=0, aux=0, epilogue=None,
                    fast_accum=True):
        """out (N,OC) bf16 = inp8 (N,C) @ weight8 (OC,C)^T, both e4m3; `scales` = (weight's, input's)."""
        epi = epilogue if epilogue is not None else (_EPI.BIAS if bias else _EPI.DEFAULT)
        has_aux = epi in (_EPI.GELU_AUX, _EPI.GELU_AUX_BIAS)
        key = ("fwd8", N, C, OC, int(epi), scales, fast_accum)
        p = self.plan(key, OC, N, C, OP_T, OP_N, C, C, OC, (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF), epi,
                      OC if has_aux else None, None, align=_align(weight8, inp8, out, out, bias, aux), scales=scales,
                      fast_accum=fast_accum)
        if p is None:
            return False
        self.matmul(p, weight8, inp8, out, stream, bias=bias, aux=aux,
                    outputs=((aux, N * OC * p.elsize),) if has_aux else ())
        return True

    def backward_input_fp8(self, dinp, dout8, weight8_t, N, C, OC, stream, scales, pre_gelu=0):
        """dinp (N,C) bf16 = dout8 (N,OC) e5m2 @ weight (OC,C), the weight given as weight8_t (C,OC) e4m3;
        `scales` = (weight's, dout's)."""
        epi = _EPI.DGELU if pre_gelu else _EPI.DEFAULT
        key = ("bwd_in8", N, C, OC, int(epi), scales)
        p = self.plan(key, C, N, OC, OP_T, OP_N, OC, OC, C, (CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF), epi,
                      C if pre_gelu else None, None, align=_align(weight8_t, dout8, dinp, dinp, pre_gelu),
                      scales=scales)
        if p is None:
            return False
        self.matmul(p, weight8_t, dout8, dinp, stream, aux=pre_gelu)
        return True

    def backward_weight_fp8(self, dweight, dout8_t, inp8_t, N, C, OC, stream, scales):
        """dweight (OC,C) bf16 += dout^T @ inp from the transposed copies dout8_t (OC,N) e5m2 and inp8_t (C,N)
        e4m3; `scales` = (input's, dout's)."""
        key = ("bwd_w8", N, C, OC, scales)
        p = self.plan(key, C, OC, N, OP_T, OP_N, N, N, C, (CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF),
                      _EPI.DEFAULT, None, None, align=_align(inp8_t, dout8_t, dweight, dweight), scales=scales)
        if p is None:
            return False
        self.matmul(p, inp8_t, dout8_t, dweight, stream, accumulate=True)
        return True
