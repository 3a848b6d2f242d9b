"""The CUDA backend proper (imported only once CuPy and a device are known to be there)."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import defaultdict, deque
from contextlib import contextmanager
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np

from llmc_cli.kernels import (
    BFLOAT16,
    CAP_ASYNC_INPUTS,
    CAP_BF16,
    CAP_COPY_OVERLAP,
    CAP_DEVICE_EVENTS,
    CAP_FP8,
    CAP_GRAPHS,
    CAP_KV_CACHE,
    CAP_SAMPLING,
    FLOAT32,
    FP8,
    INT32,
    TF32,
    Backend,
    BackendUnavailable,
    MemoryReport,
    VariantUnsupported,
    cache_dir,
    check_decode_chunk,
    check_input_batch,
    option_flag,
    read_cache_json,
    write_cache_file,
)

from .fp8 import Fp8Matmuls
from .options import CUDNN_WORKSPACE_SHARE, cudnn_workspace_cap, fp8_classifier  # (checked in CudaPlugin.create)
from .overlap import Overlap, host_alloc

KERNEL_SOURCE = Path(__file__).with_name("kernels.cu")
_BLOCK = 256
_DECODE_SPLIT = 64  # keys per block of attention_decode_part, one thread each (kernels.cu's DECODE_SPLIT)
_DECODE_MAX_HD = 256  # its shared query row
_GEMV_MAX_N = 8  # matmul_forward for at most this many rows: a warp per output column (kernels.cu's GEMV_MAX_N)
FP8_MIN_CC = 89  # --dtype fp8 below this is refused
_STAGE_MAX = 4 << 20  # uploads up to this size go through pinned staging memory (non-blocking)

# Variants (`llmc bench kernels --variants`, Backend.variants): "b<n>" is the default's code at n threads a block,
# "scalar-b<n>" its path without 128-bit packs (what unaligned shapes take), "naive-b<n>" one thread per row
# (norm_forward_naive), "warp-b<n>" the norm backward with a warp a row (norm_backward_vec, the default before
# norm_backward_grp), "own" attention on the own kernels instead of cuDNN.
_BLOCKS = (32, 64, 128, 256, 512, 1024)
_NORM_FWD = ("layernorm_forward", "fused_residual_layernorm_forward", "rmsnorm_forward")
_NORM_BWD = ("layernorm_backward", "rmsnorm_backward")  # packed kernels: __launch_bounds__(256)
_IMPLS = {**{k: ("", "scalar", "naive") for k in _NORM_FWD}, **{k: ("", "warp", "scalar") for k in _NORM_BWD},
          **{k: ("", "scalar") for k in ("residual_forward", "gelu_forward", "gelu_backward", "swiglu_forward",
                                          "swiglu_backward", "classifier_forward_backward")},
          "adamw_update": ("", "scalar")}


def compile_options(cc: str, bf16: bool) -> tuple[str, ...]:
    # CuPy's RawModule passes -arch for the current device itself (sm_XY cubin through NVRTC) and caches the result
    # on disk keyed by source, options and NVRTC version ($CUPY_CACHE_DIR, ~/.cupy/kernel_cache).
    return ("--std=c++17", "-DLLMC_CC=" + str(cc)) + (("-DACT_BF16",) if bf16 else ())


def compile_module(device: int, cc: str, bf16: bool) -> cp.RawModule:
    """kernels.cu for one activation dtype, compiled (or read from CuPy's cache) and loaded on `device`."""
    with cp.cuda.Device(device):
        m = cp.RawModule(code=KERNEL_SOURCE.read_text(), options=compile_options(cc, bf16))
        m.compile()
    return m


class _Compiling:
    """The kernel modules compiled on threads from the moment the backend is created, so NVRTC (seconds on a
    fresh machine) runs while the host initialises the model; `get` waits for one."""

    def __init__(self, device: int, cc: str, which: tuple[bool, ...]):
        self.done: dict[bool, object] = {}
        self.threads = {bf16: threading.Thread(target=self._run, args=(device, cc, bf16), daemon=True)
                        for bf16 in which}
        for t in self.threads.values():
            t.start()

    def _run(self, device, cc, bf16):
        try:
            self.done[bf16] = compile_module(device, cc, bf16)
        except BaseException as e:  # noqa: BLE001  (raised where the module is asked for)
            self.done[bf16] = e

    def get(self, bf16: bool):
        t = self.threads.get(bf16)
        if t is None:
            return None
        t.join()
        m = self.done[bf16]
        if isinstance(m, BaseException):
            raise m
        return m


def device_cache(device_name: str, cc: str) -> Path:
    """This GPU model's folder in llmc's cache: cuBLASLt's decisions, cuDNN's plans."""
    return cache_dir("cuda") / (re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-") + f"-sm{cc}")


def _decisions_file(device_name: str, cc: str) -> Path:
    from nvmath.bindings import cublasLt
    return device_cache(device_name, cc) / f"cublaslt-{cublasLt.get_version()}.json"


def _bf16_dtype():
    """CuPy >= 14 knows ml_dtypes.bfloat16; older ones get raw 16-bit storage (the kernels see bits anyway)."""
    try:
        cp.empty(1, dtype=ml_dtypes.bfloat16)
        return np.dtype(ml_dtypes.bfloat16)
    except Exception:  # pragma: no cover - depends on the CuPy version
        return np.dtype(np.uint16)


class EventTimer:
    """Device time between two events on the backend's stream; marks are events between them (no host wait)."""

    def __init__(self, stream):
        self.stream = stream
        self.a = cp.cuda.Event()
        self.b = cp.cuda.Event()
        self._marks: list = []

    def start(self):
        self._marks = []
        self.a.record(self.stream)

    def mark(self):
        ev = cp.cuda.Event()
        ev.record(self.stream)
        self._marks.append(ev)

    def marks(self):
        return [cp.cuda.get_elapsed_time(self.a, ev) / 1000.0 for ev in self._marks]

    def stop(self):
        self.b.record(self.stream)
        self.b.synchronize()
        return cp.cuda.get_elapsed_time(self.a, self.b) / 1000.0


class CudaBackend(Fp8Matmuls, Backend):
    name = "cuda"
    GEMV_MAX_N = _GEMV_MAX_N  # (for the FP8 side, which leaves such products to the GEMV path)

    def __init__(self, device: int = 0, dtype: str = BFLOAT16, options: dict[str, str] | None = None):
        if dtype not in (FLOAT32, BFLOAT16, FP8):
            raise BackendUnavailable(f"the cuda backend computes in float32, bfloat16 or fp8 (asked for {dtype})")
        # fp8: every buffer bf16, the matmuls FP8 (fp8.py)
        self.fp8 = dtype == FP8
        self.dtype = BFLOAT16 if self.fp8 else dtype
        self.matmul_dtype = FP8 if self.fp8 else None
        self.capabilities = frozenset({CAP_ASYNC_INPUTS, CAP_BF16, CAP_COPY_OVERLAP, CAP_DEVICE_EVENTS, CAP_GRAPHS,
                                       CAP_KV_CACHE, CAP_SAMPLING}
                                      | ({CAP_FP8} if self.fp8 else set()))
        self._open_device(device)
        self.bf16 = _bf16_dtype()
        self._np = {FLOAT32: np.dtype(np.float32), INT32: np.dtype(np.int32), BFLOAT16: self.bf16}
        self._allocated: dict[str, int] = defaultdict(int)
        self._modules: dict[bool, cp.RawModule] = {}
        self._kernels: dict[tuple, object] = {}
        self._scratch: dict[tuple, cp.ndarray] = {}
        self._staging: dict[int, list] = {}  # nbytes -> [[pinned memory, event of its last copy], ...]
        self.use_cudnn = option_flag(options, "cudnn", True, env="LLMC_CUDNN")
        self.use_epilogues = option_flag(options, "epilogues", True, env="LLMC_CUBLASLT_EPILOGUES")
        # float32 runs multiply on TF32 tensor cores unless told not to (llm.c's fp32 default; PyTorch's "high")
        self.tf32 = self.dtype == FLOAT32 and option_flag(options, "tf32", True, env="LLMC_TF32")
        if self.tf32:
            self.matmul_dtype = TF32
        # both kernel modules start compiling now (bf16 runs use the float32 one too: master weights, AdamW)
        self._compiling = _Compiling(device, self.cc, (False, True) if self.dtype == BFLOAT16 else (False,))
        from .cublaslt import CublasLt  # (imports nvmath, heavy: only once a device is known to be there)
        self._decisions_path = _decisions_file(self.device_name, self.cc)
        self.lt = CublasLt(cp, tune=option_flag(options, "tune", True, env="LLMC_CUBLASLT_TUNE"),
                           signature=self._signature, decisions=read_cache_json(self._decisions_path),
                           on_decided=self._keep_decisions, tf32=self.tf32)
        self._cudnn = None
        cap = cudnn_workspace_cap(options)
        self.cudnn_workspace = cap if cap is not None else self.props["totalGlobalMem"] // CUDNN_WORKSPACE_SHARE
        self.cudnn_reason = "not tried yet"
        self._read_fp8_and_p2p_options(options)
        self._init_fp8_scaling(options)
        self.attention_path = {}  # (kind, shape) -> "cudnn" | "own", for tests and logs
        self._overlap = None  # `llmc bench overlap`'s kernels and streams (overlap.py), made on first use
        self._variant: dict[str, tuple[str, int]] = {}  # kernel -> (implementation, block) inside `variant`

    def _open_device(self, device: int) -> None:
        """The device made current, its properties, and this backend's own stream; fp8 refused below Ada."""
        self.device = cp.cuda.Device(device)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(device)
        self.props = props
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = self.device.compute_capability  # e.g. "90"
        if self.fp8 and int(self.cc) < FP8_MIN_CC:  # FP8 tensor cores (cuBLASLt's FP8 matmuls): Ada, Hopper on
            raise BackendUnavailable(f"fp8 needs compute capability 8.9 or newer (capability 'fp8'); cuda:{device} "
                                     f"{self.device_name} is {self.cc[:-1]}.{self.cc[-1]}")
        self.sm_count = props["multiProcessorCount"]
        # every launch, copy and library call of this backend goes to its own stream (entered explicitly, so
        # two backends in one process, e.g. bf16 and fp32 in the tests, never share or steal a stream)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def _read_fp8_and_p2p_options(self, options: dict[str, str] | None) -> None:
        self.fp8_classifier = fp8_classifier(options)
        self.fp8_fast_accum = option_flag(options, "fp8_fast_accum", True, env="LLMC_FP8_FAST_ACCUM")
        self.fp8_wgrad = option_flag(options, "fp8_wgrad", True, env="LLMC_FP8_WGRAD")
        # a backward fused with GELU's derivative stays bf16: cuBLASLt's FP8 path has no DGELU epilogue, and the
        # separate pass it then needs lost more than FP8 saved (GPT-2 d48 on an H100: 1.18x bf16's speed without,
        # 1.06x with; docs/performance.md)
        self.fp8_dgelu = option_flag(options, "fp8_dgelu", False, env="LLMC_FP8_DGELU")
        self.fp8_fuse = option_flag(options, "fp8_fuse", True, env="LLMC_FP8_FUSE")
        # read by the communicator (nccl.py, p2p.py); None: unset, the communicator decides by its rank count
        self.p2p = option_flag(options, "p2p", None, env="LLMC_P2P")
        self.p2p_reduce = option_flag(options, "p2p_reduce", False, env="LLMC_P2P_REDUCE")
        self.p2p_copies = option_flag(options, "p2p_copies", True, env="LLMC_P2P_COPIES")

    # ---- compilation -----------------------------------------------------------------------------------------
    def compile_options(self, bf16: bool) -> tuple[str, ...]:
        return compile_options(self.cc, bf16)

    def module(self, bf16: bool) -> cp.RawModule:
        m = self._modules.get(bf16)
        if m is None:
            m = self._compiling.get(bf16) or compile_module(self.device.id, self.cc, bf16)
            self._modules[bf16] = m
        return m

    def _keep_decisions(self) -> None:
        write_cache_file(self._decisions_path, json.dumps(self.lt.decisions, indent=0, sort_keys=True))

    def _signature(self, *args, **kw):
        """The cuBLASLt tuner's bit signature kernel (kernels.cu: bits_signature)."""
        return self._k("bits_signature", self.dtype == BFLOAT16)(*args, **kw)

    def _k(self, name: str, bf16: bool):
        key = (name, bf16)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.module(bf16).get_function(name)
        return k

    def _is_bf16(self, buf) -> bool:
        return buf.dtype == self.bf16

    def _kk(self, name: str, buf):
        """The kernel compiled for `buf`'s dtype (bf16 or float32)."""
        if buf.dtype != self.bf16 and buf.dtype != np.float32:
            raise TypeError(f"{name}: buffer dtype {buf.dtype} is neither float32 nor bfloat16")
        return self._k(name, self._is_bf16(buf))

    def _launch(self, kern, grid, block, args, shared=0):
        with self.stream:
            kern((grid,) if isinstance(grid, int) else grid, (block,) if isinstance(block, int) else block, args,
                 shared_mem=shared)

    def _grid(self, n: int, per_thread: int = 1, block: int = _BLOCK) -> int:
        work = (n + per_thread - 1) // per_thread
        return max(1, min((work + block - 1) // block, self.sm_count * 32 * _BLOCK // block))

    def _cfg(self, kernel: str, kern, vec: int = 0, block: int = _BLOCK) -> tuple[int, int]:
        """(vec, block) of a launch of `kern` for `kernel`: as given, unless a variant of `kernel` is in use
        (`variant`): its block size, and no 128-bit packs for a "scalar" one."""
        v = self._variant.get(kernel)
        if v is None:
            return vec, block
        impl, n = v
        if n > kern.max_threads_per_block:
            raise VariantUnsupported(f"{n} threads a block; the compiled kernel takes at most "
                                     f"{kern.max_threads_per_block}")
        return (0 if impl == "scalar" else vec), n

    # ---- variants and tuning (Backend.variants, variant, settle) ----------------------------------------------
    def _variant_table(self, kernel: str) -> dict[str, tuple[str, int]]:
        if kernel in ("attention_forward", "attention_backward"):
            return {"own": ("own", 0)} if self.dtype == BFLOAT16 and self._cudnn_ready() else {}
        table = {}
        for impl in _IMPLS.get(kernel, ()):
            for n in _BLOCKS:
                if not (impl in ("", "warp") and kernel in _NORM_BWD and n > 256):
                    table[f"{impl}-b{n}" if impl else f"b{n}"] = (impl, n)
        return table

    def variants(self, kernel):
        return list(self._variant_table(kernel))

    @contextmanager
    def variant(self, kernel, name):
        if name is None:
            yield
            return
        table = self._variant_table(kernel)
        if name not in table:
            raise ValueError(f"the cuda backend has no variant {name!r} of {kernel} "
                             f"(variants: {', '.join(table) or 'none'})")
        saved = self._variant.get(kernel)
        self._variant[kernel] = table[name]
        try:
            yield
        finally:
            if saved is None:
                del self._variant[kernel]
            else:
                self._variant[kernel] = saved

    def settle(self, rerun=None):
        """The cuBLASLt races end now: with `rerun`, each runs to its end on rerun's calls (real calls of the
        products, as in training, without waiting TUNE_AFTER calls first); the others keep what they timed so
        far (CublasLt.settle_all). Under FP8's delayed scaling the calls so far end a step."""
        if rerun is not None:
            self.lt.race_now(rerun)
        self.lt.settle_all()
        if self._fp8_hist is not None:  # the warm-up calls make a step: later FP8 casts scale by its history (one
            self.end_step()             # pass each, as in training's steady state)

    @staticmethod
    def _aligned(*bufs) -> bool:
        return all(b.data.ptr % 16 == 0 for b in bufs)

    def _vec(self, n, *bufs) -> int:
        pack = 16 // bufs[0].dtype.itemsize
        return int(n % pack == 0 and self._aligned(*bufs))

    def scratch(self, key: str, n: int, dtype=np.float32) -> cp.ndarray:
        """Scratch kept between calls (sized by the largest request), so steady-state steps allocate nothing. A
        buffer outgrown goes back to the driver, not to CuPy's cache, where it would stay counted as in use."""
        k = (key, np.dtype(dtype).str)
        a = self._scratch.get(k)
        if a is None or a.size < n:
            if a is not None:
                del self._scratch[k], a
                cp.get_default_memory_pool().free_all_blocks()  # (cudaFree waits for the kernels that used it)
            a = self._scratch[k] = cp.empty(max(n, 1), dtype=dtype)
            self._allocated["scratch"] = sum(x.nbytes for x in self._scratch.values())
        return a[:n]

    def _transient(self, nbytes: int) -> cp.ndarray:
        """Bytes for the duration of one call: cuDNN attention's workspace and the FP8 casts share them (never
        needed at once), so FP8 takes no more memory than bf16 where the attention workspace is the larger."""
        return self.scratch("transient", nbytes, np.uint8)

    # ---- memory ----------------------------------------------------------------------------------------------
    def alloc(self, shape, dtype=FLOAT32, tag="other"):
        if dtype not in self._np:
            raise BackendUnavailable(f"cuda backend has no dtype {dtype}")
        a = cp.empty(shape, dtype=self._np[dtype])
        self._allocated[tag] += a.nbytes
        if self._fp8_sites or self._fp8_held or self._fp8_head_of:
            self._fp8_forget(a.data.ptr, a.nbytes)
        return a

    def _host_bytes(self, dst, host) -> np.ndarray:
        """`host` as the bytes `dst` holds: its dtype (bf16 rounded to nearest even), contiguous."""
        h = np.ascontiguousarray(np.asarray(host).reshape(dst.shape))
        if dst.dtype == self.bf16:
            if h.dtype != ml_dtypes.bfloat16:
                h = h.astype(np.float32).astype(ml_dtypes.bfloat16)  # round to nearest even
            h = np.ascontiguousarray(h).view(np.uint16)
        else:
            h = np.ascontiguousarray(h.astype(dst.dtype, copy=False))
        if h.nbytes != dst.nbytes:
            raise ValueError(f"upload of {h.nbytes} bytes into a buffer of {dst.nbytes}")
        if not dst.flags.c_contiguous:
            raise ValueError("upload needs a contiguous destination")
        return h

    def upload(self, dst, host):
        h = self._host_bytes(dst, host)
        if h.nbytes > _STAGE_MAX:  # parameters and optimizer state: rare, so copy from pageable memory and wait
            dst.data.copy_from_host_async(h.ctypes.data, h.nbytes, stream=self.stream)
            self.stream.synchronize()  # the host array may go away
            return
        # small uploads (a step's tokens) go through pinned staging memory, so the call returns at once and the
        # device does not idle behind a host wait in the middle of a step; the caller's array may go away
        mem, slot = self._stage(h.nbytes)
        np.copyto(np.frombuffer(mem, np.uint8, h.nbytes), h.reshape(-1).view(np.uint8))
        dst.data.copy_from_host_async(mem.ptr, h.nbytes, stream=self.stream)
        slot[1] = cp.cuda.Event(block=False, disable_timing=True)
        slot[1].record(self.stream)

    def _stage(self, nbytes):
        """A pinned buffer of `nbytes` whose last copy has finished (a few per size, reused round robin)."""
        slots = self._staging.setdefault(nbytes, [])
        for slot in slots:
            if slot[1] is None or slot[1].done:
                return slot[0], slot
        if len(slots) < 4:
            slots.append([cp.cuda.alloc_pinned_memory(nbytes), None])
            return slots[-1][0], slots[-1]
        slots.append(slots.pop(0))
        slots[-1][1].synchronize()
        return slots[-1][0], slots[-1]

    def download(self, src):
        with self.stream:
            s = src if src.flags.c_contiguous else cp.ascontiguousarray(src)
        if src.dtype == self.bf16:
            h = np.empty(src.shape, dtype=np.uint16)
            s.data.copy_to_host_async(h.ctypes.data, h.nbytes, stream=self.stream)
            self.stream.synchronize()
            return h.view(ml_dtypes.bfloat16).astype(np.float32)
        h = np.empty(src.shape, dtype=src.dtype)
        s.data.copy_to_host_async(h.ctypes.data, h.nbytes, stream=self.stream)
        self.stream.synchronize()
        return h

    def fill(self, buf, value):
        n = buf.size
        if buf.dtype == np.int32:
            self._launch(self._k("fill_i32", False), self._grid(n), _BLOCK, (buf, np.int32(value), np.int64(n)))
        else:
            self._launch(self._kk("fill_act", buf), self._grid(n), _BLOCK, (buf, np.float32(value), np.int64(n)))

    def copy(self, dst, src):
        if dst.size != src.size:
            raise ValueError(f"copy of {src.size} elements into {dst.size}")
        n = src.size
        if dst.dtype == src.dtype:
            with self.stream:
                s = src if src.flags.c_contiguous else cp.ascontiguousarray(src)
            dst.data.copy_from_device_async(s.data, s.nbytes, stream=self.stream)
        elif dst.dtype == self.bf16 and src.dtype == np.float32:
            self._launch(self._k("cast_f32_to_bf16", True), self._grid(n), _BLOCK, (dst, src, np.int64(n)))
        elif dst.dtype == np.float32 and src.dtype == self.bf16:
            self._launch(self._k("cast_bf16_to_f32", True), self._grid(n), _BLOCK, (dst, src, np.int64(n)))
        else:
            raise TypeError(f"copy from {src.dtype} to {dst.dtype} is not supported")

    def synchronize(self):
        self.stream.synchronize()

    def input_queue(self, dsts, depth=2):
        return CudaInputQueue(self, dsts, depth)

    def is_out_of_memory(self, e: BaseException) -> bool:
        """CuPy's OutOfMemoryError, or a CUDA allocation failure surfacing through cuBLASLt / NVRTC / cuDNN."""
        text = f"{type(e).__name__} {e}".lower()
        return (isinstance(e, MemoryError) or "outofmemory" in text or "out of memory" in text
                or "cudaerrormemoryallocation" in text)

    def memory_report(self):
        free, total = cp.cuda.runtime.memGetInfo()
        pool = cp.get_default_memory_pool()
        return MemoryReport(allocated=sum(v for k, v in self._allocated.items()), by_tag=dict(self._allocated),
                            device_total=int(total), device_free=int(free),
                            cached=int(pool.total_bytes() - pool.used_bytes()))

    def describe(self):
        dt = ("fp8 matmuls, bf16" if self.fp8 else "bf16" if self.dtype == BFLOAT16
              else "fp32, TF32 matmuls (--backend-opt tf32=off: IEEE fp32)" if self.tf32 else "fp32")
        att = ("own tiled kernels (cuDNN's SDPA takes bf16)" if self.dtype != BFLOAT16 else "cuDNN SDPA"
               if self._cudnn_ready() else "own kernels (" + self.cudnn_reason + ")")
        return f"{self.device_name} (sm_{self.cc}, {self.sm_count} SMs), CuPy {cp.__version__}, {dt}, attention: {att}"

    def timer(self):
        return EventTimer(self.stream)

    # ---- copy/compute overlap (`llmc bench overlap`: overlap.py, overlap.cu) -----------------------------------
    def host_alloc(self, shape, pinned=False):
        return host_alloc(shape, pinned)

    def overlap_layernorm(self, out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias, *, mode,
                          streams, block):
        if self._overlap is None:
            self._overlap = Overlap(self)
        return self._overlap.layernorm(out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias,
                                       mode=mode, streams=streams, block=block)

    # dense peaks by the vendor's datasheets (SXM parts): bf16 and TF32 tensor cores, plain fp32; for MFU
    _PEAKS = {"H100": (989e12, 495e12, 67e12), "H200": (989e12, 495e12, 67e12), "H800": (989e12, 495e12, 67e12),
              "A100": (312e12, 156e12, 19.5e12)}

    def peak_flops(self, dtype=None):
        dt = dtype or (TF32 if self.tf32 else self.dtype)
        for key, (bf16, tf32, fp32) in self._PEAKS.items():
            if key in self.device_name:
                if key == "H100" and "PCIe" in self.device_name:
                    bf16, tf32, fp32 = 756e12, 378e12, 51e12
                return bf16 if dt in (BFLOAT16, FP8) else tf32 if dt == TF32 else fp32
        return None

    # ---- encoder ---------------------------------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        B, T = inp.shape[0], inp.shape[1]
        C = wte.shape[-1]
        N = B * T
        vec = int(C % (16 // out.dtype.itemsize) == 0 and self._aligned(out, wte, *([wpe] if wpe is not None else [])))
        self._launch(self._kk("encoder_forward", out), self._grid(N * C, 16 // out.dtype.itemsize if vec else 1),
                     _BLOCK, (out, inp, wte, wpe if wpe is not None else np.uint64(0), np.int32(N), np.int32(T),
                              np.int32(C), np.int32(vec)))

    def encoder_backward(self, dwte, dwpe, dout, inp):
        B, T = inp.shape[0], inp.shape[1]
        C = dwte.shape[-1]
        N = B * T
        flat = inp.reshape(-1)
        # positions sorted by (token, position): the keys are unique, so the order does not depend on the sort
        with self.stream:
            keys = flat.astype(cp.int64) * N + cp.arange(N, dtype=cp.int64)
            order = (cp.sort(keys) % N).astype(cp.int32)
        self._launch(self._kk("encoder_backward_wte", dwte), N, min(1024, max(32, ((C + 31) // 32) * 32)),
                     (dwte, dout, order, flat, np.int32(N), np.int32(C)))
        if dwpe is not None:
            self._launch(self._kk("encoder_backward_wpe", dwpe), self._grid(T * C), _BLOCK,
                         (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))

    # ---- layernorm / rmsnorm ---------------------------------------------------------------------------------
    def _norm_packs(self, C, *bufs):
        """Packs per lane (1..8) for the vectorised norm kernels (a warp a row), or 0 when they do not apply."""
        p = (self._norm_row_packs(C, *bufs) + 31) // 32
        return p if p <= 8 else 0

    def _norm_row_packs(self, C, *bufs):
        """128-bit packs in a row for the vectorised norm kernels, or 0 when they do not apply (unaligned, too wide
        for norm_backward_grp)."""
        pack = 16 // bufs[0].dtype.itemsize
        if C % pack or not self._aligned(*[b for b in bufs if b is not None]):
            return 0
        return C // pack if C // pack <= 8 * 256 else 0

    @staticmethod
    def _norm_groups(packs: int, warps: int) -> tuple[int, int]:
        """(packs a lane, warps a row) for norm_backward_grp: the fewest warps that leave a lane at most 2 packs;
        rows too wide for that take 8 warps and up to 8 packs a lane (the compiled kernels)."""
        for g in (1, 2, 4, 8):
            if g <= warps and packs <= 64 * g:
                return (packs + 32 * g - 1) // (32 * g), g
        p = (packs + 255) // 256
        if warps < 8 or p > 8:
            raise VariantUnsupported(f"{packs} packs a row need 8 warps a block and at most 8 packs a lane")
        return p, 8

    def _norm_forward(self, kernel, out, mean, rstd, residual, inp1, inp2, weight, bias, eps, rms, fp8_next):
        C = inp1.shape[-1]
        N = inp1.size // C
        warps = 8
        null = np.uint64(0)
        impl = self._variant.get(kernel, ("",))[0]
        P = self._norm_packs(C, out, residual, inp1, inp2, weight, bias) if impl == "" else 0
        k = self._kk("norm_forward_naive" if impl == "naive" else f"norm_forward_vec{P}" if P else "norm_forward", out)
        _, block = self._cfg(kernel, k, 0, 32 * warps)
        rows = block if impl == "naive" else block // 32  # rows a block: a thread each, or a warp each
        args = (out, mean if mean is not None else null, rstd, residual if residual is not None else null,
                inp1, inp2 if inp2 is not None else null, weight, bias if bias is not None else null,
                np.int32(N), np.int32(C), np.float32(eps), np.int32(rms))
        if impl != "naive":  # (these kernels write the FP8 operand where fp8_next asks and FP8 allows)
            f8 = self._fp8_producer(out, fp8_next, "x", able=self._is_bf16(out))
            args += f8 or (null, null, null, np.int32(0), np.int32(0), null)
        else:
            self._fp8_producer(out, None, "x")
        self._launch(k, (N + rows - 1) // rows, block, args)

    def layernorm_forward(self, out, mean, rstd, inp, weight, bias, fp8_next=None):
        self._norm_forward("layernorm_forward", out, mean, rstd, None, inp, None, weight, bias, 1e-5, 0, fp8_next)

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias, fp8_next=None):
        self._norm_forward("fused_residual_layernorm_forward", out, mean, rstd, residual, inp1, inp2, weight, bias,
                           1e-5, 0, fp8_next)

    def rmsnorm_forward(self, out, rstd, inp, weight, eps, fp8_next=None):
        self._norm_forward("rmsnorm_forward", out, None, rstd, None, inp, None, weight, None, eps, 1, fp8_next)

    def _norm_backward(self, kernel, dinp, dweight, dbias, dout, inp, weight, mean, rstd, rms):
        C = inp.shape[-1]
        N = inp.size // C
        impl = self._variant.get(kernel, ("",))[0]
        k = None
        if impl == "warp" and (P := self._norm_packs(C, dinp, dout, inp, weight)):
            # a warp a row: a lane holds P packs of each of the row's tensors (C <= 2048 in bf16)
            k = self._kk(f"norm_backward_{'rms_' if rms else ''}vec{P}", dinp)
            _, threads = self._cfg(kernel, k, 0, 256)
            per_sm = 2
        elif impl == "" and (packs := self._norm_row_packs(C, dinp, dout, inp, weight)):
            # G warps a row, so a lane holds at most 2 packs up to C = 4096 (bf16) and 4 blocks fit an SM
            threads = self._variant.get(kernel, ("", 256))[1]
            P, G = self._norm_groups(packs, threads // 32)
            k = self._kk(f"norm_backward_{'rms_' if rms else ''}grp{P}_{G}", dinp)
            per_sm = 4
        if k is not None:
            # one wave of blocks, each owning a contiguous range of rows; partials per block
            blocks = max(1, min(self.sm_count * per_sm, N))
            rows_per_block = (N + blocks - 1) // blocks
            blocks = (N + rows_per_block - 1) // rows_per_block
            part = self.scratch("norm_partials", blocks * 2 * C)
            shared = 2 * C * 4
            if shared > 48 * 1024:
                k.max_dynamic_shared_size_bytes = shared
            null = np.uint64(0)
            self._launch(k, blocks, threads,
                         (dinp, part, dout, inp, weight, mean if mean is not None else null, rstd, np.int32(N),
                          np.int32(C), np.int32(rows_per_block)), shared=shared)
            self._launch(self._kk("norm_backward_reduce_vec", dweight), (C + 31) // 32, 256,
                         (dweight, dbias if dbias is not None else null, part, np.int32(blocks), np.int32(C)))
            return
        k = self._kk("norm_backward", dinp)
        warps = self._cfg(kernel, k, 0, 4 * 32)[1] // 32
        blocks = max(1, min(self.sm_count * 2, (N + warps - 1) // warps))
        rows_per_block = (N + blocks - 1) // blocks
        blocks = (N + rows_per_block - 1) // rows_per_block
        P = blocks * warps
        part = self.scratch("norm_partials", P * 2 * C)
        shared = warps * 2 * C * 4
        if kernel in self._variant and shared > self.props.get("sharedMemPerBlockOptin", 48 * 1024):
            raise VariantUnsupported(f"{warps} warps of C={C} need {shared} bytes of shared memory a block")
        if shared > 48 * 1024:
            k.max_dynamic_shared_size_bytes = shared
        null = np.uint64(0)
        self._launch(k, blocks, 32 * warps,
                     (dinp, part, dout, inp, weight, mean if mean is not None else null, rstd, np.int32(N),
                      np.int32(C), np.int32(rows_per_block), np.int32(rms)), shared=shared)
        self._launch(self._kk("norm_backward_reduce", dweight), (C + 255) // 256, 256,
                     (dweight, dbias if dbias is not None else null, part, np.int32(P), np.int32(C)))

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        self._norm_backward("layernorm_backward", dinp, dweight, dbias, dout, inp, weight, mean, rstd, 0)

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd):
        self._norm_backward("rmsnorm_backward", dinp, dweight, None, dout, inp, weight, None, rstd, 1)

    def residual_forward(self, out, inp1, inp2):
        n = out.size
        k = self._kk("residual_forward", out)
        vec, block = self._cfg("residual_forward", k, self._vec(n, out, inp1, inp2))
        self._launch(k, self._grid(n, 16 // out.dtype.itemsize if vec else 1, block), block,
                     (out, inp1, inp2, np.int64(n), np.int32(vec)))

    # ---- matmul ----------------------------------------------------------------------------------------------
    def _lt_dtype(self, buf):
        from .cublaslt import CUDA_R_16BF, CUDA_R_32F  # (imports nvmath, heavy: see __init__)
        return CUDA_R_16BF if self._is_bf16(buf) else CUDA_R_32F

    def matmul_forward(self, out, inp, weight, bias=None, pre_gelu=None, precise=False, fp8_next=None):
        from nvmath.bindings.cublasLt import Epilogue as E
        OC, C = weight.shape
        N = inp.size // C
        if self._fp8_held:  # (what this writes holds act)
            self._fp8_held.pop((out.data.ptr, out.size), None)
        if pre_gelu is not None and self._fp8_gelu_feeds(out, fp8_next):
            # (GELU as the FP8 producer of the product after it: the product here, GELU in its own kernel, which
            # writes that product's operand; with fp8_fuse=off it writes act, which that product casts: same bits)
            self.matmul_forward(pre_gelu, inp, weight, bias, precise=precise)
            self.gelu_forward(out, pre_gelu, fp8_next=fp8_next)
            return
        if self._fp8_serves(N, C, OC, precise, inp, weight, out) \
                and self._fp8_forward(out, inp, weight, bias, pre_gelu, N, C, OC):
            return
        self._fp8_restore(inp)
        if N <= _GEMV_MAX_N and self._vec(C, out, inp, weight, *(b for b in (bias, pre_gelu) if b is not None)):
            self._launch(self._kk("matmul_forward_gemv", out), -(-OC // 8), 256,
                         (out, pre_gelu if pre_gelu is not None else np.uint64(0), inp, weight,
                          bias if bias is not None else np.uint64(0), np.int32(N), np.int32(C), np.int32(OC)))
            return
        dt = self._lt_dtype(inp)
        s = self.stream.ptr
        b = bias.data.ptr if bias is not None else 0
        if pre_gelu is not None:
            if self.use_epilogues:
                epi = E.GELU_AUX_BIAS if bias is not None else E.GELU_AUX
                if self.lt.forward(out.data.ptr, inp.data.ptr, weight.data.ptr, N, C, OC, dt, s, bias=b,
                                   aux=pre_gelu.data.ptr, epilogue=epi):
                    return
            self._matmul_plain(pre_gelu, inp, weight, bias, N, C, OC, dt)
            self.gelu_forward(out, pre_gelu)
            return
        if self.use_epilogues or bias is None:
            if self.lt.forward(out.data.ptr, inp.data.ptr, weight.data.ptr, N, C, OC, dt, s, bias=b):
                return
        self._matmul_plain(out, inp, weight, bias, N, C, OC, dt)

    def _matmul_plain(self, out, inp, weight, bias, N, C, OC, dt):
        if not self.lt.forward(out.data.ptr, inp.data.ptr, weight.data.ptr, N, C, OC, dt, self.stream.ptr):
            raise RuntimeError(f"cuBLASLt found no algorithm for ({N}x{C}) @ ({OC}x{C})^T")
        if bias is not None:
            self._launch(self._kk("add_bias", out), self._grid(N * OC), _BLOCK,
                         (out, bias, np.int64(N), np.int32(OC)))

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu=None, precise=False):
        OC, C = weight.shape
        N = inp.size // C
        bufs = (inp, weight, dout, dweight, *(x for x in (dinp,) if x is not None))
        if (pre_gelu is None or self.fp8_dgelu) and self._fp8_serves(N, C, OC, precise, *bufs, backward=True) \
                and self._fp8_backward(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC, head=precise):
            return
        self._fp8_restore(dout)  # (what follows reads the gradient as act)
        if pre_gelu is not None and self.fp8_wgrad and self._fp8_serves(N, C, OC, precise, *bufs, backward=True) \
                and self._fp8_backward_wgrad(dweight, dbias, dout, inp, weight, N, C, OC):
            self._dinp(dinp, dout, weight, pre_gelu, N, C, OC)  # (its GELU derivative fused, in bf16)
            return
        self._fp8_restore(inp)
        self._dinp(dinp, dout, weight, pre_gelu, N, C, OC)
        self._dweight(dweight, dbias, dout, inp, N, C, OC)

    def _dinp(self, dinp, dout, weight, pre_gelu, N, C, OC):
        """dinp = dout @ weight [* gelu'(pre_gelu)] in the buffers' dtype (DGELU epilogue where cuBLASLt has it)."""
        if dinp is None:
            return
        dt, s = self._lt_dtype(dout), self.stream.ptr
        if pre_gelu is not None and self.use_epilogues and self.lt.backward_input(
                dinp.data.ptr, dout.data.ptr, weight.data.ptr, N, C, OC, dt, s, pre_gelu=pre_gelu.data.ptr):
            return
        if not self.lt.backward_input(dinp.data.ptr, dout.data.ptr, weight.data.ptr, N, C, OC, dt, s):
            raise RuntimeError(f"cuBLASLt found no algorithm for dinp ({N}x{OC}) @ ({OC}x{C})")
        if pre_gelu is not None:
            self.gelu_backward(dinp, pre_gelu, dinp)

    def _dweight(self, dweight, dbias, dout, inp, N, C, OC):
        """dweight += dout^T @ inp and dbias += column sums of dout, in the buffers' dtype (BGRADB epilogue
        where cuBLASLt has it)."""
        dt, s = self._lt_dtype(inp), self.stream.ptr
        if dbias is not None and self.use_epilogues:
            tmp = self.scratch("dbias_" + str(dbias.dtype), OC, dtype=dbias.dtype)
            if self.lt.backward_weight(dweight.data.ptr, dout.data.ptr, inp.data.ptr, N, C, OC, dt, s,
                                       dbias_tmp=tmp.data.ptr):
                self._launch(self._kk("accumulate_act", dbias), (OC + 255) // 256, 256, (dbias, tmp, np.int32(OC)))
                return
        if not self.lt.backward_weight(dweight.data.ptr, dout.data.ptr, inp.data.ptr, N, C, OC, dt, s):
            raise RuntimeError(f"cuBLASLt found no algorithm for dweight ({OC}x{N}) @ ({N}x{C})")
        if dbias is not None:
            self._column_sums(dbias, dout, N, OC)

    def _column_sums(self, dbias, dout, N, OC):
        rows_per = 256
        P = (N + rows_per - 1) // rows_per
        part = self.scratch("colsum", P * OC)
        self._launch(self._kk("column_sums", dout), ((OC + 255) // 256, P), 256,
                     (part, dout, np.int32(N), np.int32(OC), np.int32(rows_per)))
        self._launch(self._kk("column_sums_reduce", dbias), (OC + 255) // 256, 256,
                     (dbias, part, np.int32(P), np.int32(OC)))

    # ---- elementwise -----------------------------------------------------------------------------------------
    def gelu_forward(self, out, inp, fp8_next=None):
        n = out.size
        k = self._kk("gelu_forward", out)
        vec, block = self._cfg("gelu_forward", k, self._vec(n, out, inp))
        if f8 := self._fp8_producer(out, fp8_next, "x", able=vec and self._is_bf16(out)):
            self._launch(self._k("gelu_forward_fp8", True), self._grid(n, 8, block), block, (*f8, inp, np.int64(n)))
            return
        self._launch(k, self._grid(n, 16 // out.dtype.itemsize if vec else 1, block), block,
                     (out, inp, np.int64(n), np.int32(vec)))

    def gelu_backward(self, dinp, inp, dout):
        n = dinp.size
        k = self._kk("gelu_backward", dinp)
        vec, block = self._cfg("gelu_backward", k, self._vec(n, dinp, inp, dout))
        self._launch(k, self._grid(n, 16 // dinp.dtype.itemsize if vec else 1, block), block,
                     (dinp, inp, dout, np.int64(n), np.int32(vec)))

    def swiglu_forward(self, out, inp, fp8_next=None):
        H = out.shape[-1]
        N = out.size // H
        k = self._kk("swiglu_forward", out)
        vec, block = self._cfg("swiglu_forward", k, self._vec(H, out, inp))
        if f8 := self._fp8_producer(out, fp8_next, "x", able=vec and self._is_bf16(out)):
            self._launch(self._k("swiglu_forward_fp8", True), self._grid(N * H, 8, block), block,
                         (*f8, inp, np.int64(N), np.int32(H)))
            return
        self._launch(k, self._grid(N * H, 16 // out.dtype.itemsize if vec else 1, block), block,
                     (out, inp, np.int64(N), np.int32(H), np.int32(vec)))

    def swiglu_backward(self, dinp, dout, inp, fp8_next=None):
        H = dout.shape[-1]
        N = dout.size // H
        k = self._kk("swiglu_backward", dinp)
        vec, block = self._cfg("swiglu_backward", k, self._vec(H, dinp, dout, inp))
        if f8 := self._fp8_producer(dinp, fp8_next, "dout", able=vec and self._is_bf16(dinp)):
            self._launch(self._k("swiglu_backward_fp8", True), self._grid(N * H, 8, block), block,
                         (*f8, dout, inp, np.int64(N), np.int32(H)))
            return
        self._launch(k, self._grid(N * H, 16 // dinp.dtype.itemsize if vec else 1, block), block,
                     (dinp, dout, inp, np.int64(N), np.int32(H), np.int32(vec)))

    def _rope(self, qkv, freqs_cis, n_head, n_kv_head, sign):
        B, T, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        pack = 16 // qkv.dtype.itemsize
        vec = int(hd % pack == 0 and W % pack == 0 and self._aligned(qkv))
        n = B * T * (n_head + n_kv_head) * (hd // 2)
        self._launch(self._kk("rope_kernel", qkv), self._grid(n, pack // 2 if vec else 1), _BLOCK,
                     (qkv, freqs_cis, np.int32(B), np.int32(T), np.int32(n_head + n_kv_head), np.int32(W),
                      np.int32(hd), np.float32(sign), np.int32(vec)))

    def rope_forward(self, qkv, freqs_cis, n_head, n_kv_head):
        self._rope(qkv, freqs_cis, n_head, n_kv_head, 1.0)

    def rope_backward(self, dqkv, freqs_cis, n_head, n_kv_head):
        self._rope(dqkv, freqs_cis, n_head, n_kv_head, -1.0)

    # ---- attention -------------------------------------------------------------------------------------------
    def _cudnn_ready(self) -> bool:
        if self._cudnn is None and self.use_cudnn:
            try:
                from .cudnn_attention import CudnnAttention  # (imports cuDNN, heavy and optional: use_cudnn)
                self._cudnn = CudnnAttention(cp, self.stream.ptr, self.cudnn_workspace,
                                             plan_dir=self._decisions_path.parent, workspace=self._transient)
                self.cudnn_reason = "ok"
            except Exception as e:
                self.use_cudnn = False
                self.cudnn_reason = f"cuDNN unavailable: {type(e).__name__}: {e}"
        elif not self.use_cudnn and self.cudnn_reason == "not tried yet":
            self.cudnn_reason = "disabled (--backend-opt cudnn=off)"
        return self._cudnn is not None and self.use_cudnn

    def _attn_shape(self, qkv, n_head, n_kv_head):
        B, T, W = qkv.shape
        hd = W // (n_head + 2 * n_kv_head)
        return B, T, hd

    def _can_cudnn(self, qkv, hd):
        return (self._is_bf16(qkv) and hd % 8 == 0 and hd <= 256 and self._cudnn_ready())

    def attention_forward(self, out, lse, qkv, n_head, n_kv_head):
        B, T, hd = self._attn_shape(qkv, n_head, n_kv_head)
        if self._can_cudnn(qkv, hd) and self._aligned(out, lse, qkv) and "attention_forward" not in self._variant:
            if self._cudnn.forward(out.data.ptr, lse.data.ptr, qkv.data.ptr, B, T, n_head, n_kv_head, hd):
                self.attention_path[("fwd", B, T, n_head, n_kv_head, hd)] = "cudnn"
                return
        self.attention_path[("fwd", B, T, n_head, n_kv_head, hd)] = "own"
        self.attention_forward_own(out, lse, qkv, n_head, n_kv_head)

    def attention_backward(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, hd = self._attn_shape(qkv, n_head, n_kv_head)
        if (self._can_cudnn(qkv, hd) and self._aligned(dqkv, dout, out, lse, qkv)
                and "attention_backward" not in self._variant):
            if self._cudnn.backward(dqkv.data.ptr, dout.data.ptr, qkv.data.ptr, out.data.ptr, lse.data.ptr, B, T,
                                    n_head, n_kv_head, hd):
                self.attention_path[("bwd", B, T, n_head, n_kv_head, hd)] = "cudnn"
                return
        self.attention_path[("bwd", B, T, n_head, n_kv_head, hd)] = "own"
        self.attention_backward_own(dqkv, dout, qkv, out, lse, n_head, n_kv_head)

    def _att_launch(self, name, rows, T_floats, args, buf):
        warps = 4
        shared = warps * T_floats * 4
        k = self._kk(name, buf)
        if shared > 48 * 1024:
            k.max_dynamic_shared_size_bytes = shared
        self._launch(k, (rows + warps - 1) // warps, 32 * warps, args, shared=shared)

    # shared memory (bytes) of the tiled kernels for head size hd: forward, backward dk/dv, backward dq
    @staticmethod
    def _tiled_smem(hd):
        ld, pld = 64 * (hd + 4), 64 * 68
        return 4 * (3 * ld + pld), 4 * (4 * ld + 2 * pld + 128), 4 * (4 * ld + pld)

    def _tiled(self, hd, which: int) -> bool:
        """Whether the tiled kernels (kernels.cu) serve head size hd on this device."""
        return hd in (64, 128) and self._tiled_smem(hd)[which] <= self.props.get("sharedMemPerBlockOptin", 48 << 10)

    def _tiled_launch(self, name, hd, which, grid, args, buf):
        k = self._kk(f"{name}_{hd}", buf)
        shared = self._tiled_smem(hd)[which]
        if k.max_dynamic_shared_size_bytes < shared:
            k.max_dynamic_shared_size_bytes = shared
        self._launch(k, grid, 256, args, shared=shared)

    def attention_forward_own(self, out, lse, qkv, n_head, n_kv_head):
        B, T, hd = self._attn_shape(qkv, n_head, n_kv_head)
        scale = np.float32(1.0 / math.sqrt(hd))
        if self._tiled(hd, 0):
            self._tiled_launch("attention_forward_tiled", hd, 0, ((T + 63) // 64, n_head, B),
                               (out, lse, qkv, np.int32(T), np.int32(n_head), np.int32(n_kv_head), scale), out)
            return
        self._att_launch("attention_forward_ref", B * n_head * T, T,
                         (out, lse, qkv, np.int32(B), np.int32(T), np.int32(n_head), np.int32(n_kv_head),
                          np.int32(hd), scale), out)

    def attention_backward_own(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, hd = self._attn_shape(qkv, n_head, n_kv_head)
        if hd > 256:
            raise NotImplementedError("own attention backward supports head sizes up to 256")
        scale = np.float32(1.0 / math.sqrt(hd))
        D = self.scratch("att_D", B * n_head * T)
        if self._tiled(hd, 1) and self._tiled(hd, 2):
            rows = B * n_head * T
            self._launch(self._kk("attention_backward_dsum", dout), (rows + 7) // 8, 256,
                         (D, dout, out, np.int32(B), np.int32(T), np.int32(n_head), np.int32(hd)))
            args = (dqkv, D, dout, qkv, lse, np.int32(T), np.int32(n_head), np.int32(n_kv_head), scale)
            self._tiled_launch("attention_backward_dkv_tiled", hd, 1, ((T + 63) // 64, n_kv_head, B), args, dqkv)
            self._tiled_launch("attention_backward_dq_tiled", hd, 2, ((T + 63) // 64, n_head, B), args, dqkv)
            return
        dims = (np.int32(B), np.int32(T), np.int32(n_head), np.int32(n_kv_head), np.int32(hd), scale)
        self._att_launch("attention_backward_dq_ref", B * n_head * T, T, (dqkv, D, dout, qkv, out, lse) + dims, dqkv)
        self._att_launch("attention_backward_dkv_ref", B * n_kv_head * T, 2 * T, (dqkv, D, dout, qkv, lse) + dims,
                         dqkv)

    # qkv (B,Tn,(NH+2*NKV)*hd) of new tokens at pos..; k_cache, v_cache (B,NKV,S,hd) rings; out (B,Tn,NH*hd)
    def attention_decode(self, out, qkv, k_cache, v_cache, pos, n_head, n_kv_head):
        B, Tn, hd = self._attn_shape(qkv, n_head, n_kv_head)
        S = k_cache.shape[2]
        on_device = not isinstance(pos, (int, np.integer))  # a (1,) int32 buffer: read by the kernels
        check_decode_chunk(0 if on_device else int(pos), Tn, S)
        if on_device and Tn != 1:
            raise ValueError("attention_decode: a position held on the device takes one new token at a time")
        if hd > _DECODE_MAX_HD:
            raise NotImplementedError(f"cuda attention_decode supports head sizes up to {_DECODE_MAX_HD}, got {hd}")
        i32 = np.int32
        pos_v, pos_p = (np.int64(0), pos) if on_device else (np.int64(pos), np.uint64(0))
        n = B * Tn * n_kv_head * hd
        self._launch(self._kk("kv_cache_append", qkv), self._grid(n), _BLOCK,
                     (k_cache, v_cache, qkv, i32(B), i32(Tn), i32(n_head), i32(n_kv_head), i32(hd), i32(S), pos_v,
                      pos_p))
        rows, splits = B * n_head * Tn, -(-S // _DECODE_SPLIT)  # a grid fixed by S, whatever the position
        part = self.scratch("att_decode", rows * splits * (hd + 2))
        self._launch(self._kk("attention_decode_part", qkv), (rows, splits), _DECODE_SPLIT,
                     (part, qkv, k_cache, v_cache, i32(Tn), i32(n_head), i32(n_kv_head), i32(hd), i32(S), pos_v,
                      pos_p, np.float32(1.0 / math.sqrt(hd)), i32(self._vec(hd, k_cache, v_cache))))
        self._launch(self._kk("attention_decode_combine", out), rows, 128,
                     (out, part, i32(Tn), i32(n_head), i32(hd), i32(splits)))

    # ---- sampling --------------------------------------------------------------------------------------------
    def sample_token(self, out, logits, u, temperature, vocab_size):
        if logits.ndim != 1 or not logits.flags.c_contiguous or not 1 <= vocab_size <= logits.size:
            raise ValueError(f"sample_token: logits must be one contiguous row of at least vocab_size={vocab_size} "
                             f"(got shape {logits.shape})")
        self._launch(self._kk("sample_token", logits), 1, 1024,
                     (out, logits, np.int32(vocab_size), np.float64(u), np.float64(temperature)))

    # ---- graphs ----------------------------------------------------------------------------------------------
    def capture(self, fn):
        """CUDA graph of the work `fn` enqueues on the backend's stream (recorded, not run); the returned function
        launches it. The cuBLASLt tuner's races end first (a graph would freeze a race's current candidate; every
        candidate is bit-identical to the heuristic's first, so only speed is at stake) and stay off while
        recording."""
        self.lt.settle_all()
        self.lt.capturing = True
        # Memory CuPy hands out while recording (encoder_backward's sort: keys, CUB's temporary storage) is freed
        # when the recording ends, yet the graph writes it on every replay: it is kept out of the pool for as
        # long as the graph lives, so nothing allocated later can land there (PyTorch's private graph pool).
        pool, kept = cp.get_default_memory_pool(), []

        def alloc(size):
            mem = pool.malloc(size)
            kept.append(mem)
            return mem
        try:
            with cp.cuda.using_allocator(alloc):
                self.stream.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    fn()
                finally:
                    graph = self.stream.end_capture()
        finally:
            self.lt.capturing = False
        stream = self.stream

        def replay():
            graph.launch(stream)
        replay.kept = kept  # (the graph's memory, held with it)
        return replay

    # ---- classifier ------------------------------------------------------------------------------------------
    def classifier_forward_backward(self, logits, losses, targets, vocab_size, dloss, fp8_next=None):
        Vp = logits.shape[-1]
        N = logits.size // Vp
        k = self._kk("classifier_fwd_bwd", logits)
        vec, block = self._cfg("classifier_forward_backward", k,
                               int(Vp % (16 // logits.dtype.itemsize) == 0 and self._aligned(logits)), 512)
        if dloss is not None and (f8 := self._fp8_producer(logits, fp8_next, "dout", able=vec and self._is_bf16(logits),
                                                           head=True)):
            self._launch(self._k("classifier_fwd_bwd_fp8", True), N, block,
                         (logits, losses, targets, np.int32(N), np.int32(vocab_size), np.int32(Vp),
                          np.float32(dloss), *f8))
            return
        self._launch(k, N, block,
                     (logits, losses, targets, np.int32(N), np.int32(vocab_size), np.int32(Vp),
                      np.float32(dloss if dloss is not None else 0.0), np.int32(dloss is not None), np.int32(vec)))

    # ---- optimizer -------------------------------------------------------------------------------------------
    def global_norm_squared(self, out, grads):
        grads = list(grads)
        grids = [max(1, min(self.sm_count * 2, (g.size + 1023) // 1024)) for g in grads]
        part = self.scratch("norm_sumsq", sum(grids))
        off = 0
        for g, nb in zip(grads, grids):
            self._launch(self._kk("sumsq_partial", g), nb, 512, (part[off:off + nb], g, np.int64(g.size)))
            off += nb
        self._launch(self._k("sumsq_final", False), 1, 32, (out, part, np.int32(off)))

    def loss_sum(self, out, losses, weight, accumulate):
        self._launch(self._k("loss_sum", False), 1, 1024,
                     (out, losses, np.int64(losses.size), np.float64(weight), np.int32(bool(accumulate))))

    def step_guard(self, guard, loss, norm_squared, grad_clip, max_loss, max_norm):
        with np.errstate(over="ignore"):
            bounds = (np.float32(max_loss), np.float32(max_norm))
        self._launch(self._k("step_guard", False), 1, 32, (guard, loss, norm_squared, np.float64(grad_clip)) + bounds)

    def adamw_update(self, param, grad, m, v, master, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     seed, guard=None, mirrors=None):
        """(mirrors: the other ranks' copies of `param`, a device array of pointers from p2p.PeerCopies.others,
        written with the same bits as `param`)"""
        n = param.size
        step_size = lr / (1.0 - beta1 ** step)
        rbc2 = 1.0 / math.sqrt(1.0 - beta2 ** step)
        decay = 1.0 - lr * weight_decay
        c1 = (1.0 - beta1) * grad_scale
        c2 = (1.0 - beta2) * grad_scale * grad_scale
        if master is None and self._is_bf16(param):
            raise ValueError("adamw_update on bfloat16 params needs float32 master weights")
        k = self._kk("adamw_kernel", param)
        # four elements a thread where every buffer allows it (fp32 state in 16-byte packs, act_t in 4-element ones)
        quad = 4 * param.dtype.itemsize
        packed = int(n % 4 == 0 and param.data.ptr % quad == 0 and grad.data.ptr % quad == 0
                     and self._aligned(m, v, *([master] if master is not None else [])))
        vec, block = self._cfg("adamw_update", k, packed)
        self._launch(k, self._grid(n, 4 if vec else 1, block), block,
                     (param, grad, m, v, master if master is not None else np.uint64(0), np.int64(n),
                      np.float32(lr), np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(decay),
                      np.int32(weight_decay != 0.0), np.float32(c1), np.float32(c2), np.float32(step_size),
                      np.float32(rbc2), np.uint32(seed & 0xFFFFFFFF), guard if guard is not None else np.uint64(0),
                      np.float64(1.0 - beta1), np.float64(1.0 - beta2),
                      mirrors if mirrors is not None else np.uint64(0),
                      np.int32(0 if mirrors is None else mirrors.size), np.int32(vec)))

    def peer_mean(self, out, srcs, nsrc: int, off: int):
        """out[i] = the mean over nsrc ranks' copies of element off + i (srcs: a device array of their pointers,
        in rank order); p2p.py's reduce-scatter (--backend-opt p2p_reduce=on)."""
        n = out.size
        vec = int(self._vec(n, out) and off % (16 // out.dtype.itemsize) == 0)
        self._launch(self._kk("peer_mean", out), self._grid(n, 16 // out.dtype.itemsize if vec else 1), _BLOCK,
                     (out, srcs, np.int32(nsrc), np.int64(off), np.int64(n), np.int32(vec)))

    def scale(self, buf, factor):
        n = buf.size
        vec = self._vec(n, buf)
        self._launch(self._kk("scale_act", buf), self._grid(n, 16 // buf.dtype.itemsize if vec else 1), _BLOCK,
                     (buf, np.float32(factor), np.int64(n), np.int32(vec)))


class _Slot:
    """One batch in flight: pinned host memory and a device staging buffer per destination, the event of its last
    host-to-device copy (copy stream) and of its last read into the destinations (compute stream)."""

    def __init__(self, dsts):
        self.pinned = [cp.cuda.alloc_pinned_memory(d.nbytes) for d in dsts]
        self.staging = [cp.empty_like(d) for d in dsts]
        self.copied = cp.cuda.Event(block=False, disable_timing=True)
        self.consumed = cp.cuda.Event(block=False, disable_timing=True)
        self.copied_once = self.consumed_once = False


class CudaInputQueue:
    """Backend.input_queue with CAP_ASYNC_INPUTS. put() fills the next of `depth` slots round robin (the oldest
    not waiting to be taken) and copies it to the device on a stream of its own; take() makes the compute stream
    wait for that copy, then copies the slot's staging buffers into the destinations there (device to device), so
    a captured graph's inputs keep their addresses. A slot's staging buffers are written again only after the
    compute stream has read them (the copy stream waits on that event), its pinned memory only after its last
    copy finished (the host waits for it: so the host runs at most about 2*depth batches ahead of the device, and
    in training, where the device is rarely that far behind, it does not wait at all)."""

    def __init__(self, backend: CudaBackend, dsts, depth: int = 2):
        if depth < 1:
            raise ValueError(f"input_queue: depth must be >= 1 (got {depth})")
        if not all(d.flags.c_contiguous for d in dsts):
            raise ValueError("input_queue needs contiguous destinations")
        self.backend, self.dsts, self.depth = backend, list(dsts), depth
        with backend.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.slots = [_Slot(self.dsts) for _ in range(depth)]
        backend._allocated["inputs ahead"] += depth * sum(d.nbytes for d in self.dsts)
        self.next = 0
        self.pending: deque[_Slot] = deque()

    def put(self, hosts):
        check_input_batch(self.dsts, hosts)
        if len(self.pending) >= self.depth:
            raise ValueError(f"input_queue.put: {self.depth} batches already wait to be taken")
        slot = self.slots[self.next]
        self.next = (self.next + 1) % self.depth
        if slot.copied_once:
            slot.copied.synchronize()
        for mem, dst, host in zip(slot.pinned, self.dsts, hosts):
            h = self.backend._host_bytes(dst, host)
            np.copyto(np.frombuffer(mem, np.uint8, h.nbytes), h.reshape(-1).view(np.uint8))
        if slot.consumed_once:
            self.stream.wait_event(slot.consumed)
        for mem, buf in zip(slot.pinned, slot.staging):
            buf.data.copy_from_host_async(mem.ptr, buf.nbytes, stream=self.stream)
        slot.copied.record(self.stream)
        slot.copied_once = True
        self.pending.append(slot)

    def take(self):
        if not self.pending:
            raise ValueError("input_queue.take: no batch was put")
        slot = self.pending.popleft()
        compute = self.backend.stream
        compute.wait_event(slot.copied)
        for dst, buf in zip(self.dsts, slot.staging):
            dst.data.copy_from_device_async(buf.data, buf.nbytes, stream=compute)
        slot.consumed.record(compute)
        slot.consumed_once = True
