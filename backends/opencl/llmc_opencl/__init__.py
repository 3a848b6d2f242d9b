"""llmc's OpenCL backend: every kernel of `llmc_cli.kernels` as OpenCL C, float32, through PyOpenCL.

Runs on any OpenCL 1.2+ device: PoCL's CPU device (``pip install "pyopencl[pocl]"``) in CI, vendor GPU drivers
elsewhere. The kernels live in ``kernels.cl`` and ``sgemm.cl`` beside this file; programs are built once per
context and cached. Matmuls (including attention's batched products) go through a tiled, register-blocked
SGEMM whose tile sizes come from a short autotune run cached per device (``llmc_opencl.tune``).

Buffers are ``pyopencl.array.Array``; a view is an Array slice (same ``base_data``, an ``offset``), and every
kernel takes (base buffer, element offset) pairs, so views need no sub-buffers.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from llmc_cli.kernels import (CAP_COPY_OVERLAP, CAP_KV_CACHE, FLOAT32, INT32, Backend, BackendPlugin,
                              BackendUnavailable, MemoryReport, VariantUnsupported, check_decode_chunk, guard_scale,
                              option_choice, option_int)

from . import clblast
from . import tune as _tune
from .probe import check, no_device_reason
from .programs import bo as _bo
from .programs import build_program

try:
    import pyopencl as cl
    import pyopencl.array as cla
    _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - exercised by test_probe_without_pyopencl
    cl = cla = None
    _IMPORT_ERROR = e

__all__ = ["OpenCLBackend", "OpenCLPlugin", "list_devices", "select_device"]

_NP_DTYPES = {FLOAT32: np.float32, INT32: np.int32}
_DECODE_MAX_HD = 256  # kernels.cl's DECODE_MAX_HD: output elements of a head per attention_decode launch
_ATTN_SCRATCH_BYTES = 256 << 20  # per (S, dP) scratch; attention is chunked over the batch to stay under it
# elementwise kernels (each its kernels.cl name) whose work-group size a variant sets: "wg<n>" (Backend.variants)
_WG_VARIANTS = ("residual_forward", "gelu_forward", "gelu_backward", "swiglu_forward", "swiglu_backward",
                "adamw_update")



# ---- devices -------------------------------------------------------------------------------------------------
def _all_devices():
    out = []
    for pi, plat in enumerate(cl.get_platforms()):
        try:
            devs = plat.get_devices()
        except cl.Error:
            continue
        for di, dev in enumerate(devs):
            out.append((pi, di, plat, dev))
    return out


def _dev_label(pi, di, plat, dev) -> str:
    kind = cl.device_type.to_string(dev.type).replace("ALL | ", "")
    return f"{pi}:{di} {plat.name.strip()}: {dev.name.strip()} ({kind}, {dev.max_compute_units} CUs)"


def list_devices() -> list[str]:
    """Every device's label, those that run kernels first; the others say why they cannot."""
    devs = [(d, _why_not(d)) for d in _all_devices()]
    return ([_dev_label(*d) for d, why in devs if not why]
            + [f"{_dev_label(*d)} -- unusable: {why}" for d, why in devs if why])


def _is_gpu(dev) -> bool:
    return bool(dev.type & cl.device_type.GPU)


def _why_not(d) -> str:
    """"" when the device builds and runs a kernel, else why not (llmc_opencl.probe, cached)."""
    return check(d[2], d[3])


def _unusable(d, reason: str) -> BackendUnavailable:
    return BackendUnavailable(f"OpenCL device {_dev_label(*d)}: {reason}")


def select_device(device: str | None = None):
    """(platform, device) for a selector: None = the fastest GPU, else the first CPU / any device, among those
    that build and run a kernel; "P:D" = platform P's device D; "gpu" / "cpu" = the first such usable device;
    anything else = the first device whose label contains it (case-insensitive). A device chosen by name that
    cannot run kernels is refused with its reason."""
    devs = _all_devices()
    if not devs:
        raise BackendUnavailable(no_device_reason(cl.get_platforms()))
    if device is None or device in ("", "auto", "default"):
        ok = [d for d in devs if not _why_not(d)]
        if not ok:
            raise _unusable(devs[0], _why_not(devs[0]))
        gpus = [d for d in ok if _is_gpu(d[3])]
        if gpus:
            best = max(gpus, key=lambda d: d[3].max_compute_units * max(1, d[3].max_clock_frequency))
            return best[2], best[3]
        cpus = [d for d in ok if d[3].type & cl.device_type.CPU]
        d = (cpus or ok)[0]
        return d[2], d[3]
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", device)
    if m:
        pi, di = int(m.group(1)), int(m.group(2))
        found = [d for d in devs if d[0] == pi and d[1] == di]
        if not found:
            raise BackendUnavailable(f"no OpenCL device {pi}:{di} (have: {'; '.join(_dev_label(*d) for d in devs)})")
    elif device.lower() in ("gpu", "cpu"):
        want = cl.device_type.GPU if device.lower() == "gpu" else cl.device_type.CPU
        found = [d for d in devs if d[3].type & want]
    else:
        found = [d for d in devs if device.lower() in _dev_label(*d).lower()]
    if not found:
        raise BackendUnavailable(f"no OpenCL device matches '{device}' (have: "
                                 f"{'; '.join(_dev_label(*d) for d in devs)})")
    for d in found:
        if not _why_not(d):
            return d[2], d[3]
    raise _unusable(found[0], _why_not(found[0]))


def _overlaps(k1, k2) -> bool:
    """Do two (buffer pointer, byte offset, bytes) ranges overlap?"""
    return k1[0] == k2[0] and k1[1] < k2[1] + k2[2] and k2[1] < k1[1] + k1[2]


RED_LS_MAX = 1024  # --backend-opt red_ls: work-items per row, a power of two up to a work-group's usual limit
SPLITK_MIN, SPLITK_MAX = 16, 1 << 24  # --backend-opt splitk: 0 (off) or a K chunk in this range
_TUNE_ALIASES = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


def read_options(opts: dict[str, str] | None, cpu: bool) -> dict:
    """The backend's settings from `opts` (--backend-opt), else their environment variables, else the defaults of a
    CPU device (`cpu`) or a GPU: every value checked, BackendUnavailable naming the option or variable otherwise
    (LLMC_OPENCL_TUNE=garbage is refused, not taken as on)."""
    return {
        "tune": option_choice(opts, "tune", ("on", "off", "force"), "on", env="LLMC_OPENCL_TUNE", aliases=_TUNE_ALIASES),
        "blas": option_choice(opts, "blas", ("llmc", "clblast"), "llmc", env="LLMC_OPENCL_BLAS"),
        "red_ls": option_int(opts, "red_ls", 1 if cpu else 256, env="LLMC_OPENCL_RED_LS", min=1, max=RED_LS_MAX,
                             power_of_two=True),
        "splitk": option_int(opts, "splitk", 512 if cpu else 0, env="LLMC_OPENCL_SPLITK", min=SPLITK_MIN,
                             max=SPLITK_MAX, off=0),
    }


class OpenCLBackend(Backend):
    name = "opencl"
    dtype = FLOAT32
    capabilities = frozenset({CAP_COPY_OVERLAP, CAP_KV_CACHE})

    def __init__(self, platform, device, tune: bool | None = None, options: dict[str, str] | None = None):
        opts = options or {}
        self.platform, self.device = platform, device
        self.ctx = cl.Context([device])
        self.queue = cl.CommandQueue(self.ctx)
        ls = 1
        # reductions: 256 items per row on GPUs; one item per row on CPU devices, where PoCL would otherwise
        # run every work-item to each barrier in turn and stride through memory (option red_ls overrides)
        settings = read_options(opts, cpu=bool(device.type & cl.device_type.CPU))
        cap = settings["red_ls"]
        while ls * 2 <= min(cap, device.max_work_group_size):
            ls *= 2
        self.red_ls = ls
        # split-K chunk for long-K NN products on CPU devices (0 = off; option splitk overrides)
        self._splitk = settings["splitk"]
        _, self.k = build_program(self.ctx, "kernels.cl", f"-DRED_LS={ls}")
        self._allocated: dict[str, int] = defaultdict(int)
        self._scratch: dict[str, object] = {}
        self._int_host: dict[tuple, np.ndarray] = {}  # (buffer, byte offset, bytes) -> the int32 ids uploaded
        self._wg = min(256, device.max_work_group_size)
        self._wg_of: dict[str, int] = {}  # kernel -> work-group size inside `variant`
        self._tune = _tune
        self._gemm_kernels: dict[tuple, tuple] = {}
        self._dummy = cla.zeros(self.queue, (4,), np.float32)
        self.gemm_config = dict(_tune.default_config(device), source="default")
        self.gemm_config = _tune.get_config(self, tune, mode=settings["tune"])
        self._overlap = None  # `llmc bench overlap`'s queues (overlap.py), made on first use
        self.blas = None  # an optional external BLAS (CLBlast) when present and faster
        try:
            self.blas = clblast.maybe_load(self, settings["blas"])
        except Exception:  # pragma: no cover - the fallback is always ours
            self.blas = None
        if settings["blas"] == "clblast" and self.blas is None:  # asked for by name: not silently llmc's instead
            raise BackendUnavailable("blas=clblast: CLBlast's library (libclblast) does not load here; install it, "
                                     "or leave the option out (blas=llmc)")

    # ---- launching -----------------------------------------------------------------------------------------
    def _ew(self, kname: str, n: int, *args):
        """Elementwise launch over n items (kernel checks bounds)."""
        if n <= 0:
            return
        wg = self._wg_of.get(kname, self._wg)
        if kname in self._wg_of:
            most = self.k[kname].get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, self.device)
            if wg > most:
                raise VariantUnsupported(f"work-groups of {wg}; this device runs {kname} in at most {most}")
        g = (n + wg - 1) // wg * wg
        self.k[kname](self.queue, (g,), (wg,), *args)

    # ---- variants (Backend.variants): the elementwise kernels' work-group sizes ---------------------------------
    def variants(self, kernel):
        if kernel not in _WG_VARIANTS:
            return []
        return [f"wg{n}" for n in (32, 64, 128, 256, 512, 1024) if n <= self.device.max_work_group_size]

    @contextmanager
    def variant(self, kernel, name):
        if name is None:
            yield
            return
        if name not in self.variants(kernel):
            raise ValueError(f"the opencl backend has no variant {name!r} of {kernel} "
                             f"(variants: {', '.join(self.variants(kernel)) or 'none'})")
        saved = self._wg_of.get(kernel)
        self._wg_of[kernel] = int(name[2:])
        try:
            yield
        finally:
            if saved is None:
                del self._wg_of[kernel]
            else:
                self._wg_of[kernel] = saved

    def _rows(self, kname: str, rows: int, *args):
        """One work-group of red_ls items per row."""
        if rows <= 0:
            return
        self.k[kname](self.queue, (rows * self.red_ls,), (self.red_ls,), *args)

    def _tmp(self, key: str, n: int, dtype=np.float32):
        """Scratch kept between calls (grown when too small), so steady-state steps allocate nothing."""
        a = self._scratch.get(key)
        if a is None or a.size < n or a.dtype != dtype:
            a = cla.empty(self.queue, (max(n, 1),), dtype)
            self._scratch[key] = a
        return a

    # ---- memory --------------------------------------------------------------------------------------------
    def alloc(self, shape, dtype=FLOAT32, tag="other"):
        if dtype not in _NP_DTYPES:
            raise BackendUnavailable(f"opencl backend has no dtype {dtype} (float32 only)")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        a = cla.empty(self.queue, shape, _NP_DTYPES[dtype])
        self._allocated[tag] += a.nbytes
        return a

    def upload(self, dst, host):
        h = np.ascontiguousarray(np.asarray(host).reshape(dst.shape), dtype=dst.dtype)
        if dst.dtype == np.int32:  # keep the uploaded ids (tokens, targets): used without a device read-back
            key = self._ikey(dst)
            self._int_host = {k: v for k, v in self._int_host.items() if not _overlaps(k, key)}
            self._int_host[key] = h.copy()
        dst.set(h)

    @staticmethod
    def _ikey(a):
        return (a.base_data.int_ptr, a.offset, a.nbytes)

    def _forget(self, dst):
        if dst.dtype == np.int32 and self._int_host:
            key = self._ikey(dst)
            self._int_host = {k: v for k, v in self._int_host.items() if not _overlaps(k, key)}

    def _ints(self, a):
        """Host copy of an int32 buffer: the array last uploaded into exactly it (no device round trip), else
        read back (ids written on the device)."""
        hit = self._int_host.get(self._ikey(a))
        return hit if hit is not None else a.get()

    def download(self, src):
        return src.get()

    def fill(self, buf, value):
        self._forget(buf)
        b, o = _bo(buf)
        if buf.dtype == np.int32:
            self._ew("fill_i32", buf.size, b, o, buf.size, int(value))
        else:
            self._ew("fill_f32", buf.size, b, o, buf.size, float(value))

    def copy(self, dst, src):
        if dst.size != src.size:
            raise ValueError(f"copy of {src.size} elements into {dst.size}")
        self._forget(dst)
        if dst.dtype != src.dtype:  # rare (int32 <-> float32): through the host
            self.upload(dst, self.download(src).astype(dst.dtype))
            return
        if dst.size == 0:
            return
        cl.enqueue_copy(self.queue, dst.base_data, src.base_data, byte_count=src.nbytes,
                        src_offset=src.offset, dst_offset=dst.offset)

    def synchronize(self):
        self.queue.finish()

    def is_out_of_memory(self, e: BaseException) -> bool:
        """An OpenCL allocation failure (the driver's MEM_OBJECT_ALLOCATION_FAILURE / OUT_OF_RESOURCES)."""
        text = f"{type(e).__name__} {e}".lower()
        return (isinstance(e, MemoryError) or "mem_object_allocation_failure" in text
                or "out_of_resources" in text or "out of memory" in text)

    def memory_report(self):
        return MemoryReport(allocated=sum(self._allocated.values()), by_tag=dict(self._allocated),
                            device_total=int(self.device.global_mem_size))

    def describe(self):
        gemm = ((f"forward SGEMM: CLBlast {self.blas.version}, other products: " if self.blas is not None
                 else "SGEMM: ") + "llmc " + ", ".join(f"{lay} {self._tune.config_name(self.gemm_config[lay])}"
                                           for lay in self._tune.LAYOUTS) + f" ({self.gemm_config['source']})")
        return (f"OpenCL {self.device.name.strip()} on {self.platform.name.strip()} "
                f"({self.device.max_compute_units} CUs, {self.device.global_mem_size >> 20} MiB); {gemm}")

    # ---- copy/compute overlap (`llmc bench overlap`: overlap.py, overlap.cl) -----------------------------------
    def _overlapper(self):
        if self._overlap is None:
            from .overlap import Overlap  # (imports pyopencl at its top, which this module may lack)
            self._overlap = Overlap(self)
        return self._overlap

    def host_alloc(self, shape, pinned=False):
        return self._overlapper().host_alloc(shape, pinned)

    def overlap_layernorm(self, out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias, *, mode,
                          streams, block):
        return self._overlapper().layernorm(out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias,
                                            mode=mode, streams=streams, block=block)

    # ---- SGEMM ---------------------------------------------------------------------------------------------
    def _gemm_kernel(self, a_t: int, b_t: int, config: dict | None = None, va: int = 0, vb: int = 0):
        c = config or self.gemm_config[("T" if a_t else "N") + ("T" if b_t else "N")]
        key = (a_t, b_t, va, vb) + self._tune.config_key(c)
        hit = self._gemm_kernels.get(key)
        if hit is None:
            layout = ("T" if a_t else "N") + ("T" if b_t else "N")
            _, ks = build_program(self.ctx, *self._tune.build_options(c, layout, va, vb))
            hit = self._gemm_kernels[key] = (ks["sgemm"], c)
        return hit

    def gemm(self, a_t, b_t, M, N, K, A, a_off, lda, B, b_off, ldb, Cb, c_off, ldc, *, batch=1, zdiv=1,
             a_so=0, a_si=0, a_g=1, b_so=0, b_si=0, b_g=1, c_so=0, c_si=0, alpha=1.0, accumulate=False,
             bias=None, aux=None, epi=0, causal=0, config=None):
        """C (M,N) [+]= alpha * op(A) @ op(B) on raw (buffer, element offset) operands; see sgemm.cl."""
        if M <= 0 or N <= 0 or batch <= 0:
            return
        if (self._splitk and config is None and batch == 1 and causal == 0 and not a_t and not b_t
                and K >= 2 * self._splitk and M * N <= (1 << 22)):
            # CPU devices, long K (the classifier's dinp, K = vocab): consecutive K chunks as a batch, so each
            # chunk of B is reused from cache by every row block, then one fixed-order sum with the epilogue
            KC = self._splitk
            S0, rem = divmod(K, KC)
            S = S0 + (rem > 0)
            P = self._tmp("splitk", S * M * N)
            self.gemm(0, 0, M, N, KC, A, a_off, lda, B, b_off, ldb, P.data, 0, N, batch=S0, a_so=KC,
                      b_so=KC * ldb, c_so=M * N)
            if rem:
                self.gemm(0, 0, M, N, rem, A, a_off + S0 * KC, lda, B, b_off + S0 * KC * ldb, ldb, P.data,
                          S0 * M * N, N)
            bb, bo = _bo(bias) if bias is not None else (self._dummy.base_data, 0)
            xb, xo = _bo(aux) if aux is not None else (self._dummy.base_data, 0)
            self._ew("splitk_reduce", M * N, Cb, c_off, ldc, P.data, S, M, N, alpha, int(bool(accumulate)),
                     bb, bo, int(bias is not None), xb, xo, epi)
            return
        c = config or self.gemm_config[("T" if a_t else "N") + ("T" if b_t else "N")]
        va = vb = 0
        if c.get("VEC") and c.get("PREF"):
            # float4 global reads need every operand start 16-byte aligned (buffer bases are) and whole float4s
            # along the contiguous dimension, so that the kernel's per-float4 edge test is exact
            def vec_ok(off, ld, so, si, inner, tile):
                return all(v % 4 == 0 for v in (off, ld, so, si, inner, tile))
            va = int(vec_ok(a_off, lda, a_so, a_si, M if a_t else K, c["TM"] if a_t else c["TK"]))
            vb = int(vec_ok(b_off, ldb, b_so, b_si, K if b_t else N, c["TK"] if b_t else c["TN"]))
        knl, c = self._gemm_kernel(a_t, b_t, c, va, vb)
        if c.get("kind", "tiled") == "direct":
            lx, ly = c["LX"], c["LY"]
            gsize = (-(-N // (c["RN"] * lx)) * lx, -(-M // (c["RM"] * ly)) * ly, batch)
            lsize = (lx, ly, 1)
        else:
            rtm, rtn = c["TM"] // c["WPTM"], c["TN"] // c["WPTN"]
            gsize = ((N + c["TN"] - 1) // c["TN"] * rtn, (M + c["TM"] - 1) // c["TM"] * rtm, batch)
            lsize = (rtn, rtm, 1)
        bb, bo = _bo(bias) if bias is not None else (self._dummy.base_data, 0)
        xb, xo = _bo(aux) if aux is not None else (self._dummy.base_data, 0)
        knl(self.queue, gsize, lsize, M, N, K,
            A, a_off, lda, a_so, a_si, a_g,
            B, b_off, ldb, b_so, b_si, b_g,
            Cb, c_off, ldc, c_so, c_si,
            zdiv, alpha, int(bool(accumulate)), bb, bo, int(bias is not None), xb, xo, epi, causal)

    def _colsum(self, out, x, rows: int, C: int):
        """out (C,) += column sums of x (rows, C), in a fixed order."""
        R = 64
        nk = (rows + R - 1) // R
        p = self._tmp("colsum", nk * C)
        xb, xo = _bo(x)
        gc = (C + 63) // 64 * 64
        self.k["colsum_partial"](self.queue, (gc, nk), (64, 1), p.data, xb, xo, rows, C, R)
        ob, oo = _bo(out)
        self._ew("colsum_finish", C, ob, oo, p.data, nk, C)

    # ---- encoder --------------------------------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        B, T = inp.shape[0], inp.shape[1]
        C = wte.shape[-1]
        n = B * T * C
        pe = _bo(wpe) if wpe is not None else (self._dummy.data, 0)
        self._ew("encoder_forward", n, *_bo(out), *_bo(inp), *_bo(wte), *pe, int(wpe is not None), T, C, n)

    def encoder_backward(self, dwte, dwpe, dout, inp):
        B, T = inp.shape[0], inp.shape[1]
        C = dout.shape[-1]
        # group rows by token on the host, from the ids the host uploaded (no read-back): a stable order makes
        # the per-token sums deterministic without atomics
        ids = self._ints(inp).reshape(-1)
        order = np.argsort(ids, kind="stable").astype(np.int32)
        sids = ids[order]
        starts = np.flatnonzero(np.r_[True, sids[1:] != sids[:-1]]) if sids.size else np.zeros(0, np.int64)
        U = int(starts.size)
        if U:
            seg = np.r_[starts, sids.size].astype(np.int32)
            tok = sids[starts].astype(np.int32)
            o_ = self._tmp("enc_order", order.size, np.int32)
            s_ = self._tmp("enc_seg", seg.size, np.int32)
            t_ = self._tmp("enc_tok", tok.size, np.int32)
            # non-blocking (PyOpenCL's NannyEvent keeps the host arrays alive): the queue never drains here
            cl.enqueue_copy(self.queue, o_.data, order, is_blocking=False)
            cl.enqueue_copy(self.queue, s_.data, seg, is_blocking=False)
            cl.enqueue_copy(self.queue, t_.data, tok, is_blocking=False)
            bufs = (o_.data, s_.data, t_.data)
            gc = (C + 63) // 64 * 64
            self.k["encoder_backward_wte"](self.queue, (gc, U), (64, 1), *_bo(dwte), *_bo(dout), *bufs, C, U)
        if dwpe is not None:
            self._ew("encoder_backward_wpe", T * C, *_bo(dwpe), *_bo(dout), B, T, C)

    # ---- layernorm ------------------------------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        C = weight.size
        rows = inp.size // C
        self._rows("layernorm_forward", rows, *_bo(out), *_bo(mean), *_bo(rstd), *_bo(inp),
                   self._dummy.data, 0, self._dummy.data, 0, 0, *_bo(weight), *_bo(bias), C)

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        C = weight.size
        rows = inp1.size // C
        self._rows("layernorm_forward", rows, *_bo(out), *_bo(mean), *_bo(rstd), *_bo(inp1), *_bo(inp2),
                   *_bo(residual), 1, *_bo(weight), *_bo(bias), C)

    def _norm_dparams(self, dweight, dbias, dout, inp, mean, rstd, rows, C, is_rms):
        R = 64
        nk = (rows + R - 1) // R
        pw = self._tmp("ln_pw", nk * C)
        pb = self._tmp("ln_pb", nk * C) if not is_rms else pw
        mb, mo = _bo(mean) if mean is not None else (self._dummy.data, 0)
        gc = (C + 63) // 64 * 64
        self.k["norm_dparams_partial"](self.queue, (gc, nk), (64, 1), pw.data, pb.data, *_bo(dout), *_bo(inp),
                                       mb, mo, *_bo(rstd), int(is_rms), rows, C, R)
        self._ew("colsum_finish", C, *_bo(dweight), pw.data, nk, C)
        if not is_rms:
            self._ew("colsum_finish", C, *_bo(dbias), pb.data, nk, C)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        C = weight.size
        rows = inp.size // C
        self._norm_dparams(dweight, dbias, dout, inp, mean, rstd, rows, C, False)
        self._rows("layernorm_backward_dinp", rows, *_bo(dinp), *_bo(dout), *_bo(inp), *_bo(weight), *_bo(mean),
                   *_bo(rstd), C)

    def residual_forward(self, out, inp1, inp2):
        n = out.size
        self._ew("residual_forward", n, *_bo(out), *_bo(inp1), *_bo(inp2), n)

    def scale(self, buf, factor):
        self._ew("scale_f32", buf.size, *_bo(buf), buf.size, float(factor))

    # ---- rmsnorm --------------------------------------------------------------------------------------------
    def rmsnorm_forward(self, out, rstd, inp, weight, eps):
        C = weight.size
        rows = inp.size // C
        self._rows("rmsnorm_forward", rows, *_bo(out), *_bo(rstd), *_bo(inp), *_bo(weight), float(eps), C)

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd):
        C = weight.size
        rows = inp.size // C
        self._norm_dparams(dweight, None, dout, inp, None, rstd, rows, C, True)
        self._rows("rmsnorm_backward_dinp", rows, *_bo(dinp), *_bo(dout), *_bo(inp), *_bo(weight), *_bo(rstd), C)

    # ---- matmul ---------------------------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias=None, pre_gelu=None):
        OC, C = weight.shape
        N = inp.size // C
        target = pre_gelu if pre_gelu is not None else out
        if self.blas is not None and self.blas.matmul_forward(target, inp, weight, N, OC, C):
            if bias is not None or pre_gelu is not None:
                self._bias_gelu(target, out, bias, pre_gelu, N, OC)
            return
        tb, to = _bo(target)
        ib, io = _bo(inp)
        wb, wo = _bo(weight)
        aux = out if pre_gelu is not None else None
        self.gemm(0, 1, N, OC, C, ib, io, C, wb, wo, C, tb, to, OC, bias=bias, aux=aux,
                  epi=1 if pre_gelu is not None else 0)

    def _bias_gelu(self, target, out, bias, pre_gelu, N, OC):  # epilogue after an external GEMM
        if bias is not None:
            self.gemm(0, 0, N, OC, 1, self._ones(N).data, 0, 1, *_bo(bias), OC, *_bo(target), OC,
                      accumulate=True)
        if pre_gelu is not None:
            self.gelu_forward(out, pre_gelu)

    def _ones(self, n):
        a = self._scratch.get("ones")
        if a is None or a.size < n:
            a = cla.empty(self.queue, (n,), np.float32)
            a.fill(1.0)
            self._scratch["ones"] = a
        return a

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu=None):
        OC, C = weight.shape
        N = inp.size // C
        gb, go = _bo(dout)
        if dinp is not None:
            db, do = _bo(dinp)
            wb, wo = _bo(weight)
            if pre_gelu is not None:
                self.gemm(0, 0, N, C, OC, gb, go, OC, wb, wo, C, db, do, C, aux=pre_gelu, epi=2)
            else:
                self.gemm(0, 0, N, C, OC, gb, go, OC, wb, wo, C, db, do, C)
        if dbias is not None:
            self._colsum(dbias, dout, N, OC)
        ib, io = _bo(inp)
        self.gemm(1, 0, OC, C, N, gb, go, OC, ib, io, C, *_bo(dweight), C, accumulate=True)

    # ---- elementwise ----------------------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        n = inp.size
        self._ew("gelu_forward", n, *_bo(out), *_bo(inp), n)

    def gelu_backward(self, dinp, inp, dout):
        n = inp.size
        self._ew("gelu_backward", n, *_bo(dinp), *_bo(inp), *_bo(dout), n)

    def swiglu_forward(self, out, inp):
        H = out.shape[-1]
        n = out.size
        self._ew("swiglu_forward", n, *_bo(out), *_bo(inp), H, n)

    def swiglu_backward(self, dinp, dout, inp):
        H = dout.shape[-1]
        n = dout.size
        self._ew("swiglu_backward", n, *_bo(dinp), *_bo(dout), *_bo(inp), H, n)

    # ---- rope -----------------------------------------------------------------------------------------------
    def _rope(self, qkv, freqs_cis, n_head, n_kv_head, sign):
        B, T, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        nqk = n_head + n_kv_head
        n = B * T * nqk * (hd // 2)
        self._ew("rope", n, *_bo(qkv), *_bo(freqs_cis), T, W, nqk, hd, float(sign), n)

    def rope_forward(self, qkv, freqs_cis, n_head, n_kv_head):
        self._rope(qkv, freqs_cis, n_head, n_kv_head, 1.0)

    def rope_backward(self, dqkv, freqs_cis, n_head, n_kv_head):
        self._rope(dqkv, freqs_cis, n_head, n_kv_head, -1.0)

    # ---- attention ------------------------------------------------------------------------------------------
    def _attn_chunk(self, B, T, NH):
        per_b = NH * T * T * 4
        return max(1, min(B, _ATTN_SCRATCH_BYTES // max(per_b, 1)))

    def _scores(self, S, qkv_b, q0, T, W, NH, NKV, hd, bc):
        """S (bc*NH, T, T) = Q K^T / sqrt(hd), lower triangle only."""
        g = NH // NKV
        self.gemm(0, 1, T, T, hd, qkv_b, q0, W, qkv_b, q0 + NH * hd, W, S.data, 0, T, batch=bc * NH, zdiv=NH,
                  a_so=T * W, a_si=hd, b_so=T * W, b_si=hd, b_g=g, c_so=NH * T * T, c_si=T * T,
                  alpha=1.0 / math.sqrt(hd), causal=2)

    def attention_forward(self, out, lse, qkv, n_head, n_kv_head):
        B, T, W = qkv.shape
        NH, NKV = n_head, n_kv_head
        hd = W // (NH + 2 * NKV)
        g = NH // NKV
        qb, qo = _bo(qkv)
        ob, oo = _bo(out)
        lb, lo = _bo(lse)
        bc = self._attn_chunk(B, T, NH)
        S = self._tmp("att_s", bc * NH * T * T)
        for b0 in range(0, B, bc):
            nb = min(bc, B - b0)
            q0 = qo + b0 * T * W
            self._scores(S, qb, q0, T, W, NH, NKV, hd, nb)
            self._rows("attn_softmax_forward", nb * NH * T, S.data, 0, lb, lo + b0 * NH * T, T)
            self.gemm(0, 0, T, hd, T, S.data, 0, T, qb, q0 + (NH + NKV) * hd, W, ob, oo + b0 * T * NH * hd,
                      NH * hd, batch=nb * NH, zdiv=NH, a_so=NH * T * T, a_si=T * T, b_so=T * W, b_si=hd, b_g=g,
                      c_so=T * NH * hd, c_si=hd, causal=1)

    def attention_backward(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, W = qkv.shape
        NH, NKV = n_head, n_kv_head
        hd = W // (NH + 2 * NKV)
        g = NH // NKV
        qb, qo = _bo(qkv)
        db, do = _bo(dqkv)
        gb, go = _bo(dout)
        ob, oo = _bo(out)
        lb, lo = _bo(lse)
        bc = self._attn_chunk(B, T, NH)
        P = self._tmp("att_s", bc * NH * T * T)
        dP = self._tmp("att_dp", bc * NH * T * T)
        dkv = self._tmp("att_dkv", bc * NH * T * hd) if g > 1 else None
        scale = 1.0 / math.sqrt(hd)
        for b0 in range(0, B, bc):
            nb = min(bc, B - b0)
            Z = nb * NH
            q0 = qo + b0 * T * W
            d0 = do + b0 * T * W
            g0 = go + b0 * T * NH * hd
            self._scores(P, qb, q0, T, W, NH, NKV, hd, nb)
            n = Z * T * T
            self._ew("attn_probs_from_lse", n, P.data, 0, lb, lo + b0 * NH * T, T, n)

            def to_kv(section: int):  # where dK / dV of query heads go: straight into dqkv, or summed per group
                if g == 1:
                    return dict(Cb=db, c_off=d0 + section * hd, ldc=W, c_so=T * W, c_si=hd)
                return dict(Cb=dkv.data, c_off=0, ldc=hd, c_so=NH * T * hd, c_si=T * hd)

            def group_sum(section: int):
                if g > 1:
                    m = nb * T * NKV * hd
                    self._ew("attn_group_sum", m, db, d0 + section * hd, W, dkv.data, 0, T, NH, NKV, hd, m)

            # dV = P^T dO
            self.gemm(1, 0, T, hd, T, P.data, 0, T, gb, g0, NH * hd, **to_kv(NH + NKV), batch=Z, zdiv=NH,
                      a_so=NH * T * T, a_si=T * T, b_so=T * NH * hd, b_si=hd, causal=3)
            group_sum(NH + NKV)
            # dP = dO V^T
            self.gemm(0, 1, T, T, hd, gb, g0, NH * hd, qb, q0 + (NH + NKV) * hd, W, dP.data, 0, T, batch=Z,
                      zdiv=NH, a_so=T * NH * hd, a_si=hd, b_so=T * W, b_si=hd, b_g=g, c_so=NH * T * T,
                      c_si=T * T, causal=2)
            # dS = P * (dP - rowsum(dO*O)) * scale, in place over dP
            self._rows("attn_softmax_backward", Z * T, dP.data, 0, P.data, 0, gb, g0, ob,
                       oo + b0 * T * NH * hd, T, NH, hd, scale)
            # dQ = dS K
            self.gemm(0, 0, T, hd, T, dP.data, 0, T, qb, q0 + NH * hd, W, db, d0, W, batch=Z, zdiv=NH,
                      a_so=NH * T * T, a_si=T * T, b_so=T * W, b_si=hd, b_g=g, c_so=T * W, c_si=hd, causal=1)
            # dK = dS^T Q
            self.gemm(1, 0, T, hd, T, dP.data, 0, T, qb, q0, W, **to_kv(NH), batch=Z, zdiv=NH,
                      a_so=NH * T * T, a_si=T * T, b_so=T * W, b_si=hd, causal=3)
            group_sum(NH)

    # qkv (B,Tn,(NH+2*NKV)*hd) of new tokens at pos..; k_cache, v_cache (B,NKV,S,hd) rings; out (B,Tn,NH*hd)
    def attention_decode(self, out, qkv, k_cache, v_cache, pos, n_head, n_kv_head):
        B, Tn, W = qkv.shape
        NH, NKV = n_head, n_kv_head
        hd = W // (NH + 2 * NKV)
        S = k_cache.shape[2]
        if not isinstance(pos, (int, np.integer)):  # a (1,) int32 buffer holding the position (one new token)
            if Tn != 1:
                raise ValueError("attention_decode: a position held in a buffer takes one new token at a time")
            pos = int(pos.get().reshape(-1)[0])
        check_decode_chunk(pos, Tn, S)
        kb, ko = _bo(k_cache)
        vb, vo = _bo(v_cache)
        qb, qo = _bo(qkv)
        ob, oo = _bo(out)
        n = B * Tn * NKV * hd
        self._ew("kv_cache_append", n, kb, ko, vb, vo, qb, qo, Tn, NH, NKV, hd, S, pos, n)
        for d0 in range(0, hd, _DECODE_MAX_HD):  # a head larger than the kernel's output block: one launch a block
            self._rows("attention_decode", B * NH * Tn, ob, oo, qb, qo, kb, ko, vb, vo, Tn, NH, NKV, hd, S, pos,
                       1.0 / math.sqrt(hd), d0)

    # ---- fused classifier -----------------------------------------------------------------------------------
    def classifier_forward_backward(self, logits, losses, targets, vocab_size, dloss):
        Vp = logits.shape[-1]
        N = logits.size // Vp
        if targets.size:
            t = self._ints(targets)
            if t.min() < 0 or t.max() >= vocab_size:
                raise ValueError(f"target token id out of range [0, {vocab_size})")
        self._rows("classifier_forward_backward", N, *_bo(logits), *_bo(losses), *_bo(targets), vocab_size, Vp,
                   int(dloss is not None), float(dloss or 0.0))

    # ---- optimizer ------------------------------------------------------------------------------------------
    def global_norm_squared(self, out, grads):
        ls = self.red_ls
        plan = []
        total = 0
        for gr in grads:
            n = gr.size
            groups = max(1, min(64, (n + ls * 8 - 1) // (ls * 8)))
            plan.append((gr, n, groups, total))
            total += groups
        p = self._tmp("norm_partial", max(total, 1))
        for gr, n, groups, slot in plan:
            if n:
                self.k["sumsq_partial"](self.queue, (groups * ls,), (ls,), p.data, slot, *_bo(gr), n)
            else:
                self._ew("fill_f32", 1, p.data, slot, 1, 0.0)
        self.k["sum_final"](self.queue, (ls,), (ls,), *_bo(out), p.data, total)

    def adamw_update(self, param, grad, m, v, master, *, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale, seed, guard=None):
        if guard is not None:  # read back (a sync); the guarded step saves host round trips only on CUDA
            apply, grad_scale = guard_scale(self.download(guard))
            if not apply:
                return
        p = master if master is not None else param
        n = p.size
        mir = _bo(param) if master is not None else (self._dummy.data, 0)
        self._ew("adamw_update", n, *_bo(p), *_bo(grad), *_bo(m), *_bo(v), *mir, int(master is not None), n,
                 lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step), 1.0 - lr * weight_decay,
                 int(weight_decay != 0.0), beta1, beta2, (1.0 - beta1) * grad_scale,
                 (1.0 - beta2) * grad_scale * grad_scale, eps)


class OpenCLPlugin(BackendPlugin):
    name = "opencl"
    priority = 5  # above the numpy reference, below CUDA
    default_dtype = FLOAT32

    def probe(self):
        if cl is None:
            return False, f"pyopencl is not importable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR})"
        try:
            devs = _all_devices()
        except Exception as e:
            return False, f"no OpenCL platform ({type(e).__name__}: {str(e).strip() or 'none found'})"
        if not devs:
            return False, no_device_reason(cl.get_platforms())
        try:
            plat, dev = select_device(None)
        except BackendUnavailable as e:  # every device failed to build or run a kernel: the first one's reason
            more = f" ({len(devs) - 1} more device(s), none usable)" if len(devs) > 1 else ""
            return False, f"{e}{more}"
        except Exception as e:
            return False, f"no usable OpenCL device ({type(e).__name__}: {e})"
        if dev.type & cl.device_type.CPU:
            # "auto" then prefers the numpy backend: on the same cores it is measured faster than PoCL
            # (d12 B=4 T=64: 1.27-1.35x, docs/performance.md), and it has the KV-cache decode kernel
            self.priority = -1
        broken = sum(1 for d in devs if _why_not(d))
        note = f", {broken} unusable" if broken else ""
        return True, f"{dev.name.strip()} on {plat.name.strip()} ({len(devs)} device(s){note})"

    def devices(self):
        if cl is None:
            return []
        try:
            return list_devices()
        except Exception:
            return []

    options = {
        "tune": "on|off|force: autotune the SGEMM per device once and cache it; force re-runs it (default on; env "
                "LLMC_OPENCL_TUNE; cache file LLMC_OPENCL_TUNE_CACHE)",
        "blas": "llmc|clblast: the forward matmul's library; clblast needs libclblast (default llmc; env "
                "LLMC_OPENCL_BLAS)",
        "splitk": f"K chunk of split-K matmuls on CPU devices, {SPLITK_MIN}..{SPLITK_MAX}, 0 = off (default 512 on "
                  "CPUs, 0 on GPUs; env LLMC_OPENCL_SPLITK)",
        "red_ls": f"work-items per row of the reductions, a power of two up to {RED_LS_MAX} (default 1 on CPUs, 256 on "
                  "GPUs; env LLMC_OPENCL_RED_LS)",
    }

    def create(self, device=None, dtype=None, options=None):
        opts = dict(options or {})
        read_options(opts, cpu=True)  # every option and its environment variable checked before a device opens
        if cl is None:
            raise BackendUnavailable(f"pyopencl is not importable: {_IMPORT_ERROR}")
        if dtype not in (None, FLOAT32):
            raise BackendUnavailable(f"the opencl backend computes in float32 only (asked for {dtype}); "
                                     "use --dtype fp32")
        try:
            plat, dev = select_device(device)
        except BackendUnavailable:
            raise
        except Exception as e:
            raise BackendUnavailable(f"OpenCL unavailable: {type(e).__name__}: {e}") from None
        return OpenCLBackend(plat, dev, options=opts)

    def prepare(self):
        """Every usable device's programs built, its SGEMM tuned and every kernel of a training step and of decoding
        launched once (llmc_opencl.prepare), so that the first run finds all of it in the caches."""
        ok, reason = self.probe()
        if not ok:
            raise BackendUnavailable(reason)
        from .prepare import prepare_device  # (it imports the engine's trainer: only when preparing)
        done = []
        for d in _all_devices():
            if _why_not(d):
                continue
            be = OpenCLBackend(d[2], d[3])
            prepare_device(be)
            done.append(f"{d[3].name.strip()} (SGEMM {be.gemm_config['source']})")
        return (f"programs built, SGEMM tuned and every kernel of a training step and of decoding compiled for "
                f"{'; '.join(done)}")
