"""``llmc bench``: every kernel of the interface and the whole training step, timed on every backend side by side.

llm.c's ``dev/cuda`` files time each kernel and check it against a CPU reference; here one command does that for
every installed backend on the shapes a GPT-2 really uses.

* ``kernels``: each kernel (forward and backward) on random inputs drawn from a fixed seed; the same inputs go to
  every backend and to the reference (the ``cpu`` backend, numpy float32). Timing is the median of ``repeat`` calls
  after ``warmup`` calls, each call measured with ``Backend.timer()`` (device events where the backend announces
  CAP_DEVICE_EVENTS, else the host clock around a synchronize). Throughput is GB/s for memory-bound kernels (bytes
  read + written, counted analytically per kernel: every input element read once, every output written once,
  accumulated outputs read and written) and TFLOP/s for matmuls and attention (useful FLOPs: 2*M*N*K per product,
  the causal half for attention). The error is ``max|got - ref| / max|ref|`` over each output, the worst output
  of the kernel; a backend whose error exceeds the tolerance of its dtype is flagged as a mismatch.
* ``train``: end-to-end training steps through the same ``Trainer`` that ``llmc train`` uses (data loader,
  forward, backward, global norm, AdamW), ms/step, tokens/s, MFU where the backend knows its peak FLOP/s
  (``Backend.peak_flops``), memory; optionally PyTorch on the same model, weights, data and optimizer.

The functions here take lists of ``(label, Backend)`` so tests (or other tools) can pass backends directly.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np

from llmc_cli import registry
from llmc_cli.models.gpt2 import GPT2Config, num_parameters, preset
from llmc_cli.kernels import BFLOAT16, CAP_DEVICE_EVENTS, CAP_KV_CACHE, FLOAT32, INT32, Backend, BackendUnavailable
from llmc_cli.models.base import split_flat
from llmc_cli.commands.options import COUNT, POSITIVE, SEED, Real

# relative error (max |got - ref| / max |ref|) above which a kernel is a mismatch, by the backend's dtype
TOLERANCES = {FLOAT32: 1e-4, BFLOAT16: 3e-2}
DTYPE_BYTES = {FLOAT32: 4, BFLOAT16: 2, INT32: 4}


class BenchError(ValueError):
    """Bad options (unknown backend, impossible shapes); the message is one line."""


# ---------------------------------------------------------------------------------------------------------------
# the machine

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _blas() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        b = cfg["Build Dependencies"]["blas"]
        return f"{b.get('name', '?')} {b.get('version', '')}".strip()
    except Exception:
        return "?"


def _nvidia_smi() -> list[str]:
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return [l.strip() for l in out.stdout.splitlines() if l.strip()]
    except Exception:
        return []


def describe_machine(backends: Sequence[tuple[str, Backend]] = ()) -> dict:
    """CPU model, cores, OS, library versions, GPUs (nvidia-smi where present) and each backend's own line."""
    libs = {d: _version(d) for d in ("llmc", "llmc-cpu", "llmc-opencl", "llmc-cuda", "numpy", "scipy", "pyopencl",
                                     "cupy-cuda12x", "cupy-cuda13x", "torch", "click", "rich")}
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "os": platform.platform(),
        "python": platform.python_version(), "blas": _blas(),
        "libraries": {k: v for k, v in libs.items() if v},
        "gpus": _nvidia_smi(),
        "backends": [{"label": label, "describe": b.describe(), "dtype": b.dtype,
                      "timer": "device events" if CAP_DEVICE_EVENTS in b.capabilities else "host clock"}
                     for label, b in backends],
    }


def machine_lines(m: dict) -> list[str]:
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['os']}, Python {m['python']}, BLAS {m['blas']}",
             f"libraries: {libs}"]
    lines += [f"gpu: {g}" for g in m["gpus"]]
    lines += [f"backend {b['label']}: {b['describe']} ({b['dtype']}, timer: {b['timer']})" for b in m["backends"]]
    return lines


# ---------------------------------------------------------------------------------------------------------------
# choosing backends

def resolve_backends(names: Sequence[str], dtype: str | None = None, plugins=None,
                     ) -> tuple[list[tuple[str, Backend]], list[tuple[str, str]]]:
    """Create the named backends (all usable ones when `names` is empty) computing in `dtype` (None = each
    backend's default). Returns ([(label, backend)], [(name, why it was left out)]). A backend named explicitly
    that cannot run raises BenchError; with no names, unusable backends are only reported.
    `plugins`: a list of `registry.PluginInfo` to choose from (default: `registry.discover()`)."""
    plugins = registry.discover() if plugins is None else list(plugins)
    by_name = {p.name: p for p in plugins}
    chosen, skipped = [], []
    wanted = list(dict.fromkeys(names)) if names else [p.name for p in plugins]
    for name in wanted:
        p = by_name.get(name)
        if p is None:
            raise BenchError(f"--backend {name}: not installed (installed: {', '.join(by_name) or 'none'})")
        if p.plugin is None or not p.usable:
            if names:
                raise BenchError(f"--backend {name}: installed but cannot run here: {p.reason}")
            skipped.append((name, p.reason))
            continue
        try:
            chosen.append((name, p.plugin.create(dtype=dtype)))
        except BackendUnavailable as e:
            if names:
                raise BenchError(f"--backend {name}: {e}") from None
            skipped.append((name, str(e)))
    if not chosen:
        raise BenchError("no usable backend to benchmark (see `llmc backends`)")
    return chosen, skipped


def reference_backend(backends: Sequence[tuple[str, Backend]], plugins=None) -> Backend | None:
    """The numpy float32 backend every other is checked against: the one in `backends` if it is there."""
    for label, b in backends:
        if b.name == "cpu" and b.dtype == FLOAT32:
            return b
    plugins = registry.discover() if plugins is None else plugins
    for p in plugins:
        if p.name == "cpu" and p.plugin is not None and p.usable:
            try:
                return p.plugin.create(dtype=FLOAT32)
            except BackendUnavailable:
                return None
    return None


# ---------------------------------------------------------------------------------------------------------------
# kernel cases

@dataclass
class Buf:
    shape: tuple
    kind: str = "act"          # "act" (the backend's compute dtype), "f32" or "i32"
    init: str = "normal"       # normal | weight (N(0, 0.02)) | gamma (1 + N(0, 0.1)) | small | positive | tokens:V


@dataclass
class KernelCase:
    name: str                                   # e.g. "matmul_fwd qkv"
    kind: str                                   # "memory" (GB/s) or "compute" (TFLOP/s)
    shape: dict                                 # what the shape is, for the JSON
    bufs: dict[str, Buf]
    outputs: list[str]                          # compared against the reference after one call
    call: Callable[[Backend, dict], None]
    bytes_fn: Callable[[int], int]              # bytes moved for an act itemsize
    flops: int = 0
    derive: Callable[[dict, Backend], None] | None = None   # fills dependent inputs (on the host, via reference)
    needs: str | None = None                    # a capability the kernel needs (backends without it skip it)


def _kind_dtype(kind: str, backend: Backend) -> str:
    return {"act": backend.dtype, "f32": FLOAT32, "i32": INT32}[kind]


def _decode_case(B: int, T: int, NH: int, NKV: int, hd: int) -> KernelCase:
    """attention_decode as sampling uses it: one new token per sequence at the last position of a T-long cache
    (writes its k, v at position T-1, attends over all T); rerunning it rewrites the same values."""
    qkv_c, pos = (NH + 2 * NKV) * hd, T - 1
    return KernelCase(
        "attention_decode", "compute", {"B": B, "Tn": 1, "pos": pos, "NH": NH, "NKV": NKV, "hd": hd},
        {"out": Buf((B, 1, NH * hd)), "qkv": Buf((B, 1, qkv_c)), "k_cache": Buf((B, NKV, T, hd)),
         "v_cache": Buf((B, NKV, T, hd))}, ["out", "k_cache", "v_cache"],
        lambda k, b: k.attention_decode(b["out"], b["qkv"], b["k_cache"], b["v_cache"], pos, NH, NKV),
        lambda s: B * (qkv_c + NH * hd + 2 * NKV * T * hd + 2 * NKV * hd) * s,
        flops=4 * B * NH * T * hd, needs=CAP_KV_CACHE)


def _shared_tail_cases(B: int, T: int, Vp: int, V: int, P: int, NH: int, NKV: int, hd: int) -> list[KernelCase]:
    """The kernels every model family ends its step with: the fused classifier over (B, T, Vp) logits (losses
    and dlogits in place), AdamW and the global norm over all P parameters, and single-token decode attention."""
    N = B * T
    cases = [
        KernelCase("classifier_fwd_bwd", "memory", {"N": N, "Vp": Vp, "V": V},
                   {"logits": Buf((B, T, Vp)), "losses": Buf((B, T), "f32"),
                    "targets": Buf((B, T), "i32", f"tokens:{V}")}, ["logits", "losses"],
                   lambda k, b: k.classifier_forward_backward(b["logits"], b["losses"], b["targets"], V, 1.0 / N),
                   lambda s: 2 * N * Vp * s + 8 * N)]

    def adamw(k, b):
        k.adamw_update(b["param"], b["grad"], b["m"], b["v"], b.get("master"), lr=3e-4, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0, seed=1337)
    cases.append(KernelCase("adamw", "memory", {"params": P},
                            {"param": Buf((P,), init="weight"), "grad": Buf((P,), init="small"),
                             "m": Buf((P,), "f32", "small"), "v": Buf((P,), "f32", "positive")}, ["param"], adamw,
                            lambda s: P * (3 * s + 16 + (8 if s < 4 else 0))))
    cases.append(KernelCase("global_norm", "memory", {"params": P},
                            {"out": Buf((1,), "f32", "small"), "grad": Buf((P,), init="small")}, ["out"],
                            lambda k, b: k.global_norm_squared(b["out"], [b["grad"]]), lambda s: P * s + 4))
    cases.append(_decode_case(B, T, NH, NKV, hd))
    return cases


def kernel_cases(cfg, B: int, T: int) -> list[KernelCase]:
    """Every kernel of the interface the model uses, on its shapes at (B, T): GPT-2's, or Llama 3's (rmsnorm,
    rotary embedding, grouped-query attention, SwiGLU) for a Llama config."""
    if not isinstance(cfg, GPT2Config):
        return llama_kernel_cases(cfg, B, T)
    C, NH, Vp, V, maxT = cfg.n_embd, cfg.n_head, cfg.padded_vocab_size, cfg.vocab_size, cfg.block_size
    N, hd, P = B * T, C // NH, num_parameters(cfg)
    F = 4 * C
    cases: list[KernelCase] = []

    def add(*a, **k):
        cases.append(KernelCase(*a, **k))

    # encoder
    add("encoder_fwd", "memory", {"B": B, "T": T, "C": C, "Vp": Vp},
        {"out": Buf((B, T, C)), "inp": Buf((B, T), "i32", f"tokens:{V}"), "wte": Buf((Vp, C), init="weight"),
         "wpe": Buf((maxT, C), init="weight")}, ["out"],
        lambda k, b: k.encoder_forward(b["out"], b["inp"], b["wte"], b["wpe"]),
        lambda s: 4 * N + 3 * N * C * s)
    add("encoder_bwd", "memory", {"B": B, "T": T, "C": C, "Vp": Vp},
        {"dwte": Buf((Vp, C), init="small"), "dwpe": Buf((maxT, C), init="small"), "dout": Buf((B, T, C)),
         "inp": Buf((B, T), "i32", f"tokens:{V}")}, ["dwte", "dwpe"],
        lambda k, b: k.encoder_backward(b["dwte"], b["dwpe"], b["dout"], b["inp"]),
        lambda s: 4 * N + N * C * s + 2 * N * C * s + 2 * T * C * s)
    # layernorm
    ln_in = {"inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma"), "bias": Buf((C,), init="weight")}
    add("layernorm_fwd", "memory", {"N": N, "C": C},
        {"out": Buf((B, T, C)), "mean": Buf((B, T), "f32"), "rstd": Buf((B, T), "f32"), **ln_in},
        ["out", "mean", "rstd"],
        lambda k, b: k.layernorm_forward(b["out"], b["mean"], b["rstd"], b["inp"], b["weight"], b["bias"]),
        lambda s: 2 * N * C * s + 2 * C * s + 8 * N)

    def ln_stats(h, ref):
        x = h["inp"].astype(np.float64)
        h["mean"] = x.mean(-1).astype(np.float32)
        h["rstd"] = (1.0 / np.sqrt(x.var(-1) + 1e-5)).astype(np.float32)

    add("layernorm_bwd", "memory", {"N": N, "C": C},
        {"dinp": Buf((B, T, C)), "dweight": Buf((C,), init="small"), "dbias": Buf((C,), init="small"),
         "dout": Buf((B, T, C)), "inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma"),
         "mean": Buf((B, T), "f32", "small"), "rstd": Buf((B, T), "f32", "positive")},
        ["dinp", "dweight", "dbias"],
        lambda k, b: k.layernorm_backward(b["dinp"], b["dweight"], b["dbias"], b["dout"], b["inp"], b["weight"],
                                          b["mean"], b["rstd"]),
        lambda s: 4 * N * C * s + 5 * C * s + 8 * N, derive=ln_stats)
    add("residual_fwd", "memory", {"N": N, "C": C},
        {"out": Buf((B, T, C)), "inp1": Buf((B, T, C)), "inp2": Buf((B, T, C))}, ["out"],
        lambda k, b: k.residual_forward(b["out"], b["inp1"], b["inp2"]),
        lambda s: 3 * N * C * s)
    add("fused_residual_layernorm_fwd", "memory", {"N": N, "C": C},
        {"residual": Buf((B, T, C)), "out": Buf((B, T, C)), "mean": Buf((B, T), "f32"), "rstd": Buf((B, T), "f32"),
         "inp1": Buf((B, T, C)), "inp2": Buf((B, T, C)), "weight": Buf((C,), init="gamma"),
         "bias": Buf((C,), init="weight")}, ["residual", "out", "mean", "rstd"],
        lambda k, b: k.fused_residual_layernorm_forward(b["residual"], b["out"], b["mean"], b["rstd"], b["inp1"],
                                                        b["inp2"], b["weight"], b["bias"]),
        lambda s: 4 * N * C * s + 2 * C * s + 8 * N)

    # matmuls: (name, in channels K, out channels OC, bias, GELU fused in forward / its derivative in backward)
    mm = [("qkv", C, 3 * C, True, False), ("attproj", C, C, True, False), ("fc", C, F, True, True),
          ("fcproj", F, C, True, False), ("classifier", C, Vp, False, False)]
    for name, K, OC, bias, gelu in mm:
        bufs = {"out": Buf((B, T, OC)), "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}
        if bias:
            bufs["bias"] = Buf((OC,), init="weight")
        if gelu:
            bufs["pre_gelu"] = Buf((B, T, OC))

        def fwd(k, b):
            k.matmul_forward(b["out"], b["inp"], b["weight"], b.get("bias"), pre_gelu=b.get("pre_gelu"))
        add(f"matmul_fwd {name}" + (" +gelu" if gelu else ""), "compute",
            {"N": N, "K": K, "OC": OC, "bias": bias, "gelu": gelu}, bufs,
            ["out"] + (["pre_gelu"] if gelu else []), fwd,
            (lambda K, OC, bias, gelu: lambda s: (N * K + OC * K + N * OC * (2 if gelu else 1)) * s
             + (OC * s if bias else 0))(K, OC, bias, gelu),
            flops=2 * N * K * OC)
    # backward: GPT-2 fuses GELU's derivative into fcproj's dinp (its input was gelu(fch))
    for name, K, OC, bias, _ in mm:
        gelu_bwd = name == "fcproj"
        bufs = {"dinp": Buf((B, T, K)), "dweight": Buf((OC, K), init="small"), "dout": Buf((B, T, OC)),
                "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}
        if bias:
            bufs["dbias"] = Buf((OC,), init="small")
        if gelu_bwd:
            bufs["pre_gelu"] = Buf((B, T, K))

        def bwd(k, b):
            k.matmul_backward(b["dinp"], b["dweight"], b.get("dbias"), b["dout"], b["inp"], b["weight"],
                              pre_gelu=b.get("pre_gelu"))
        add(f"matmul_bwd {name}" + (" +gelu'" if gelu_bwd else ""), "compute",
            {"N": N, "K": K, "OC": OC, "bias": bias, "gelu": gelu_bwd}, bufs,
            ["dinp", "dweight"] + (["dbias"] if bias else []), bwd,
            (lambda K, OC, bias, g: lambda s: (N * OC + 2 * N * K + 3 * OC * K + (N * K if g else 0)) * s
             + (2 * OC * s if bias else 0))(K, OC, bias, gelu_bwd),
            flops=4 * N * K * OC)

    # elementwise GELU on the MLP's hidden activations
    add("gelu_fwd", "memory", {"N": N, "C": F}, {"out": Buf((B, T, F)), "inp": Buf((B, T, F))}, ["out"],
        lambda k, b: k.gelu_forward(b["out"], b["inp"]), lambda s: 2 * N * F * s)
    add("gelu_bwd", "memory", {"N": N, "C": F},
        {"dinp": Buf((B, T, F)), "inp": Buf((B, T, F)), "dout": Buf((B, T, F))}, ["dinp"],
        lambda k, b: k.gelu_backward(b["dinp"], b["inp"], b["dout"]), lambda s: 3 * N * F * s)

    # attention: useful FLOPs of the causal half (QK^T and PV forward; dV, dP, dQ, dK backward)
    att_shape = {"B": B, "T": T, "NH": NH, "hd": hd}
    add("attention_fwd", "compute", att_shape,
        {"out": Buf((B, T, C)), "lse": Buf((B, NH, T), "f32"), "qkv": Buf((B, T, 3 * C))}, ["out", "lse"],
        lambda k, b: k.attention_forward(b["out"], b["lse"], b["qkv"], NH, NH),
        lambda s: 4 * N * C * s + 4 * B * NH * T, flops=2 * B * NH * T * T * hd)

    def att_fwd(h, ref):
        q = ref.alloc((B, T, 3 * C), FLOAT32, tag="bench")
        o = ref.alloc((B, T, C), FLOAT32, tag="bench")
        lse = ref.alloc((B, NH, T), FLOAT32, tag="bench")
        ref.upload(q, h["qkv"])
        ref.attention_forward(o, lse, q, NH, NH)
        h["out"], h["lse"] = ref.download(o).astype(np.float32), ref.download(lse).astype(np.float32)

    add("attention_bwd", "compute", att_shape,
        {"dqkv": Buf((B, T, 3 * C)), "dout": Buf((B, T, C)), "qkv": Buf((B, T, 3 * C)), "out": Buf((B, T, C)),
         "lse": Buf((B, NH, T), "f32")}, ["dqkv"],
        lambda k, b: k.attention_backward(b["dqkv"], b["dout"], b["qkv"], b["out"], b["lse"], NH, NH),
        lambda s: 8 * N * C * s + 4 * B * NH * T, flops=4 * B * NH * T * T * hd, derive=att_fwd)

    return cases + _shared_tail_cases(B, T, Vp, V, P, NH, NH, hd)


def llama_kernel_cases(cfg, B: int, T: int) -> list[KernelCase]:
    """Llama 3's kernels on its shapes: rmsnorm, bias-free matmuls (fused qkv with grouped-query heads, fused
    gate/up), rotary embedding, GQA attention, SwiGLU, the untied (or tied) head and the shared ones."""
    from llmc_cli.models.llama3 import freqs_cis, num_parameters as llama_params
    C, NH, NKV, hd, H, V = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size
    N, P, QKV = B * T, llama_params(cfg), (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    eps = cfg.norm_eps
    cases: list[KernelCase] = []
    freqs = freqs_cis(cfg, T)

    def add(*a, **k):
        cases.append(KernelCase(*a, **k))

    def with_freqs(h, ref):
        h["freqs"] = freqs

    add("encoder_fwd", "memory", {"B": B, "T": T, "C": C, "V": V},
        {"out": Buf((B, T, C)), "inp": Buf((B, T), "i32", f"tokens:{V}"), "wte": Buf((V, C), init="weight")},
        ["out"], lambda k, b: k.encoder_forward(b["out"], b["inp"], b["wte"], None), lambda s: 4 * N + 2 * N * C * s)
    add("encoder_bwd", "memory", {"B": B, "T": T, "C": C, "V": V},
        {"dwte": Buf((V, C), init="small"), "dout": Buf((B, T, C)), "inp": Buf((B, T), "i32", f"tokens:{V}")},
        ["dwte"], lambda k, b: k.encoder_backward(b["dwte"], None, b["dout"], b["inp"]),
        lambda s: 4 * N + 3 * N * C * s)
    add("rmsnorm_fwd", "memory", {"N": N, "C": C},
        {"out": Buf((B, T, C)), "rstd": Buf((B, T), "f32"), "inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma")},
        ["out", "rstd"], lambda k, b: k.rmsnorm_forward(b["out"], b["rstd"], b["inp"], b["weight"], eps),
        lambda s: 2 * N * C * s + C * s + 4 * N)

    def rms_stats(h, ref):
        x = h["inp"].astype(np.float64)
        h["rstd"] = (1.0 / np.sqrt((x * x).mean(-1) + eps)).astype(np.float32)

    add("rmsnorm_bwd", "memory", {"N": N, "C": C},
        {"dinp": Buf((B, T, C)), "dweight": Buf((C,), init="small"), "dout": Buf((B, T, C)), "inp": Buf((B, T, C)),
         "weight": Buf((C,), init="gamma"), "rstd": Buf((B, T), "f32", "positive")}, ["dinp", "dweight"],
        lambda k, b: k.rmsnorm_backward(b["dinp"], b["dweight"], b["dout"], b["inp"], b["weight"], b["rstd"]),
        lambda s: 4 * N * C * s + 3 * C * s + 4 * N, derive=rms_stats)
    add("residual_fwd", "memory", {"N": N, "C": C},
        {"out": Buf((B, T, C)), "inp1": Buf((B, T, C)), "inp2": Buf((B, T, C))}, ["out"],
        lambda k, b: k.residual_forward(b["out"], b["inp1"], b["inp2"]), lambda s: 3 * N * C * s)
    mm = [("qkv", C, QKV), ("wo", NH * hd, C), ("w13", C, 2 * H), ("w2", H, C), ("lm_head", C, V)]
    for name, K, OC in mm:
        add(f"matmul_fwd {name}", "compute", {"N": N, "K": K, "OC": OC, "bias": False, "gelu": False},
            {"out": Buf((B, T, OC)), "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}, ["out"],
            lambda k, b: k.matmul_forward(b["out"], b["inp"], b["weight"]),
            (lambda K, OC: lambda s: (N * K + OC * K + N * OC) * s)(K, OC), flops=2 * N * K * OC)
    for name, K, OC in mm:
        add(f"matmul_bwd {name}", "compute", {"N": N, "K": K, "OC": OC, "bias": False, "gelu": False},
            {"dinp": Buf((B, T, K)), "dweight": Buf((OC, K), init="small"), "dout": Buf((B, T, OC)),
             "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}, ["dinp", "dweight"],
            lambda k, b: k.matmul_backward(b["dinp"], b["dweight"], None, b["dout"], b["inp"], b["weight"]),
            (lambda K, OC: lambda s: (N * OC + 2 * N * K + 3 * OC * K) * s)(K, OC), flops=4 * N * K * OC)
    rope_shape = {"B": B, "T": T, "NH": NH, "NKV": NKV, "hd": hd}
    rope_bytes = lambda s: 2 * N * (NH + NKV) * hd * s + T * hd * 4  # noqa: E731  (q and k rotated in place)
    add("rope_fwd", "memory", rope_shape, {"qkv": Buf((B, T, QKV)), "freqs": Buf((T, hd // 2, 2), "f32")}, ["qkv"],
        lambda k, b: k.rope_forward(b["qkv"], b["freqs"], NH, NKV), rope_bytes, derive=with_freqs)
    add("rope_bwd", "memory", rope_shape, {"dqkv": Buf((B, T, QKV)), "freqs": Buf((T, hd // 2, 2), "f32")},
        ["dqkv"], lambda k, b: k.rope_backward(b["dqkv"], b["freqs"], NH, NKV), rope_bytes, derive=with_freqs)
    add("swiglu_fwd", "memory", {"N": N, "H": H}, {"out": Buf((B, T, H)), "inp": Buf((B, T, 2 * H))}, ["out"],
        lambda k, b: k.swiglu_forward(b["out"], b["inp"]), lambda s: 3 * N * H * s)
    add("swiglu_bwd", "memory", {"N": N, "H": H},
        {"dinp": Buf((B, T, 2 * H)), "dout": Buf((B, T, H)), "inp": Buf((B, T, 2 * H))}, ["dinp"],
        lambda k, b: k.swiglu_backward(b["dinp"], b["dout"], b["inp"]), lambda s: 5 * N * H * s)
    att_shape = {"B": B, "T": T, "NH": NH, "NKV": NKV, "hd": hd}
    add("attention_fwd", "compute", att_shape,
        {"out": Buf((B, T, NH * hd)), "lse": Buf((B, NH, T), "f32"), "qkv": Buf((B, T, QKV))}, ["out", "lse"],
        lambda k, b: k.attention_forward(b["out"], b["lse"], b["qkv"], NH, NKV),
        lambda s: (N * QKV + N * NH * hd) * s + 4 * B * NH * T, flops=2 * B * NH * T * T * hd)

    def att_fwd(h, ref):
        q = ref.alloc((B, T, QKV), FLOAT32, tag="bench")
        o = ref.alloc((B, T, NH * hd), FLOAT32, tag="bench")
        lse = ref.alloc((B, NH, T), FLOAT32, tag="bench")
        ref.upload(q, h["qkv"])
        ref.attention_forward(o, lse, q, NH, NKV)
        h["out"], h["lse"] = ref.download(o).astype(np.float32), ref.download(lse).astype(np.float32)

    add("attention_bwd", "compute", att_shape,
        {"dqkv": Buf((B, T, QKV)), "dout": Buf((B, T, NH * hd)), "qkv": Buf((B, T, QKV)),
         "out": Buf((B, T, NH * hd)), "lse": Buf((B, NH, T), "f32")}, ["dqkv"],
        lambda k, b: k.attention_backward(b["dqkv"], b["dout"], b["qkv"], b["out"], b["lse"], NH, NKV),
        lambda s: (2 * N * QKV + 2 * N * NH * hd) * s + 4 * B * NH * T, flops=4 * B * NH * T * T * hd,
        derive=att_fwd)
    return cases + _shared_tail_cases(B, T, V, V, P, NH, NKV, hd)


def _host_inputs(case: KernelCase, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    h = {}
    for name, spec in case.bufs.items():
        shape, init = spec.shape, spec.init
        if init.startswith("tokens:"):
            h[name] = rng.integers(0, int(init.split(":")[1]), shape, dtype=np.int32)
            continue
        x = rng.standard_normal(shape, dtype=np.float32)
        if init == "weight":
            x *= 0.02
        elif init == "gamma":
            x = 1.0 + 0.1 * x
        elif init == "small":
            x *= 0.01
        elif init == "positive":
            x = np.abs(x) * 1e-3 + 1e-4
        h[name] = x.astype(np.float32, copy=False)
    return h


def _run_once(case: KernelCase, backend: Backend, host: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """Allocate and fill the case's buffers on `backend`, call the kernel once; (buffers, outputs on the host,
    the inputs as the backend held them before the call)."""
    bufs = {}
    for name, spec in case.bufs.items():
        buf = backend.alloc(spec.shape, _kind_dtype(spec.kind, backend), tag="bench")
        backend.upload(buf, host[name])
        bufs[name] = buf
    if case.name == "adamw" and backend.dtype != FLOAT32:  # bf16 parameters keep float32 master weights
        bufs["master"] = backend.alloc(case.bufs["param"].shape, FLOAT32, tag="bench")
        backend.upload(bufs["master"], host["param"])
    held = _as_held(case, backend, bufs, host)  # before the call: kernels update buffers in place (+=, rope)
    case.call(backend, bufs)
    backend.synchronize()
    outs = {n: np.asarray(backend.download(bufs[n]), dtype=np.float32) for n in case.outputs}
    return bufs, outs, held


def _as_held(case: KernelCase, backend: Backend, bufs: dict, host: dict) -> dict:
    """The inputs as the backend holds them (rounded to bfloat16 where it computes in bf16), for its reference;
    read before the kernel runs."""
    if backend.dtype == FLOAT32:
        return host
    return {n: (host[n] if case.bufs[n].kind != "act" else np.asarray(backend.download(bufs[n]), np.float32))
            for n in host}


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (inf when got holds NaN / inf)."""
    got = got.reshape(-1)
    ref = ref.reshape(-1)
    if not np.all(np.isfinite(got)):
        return math.inf
    den = float(np.max(np.abs(ref))) if ref.size else 0.0
    num = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    return num / den if den > 0 else num


def _spread(times_s: list[float]) -> dict:
    ms = [t * 1e3 for t in times_s]
    return {"times_ms": ms, "min_ms": min(ms), "median_ms": statistics.median(ms), "max_ms": max(ms)}


def run_kernels(backends: Sequence[tuple[str, Backend]], cfg: GPT2Config, B: int, T: int, *, repeat: int = 10,
                warmup: int = 2, seed: int = 1337, reference: Backend | None = None,
                tol: float | None = None, only: Sequence[str] | None = None,
                progress: Callable[[str], None] | None = None) -> dict:
    """Time and check every kernel case on every backend. `reference`: the backend outputs are compared with
    (None: errors are not computed). `tol`: mismatch threshold (default by dtype, TOLERANCES). `only`: kernel
    name prefixes to keep. Returns {"config", "results": [...], "mismatches": [...]}."""
    if repeat < 1 or warmup < 0:
        raise BenchError(f"--repeat must be >= 1 and --warmup >= 0 (got {repeat}, {warmup})")
    cases = kernel_cases(cfg, B, T)
    if only:
        cases = [c for c in cases if any(c.name.startswith(o) for o in only)]
        if not cases:
            raise BenchError(f"--only {' '.join(only)}: matches no kernel")
    results, mismatches = [], []
    for case in cases:
        host = _host_inputs(case, seed)
        if case.derive is not None:
            case.derive(host, reference if reference is not None else backends[0][1])
        refs: dict[str, dict] = {}  # by dtype the inputs were held in
        for label, be in backends:
            if progress:
                progress(f"{case.name} on {label}")
            if case.needs and case.needs not in be.capabilities:  # e.g. attention_decode without CAP_KV_CACHE
                continue
            bufs, outs, held = _run_once(case, be, host)
            err = None
            if reference is not None:
                if be.dtype not in refs:
                    refs[be.dtype] = _run_once(case, reference, held)[1]
                err = max(rel_error(outs[n], refs[be.dtype][n]) for n in case.outputs)
            del held
            del outs
            for _ in range(warmup):
                case.call(be, bufs)
            timer = be.timer()
            times = []
            for _ in range(repeat):
                timer.start()
                case.call(be, bufs)
                times.append(timer.stop())
            del bufs
            s = DTYPE_BYTES[be.dtype]
            r = {"kernel": case.name, "kind": case.kind, "shape": case.shape, "backend": label,
                 "dtype": be.dtype, "bytes": case.bytes_fn(s), "flops": case.flops, **_spread(times)}
            med = r["median_ms"] / 1e3
            r["gb_s"] = r["bytes"] / med / 1e9 if med > 0 else None
            r["tflop_s"] = case.flops / med / 1e12 if (case.flops and med > 0) else None
            limit = tol if tol is not None else TOLERANCES.get(be.dtype, 3e-2)
            r["max_rel_err"] = err
            r["tol"] = limit
            r["ok"] = None if err is None else bool(err <= limit)
            if r["ok"] is False:
                mismatches.append({"kernel": case.name, "backend": label, "max_rel_err": err, "tol": limit})
            results.append(r)
        refs.clear()
        del host
        gc.collect()
    return {"config": {**_cfg_dict(cfg), "B": B, "T": T, "repeat": repeat, "warmup": warmup, "seed": seed,
                       "reference": None if reference is None else reference.describe()},
            "results": results, "mismatches": mismatches}


def _cfg_dict(cfg) -> dict:
    from llmc_cli.models.families import family_of_config
    fam = family_of_config(cfg)
    d = {"family": fam.name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
         "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.padded_vocab_size, "block_size": cfg.block_size,
         "num_parameters": fam.module.num_parameters(cfg)}
    if hasattr(cfg, "n_kv_head"):
        d["n_kv_head"] = cfg.n_kv_head
    return d


# ---------------------------------------------------------------------------------------------------------------
# end-to-end training

def flops_per_step(cfg: GPT2Config, B: int, T: int) -> int:
    """llm.c's estimate: 6 FLOPs per parameter per token plus attention's 6*L*C*T per token (causal)."""
    return (6 * num_parameters(cfg) + 6 * cfg.n_layer * cfg.n_embd * T) * B * T


def _rss_peak_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _peak_flops(backend: Backend) -> float | None:
    fn = getattr(backend, "peak_flops", None)
    try:
        v = fn(backend.dtype) if callable(fn) else fn
    except Exception:
        return None
    return float(v) if v else None


def _train_record(label: str, kind: str, times_s: list[float], losses: list[float], B: int, T: int,
                  flops: int, peak: float | None) -> dict:
    r = {"name": label, "kind": kind, **_spread(times_s)}
    med = r["median_ms"] / 1e3
    r["tok_s"] = B * T / med
    r["tflop_s"] = flops / med / 1e12
    r["peak_flops"] = peak
    r["mfu"] = flops / med / peak if peak else None
    r["loss_first"], r["loss_last"] = losses[0], losses[-1]
    return r


def train_llmc(label: str, backend: Backend, cfg: GPT2Config, B: int, T: int, data: str, *, steps: int,
               warmup: int, seed: int) -> dict:
    """`steps` timed training steps after `warmup` ones, through llmc's Trainer (data loader + optimizer)."""
    from llmc_cli.optim import AdamWConfig
    from llmc_cli.training.trainer import TrainArgs, Trainer
    args = TrainArgs(data=data, model="d2", n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                     block_size=cfg.block_size, vocab_size=cfg.vocab_size, batch_size=B, seq_len=T,
                     steps=warmup + steps, seed=seed, optim=AdamWConfig(weight_decay=0.1), val_every=0,
                     sample_every=0)
    trainer = Trainer(args, backend, say=lambda s: None)
    times, losses = [], []
    try:
        for s in range(warmup + steps):
            rec = trainer.train_step(s)
            losses.append(rec["loss"])
            if s >= warmup:
                times.append(rec["ms"] / 1e3)
        mem = backend.memory_report()
    finally:
        del trainer
        gc.collect()
    r = _train_record(label, "llmc", times, losses, B, T, flops_per_step(cfg, B, T), _peak_flops(backend))
    r.update(describe=backend.describe(), dtype=backend.dtype, allocated_bytes=mem.allocated,
             device_total_bytes=mem.device_total,
             device_used_bytes=(mem.device_total - mem.device_free) if (mem.device_total and mem.device_free is not None)
             else None, host_rss_peak_bytes=_rss_peak_bytes())
    return r


def train_torch(cfg: GPT2Config, B: int, T: int, data: str, *, steps: int, warmup: int, seed: int,
                compile: bool = False, dtype: str = FLOAT32) -> dict:
    """PyTorch on the same model (llmc's initial weights), data loader, AdamW and clipping. Raises on failure."""
    import torch
    from llmc_cli.data.loader import DataLoader
    from llmc_cli.models.gpt2 import init_parameters, parameter_shapes
    from llmc_cli.optim import AdamWConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_torch_gpt2(cfg, init_parameters(cfg, seed), parameter_shapes(cfg)).to(device)
    oc = AdamWConfig(weight_decay=0.1)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                             {"params": plain, "weight_decay": 0.0}], lr=oc.lr, betas=(oc.beta1, oc.beta2),
                            eps=oc.eps)
    step_fn = torch.compile(model) if compile else model
    loader = DataLoader(data, B, T, seed=seed, vocab_size=cfg.vocab_size)
    amp = torch.autocast(device, dtype=torch.bfloat16) if dtype == BFLOAT16 else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, first = [], [], None
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        x, y = loader.next_batch()
        xt = torch.from_numpy(x.astype(np.int64)).to(device)
        yt = torch.from_numpy(y.astype(np.int64)).to(device)
        if amp is not None:
            with amp:
                loss = step_fn(xt, yt)
        else:
            loss = step_fn(xt, yt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        opt.step()
        lv = loss.item()
        dt = time.perf_counter() - t0
        if s == 0:
            first = dt
        if s >= warmup:
            times.append(dt)
        losses.append(lv)
    label = "torch " + ("compile" if compile else "eager") + (" bf16" if dtype == BFLOAT16 else "")
    r = _train_record(label, "torch", times, losses, B, T, flops_per_step(cfg, B, T), None)
    r.update(describe=f"PyTorch {torch.__version__} on {device}"
             + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else f", {torch.get_num_threads()} threads"),
             dtype=dtype, first_step_s=first, host_rss_peak_bytes=_rss_peak_bytes(),
             allocated_bytes=int(torch.cuda.max_memory_allocated()) if device == "cuda" else None)
    return r


def build_torch_gpt2(cfg: GPT2Config, flat: np.ndarray, shapes):
    """GPT-2 as a torch.nn.Module (SDPA attention, tanh GELU, tied wte) holding llmc's flat parameters."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, C, NH):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.NH = NH

        def forward(self, x):
            Bx, Tx, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(Bx, Tx, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bx, Tx, C)
            x = x + self.proj(y)
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            C = cfg.n_embd
            self.wte = nn.Embedding(cfg.padded_vocab_size, C)
            self.wpe = nn.Embedding(cfg.block_size, C)
            self.blocks = nn.ModuleList(Block(C, cfg.n_head) for _ in range(cfg.n_layer))
            self.lnf = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.lnf(x) @ self.wte.weight.T
            V = cfg.vocab_size
            return F.cross_entropy(logits[..., :V].reshape(-1, V).float(), targets.reshape(-1))

    model = GPT()
    t = split_flat(flat, shapes)
    names = {"ln1w": "ln1.weight", "ln1b": "ln1.bias", "qkvw": "qkv.weight", "qkvb": "qkv.bias",
             "attprojw": "proj.weight", "attprojb": "proj.bias", "ln2w": "ln2.weight", "ln2b": "ln2.bias",
             "fcw": "fc.weight", "fcb": "fc.bias", "fcprojw": "fcproj.weight", "fcprojb": "fcproj.bias"}
    state = {"wte.weight": t["wte"], "wpe.weight": t["wpe"], "lnf.weight": t["lnfw"], "lnf.bias": t["lnfb"]}
    for l in range(cfg.n_layer):
        for ours, theirs in names.items():
            state[f"blocks.{l}.{theirs}"] = t[ours][l]
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in state.items()})
    return model


def random_shard(directory: str | Path, cfg: GPT2Config, ntokens: int, seed: int) -> str:
    """A shard of `ntokens` uniformly random token ids (seeded) in `directory`; returns a glob for it."""
    from llmc_cli.data.loader import write_shard
    rng = np.random.default_rng(seed)
    path = Path(directory) / "bench_train_000000.bin"
    write_shard(path, rng.integers(0, cfg.vocab_size, ntokens, dtype=np.int64).astype(np.uint16))
    return str(path)


def run_train(backends: Sequence[tuple[str, Backend]], cfg: GPT2Config, B: int, T: int, *, steps: int = 10,
              warmup: int = 2, seed: int = 1337, data: str | None = None, compare: Sequence[str] = (),
              torch_dtype: str = FLOAT32, progress: Callable[[str], None] | None = None) -> dict:
    """Training steps on every backend (and PyTorch for `compare` entries "torch-eager" / "torch-compile").
    `data`: a glob of shards; None writes a temporary shard of random tokens. Returns {"config", "results",
    "notes"}; a PyTorch variant that fails is a note, not an error."""
    if steps < 1 or warmup < 0:
        raise BenchError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    if T > cfg.block_size:
        raise BenchError(f"-t {T} is longer than the model's block size {cfg.block_size}")
    results, notes = [], []
    with tempfile.TemporaryDirectory(prefix="llmc-bench-") as tmp:
        if data is None:
            data = random_shard(tmp, cfg, max((warmup + steps) * B * T + 1, 2 * B * T + 1), seed)
            data_desc = "random tokens (temporary shard)"
        else:
            data_desc = data
        for label, be in backends:
            if progress:
                progress(f"training on {label}")
            try:
                results.append(train_llmc(label, be, cfg, B, T, data, steps=steps, warmup=warmup, seed=seed))
            except ValueError as e:  # TrainError / DataError: options the trainer refuses
                raise BenchError(f"training on {label}: {e}") from None
        torch_modes = [m for m in compare if m.startswith("torch")]
        if torch_modes:
            try:
                import torch  # noqa: F401
            except ImportError:
                notes.append("PyTorch is not installed: --compare torch skipped (pip install torch)")
                torch_modes = []
        for mode in torch_modes:
            if progress:
                progress(f"training with {mode}")
            try:
                r = train_torch(cfg, B, T, data, steps=steps, warmup=warmup, seed=seed,
                                compile=mode == "torch-compile", dtype=torch_dtype)
                results.append(r)
                if mode == "torch-compile":
                    notes.append(f"torch compile: first step {r['first_step_s']:.1f} s (compilation, untimed)")
            except Exception as e:  # torch.compile needs a working compiler toolchain; report, don't fail
                first = (str(e).strip().splitlines() or [""])[0][:200]
                notes.append(f"{mode} failed: {type(e).__name__}: {first}")
                gc.collect()
    return {"config": {**_cfg_dict(cfg), "B": B, "T": T, "steps": steps, "warmup": warmup, "seed": seed,
                       "data": data_desc, "flops_per_step": flops_per_step(cfg, B, T)},
            "results": results, "notes": notes}


# ---------------------------------------------------------------------------------------------------------------
# presenting

def _fmt_ms(ms: float) -> str:
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _fmt_rate(r: dict) -> str:
    if r.get("tflop_s") is not None:
        v = r["tflop_s"]
        return f"{v * 1e6:.0f} MF/s" if v < 1e-4 else f"{v * 1e3:.1f} GF/s" if v < 1 else f"{v:.2f} TF/s"
    v = r.get("gb_s")
    return "-" if v is None else f"{v * 1e3:.0f} MB/s" if v < 0.1 else f"{v:.1f} GB/s"


def _fmt_err(r: dict) -> str:
    e = r["max_rel_err"]
    if e is None:
        return "n/a"
    s = "0" if e == 0 else "inf" if math.isinf(e) else f"{e:.1e}"
    return f"[bold red]{s} MISMATCH[/]" if r["ok"] is False else f"[green]{s}[/]"


def kernels_table(res: dict):
    """Kernels as rows, backends as columns; each cell: median ms [min-max], then the rate and the error."""
    from rich.table import Table
    c = res["config"]
    labels = list(dict.fromkeys(r["backend"] for r in res["results"]))
    table = Table(title=f"llmc bench kernels: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} "
                        f"Vp={c['padded_vocab_size']}, B={c['B']} T={c['T']}",
                  caption=f"ms: median of {c['repeat']} calls \\[min-max] after {c['warmup']} warm-up; "
                          "rate: GB/s or TFLOP/s at the median; err: max|got-ref| / max|ref| against the cpu "
                          "backend on the same inputs", show_lines=True)
    table.add_column("kernel", no_wrap=True)
    for l in labels:
        table.add_column(l, justify="right", no_wrap=True)
    rows: dict[str, dict[str, dict]] = {}
    for r in res["results"]:
        rows.setdefault(r["kernel"], {})[r["backend"]] = r
    for kernel, per in rows.items():
        cells = [kernel]
        for l in labels:
            r = per.get(l)
            cells.append("-" if r is None else
                         f"{_fmt_ms(r['median_ms'])} ms [dim]\\[{_fmt_ms(r['min_ms'])}-{_fmt_ms(r['max_ms'])}][/]\n"
                         f"{_fmt_rate(r)}  err {_fmt_err(r)}")
        table.add_row(*cells)
    return table


def print_wide(console, renderable) -> None:
    """Print a table at its natural width when stdout is not a terminal (files, pipes), else at the terminal's."""
    if console.is_terminal:
        console.print(renderable)
        return
    from rich.measure import Measurement
    need = Measurement.get(console, console.options.update(width=1000), renderable).maximum
    old = console.width
    console.width = max(old, min(need, 1000))
    try:
        console.print(renderable)
    finally:
        console.width = old


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def train_table(res: dict):
    from rich.table import Table
    c = res["config"]
    table = Table(title=f"llmc bench train: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} "
                        f"({c['num_parameters']:,} params), B={c['B']} T={c['T']}",
                  caption=f"median of {c['steps']} steps \\[min-max] after {c['warmup']} warm-up; each step "
                          "includes the data loader, forward, backward, grad norm and AdamW; RSS peak is the "
                          "process's, cumulative over the runs before it")
    for col, just in (("backend", "left"), ("dtype", "left"), ("ms/step \\[min-max]", "right"),
                      ("tok/s", "right"), ("TFLOP/s", "right"), ("MFU", "right"), ("loss 1st -> last", "right"),
                      ("alloc MiB", "right"), ("device used MiB", "right"), ("RSS peak MiB", "right")):
        table.add_column(col, justify=just, no_wrap=col != "backend")
    for r in res["results"]:
        table.add_row(r["name"], r.get("dtype", "-"),
                      f"{_fmt_ms(r['median_ms'])} [dim]\\[{_fmt_ms(r['min_ms'])}-{_fmt_ms(r['max_ms'])}][/]",
                      f"{r['tok_s']:,.0f}", f"{r['tflop_s']:.3f}",
                      "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                      f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
                      _mib(r.get("allocated_bytes")), _mib(r.get("device_used_bytes")),
                      _mib(r.get("host_rss_peak_bytes")))
    return table


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None


def plot_kernels(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(r["backend"] for r in res["results"]))
    kernels = list(dict.fromkeys(r["kernel"] for r in res["results"]))
    by = {(r["kernel"], r["backend"]): r for r in res["results"]}
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(kernels) * max(1, len(labels)) + 1.5))
    h = 0.8 / len(labels)
    for i, l in enumerate(labels):
        ys = [k_i + i * h for k_i in range(len(kernels))]
        med = [by[(k, l)]["median_ms"] if (k, l) in by else np.nan for k in kernels]
        lo = [m - by[(k, l)]["min_ms"] if (k, l) in by else 0 for k, m in zip(kernels, med)]
        hi = [by[(k, l)]["max_ms"] - m if (k, l) in by else 0 for k, m in zip(kernels, med)]
        ax.barh(ys, med, height=h, xerr=[lo, hi], label=l, capsize=2)
    ax.set_yticks([k + 0.4 - h / 2 for k in range(len(kernels))])
    ax.set_yticklabels(kernels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per call (median, min-max bars)")
    c = res["config"]
    ax.set_title(f"llmc kernels, L={c['n_layer']} C={c['n_embd']} B={c['B']} T={c['T']}")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt
    from llmc_cli.commands.plot import PlotError, save_png
    try:
        save_png(fig, path, dpi=120, option="--plot")
    except PlotError as e:
        raise BenchError(str(e)) from None
    finally:
        plt.close(fig)


def plot_train(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rs = res["results"]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rs) + 2), 4))
    names = [r["name"] for r in rs]
    tok = [r["tok_s"] for r in rs]
    # tokens/s from the slowest and fastest steps
    lo = [t - r["tok_s"] * r["median_ms"] / r["max_ms"] for t, r in zip(tok, rs)]
    hi = [r["tok_s"] * r["median_ms"] / r["min_ms"] - t for t, r in zip(tok, rs)]
    ax.bar(names, tok, yerr=[lo, hi], capsize=4, color=["C0" if r["kind"] == "llmc" else "C1" for r in rs])
    ax.set_ylabel("tokens / s (median, min-max bars)")
    c = res["config"]
    ax.set_title(f"llmc train step, L={c['n_layer']} C={c['n_embd']} B={c['B']} T={c['T']}")
    fig.tight_layout()
    _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# the commands

def _model_options(f):
    opts = [
        click.option("--backend", "backend_names", multiple=True,
                     help="Backend to benchmark (repeatable; default: every usable one, see `llmc backends`)."),
        click.option("--dtype", type=click.Choice(["fp32", "bf16", "auto"]), default="auto", show_default=True,
                     help="Compute dtype for every backend; auto = each backend's default."),
        click.option("--model", default="d12", show_default=True,
                     help="Preset: GPT-2 d2, d6, d12 (124M), d24, d36, d48; for `kernels` also Llama 3 "
                          "(llama3-tiny, llama3.2-1b, ...: rmsnorm, RoPE, GQA attention, SwiGLU)."),
        click.option("--n-layer", type=POSITIVE, default=None, help="Override the preset's layer count."),
        click.option("--n-head", type=POSITIVE, default=None, help="Override the preset's head count."),
        click.option("--n-embd", type=POSITIVE, default=None, help="Override the preset's channels."),
        click.option("--vocab-size", type=POSITIVE, default=None, help="Vocabulary (tokens) [default: GPT-2's 50257, "
                     "or the Llama preset's]."),
        click.option("--block-size", type=POSITIVE, default=None, help="Max sequence length (tokens) [default: 1024 for "
                     "GPT-2, or the Llama preset's]."),
        click.option("-b", "--batch-size", type=POSITIVE, default=4, show_default=True, help="Batch size (sequences)."),
        click.option("-t", "--seq-len", type=POSITIVE, default=64, show_default=True, help="Sequence length (tokens)."),
        click.option("--seed", type=SEED, default=1337, show_default=True, help="Seed for inputs, weights, data."),
        click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout (no table)."),
        click.option("--plot", default=None, type=click.Path(dir_okay=False),
                     help="Also draw the comparison into this PNG (needs matplotlib)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _setup(o: dict):
    """Shared option checks: the model config and the backends (fails with one line)."""
    from llmc_cli.commands import DTYPES, fail
    B, T = o["batch_size"], o["seq_len"]
    if B <= 0 or T <= 0:
        fail(f"-b/--batch-size and -t/--seq-len must be positive (got {B}, {T})")
    over = {k: o[k] for k in ("n_layer", "n_head", "n_embd") if o[k]}
    try:
        from llmc_cli.models.families import GPT2 as GPT2_FAMILY, family_for
        fam = family_for(o["model"])
        if fam is GPT2_FAMILY:
            cfg = preset(o["model"], block_size=o["block_size"] or 1024, vocab_size=o["vocab_size"] or 50257, **over)
        else:  # Llama 3: the preset's own vocabulary and context unless given
            over |= {k: o[k] for k in ("block_size", "vocab_size") if o[k]}
            cfg = fam.preset(o["model"], **over)
        cfg.validate()
    except ValueError as e:
        fail(f"--model: {e}")
    if not isinstance(cfg, GPT2Config) and not o.get("kernels_only"):
        fail(f"--model {o['model']}: `llmc bench train` times GPT-2 models; Llama 3 kernels are timed by "
             f"`llmc bench kernels --model {o['model']}`")
    if T > cfg.block_size:
        fail(f"-t {T} is longer than the model's block size {cfg.block_size}")
    if o["plot"]:
        from llmc_cli.commands.plot import PlotError, check_png_target
        try:
            require_matplotlib()
            check_png_target(o["plot"], "--plot")
        except (BenchError, PlotError) as e:
            fail(str(e))
    try:
        backends, skipped = resolve_backends(o["backend_names"], DTYPES[o["dtype"]])
    except BenchError as e:
        fail(str(e))
    return cfg, B, T, backends, skipped


def _progress(as_json: bool):
    from llmc_cli.commands import err_console
    status = err_console.status("") if (err_console.is_terminal and not as_json) else None
    return status


def _report_header(console, res: dict, backends, skipped, as_json: bool) -> bool:
    """Adds the machine and the skipped backends to `res`; prints all of it as JSON (returns False) or prints the
    machine lines and skips for the table that follows (returns True)."""
    res["machine"] = describe_machine(backends)
    res["skipped"] = [{"backend": n, "reason": r} for n, r in skipped]
    if as_json:
        _emit_json(res)
        return False
    for line in machine_lines(res["machine"]):
        console.print(f"[dim]{line}[/]")
    for n, r in skipped:
        console.print(f"[dim]not benchmarked: {n} ({r})[/]")
    return True


def _emit_json(obj: dict) -> None:
    import json

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    click.echo(json.dumps(clean(obj), indent=1))


@click.group(name="bench")
def bench() -> None:
    """Benchmark backends against each other: every kernel, or whole training steps.

    \b
    Example:
      llmc bench kernels --model d2 -b 2 -t 32
      llmc bench train --model d6 -b 4 -t 64 --steps 10 --compare torch
    """


@bench.command()
@_model_options
@click.option("--repeat", type=POSITIVE, default=10, show_default=True, help="Timed calls per kernel (median taken).")
@click.option("--warmup", type=COUNT, default=2, show_default=True, help="Untimed calls per kernel first.")
@click.option("--tol", type=Real(0, min_open=True), default=None,
              help="Max relative error before a kernel is flagged [default: 1e-4 for fp32, 3e-2 for bf16].")
@click.option("--only", multiple=True, help="Only kernels whose name starts with this (repeatable), e.g. matmul.")
def kernels(**o) -> None:
    """Time every kernel of the interface on the model's real shapes and check it against the cpu backend.

    Every backend gets the same random inputs (fixed seed). Time is the median of --repeat calls after --warmup
    calls, measured with the backend's timer (device events where it has them); rate is GB/s (bytes read + written,
    counted per kernel) or TFLOP/s (matmuls, attention); err is max|got - ref| / max|ref| against the numpy cpu
    backend on the same inputs. Exits with status 1 when a kernel exceeds the tolerance (a mismatch).

    \b
    Example:
      llmc bench kernels --model d2 -b 2 -t 32
      llmc bench kernels --backend opencl --only matmul --repeat 20 --json > kernels.json
      llmc bench kernels --model d12 -b 4 -t 64 --plot kernels.png
    """
    from llmc_cli.commands import console, err_console, fail
    cfg, B, T, backends, skipped = _setup(o | {"kernels_only": True})
    status = _progress(o["as_json"])
    try:
        if status:
            status.start()
        ref = reference_backend(backends)
        res = run_kernels(backends, cfg, B, T, repeat=o["repeat"], warmup=o["warmup"], seed=o["seed"],
                          reference=ref, tol=o["tol"], only=o["only"] or None,
                          progress=(lambda s: status.update(f"bench: {s}")) if status else None)
    except BenchError as e:
        fail(str(e))
    finally:
        if status:
            status.stop()
    if _report_header(console, res, backends, skipped, o["as_json"]):
        if ref is None:
            console.print("[yellow]no cpu reference backend: errors are not checked[/]")
        print_wide(console, kernels_table(res))
    if o["plot"]:
        try:
            plot_kernels(res, o["plot"])
        except BenchError as e:
            fail(str(e))
        err_console.print(f"plot: {o['plot']}")
    if res["mismatches"]:
        bad = ", ".join(f"{m['kernel']} on {m['backend']} ({m['max_rel_err']:.1e} > {m['tol']:.0e})"
                        for m in res["mismatches"])
        fail(f"{len(res['mismatches'])} kernel(s) differ from the cpu reference: {bad}", code=1)


@bench.command()
@_model_options
@click.option("--steps", type=POSITIVE, default=10, show_default=True, help="Timed training steps (median taken).")
@click.option("--warmup", type=COUNT, default=2, show_default=True, help="Untimed training steps first.")
@click.option("--data", default=None, help="Glob of token shards [default: a temporary shard of random tokens].")
@click.option("--compare", type=click.Choice(["torch", "torch-eager", "torch-compile"]), multiple=True,
              help="Also time PyTorch on the same model, weights, data and optimizer: torch = eager and "
                   "torch.compile (skipped with a note when torch is not installed).")
@click.option("--torch-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="PyTorch compute dtype (bf16 = autocast).")
def train(**o) -> None:
    """Time whole training steps (data loader, forward, backward, clip, AdamW) on each backend.

    Reports ms/step (median and min-max over --steps after --warmup), tokens/s, achieved TFLOP/s (llm.c's
    6*params + 6*L*C*T per token), MFU where the backend reports its peak FLOP/s, the first and last loss
    (every backend starts from the same weights and data, so first losses agree), memory allocated through the
    backend, device memory in use, and the process's peak RSS (cumulative over the backends run so far).

    \b
    Example:
      llmc bench train --model d2 -b 4 -t 64 --steps 20
      llmc bench train --backend cpu --model d12 -b 4 -t 64 --compare torch --plot train.png
    """
    from llmc_cli.commands import DTYPES, console, err_console, fail
    from llmc_cli.data.loader import DataError
    cfg, B, T, backends, skipped = _setup(o)
    compare = []
    for c in o["compare"]:
        compare += ["torch-eager", "torch-compile"] if c == "torch" else [c]
    status = _progress(o["as_json"])
    try:
        if status:
            status.start()
        res = run_train(backends, cfg, B, T, steps=o["steps"], warmup=o["warmup"], seed=o["seed"], data=o["data"],
                        compare=list(dict.fromkeys(compare)), torch_dtype=DTYPES[o["torch_dtype"]],
                        progress=(lambda s: status.update(f"bench: {s}")) if status else None)
    except (BenchError, DataError, ValueError) as e:  # TrainError is a ValueError too
        fail(str(e))
    finally:
        if status:
            status.stop()
    if _report_header(console, res, backends, skipped, o["as_json"]):
        console.print(f"[dim]data: {res['config']['data']}; {res['config']['flops_per_step'] / 1e9:.2f} GFLOP/step[/]")
        print_wide(console, train_table(res))
        for n in res["notes"]:
            console.print(f"[yellow]{n}[/]")
    if o["plot"]:
        try:
            plot_train(res, o["plot"])
        except BenchError as e:
            fail(str(e))
        err_console.print(f"plot: {o['plot']}")
