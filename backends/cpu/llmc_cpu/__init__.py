"""llmc's CPU backend: every kernel of `llmc_cli.kernels` in numpy, float32.

It is the reference the other backends are checked against, and fast enough to train small models: every
matmul goes to BLAS, attention is batched over (B, NH), and scratch arrays are kept between calls so a training
step allocates nothing large.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from llmc_cli.kernels import (CAP_KV_CACHE, CAP_REFERENCE, FLOAT32, INT32, Backend, BackendPlugin, BackendUnavailable,
                              MemoryReport, check_decode_chunk, guard_scale, option_int)

_NP_DTYPES = {FLOAT32: np.float32, INT32: np.int32}
GELU_SCALE = math.sqrt(2.0 / math.pi)
_ADAM_CHUNK = 1 << 16  # elements per AdamW chunk: five float32 chunks stay inside L2


def _numpy_sgemm():
    """cblas_sgemm of the OpenBLAS that numpy itself loaded (numpy's wheels ship scipy-openblas, 64-bit ints),
    or None where numpy links another BLAS."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so"))
    if not libs or not np.__config__.CONFIG.get("Build Dependencies", {}).get("blas", {}).get("name", "").startswith(
            "scipy-openblas"):
        return None
    try:
        fn = ctypes.CDLL(libs[0]).scipy_cblas_sgemm64_
    except (OSError, AttributeError):
        return None
    i64, f32, ptr, enum = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [enum, enum, enum, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]
    fn.restype = None
    return fn


def _numpy_blas_threads():
    """(set, get) of the thread count of the OpenBLAS numpy loaded, or None where numpy links another BLAS."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so"))
    try:
        lib = ctypes.CDLL(libs[0])
        set_, get = lib.scipy_openblas_set_num_threads64_, lib.scipy_openblas_get_num_threads64_
    except (OSError, AttributeError, IndexError):
        return None
    set_.argtypes, set_.restype, get.argtypes, get.restype = [ctypes.c_int], None, [], ctypes.c_int
    return set_, get


_SGEMM = _numpy_sgemm()
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_BLAS_THREADS = _numpy_blas_threads()
# products below this many multiply-adds run on one BLAS thread: splitting them costs more than it saves (768x128 by
# 128x384 on 2 cores: 2.1 ms on one thread, 7.9 ms on two while other processes share the cores)
SMALL_GEMM_MACS = 1 << 27
SPLIT_GEMM_MACS = 1 << 20  # smaller ones run whole on the calling thread: a handoff to the pool costs ~50 us


_SUMSQ_ROW = 4096


def _sum_of_squares(f: np.ndarray) -> float:
    """Sum of squares of a flat array, accurate to ~1e-8 relative: float32 dot products over rows of 4096
    (vectorised), the rows added in float64. One float32 dot over a whole 100M-element gradient drifts by
    ~1e-3 relative, which the contract's reference must not."""
    m = f.size - f.size % _SUMSQ_ROW
    rows = f[:m].reshape(-1, _SUMSQ_ROW)
    total = float(np.sum(np.einsum("ij,ij->i", rows, rows), dtype=np.float64))
    tail = f[m:].astype(np.float64)
    return total + float(tail @ tail)


class CpuBackend(Backend):
    name = "cpu"
    dtype = FLOAT32
    capabilities = frozenset({CAP_KV_CACHE, CAP_REFERENCE})

    def __init__(self, threads: int | None = None):
        self.threads = threads or max(1, min(os.cpu_count() or 1, 8))
        self._allocated: dict[str, int] = defaultdict(int)
        self._scratch: dict[tuple, np.ndarray] = {}
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._masks: dict[int, np.ndarray] = {}
        self._slice = threading.local()  # .on: this thread runs a slice of a kernel (_in_slices)
        self._blas_all = _BLAS_THREADS[1]() if _BLAS_THREADS is not None else 1
        self._blas_now = self._blas_all

    def _blas_for(self, macs: int) -> None:
        """One BLAS thread for a small product, all of them for a large one (the count numpy started with)."""
        want = 1 if macs < SMALL_GEMM_MACS else self._blas_all
        if want != self._blas_now and _BLAS_THREADS is not None:
            _BLAS_THREADS[0](want)
            self._blas_now = want

    # ---- memory --------------------------------------------------------------------------------------------
    def alloc(self, shape, dtype=FLOAT32, tag="other"):
        if dtype not in _NP_DTYPES:
            raise BackendUnavailable(f"cpu backend has no dtype {dtype} (float32 only)")
        a = np.empty(shape, dtype=_NP_DTYPES[dtype])
        self._allocated[tag] += a.nbytes
        return a

    def upload(self, dst, host):
        dst[...] = np.asarray(host).reshape(dst.shape)

    def download(self, src):
        return np.array(src, copy=True)

    def fill(self, buf, value):
        buf.fill(value)

    def copy(self, dst, src):
        dst.reshape(-1)[...] = src.reshape(-1)

    def memory_report(self):
        return MemoryReport(allocated=sum(self._allocated.values()), by_tag=dict(self._allocated))

    def describe(self):
        return f"numpy {np.__version__} on the host, {self.threads} threads"

    def _tmp(self, key: str, shape: tuple, dtype=np.float32) -> np.ndarray:
        """Scratch kept between calls, so steady-state steps allocate nothing large; one set per thread, so that a
        kernel's slices (_in_slices) run side by side."""
        k = (key, shape, dtype, threading.get_ident())
        a = self._scratch.get(k)
        if a is None:
            a = self._scratch[k] = np.empty(shape, dtype=dtype)
        return a

    # ---- encoder --------------------------------------------------------------------------------------------
    # out (B,T,C), inp (B,T), wte (Vp,C), wpe (maxT,C)
    def encoder_forward(self, out, inp, wte, wpe):
        T = inp.shape[1]
        np.take(wte, inp, axis=0, out=out)
        if wpe is not None:
            out += wpe[:T]

    def encoder_backward(self, dwte, dwpe, dout, inp):
        C = dout.shape[-1]
        np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))  # unbuffered, sequential: deterministic
        if dwpe is not None:
            T = inp.shape[1]
            dwpe[:T] += dout.reshape(-1, T, C).sum(axis=0)

    # ---- layernorm ------------------------------------------------------------------------------------------
    # inp, out (N,C); mean, rstd (N,)
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        C = inp.shape[-1]
        x = inp.reshape(-1, C)
        mean = mean.reshape(-1)
        rstd = rstd.reshape(-1)
        np.mean(x, axis=1, out=mean)
        xhat = self._tmp("ln", x.shape)
        np.subtract(x, mean[:, None], out=xhat)
        var = np.einsum("ij,ij->i", xhat, xhat) / C
        np.divide(1.0, np.sqrt(var + 1e-5), out=rstd)
        xhat *= rstd[:, None]
        o = out.reshape(-1, C)
        np.multiply(xhat, weight, out=o)
        o += bias

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        C = inp.shape[-1]
        x, g = inp.reshape(-1, C), dout.reshape(-1, C)
        mean, rstd = mean.reshape(-1, 1), rstd.reshape(-1, 1)
        xhat = self._tmp("ln", x.shape)
        np.subtract(x, mean, out=xhat)
        xhat *= rstd
        dbias += g.sum(axis=0)
        dweight += np.einsum("ij,ij->j", g, xhat)
        dnorm = self._tmp("ln_dnorm", x.shape)
        np.multiply(g, weight, out=dnorm)
        dnorm_mean = dnorm.mean(axis=1, keepdims=True)
        dnorm_norm_mean = np.einsum("ij,ij->i", dnorm, xhat)[:, None] / C
        dnorm -= dnorm_mean
        xhat *= dnorm_norm_mean
        dnorm -= xhat
        dnorm *= rstd
        dinp.reshape(-1, C)[...] += dnorm

    def residual_forward(self, out, inp1, inp2):
        np.add(inp1, inp2, out=out)

    def scale(self, buf, factor):
        buf *= np.float32(factor)

    # ---- rmsnorm --------------------------------------------------------------------------------------------
    # inp, out (N,C); rstd (N,)
    def rmsnorm_forward(self, out, rstd, inp, weight, eps):
        C = inp.shape[-1]
        x = inp.reshape(-1, C)
        ms = np.einsum("ij,ij->i", x, x) / C
        r = rstd.reshape(-1)
        np.divide(1.0, np.sqrt(ms + eps), out=r)
        o = out.reshape(-1, C)
        np.multiply(x, r[:, None], out=o)
        o *= weight

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd):
        C = inp.shape[-1]
        x, g, r = inp.reshape(-1, C), dout.reshape(-1, C), rstd.reshape(-1, 1)
        xhat = self._tmp("rms", x.shape)
        np.multiply(x, r, out=xhat)
        dweight += np.einsum("ij,ij->j", g, xhat)
        dnorm = self._tmp("rms_dnorm", x.shape)
        np.multiply(g, weight, out=dnorm)
        dot = np.einsum("ij,ij->i", dnorm, xhat)[:, None] / C
        xhat *= dot
        dnorm -= xhat
        dnorm *= r
        dinp.reshape(-1, C)[...] += dnorm

    # ---- matmul ---------------------------------------------------------------------------------------------
    # inp (N,C) @ weight (OC,C)^T + bias (OC,) -> (N,OC)
    def matmul_forward(self, out, inp, weight, bias=None, pre_gelu=None):
        OC, C = weight.shape
        target = (pre_gelu if pre_gelu is not None else out).reshape(-1, OC)
        x = inp.reshape(-1, C)
        y = out.reshape(-1, OC)

        def rows(lo: int, hi: int) -> None:
            np.matmul(x[lo:hi], weight.T, out=target[lo:hi])
            if bias is not None:
                target[lo:hi] += bias
            if pre_gelu is not None:
                self.gelu_forward(y[lo:hi], target[lo:hi])

        self._in_parts(target.size * C, [(rows, target.shape[0])])

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu=None):
        OC, C = weight.shape
        g, x = dout.reshape(-1, OC), inp.reshape(-1, C)
        work = [(lambda lo, hi: self._accumulate_gemm_tn(dweight, g, x, lo, hi), OC)]
        if dinp is not None:
            dx = dinp.reshape(-1, C)
            pre = pre_gelu.reshape(-1, C) if pre_gelu is not None else None

            def rows(lo: int, hi: int) -> None:
                np.matmul(g[lo:hi], weight, out=dx[lo:hi])
                if pre is not None:
                    self.gelu_backward(dx[lo:hi], pre[lo:hi], dx[lo:hi])

            work.append((rows, g.shape[0]))
        self._in_parts(g.size * C, work)
        if dbias is not None:
            dbias += g.sum(axis=0)

    def _in_parts(self, macs: int, work: list) -> None:
        """Run each (fn, n) as fn(lo, hi) over [0, n): a small product in as many slices as the backend has
        threads, each on one BLAS thread (blocked in our pool rather than spinning in BLAS's, which stalls on cores
        shared with other processes); a large one whole, on every BLAS thread. Each output element is made by one
        call, whatever the slicing: the same bits on every run of a given thread count."""
        self._blas_for(macs)
        parts = self.threads if (self._pool is not None and SPLIT_GEMM_MACS <= macs < SMALL_GEMM_MACS) else 1
        calls = [(fn, n * i // parts, n * (i + 1) // parts) for i in range(parts) for fn, n in work]
        if parts == 1:
            for fn, lo, hi in calls:
                fn(lo, hi)
            return
        mine = [c for i, c in enumerate(calls) if i // len(work) == 0]
        futures = [self._pool.submit(fn, lo, hi) for i, (fn, lo, hi) in enumerate(calls) if i // len(work) > 0]
        for fn, lo, hi in mine:
            fn(lo, hi)
        for f in futures:
            f.result()

    def _accumulate_gemm_tn(self, c: np.ndarray, a: np.ndarray, b: np.ndarray, lo: int = 0,
                            hi: int | None = None) -> None:
        """c[lo:hi] (M,K) += a[:, lo:hi](N,M)^T @ b(N,K), with beta=1 in numpy's own OpenBLAS (the same library and
        thread pool numpy's matmul uses; scipy's sgemm brings a second pool that fights it for the cores: 8 ms
        instead of 0.2 ms for a 64x128x384 product on 2 cores). Saves a pass over the weight gradient: 256x50304x768
        88 -> 63 ms here. Elsewhere: a matmul into a kept scratch, then an add."""
        (N, M), K = a.shape, b.shape[1]
        hi = M if hi is None else hi
        if (_SGEMM is not None and min(N, hi - lo, K) > 0 and all(x.dtype == np.float32 and x.flags.c_contiguous
                                                                  for x in (a, b, c))):
            _SGEMM(_ROW_MAJOR, _TRANS, _NO_TRANS, hi - lo, K, N, 1.0, a.ctypes.data + 4 * lo, M, b.ctypes.data, K,
                   1.0, c.ctypes.data + 4 * lo * K, K)
            return
        if hi - lo == 0:
            return
        tmp = self._tmp(f"gemm_tn{lo}", (hi - lo, K))
        np.matmul(a[:, lo:hi].T, b, out=tmp)
        c[lo:hi] += tmp

    # ---- gelu (tanh approximation) --------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        t = self._tmp("gelu", inp.shape)
        np.multiply(inp, inp, out=t)
        t *= 0.044715
        t += 1.0
        t *= inp
        t *= GELU_SCALE
        np.tanh(t, out=t)
        t += 1.0
        t *= 0.5
        np.multiply(inp, t, out=out)

    def gelu_backward(self, dinp, inp, dout):
        x = inp
        x2 = self._tmp("gelu_x2", x.shape)
        np.multiply(x, x, out=x2)
        th = self._tmp("gelu", x.shape)
        np.multiply(x2, 0.044715, out=th)
        th += 1.0
        th *= x
        th *= GELU_SCALE
        np.tanh(th, out=th)
        # local = 0.5*(1+th) + 0.5*x*(1-th^2)*s*(1+3*0.044715*x^2)
        x2 *= 3.0 * 0.044715
        x2 += 1.0
        x2 *= GELU_SCALE * 0.5
        x2 *= x
        sech2 = self._tmp("gelu_s", x.shape)
        np.multiply(th, th, out=sech2)
        np.subtract(1.0, sech2, out=sech2)
        x2 *= sech2
        th += 1.0
        th *= 0.5
        th += x2
        np.multiply(th, dout, out=dinp)

    # ---- swiglu ---------------------------------------------------------------------------------------------
    # inp (N,2H) = [gate | up]; out (N,H)
    def swiglu_forward(self, out, inp):
        H = out.shape[-1]
        x = inp.reshape(-1, 2 * H)
        gate, up = x[:, :H], x[:, H:]
        sig = self._tmp("swiglu", gate.shape)
        np.negative(gate, out=sig)
        np.exp(sig, out=sig)
        sig += 1.0
        np.divide(gate, sig, out=sig)  # silu(gate)
        np.multiply(sig, up, out=out.reshape(-1, H))

    def swiglu_backward(self, dinp, dout, inp):
        H = dout.shape[-1]
        x, g = inp.reshape(-1, 2 * H), dout.reshape(-1, H)
        d = dinp.reshape(-1, 2 * H)
        gate, up = x[:, :H], x[:, H:]
        sig = self._tmp("swiglu", gate.shape)
        np.negative(gate, out=sig)
        np.exp(sig, out=sig)
        sig += 1.0
        np.divide(1.0, sig, out=sig)
        silu = self._tmp("swiglu_silu", gate.shape)
        np.multiply(gate, sig, out=silu)
        dgate, dup = d[:, :H], d[:, H:]
        np.multiply(g, silu, out=dup)
        # dsilu = sig * (1 + gate * (1 - sig)) = sig + silu * (1 - sig)
        one_minus = self._tmp("swiglu_1m", gate.shape)
        np.subtract(1.0, sig, out=one_minus)
        silu *= one_minus
        silu += sig
        np.multiply(g, up, out=dgate)
        dgate *= silu

    # ---- rope -----------------------------------------------------------------------------------------------
    # qkv (B,T,(NH+2*NKV)*hd); freqs_cis (maxT, hd/2, 2) = (cos, sin)
    def _rope(self, qkv, freqs_cis, n_head, n_kv_head, sign):
        B, T, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        qk = qkv[:, :, :(n_head + n_kv_head) * hd].reshape(B, T, n_head + n_kv_head, hd // 2, 2)
        cos = freqs_cis[:T, None, :, 0]
        sin = freqs_cis[:T, None, :, 1] * sign
        x0 = qk[..., 0].copy()
        x1 = qk[..., 1]
        qk[..., 0] = x0 * cos - x1 * sin
        qk[..., 1] = x0 * sin + x1 * cos

    def rope_forward(self, qkv, freqs_cis, n_head, n_kv_head):
        self._rope(qkv, freqs_cis, n_head, n_kv_head, 1.0)

    def rope_backward(self, dqkv, freqs_cis, n_head, n_kv_head):
        self._rope(dqkv, freqs_cis, n_head, n_kv_head, -1.0)

    # ---- attention ------------------------------------------------------------------------------------------
    # qkv (B,T,(NH+2*NKV)*hd) -> q (B,NH,T,hd), k, v (B,NH,T,hd) with kv heads repeated for GQA
    def _split_heads(self, qkv, n_head, n_kv_head):
        B, T, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        q = qkv[:, :, :n_head * hd].reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
        k = qkv[:, :, n_head * hd:(n_head + n_kv_head) * hd].reshape(B, T, n_kv_head, hd).transpose(0, 2, 1, 3)
        v = qkv[:, :, (n_head + n_kv_head) * hd:].reshape(B, T, n_kv_head, hd).transpose(0, 2, 1, 3)
        shape = (B, n_head, T, hd)
        qc, kc, vc = self._tmp("att_q", shape), self._tmp("att_k", shape), self._tmp("att_v", shape)
        qc[...] = q
        group = n_head // n_kv_head
        if group == 1:
            kc[...] = k
            vc[...] = v
        else:
            kc.reshape(B, n_kv_head, group, T, hd)[...] = k[:, :, None]
            vc.reshape(B, n_kv_head, group, T, hd)[...] = v[:, :, None]
        return qc, kc, vc, hd

    def _probs(self, q, k, hd, lse=None):
        """Scaled causal scores softmaxed in place: P (B,NH,T,T); fills lse or uses the given one."""
        B, NH, T, _ = q.shape
        if not getattr(self._slice, "on", False):  # (a slice runs with the BLAS threads its caller set)
            self._blas_for(B * NH * T * T * hd)
        att = self._tmp("att_p", (B, NH, T, T))
        np.matmul(q, k.transpose(0, 1, 3, 2), out=att)
        att *= np.float32(1.0 / math.sqrt(hd))
        mask = self._masks.get(T)
        if mask is None:  # (built twice at worst, by two slices at once: the same values)
            mask = self._masks[T] = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
        att += mask
        if lse is None:
            m = att.max(axis=-1, keepdims=True)
            att -= m
            np.exp(att, out=att)
            s = att.sum(axis=-1, keepdims=True)
            att /= s
            return att, (m + np.log(s))[..., 0]
        att -= lse[..., None]
        np.exp(att, out=att)
        return att, None

    def attention_forward(self, out, lse, qkv, n_head, n_kv_head):
        B, T, W = qkv.shape
        self._in_slices(B, B * n_head * T * T * W // (n_head + 2 * n_kv_head), lambda lo, hi: self._attention_forward(
            out[lo:hi], lse[lo:hi], qkv[lo:hi], n_head, n_kv_head))

    def attention_backward(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, W = qkv.shape
        self._in_slices(B, B * n_head * T * T * W // (n_head + 2 * n_kv_head), lambda lo, hi: self._attention_backward(
            dqkv[lo:hi], dout[lo:hi], qkv[lo:hi], out[lo:hi], lse[lo:hi], n_head, n_kv_head))

    def _in_slices(self, n: int, macs: int, fn) -> None:
        """fn(lo, hi) over slices of [0, n) (the batch) side by side on the pool, where the products are small
        enough for one BLAS thread each (see _in_parts); whole otherwise."""
        parts = min(n, self.threads) if (self._pool is not None and SPLIT_GEMM_MACS <= macs < SMALL_GEMM_MACS) else 1
        if parts == 1:
            fn(0, n)
            return
        def part(lo: int, hi: int) -> None:
            self._slice.on = True
            try:
                fn(lo, hi)
            finally:
                self._slice.on = False

        self._blas_for(0)
        futures = [self._pool.submit(part, n * i // parts, n * (i + 1) // parts) for i in range(1, parts)]
        part(0, n // parts)
        for f in futures:
            f.result()

    def _attention_forward(self, out, lse, qkv, n_head, n_kv_head):
        B, T, _ = qkv.shape
        q, k, v, hd = self._split_heads(qkv, n_head, n_kv_head)
        att, l = self._probs(q, k, hd)
        lse[...] = l
        y = self._tmp("att_y", q.shape)
        np.matmul(att, v, out=y)
        out.reshape(B, T, n_head, hd)[...] = y.transpose(0, 2, 1, 3)

    def _attention_backward(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, _ = qkv.shape
        q, k, v, hd = self._split_heads(qkv, n_head, n_kv_head)
        p, _ = self._probs(q, k, hd, lse)
        shape = q.shape
        do = self._tmp("att_do", shape)
        do[...] = dout.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
        o = out.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
        dv = self._tmp("att_dv", shape)
        np.matmul(p.transpose(0, 1, 3, 2), do, out=dv)
        dp = self._tmp("att_dp", p.shape)
        np.matmul(do, v.transpose(0, 1, 3, 2), out=dp)
        D = np.einsum("bhtd,bhtd->bht", do, o)
        dp -= D[..., None]
        dp *= p  # dS = P * (dP - D)
        scale = np.float32(1.0 / math.sqrt(hd))
        dq = self._tmp("att_dq", shape)
        np.matmul(dp, k, out=dq)
        dq *= scale
        dk = self._tmp("att_dk", shape)
        np.matmul(dp.transpose(0, 1, 3, 2), q, out=dk)
        dk *= scale
        d = dqkv.reshape(B, T, -1)
        d[:, :, :n_head * hd].reshape(B, T, n_head, hd)[...] = dq.transpose(0, 2, 1, 3)
        group = n_head // n_kv_head
        if group > 1:  # query heads sharing a kv head: their gradients sum
            dk = dk.reshape(B, n_kv_head, group, T, hd).sum(axis=2)
            dv = dv.reshape(B, n_kv_head, group, T, hd).sum(axis=2)
        d[:, :, n_head * hd:(n_head + n_kv_head) * hd].reshape(B, T, n_kv_head, hd)[...] = dk.transpose(0, 2, 1, 3)
        d[:, :, (n_head + n_kv_head) * hd:].reshape(B, T, n_kv_head, hd)[...] = dv.transpose(0, 2, 1, 3)

    # qkv (B,Tn,(NH+2*NKV)*hd) of new tokens at pos..pos+Tn-1; k_cache, v_cache (B,NKV,S,hd) rings; out (B,Tn,NH*hd)
    def attention_decode(self, out, qkv, k_cache, v_cache, pos, n_head, n_kv_head):
        B, Tn, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        S = k_cache.shape[2]
        if not isinstance(pos, (int, np.integer)):  # a (1,) int32 buffer holding the position (one new token)
            if Tn != 1:
                raise ValueError("attention_decode: a position held in a buffer takes one new token at a time")
            pos = int(np.asarray(pos).reshape(-1)[0])
        check_decode_chunk(pos, Tn, S)
        slots = (pos + np.arange(Tn)) % S
        k_cache[:, :, slots] = qkv[:, :, n_head * hd:(n_head + n_kv_head) * hd].reshape(
            B, Tn, n_kv_head, hd).transpose(0, 2, 1, 3)
        v_cache[:, :, slots] = qkv[:, :, (n_head + n_kv_head) * hd:].reshape(
            B, Tn, n_kv_head, hd).transpose(0, 2, 1, 3)
        last = pos + Tn - 1
        n = min(last + 1, S)  # slots holding a position
        slot_pos = last - (last - np.arange(n)) % S  # the position each slot holds now
        q_pos = pos + np.arange(Tn)
        hidden = (slot_pos[None, :] > q_pos[:, None]) | (slot_pos[None, :] <= q_pos[:, None] - S)  # (Tn, n)
        group = n_head // n_kv_head
        q = qkv[:, :, :n_head * hd].reshape(B, Tn, n_kv_head, group, hd).transpose(0, 2, 3, 1, 4)
        k, v = k_cache[:, :, None, :n], v_cache[:, :, None, :n]  # (B,NKV,1,n,hd), shared by the group
        att = np.matmul(q, k.transpose(0, 1, 2, 4, 3))  # (B,NKV,group,Tn,n)
        att *= np.float32(1.0 / math.sqrt(hd))
        if hidden.any():
            att[..., hidden] = -np.inf
        att -= att.max(axis=-1, keepdims=True)
        np.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        y = np.matmul(att, v)  # (B,NKV,group,Tn,hd)
        out.reshape(B, Tn, n_kv_head, group, hd)[...] = y.transpose(0, 3, 1, 2, 4)

    # ---- fused classifier -----------------------------------------------------------------------------------
    # logits (N,Vp), losses (N,), targets (N,)
    def classifier_forward_backward(self, logits, losses, targets, vocab_size, dloss):
        Vp = logits.shape[-1]
        L = logits.reshape(-1, Vp)
        N = L.shape[0]
        tgt = targets.reshape(-1)
        if tgt.size and (tgt.min() < 0 or tgt.max() >= vocab_size):
            raise ValueError(f"target token id out of range [0, {vocab_size})")
        rows = np.arange(N)
        target_logit = L[rows, tgt].copy()
        x = L[:, :vocab_size] if dloss is not None else self._tmp("cls", (N, vocab_size))
        if dloss is None:
            x[...] = L[:, :vocab_size]
        m = x.max(axis=1)
        x -= m[:, None]
        np.exp(x, out=x)
        s = x.sum(axis=1)
        losses.reshape(-1)[...] = np.log(s) + m - target_logit
        if dloss is not None:
            x *= (np.float32(dloss) / s)[:, None]
            L[rows, tgt] -= np.float32(dloss)
            L[:, vocab_size:] = 0.0

    # ---- optimizer ------------------------------------------------------------------------------------------
    def global_norm_squared(self, out, grads):
        total = 0.0
        for g in grads:  # fixed order, float64 accumulation across tensors
            total += _sum_of_squares(g.reshape(-1))
        out.reshape(-1)[0] = total

    def adamw_update(self, param, grad, m, v, master, *, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale, seed, guard=None):
        if guard is not None:
            apply, grad_scale = guard_scale(guard)
            if not apply:
                return
        p = (master if master is not None else param).reshape(-1)
        g, mm, vv = grad.reshape(-1), m.reshape(-1), v.reshape(-1)
        n = p.size
        step_size = np.float32(lr / (1.0 - beta1 ** step))
        rbc2 = np.float32(1.0 / math.sqrt(1.0 - beta2 ** step))
        decay = np.float32(1.0 - lr * weight_decay)
        b1, b2 = np.float32(beta1), np.float32(beta2)
        c1, c2 = np.float32((1.0 - beta1) * grad_scale), np.float32((1.0 - beta2) * grad_scale * grad_scale)
        epsf = np.float32(eps)

        def work(lo: int, hi: int, t: np.ndarray, u: np.ndarray) -> None:
            # same operation order as torch.optim.AdamW (decay, moments, addcdiv)
            for i in range(lo, hi, _ADAM_CHUNK):
                j = min(i + _ADAM_CHUNK, hi)
                pi, gi, mi, vi, ti, ui = p[i:j], g[i:j], mm[i:j], vv[i:j], t[:j - i], u[:j - i]
                if weight_decay != 0.0:
                    pi *= decay
                mi *= b1
                np.multiply(gi, c1, out=ti)
                mi += ti
                vi *= b2
                np.multiply(gi, gi, out=ti)
                ti *= c2
                vi += ti
                np.sqrt(vi, out=ti)
                ti *= rbc2
                ti += epsf
                np.divide(mi, ti, out=ui)
                ui *= step_size
                pi -= ui

        parts = self.threads if (self._pool is not None and n >= 4 * _ADAM_CHUNK) else 1
        bounds = [(n * i // parts) // _ADAM_CHUNK * _ADAM_CHUNK for i in range(parts)] + [n]
        scratch = [(self._tmp(f"adam_t{i}", (_ADAM_CHUNK,)), self._tmp(f"adam_u{i}", (_ADAM_CHUNK,)))
                   for i in range(parts)]
        if parts == 1:
            work(0, n, *scratch[0])
        else:
            futures = [self._pool.submit(work, bounds[i], bounds[i + 1], *scratch[i]) for i in range(parts)]
            for f in futures:
                f.result()
        if master is not None:
            param.reshape(-1)[...] = p


THREADS_MAX = 1024  # --backend-opt threads


class CpuPlugin(BackendPlugin):
    name = "cpu"
    priority = 0
    default_dtype = FLOAT32
    reference = True

    def probe(self):
        blas = ""
        try:
            cfg = np.show_config(mode="dicts")
            blas = " with " + cfg["Build Dependencies"]["blas"]["name"]
        except Exception:
            pass
        return True, f"numpy {np.__version__}{blas}, {os.cpu_count()} cores"

    def devices(self):
        return ["host"]

    options = {"threads": f"threads of the AdamW update, 1..{THREADS_MAX} (BLAS keeps its own; OPENBLAS_NUM_THREADS "
                          "sets those) (default: the cores, at most 8)"}

    def create(self, device=None, dtype=None, options=None):
        if dtype not in (None, FLOAT32):
            raise BackendUnavailable(f"the cpu backend computes in float32 only (asked for {dtype}); "
                                     "use --dtype fp32")
        # a thread pool of that many workers splits each AdamW update that many ways: a huge count never finishes
        threads = option_int(options, "threads", None, min=1, max=THREADS_MAX)
        if device not in (None, "host", "cpu"):
            raise BackendUnavailable(f"the cpu backend has one device, 'host' (asked for '{device}')")
        return CpuBackend(threads)
