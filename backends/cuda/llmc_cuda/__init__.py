"""llmc's CUDA backend: NVRTC-compiled kernels, cuBLASLt matmuls (nvmath-python), cuDNN attention, bf16.

This module imports nothing heavy: CuPy, nvmath and cudnn are imported by `probe` / `create`, so the plugin
loads (and `llmc backends` can say why it cannot run) on machines without a GPU or without CuPy.
"""

from __future__ import annotations

import ctypes

from llmc_cli.kernels import BFLOAT16, FLOAT32, FP8, BackendPlugin, BackendUnavailable, option_flag

from .nccl import create as create_communicator
from .options import (
    CUBLASLT_WORKSPACE_BYTES,
    CUDNN_WORKSPACE_MAX_MIB,
    CUDNN_WORKSPACE_SHARE,
    FP8_SCALINGS,
    attention_backward_workspace,
    check_options,
    cudnn_workspace_cap,
    planned_attention_workspace,
)

_DTYPES = {None: None, "bf16": BFLOAT16, BFLOAT16: BFLOAT16, "fp32": FLOAT32, FLOAT32: FLOAT32, FP8: FP8}


def _driver_error() -> str | None:
    """Why there is no NVIDIA driver here (libcuda cannot be loaded), or None when there is one. Asked first:
    on a machine without a GPU, a missing CuPy is not the problem worth naming."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return str(e).split(":")[-1].strip() or "libcuda.so.1 not found"
    return None


def _check() -> tuple[bool, str]:
    """(usable, reason): an NVIDIA driver, CuPy importable, a CUDA device present, cuBLASLt bindings importable."""
    why = _driver_error()
    if why is not None:
        return False, f"no NVIDIA GPU/driver found (libcuda.so.1: {why})"
    try:
        import cupy  # (heavy and optional: probed here, so the plugin loads without it)
    except ImportError as e:
        return False, (f"cupy is not installed (pip install 'llmc-cuda[gpu]', or cupy-cuda12x for a CUDA 12 driver): "
                       f"{e}")
    except Exception as e:  # a broken CuPy install
        return False, f"cupy failed to import: {type(e).__name__}: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA driver or device: {type(e).__name__}: {e}".strip()
    if n < 1:
        return False, "no CUDA device found"
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False, "ml_dtypes is not installed (pip install ml_dtypes)"
    try:
        from nvmath.bindings import cublasLt  # noqa: F401
    except Exception as e:
        return False, f"nvmath-python (cuBLASLt) is not usable (pip install nvmath-python): {type(e).__name__}: {e}"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        cc = f"sm_{props['major']}{props['minor']}"
        ver = cupy.cuda.runtime.runtimeGetVersion()
        return True, f"{n} x {name} ({cc}), CUDA runtime {ver // 1000}.{(ver % 1000) // 10}, CuPy {cupy.__version__}"
    except Exception as e:
        return False, f"CUDA device query failed: {type(e).__name__}: {e}"


class CudaPlugin(BackendPlugin):
    name = "cuda"
    priority = 100
    default_dtype = BFLOAT16

    def probe(self):
        try:
            return _check()
        except Exception as e:  # probe must never raise
            return False, f"probe failed: {type(e).__name__}: {e}"

    def devices(self):
        ok, _ = self.probe()
        if not ok:
            return []
        import cupy  # (heavy and optional: the plugin loads without it)
        out = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            out.append(f"cuda:{i} {name}")
        return out

    options = {
        "cudnn": "on|off: attention through cuDNN's fused SDPA where it serves the shape (default on; env LLMC_CUDNN)",
        "epilogues": "on|off: bias and GELU fused into cuBLASLt's matmul epilogues (default on; env "
                     "LLMC_CUBLASLT_EPILOGUES)",
        "tune": "on|off: time cuBLASLt's candidate algorithms per shape and keep the fastest bit-identical one "
                "(default on; env LLMC_CUBLASLT_TUNE)",
        "tf32": "on|off: with --dtype fp32, matmuls on TF32 tensor cores (operands rounded to 10 mantissa bits, "
                "float32 accumulation; llm.c's default) rather than IEEE fp32 (default on; env LLMC_TF32)",
        "cudnn_workspace_mib": "MiB, 0..1048576: the most workspace cuDNN's deterministic attention backward may take; "
                               "past it the batch is run in slices (default: 1/32 of the GPU's memory; env "
                               "LLMC_CUDNN_WORKSPACE_MIB)",
        "fp8_classifier": "off|backward|on: with --dtype fp8, the classifier's matmuls in FP8 too: none (default: "
                          "bf16), its backward's two, or all three (env LLMC_FP8_CLASSIFIER)",
        "fp8_scaling": "delayed|current: with --dtype fp8, how each cast tensor is scaled: by its largest amax of "
                       "the last 16 steps (default; one pass; the history is kept in checkpoints) or by its amax now "
                       "(a pass over it first; env LLMC_FP8_SCALING)",
        "fp8_wgrad": "on|off: with --dtype fp8, the weight gradients' matmuls in FP8 too (default on; off: bf16, "
                     "which skips the transposed casts, and GELU stays in its matmul's epilogue; env LLMC_FP8_WGRAD)",
        "fp8_fuse": "on|off: with --dtype fp8 (delayed scaling, fp8_wgrad on), the norms, SwiGLU and GELU write the "
                    "FP8 operand of the matmul that reads their output next themselves, in place of their bf16 output "
                    "and that matmul's cast of it; the same bits either way (default on; env LLMC_FP8_FUSE)",
        "fp8_dgelu": "on|off: with --dtype fp8, the input gradient fused with GELU's derivative (GPT-2's MLP "
                     "output projection) in FP8 too (default off: bf16, faster on GPT-2 d12 and d48; env "
                     "LLMC_FP8_DGELU)",
        "p2p": "on|off: data parallel on GPUs that reach each other's memory (NVLink or PCIe peer access): ZeRO's "
               "update writes every rank's copy of the parameters it updates, in place of NCCL's all-gather after "
               "it (default: on for two GPUs, off for more; env LLMC_P2P)",
        "p2p_reduce": "on|off: with peer memory (p2p), ZeRO-1's reduce-scatter too: a kernel loads every rank's "
                      "chunk from their memory (default off: NCCL's; measured faster for GPT-2 d48 on two H200s, no "
                      "faster for d12; env LLMC_P2P_REDUCE)",
        "p2p_copies": "on|off: with peer memory (p2p) and --overlap, ZeRO-1's gradient pieces are copied to the "
                      "ranks that own them by the GPUs' copy engines as the backward pass makes them final, and "
                      "each rank averages its chunk after it (default on; off: NCCL reduces each piece on SMs "
                      "beside the backward; env LLMC_P2P_COPIES)",
        "fp8_fast_accum": "on|off: with --dtype fp8, cuBLASLt's fast accumulation in the forward matmuls (default on; "
                          "env LLMC_FP8_FAST_ACCUM)",
    }

    def planned_scratch(self, dtype, options=None, attention=None):
        """cuBLASLt's workspace (CUBLASLT_WORKSPACE_BYTES) and, for bf16 and fp8 with cuDNN on, cuDNN attention's
        backward: the slice it runs within cudnn_workspace_mib when that is set, else the whole batch's (an upper
        bound: on a GPU whose 1/CUDNN_WORKSPACE_SHARE is less it runs in smaller slices). Without `attention` (the
        model's shape) only a set cap is counted. FP8's casts share it: for fp8 it overlaps the plan's "FP8 casts",
        and the sum is an upper bound."""
        check_options(options)
        out = {"cuBLASLt workspace": CUBLASLT_WORKSPACE_BYTES}
        if _DTYPES.get(dtype, dtype) in (BFLOAT16, FP8) and option_flag(options, "cudnn", True, env="LLMC_CUDNN"):
            cap = cudnn_workspace_cap(options)
            need = planned_attention_workspace(*attention, cap) if attention is not None else cap
            if need is not None:
                out["cuDNN attention workspace (cudnn_workspace_mib)"] = need
        return out

    def create(self, device=None, dtype=None, options=None):
        check_options(options)
        ok, reason = self.probe()
        if not ok:
            raise BackendUnavailable(reason)
        if dtype not in _DTYPES:
            raise BackendUnavailable(f"the cuda backend computes in bf16, fp8 or fp32 (asked for {dtype})")
        dt = _DTYPES[dtype] or self.default_dtype
        index = 0
        if device not in (None, ""):
            d = str(device)
            d = d.split(":", 1)[1] if d.startswith("cuda:") else d
            try:
                index = int(d)
            except ValueError:
                raise BackendUnavailable(f"cuda device must be an index or cuda:N (got '{device}')") from None
        from .backend import CudaBackend  # (imports CuPy at its top: only once a device is known to be there)
        return CudaBackend(device=index, dtype=dt, options=options)

    def prepare(self):
        """Compile kernels.cu for both activation dtypes on every GPU architecture here, in parallel, into CuPy's
        kernel cache (the NVRTC work a first run would otherwise wait for: seconds per module)."""
        ok, reason = self.probe()
        if not ok:
            raise BackendUnavailable(reason)
        import cupy  # (heavy and optional: the plugin loads without it, to say why it cannot run)

        from .backend import _Compiling  # (imports CuPy at its top)
        archs = {}
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            archs.setdefault(f"{p['major']}{p['minor']}", i)
        jobs = [_Compiling(dev, cc, (False, True)) for cc, dev in archs.items()]
        for job in jobs:
            job.get(False), job.get(True)
        return f"kernels compiled for sm_{', sm_'.join(sorted(archs))} (fp32 and bf16) into CuPy's kernel cache"

    def communicator(self, backend, info, rendezvous):
        """NCCL on the backend's stream (see nccl.py)."""
        return create_communicator(backend, info, rendezvous)


__all__ = ["CUBLASLT_WORKSPACE_BYTES", "CUDNN_WORKSPACE_MAX_MIB", "CUDNN_WORKSPACE_SHARE", "FP8_SCALINGS", "CudaPlugin",
           "attention_backward_workspace", "check_options"]
