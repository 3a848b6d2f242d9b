"""The CUDA backend proper (imported only once CuPy and a device are known to be there)."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter, defaultdict, deque
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
    option_choice,
    option_flag,
    read_cache_json,
    write_cache_file,
)

from .options import CUDNN_WORKSPACE_SHARE, FP8_SCALINGS, cudnn_workspace_cap  # (checked in CudaPlugin.create)
from .overlap import Overlap, host_alloc

KERNEL_SOURCE = Path(__file__).with_name("kernels.cu")
_BLOCK = 256
_DECODE_SPLIT = 64  # keys per block of attention_decode_part, one thread each (kernels.cu's DECODE_SPLIT)
_DECODE_MAX_HD = 256  # its shared query row
_GEMV_MAX_N = 8  # matmul_forward for at most this many rows: a warp per output column (kernels.cu's GEMV_MAX_N)
FP8_MIN_CC = 89  # --dtype fp8 below this is refused
FP8_HISTORY = 16  # steps of amax a delayed scale looks back over (torchao's default length)
FP8_SITES = 1024  # tensors delayed scaling follows (3 per layer matmul); any beyond cast with current scaling
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


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int = 0, dtype: str = BFLOAT16, options: dict[str, str] | None = None):
        if dtype not in (FLOAT32, BFLOAT16, FP8):
            raise BackendUnavailable(f"the cuda backend computes in float32, bfloat16 or fp8 (asked for {dtype})")
        # fp8: every buffer bf16, the matmuls FP8 (see the FP8 section below)
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
        self.fp8_classifier = option_flag(options, "fp8_classifier", False, env="LLMC_FP8_CLASSIFIER")
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

    def _init_fp8_scaling(self, options: dict[str, str] | None) -> None:
        """FP8's scales: per matmul call's cast tensors, and (delayed scaling) each tensor's amax history."""
        # amax (uint32 bits) and inverse scale (float32) of the <= 3 tensors one matmul call casts: x, w, dout.
        # Fixed addresses, so cuBLASLt plans hold them and a captured graph replays them; each scale 256-byte
        # aligned (cuBLASLt refuses to run a 4-byte aligned scale pointer, though its heuristic accepts it).
        self._fp8_slots = cp.zeros(256, dtype=np.uint32) if self.fp8 else None
        self.fp8_scaling = option_choice(options, "fp8_scaling", FP8_SCALINGS, "delayed", env="LLMC_FP8_SCALING")
        # delayed scaling: row 0 the step's amax so far, rows 1..FP8_HISTORY the earlier steps' (newest first), one
        # column a tensor ("site"); float32 for the ranks' MAX all-reduce, read as bits by the kernels
        self._fp8_hist = (cp.zeros((FP8_HISTORY + 1) * FP8_SITES, dtype=np.float32)
                          if self.fp8 and self.fp8_scaling == "delayed" else None)
        self._fp8_sites: dict[tuple[int, str], int] = {}  # (weight pointer, role) -> site, in order of first use
        self._fp8_next_site = 0  # the next site's number
        self._fp8_fresh: set[int] = set()  # sites with no history yet: no step ended since they were first cast
        self._fp8_loaded = 0  # sites below this number have a history from a checkpoint (load_carried_state)
        # a producer's inverse scale per site, 256-byte aligned as the slots' (read by the product it feeds)
        self._fp8_site_inv = cp.zeros(64 * FP8_SITES, dtype=np.float32) if self._fp8_hist is not None else None
        # (pointer, elements) of a buffer -> (site, e5m2) of the FP8 bytes a producer wrote over it. A buffer, not
        # its memory: the engine may place another buffer over the same memory once the product has read it (GPT-2's
        # shared GELU output inside the logits), and that one holds act
        self._fp8_held: dict[tuple[int, int], tuple[int, bool]] = {}
        # producer calls that wrote FP8, by role (uncaptured ones: a replayed graph runs no Python)
        self.fp8_produced: Counter[str] = Counter()

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
        if self._fp8_sites or self._fp8_held:
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
        if (pre_gelu is None or self.fp8_dgelu) and self._fp8_serves(N, C, OC, precise, *bufs) \
                and self._fp8_backward(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC):
            return
        self._fp8_restore(dout)  # (what follows reads the gradient as act)
        if pre_gelu is not None and self.fp8_wgrad and self._fp8_serves(N, C, OC, precise, *bufs) \
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

    # ---- FP8 matmuls (--dtype fp8) ---------------------------------------------------------------------------
    # Each product casts the operands no producer wrote (below) just before it runs: x and w to e4m3, dout to
    # e5m2, each tensor with its own scale (kernels.cu's FP8 section), into scratch that every matmul shares. The
    # backward products take transposed copies (Hopper's FP8 matmuls are "TN" only) made by the same cast.
    # Delayed scaling (the default; measured faster, and as good, in docs/performance.md) scales by the largest
    # amax of the tensor's last FP8_HISTORY steps and records this one's in the cast itself: one pass. Current
    # scaling (fp8_scaling=current) scales by the tensor's amax now: a pass to find it, then the cast. Delayed
    # scaling's tensors ("sites") are named by the weight they meet and their role (x, w, dout), numbered in order
    # of first use, which the training step fixes (forward layer by layer, then backward), so a checkpoint's
    # histories find their tensors again (carried_state). A site's first step, with no history, scales currently.
    def _fp8_serves(self, N, C, OC, precise, *bufs) -> bool:
        """FP8 for this product: dims multiples of 16 (cuBLASLt's FP8 rule), more rows than the GEMV path
        takes, 16-byte aligned operands, and not a `precise` product unless fp8_classifier is on."""
        return (self.fp8 and (not precise or self.fp8_classifier) and N > _GEMV_MAX_N and N % 16 == 0
                and C % 16 == 0 and OC % 16 == 0 and self._aligned(*bufs))

    def _fp8_slot(self, i):
        """(amax pointer, inverse-scale pointer) of slot i (0 = x, 1 = w, 2 = dout)."""
        base = self._fp8_slots.data.ptr
        return base + 4 * i, base + 256 * (i + 1)

    def _fp8_site(self, weight, role: str) -> int | None:
        """The delayed-scaling site of (weight, role), numbered on first use; None under current scaling or once
        FP8_SITES are taken."""
        if self._fp8_hist is None:
            return None
        key = (weight.data.ptr, role)
        site = self._fp8_sites.get(key)
        if site is None and self._fp8_next_site < FP8_SITES:
            site = self._fp8_sites[key] = self._fp8_next_site
            self._fp8_next_site += 1
            if site >= self._fp8_loaded:
                self._fp8_fresh.add(site)
        return site

    def _fp8_history(self, site: int) -> tuple:
        """(amax history, its length, stride, this step's amax) of a site: the scale's arguments of every cast
        and producer kernel under delayed scaling."""
        base = self._fp8_hist.data.ptr
        return base + 4 * (FP8_SITES + site), FP8_HISTORY, FP8_SITES, base + 4 * site

    def _fp8_forget(self, ptr: int, nbytes: int) -> None:
        """A new buffer at [ptr, ptr + nbytes): weights that lived there were freed, and their sites' histories
        must not scale whatever is multiplied there next (tests, benchmarks: models made one after another)."""
        for key in [k for k in self._fp8_sites if ptr <= k[0] < ptr + nbytes]:
            del self._fp8_sites[key]  # (its number is not given out again; carried_state keeps numbering alike)
        for key in [k for k in self._fp8_held if ptr <= k[0] < ptr + nbytes]:
            del self._fp8_held[key]

    def _fp8_cast(self, src, slot, rows, cols, out=None, out_t=None, e5m2=False, site=None, sums=False):
        """src -> out (rows, cols) and/or out_t (cols, rows) in FP8, its inverse scale into `slot`: scaled by the
        history of `site` (delayed scaling), else by its own amax found first (into the site's step amax, or the
        slot's). With out_t and `sums`, src's column sums per 64 rows are taken on the way, for _fp8_add_sums."""
        amax, inv = self._fp8_slot(slot)
        n = rows * cols
        hist_n, stride, observe = 1, 0, 0
        if site is not None:
            if site not in self._fp8_fresh:
                amax, hist_n, stride, observe = self._fp8_history(site)
            else:
                amax = self._fp8_hist.data.ptr + 4 * site  # (the step's amax so far: at least this tensor's)
        if observe == 0:
            self._launch(self._k("fp8_amax", True), self._grid(n, 8), _BLOCK, (np.uint64(amax), src, np.int64(n)))
        scale = (np.uint64(inv), np.uint64(amax), np.int32(hist_n), np.int32(stride), np.uint64(observe), src)
        if out_t is None:
            self._launch(self._k("fp8_quantize", True), self._grid(n, 8), _BLOCK,
                         (out, *scale, np.int64(n), np.int32(e5m2)))
        else:
            tiles = (rows + 63) // 64
            part = self.scratch("colsum", tiles * cols) if sums else np.uint64(0)
            self._launch(self._k("fp8_quantize_t", True), ((cols + 63) // 64, tiles), 256,
                         (out if out is not None else np.uint64(0), out_t, *scale, np.int32(rows), np.int32(cols),
                          np.int32(e5m2), part))

    def _fp8_add_sums(self, dbias, rows, cols):
        """dbias += the column sums the last cast with `sums` took (the backward's bias gradient, GPT-2)."""
        tiles = (rows + 63) // 64
        self._launch(self._kk("column_sums_reduce", dbias), (cols + 255) // 256, 256,
                     (dbias, self.scratch("colsum", tiles * cols), np.int32(tiles), np.int32(cols)))

    # the training step's boundaries (Backend.begin_step etc.): only delayed scaling carries anything
    def begin_step(self) -> None:
        if self._fp8_hist is not None:
            cp.cuda.runtime.memsetAsync(self._fp8_hist.data.ptr, 0, 4 * FP8_SITES, self.stream.ptr)

    def step_observations(self):
        return None if self._fp8_hist is None else self._fp8_hist[:FP8_SITES]

    def end_step(self) -> None:
        if self._fp8_hist is not None:
            self._launch(self._k("fp8_roll", True), FP8_SITES // 256, 256,
                         (self._fp8_hist, np.int32(FP8_SITES), np.int32(FP8_HISTORY)))
            self._fp8_fresh.clear()

    def carried_state(self) -> dict:
        # (the fresh sites are the newest: the ones below have a history)
        known = max(self._fp8_loaded, self._fp8_next_site - len(self._fp8_fresh)) if self._fp8_hist is not None else 0
        if not known:
            return {}
        with self.stream:
            h = cp.asnumpy(self._fp8_hist, stream=self.stream).reshape(FP8_HISTORY + 1, FP8_SITES)
        self.stream.synchronize()
        return {"fp8_amax_history": [[float(v) for v in h[1:, site]] for site in range(known)]}

    def load_carried_state(self, state: dict) -> None:
        rows = state.get("fp8_amax_history") if isinstance(state, dict) else None
        if self._fp8_hist is None or rows is None:
            return
        if (not isinstance(rows, list) or len(rows) > FP8_SITES
                or not all(isinstance(r, list) and len(r) == FP8_HISTORY for r in rows)):
            raise ValueError(f"fp8_amax_history: expected at most {FP8_SITES} lists of {FP8_HISTORY} amax values")
        try:
            h = np.asarray(rows, dtype=np.float64).reshape(len(rows), FP8_HISTORY)
        except (TypeError, ValueError):
            raise ValueError("fp8_amax_history: expected numbers") from None
        if not (np.isfinite(h).all() and (h >= 0).all() and (h <= np.finfo(np.float32).max).all()):
            raise ValueError("fp8_amax_history: expected finite amax values >= 0")
        full = np.zeros((FP8_HISTORY + 1, FP8_SITES), np.float32)
        full[1:, :len(rows)] = h.T
        self.upload(self._fp8_hist, full.reshape(-1))
        self._fp8_sites.clear()  # (sites are numbered again, in the same order, as the steps first cast them)
        self._fp8_held.clear()
        self._fp8_next_site, self._fp8_fresh, self._fp8_loaded = 0, set(), len(rows)

    def _fp8_zero(self):
        cp.cuda.runtime.memsetAsync(self._fp8_slots.data.ptr, 0, 16, self.stream.ptr)

    def _fp8_arena(self, *sizes):
        """Views of one scratch buffer (the largest request of any call; models.families.fp8_cast_bytes)."""
        a = self._transient(sum(sizes))
        out, at = [], 0
        for n in sizes:
            out.append(a[at:at + n])
            at += n
        return out

    # Producers (fp8_next; kernels.cu's FP8 section): a kernel whose output the product with `weight` reads next
    # writes that operand in FP8 itself, over the first bytes of its own output buffer, where the scale is known
    # before the tensor exists (delayed scaling, a site with a history). The product then reads it in place, and
    # its backward transposes it into the buffer's second half (an FP8 copy takes half of act's bytes). The bytes
    # and scales are those the product's own cast would have made, so either way trains the same bits.
    def _fp8_producer(self, out, weight, role: str, able: bool = True):
        """The FP8 output arguments (out8, inv8, amax8, hist_n, stride, observe8) for a kernel writing `out`, which
        the product with `weight` reads next as its `role` operand ("x" its input, "dout" its gradient), where
        the kernel is `able` and the product runs in FP8 from a site with a history; else None (the kernel writes
        act, and the product casts it). Either way `out` no longer holds an older producer's FP8 bytes."""
        if self._fp8_held:
            self._fp8_held.pop((out.data.ptr, out.size), None)
        # (it needs the scale before the tensor exists, delayed scaling, and the weight gradient's product in FP8)
        if weight is None or not (able and self.fp8_fuse and self.fp8_wgrad and self._fp8_hist is not None):
            return None
        OC, C = weight.shape
        N = out.size // (C if role == "x" else OC)
        if not self._fp8_serves(N, C, OC, False, out, weight):
            return None
        site = self._fp8_site(weight, role)
        if site is None or site in self._fp8_fresh:
            return None
        self._fp8_held[(out.data.ptr, out.size)] = (site, role == "dout")
        self.fp8_produced[role] += 1
        amax, hist_n, stride, observe = self._fp8_history(site)
        return (out, np.uint64(self._fp8_inv_of(site)), np.uint64(amax), np.int32(hist_n), np.int32(stride),
                np.uint64(observe))

    def _fp8_gelu_feeds(self, out, weight) -> bool:
        """Whether GELU's output `out` is the FP8 input of the product with `weight` (fp8_next) under delayed
        scaling, where GELU runs apart from the product before it, to be that product's producer."""
        if weight is None or self._fp8_hist is None or not self.fp8_wgrad:
            return False
        OC, C = weight.shape
        return self._fp8_serves(out.size // C, C, OC, False, out, weight)

    def _fp8_inv_of(self, site: int) -> int:
        """Where a producer left site's inverse scale."""
        return self._fp8_site_inv.data.ptr + 256 * site

    def _fp8_take_held(self, site: int, slot: int) -> int:
        """The slot's inverse scale, set to the one site's producer left: the products' cuBLASLt plans hold the
        slots' addresses (one plan, and one tuning race, a shape, not a site)."""
        inv = self._fp8_slot(slot)[1]
        cp.cuda.runtime.memcpyAsync(inv, self._fp8_inv_of(site), 4, cp.cuda.runtime.memcpyDeviceToDevice,
                                    self.stream.ptr)
        return inv

    def _fp8_held_site(self, buf, weight, role: str) -> int | None:
        """The site whose FP8 bytes a producer wrote over `buf` for this product, or None where buf holds act."""
        held = self._fp8_held.get((buf.data.ptr, buf.size)) if self._fp8_held else None
        if held is None:
            return None
        site = self._fp8_sites.get((weight.data.ptr, role))
        if held[0] != site:
            raise RuntimeError(f"a product met the FP8 {role} written for another one (site {held[0]}, not {site}): "
                               f"fp8_next must name the product that reads a tensor next")
        return site

    def _fp8_restore(self, *bufs) -> None:
        """A product about to run in bf16 (cuBLASLt refused its FP8 product, or a shape or option keeps it in bf16)
        reads act: FP8 bytes a producer wrote over one of `bufs` become act again, the values they stand for."""
        for buf in bufs:
            held = self._fp8_held.pop((buf.data.ptr, buf.size), None) if buf is not None and self._fp8_held else None
            if held is not None:
                src, = self._fp8_arena(buf.size)  # (a copy: act's elements are wider than the bytes they replace)
                cp.cuda.runtime.memcpyAsync(src.data.ptr, buf.data.ptr, buf.size,
                                            cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
                self._launch(self._k("fp8_dequantize", True), self._grid(buf.size, 8), _BLOCK,
                             (buf, src, np.uint64(self._fp8_inv_of(held[0])), np.int64(buf.size), np.int32(held[1])))

    def _fp8_transposed(self, buf, rows, cols) -> int:
        """The transposed copy (cols, rows) of the FP8 bytes a producer wrote over `buf`, made in its second half."""
        t = buf.data.ptr + rows * cols
        self._launch(self._k("fp8_transpose", True), ((cols + 63) // 64, (rows + 63) // 64), 256,
                     (np.uint64(t), buf, np.int32(rows), np.int32(cols)))
        return t

    def _fp8_forward(self, out, inp, weight, bias, pre_gelu, N, C, OC) -> bool:
        from nvmath.bindings.cublasLt import Epilogue as E
        held = self._fp8_held_site(inp, weight, "x")
        x8, w8 = self._fp8_arena(N * C if held is None else 0, OC * C)
        self._fp8_zero()
        if held is None:
            self._fp8_cast(inp, 0, N, C, out=x8, site=self._fp8_site(weight, "x"))
            x8, x_inv = x8.data.ptr, self._fp8_slot(0)[1]
        else:
            x8, x_inv = inp.data.ptr, self._fp8_take_held(held, 0)
        self._fp8_cast(weight, 1, OC, C, out=w8, site=self._fp8_site(weight, "w"))
        scales = (self._fp8_slot(1)[1], x_inv)
        b = bias.data.ptr if bias is not None else 0
        args = (x8, w8.data.ptr, N, C, OC, self.stream.ptr, scales)
        fast = self.fp8_fast_accum
        if pre_gelu is not None:
            if self.use_epilogues and self.lt.forward_fp8(out.data.ptr, *args, bias=b, aux=pre_gelu.data.ptr,
                                                          epilogue=E.GELU_AUX_BIAS if b else E.GELU_AUX,
                                                          fast_accum=fast):
                return True
            if not self.lt.forward_fp8(pre_gelu.data.ptr, *args, bias=b, fast_accum=fast):
                return False
            self.gelu_forward(out, pre_gelu)
            return True
        return self.lt.forward_fp8(out.data.ptr, *args, bias=b, fast_accum=fast)

    def _fp8_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC) -> bool:
        if not self.fp8_wgrad:
            return self._fp8_backward_dinp(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC)
        held = self._fp8_held_site(dout, weight, "dout")
        x_cast = 0 if self._fp8_held_site(inp, weight, "x") is not None else N * C  # (bytes for the input's cast)
        if held is not None:
            if dbias is not None:  # (its sums are taken from act values, which the producer did not write)
                raise RuntimeError("fp8_next named a product with a bias as the reader of its gradient")
            w8t, x8t = self._fp8_arena(OC * C if dinp is not None else 0, x_cast)
            self._fp8_zero()
            grad = (dout.data.ptr, self._fp8_take_held(held, 2))
            if dinp is not None and not self._fp8_dinp(dinp, grad, w8t, weight, pre_gelu, N, C, OC):
                return False
            return self._fp8_dweight(dweight, None, (self._fp8_transposed(dout, N, OC), grad[1]), inp, weight,
                                     N, C, OC, x8t=x8t)
        one_pass = N * OC + max(N * OC + OC * C, x_cast)
        if dinp is not None and one_pass > self.cudnn_workspace:
            return self._fp8_backward_two_pass(dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC)
        # the transposed gradient first; after it, the gradient and the weight for dinp, then (over them) the
        # transposed input for dweight
        d8t, rest = self._fp8_arena(N * OC, max(N * OC + OC * C, x_cast))
        d8, w8t = rest[:N * OC], rest[N * OC:N * OC + OC * C]
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out=d8 if dinp is not None else None, out_t=d8t, e5m2=True,
                       site=self._fp8_site(weight, "dout"), sums=dbias is not None)
        inv = self._fp8_slot(2)[1]
        if dinp is not None and not self._fp8_dinp(dinp, (d8.data.ptr, inv), w8t, weight, pre_gelu, N, C, OC):
            return False  # (nothing accumulated yet: the bf16 path redoes the product)
        return self._fp8_dweight(dweight, dbias, (d8t.data.ptr, inv), inp, weight, N, C, OC, x8t=rest)

    def _fp8_backward_two_pass(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC) -> bool:
        """The backward of a product whose one-pass casts (the gradient normal and transposed at once) would need
        more bytes than cuDNN's attention workspace, which the casts share: the gradient cast twice, once for dinp
        and once, transposed, for dweight, in half the bytes for one more read of it (the same scale, so the same
        bits: Llama 3.2-1B's w13, whose gradient is 16384 x 16384 at B=8 T=2048)."""
        site = self._fp8_site(weight, "dout")
        d8, w8t = self._fp8_arena(N * OC, OC * C)
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out=d8, e5m2=True, site=site)
        inv = self._fp8_slot(2)[1]
        if not self._fp8_dinp(dinp, (d8.data.ptr, inv), w8t, weight, pre_gelu, N, C, OC):
            return False  # (nothing accumulated yet: the bf16 path redoes the product)
        d8t, x8t = self._fp8_arena(N * OC, N * C)
        self._fp8_cast(dout, 2, N, OC, out_t=d8t, e5m2=True, site=site, sums=dbias is not None)
        return self._fp8_dweight(dweight, dbias, (d8t.data.ptr, inv), inp, weight, N, C, OC, x8t=x8t)

    def _fp8_dweight(self, dweight, dbias, grad_t, inp, weight, N, C, OC, x8t=None) -> bool:
        """dweight += the FP8 gradient grad_t = (transposed bytes, inverse scale) times inp, cast transposed into
        x8t here (or transposed from a producer's FP8 bytes); then dbias += the sums the gradient's cast took.
        False, with neither touched, if cuBLASLt has no FP8 algorithm."""
        held = self._fp8_held_site(inp, weight, "x")
        if held is None:
            self._fp8_cast(inp, 0, N, C, out_t=x8t, site=self._fp8_site(weight, "x"))
            x = (x8t.data.ptr, self._fp8_slot(0)[1])
        else:
            x = (self._fp8_transposed(inp, N, C), self._fp8_take_held(held, 0))
        if not self.lt.backward_weight_fp8(dweight.data.ptr, grad_t[0], x[0], N, C, OC, self.stream.ptr,
                                           (x[1], grad_t[1])):
            return False  # (dinp is overwritten by the bf16 path; dweight and dbias untouched so far)
        if dbias is not None:
            self._fp8_add_sums(dbias, N, OC)
        return True

    def _fp8_dinp(self, dinp, grad, w8t, weight, pre_gelu, N, C, OC) -> bool:
        """dinp from the FP8 gradient grad = (bytes, inverse scale) and the weight cast transposed into w8t here;
        False if cuBLASLt has no FP8 algorithm for it."""
        s = self.stream.ptr
        self._fp8_cast(weight, 1, OC, C, out_t=w8t, site=self._fp8_site(weight, "w"))
        scales = (self._fp8_slot(1)[1], grad[1])
        if pre_gelu is not None and self.use_epilogues and self.lt.backward_input_fp8(
                dinp.data.ptr, grad[0], w8t.data.ptr, N, C, OC, s, scales, pre_gelu=pre_gelu.data.ptr):
            return True
        if not self.lt.backward_input_fp8(dinp.data.ptr, grad[0], w8t.data.ptr, N, C, OC, s, scales):
            return False
        if pre_gelu is not None:
            self.gelu_backward(dinp, pre_gelu, dinp)
        return True

    def _fp8_backward_wgrad(self, dweight, dbias, dout, inp, weight, N, C, OC) -> bool:
        """fp8_dgelu=off: the weight gradient of a product whose dinp takes GELU's derivative in FP8 (its input,
        GELU's output, is often a producer's FP8 bytes), the gradient cast transposed here; dinp stays the
        caller's, in bf16 (cuBLASLt's FP8 products have no DGELU epilogue)."""
        x_cast = 0 if self._fp8_held_site(inp, weight, "x") is not None else N * C
        d8t, x8t = self._fp8_arena(N * OC, x_cast)
        self._fp8_zero()
        self._fp8_cast(dout, 2, N, OC, out_t=d8t, e5m2=True, site=self._fp8_site(weight, "dout"),
                       sums=dbias is not None)
        return self._fp8_dweight(dweight, dbias, (d8t.data.ptr, self._fp8_slot(2)[1]), inp, weight, N, C, OC,
                                 x8t=x8t)

    def _fp8_backward_dinp(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu, N, C, OC) -> bool:
        """fp8_wgrad=off: dinp in FP8 (no transposed gradient needed), the weight gradient in bf16."""
        self._fp8_restore(inp, dout)  # (produced while fp8_wgrad was on: the option changed in between)
        if dinp is not None:
            d8, w8t = self._fp8_arena(N * OC, OC * C)
            self._fp8_zero()
            self._fp8_cast(dout, 2, N, OC, out=d8, e5m2=True, site=self._fp8_site(weight, "dout"))
            if not self._fp8_dinp(dinp, (d8.data.ptr, self._fp8_slot(2)[1]), w8t, weight, pre_gelu, N, C, OC):
                return False
        self._dweight(dweight, dbias, dout, inp, N, C, OC)
        return True

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
    def classifier_forward_backward(self, logits, losses, targets, vocab_size, dloss):
        Vp = logits.shape[-1]
        N = logits.size // Vp
        k = self._kk("classifier_fwd_bwd", logits)
        vec, block = self._cfg("classifier_forward_backward", k,
                               int(Vp % (16 // logits.dtype.itemsize) == 0 and self._aligned(logits)), 512)
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
