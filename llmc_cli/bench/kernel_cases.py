"""`llmc bench kernels`: every kernel of the contract on the shapes a model really uses, timed on each backend
and checked against the reference backend."""

from __future__ import annotations

import gc
import math
import statistics
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from llmc_cli.bench.backends import DTYPE_BYTES, TOLERANCES, BenchError, failure_line
from llmc_cli.kernels import (
    CAP_KV_CACHE,
    FLOAT32,
    INT32,
    Backend,
    VariantUnsupported,
)
from llmc_cli.models.families import family_of
from llmc_cli.models.gpt2 import GPT2Config, num_parameters
from llmc_cli.models.llama3 import freqs_cis
from llmc_cli.models.llama3 import num_parameters as llama_params
from llmc_cli.naming import arg, arg_both

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

    @property
    def kernel(self) -> str:
        """The contract method the case calls (what `Backend.variants` is asked about)."""
        return CASE_KERNELS[self.name.split()[0]]


# each case's contract method, by the case name's first word (matmul cases add the product's name after it)
CASE_KERNELS = {
    "encoder_fwd": "encoder_forward", "encoder_bwd": "encoder_backward",
    "layernorm_fwd": "layernorm_forward", "layernorm_bwd": "layernorm_backward",
    "fused_residual_layernorm_fwd": "fused_residual_layernorm_forward", "residual_fwd": "residual_forward",
    "rmsnorm_fwd": "rmsnorm_forward", "rmsnorm_bwd": "rmsnorm_backward",
    "matmul_fwd": "matmul_forward", "matmul_bwd": "matmul_backward",
    "gelu_fwd": "gelu_forward", "gelu_bwd": "gelu_backward", "swiglu_fwd": "swiglu_forward",
    "swiglu_bwd": "swiglu_backward", "rope_fwd": "rope_forward", "rope_bwd": "rope_backward",
    "attention_fwd": "attention_forward", "attention_bwd": "attention_backward", "attention_decode": "attention_decode",
    "classifier_fwd_bwd": "classifier_forward_backward", "adamw": "adamw_update", "global_norm": "global_norm_squared",
}


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
    return {"gpt2": gpt2_kernel_cases, "llama3": llama_kernel_cases}[family_of(cfg).name](cfg, B, T)


def _residual_case(B: int, T: int, C: int) -> KernelCase:
    N = B * T
    return KernelCase("residual_fwd", "memory", {"N": N, "C": C},
                      {"out": Buf((B, T, C)), "inp1": Buf((B, T, C)), "inp2": Buf((B, T, C))}, ["out"],
                      lambda k, b: k.residual_forward(b["out"], b["inp1"], b["inp2"]), lambda s: 3 * N * C * s)


def _attention_cases(B: int, T: int, NH: int, NKV: int, hd: int, shape: dict) -> list[KernelCase]:
    """Causal attention forward and backward over a fused qkv of NH query and NKV key/value heads; useful FLOPs
    of the causal half (QK^T and PV forward; dV, dP, dQ, dK backward)."""
    N, QKV, O = B * T, (NH + 2 * NKV) * hd, NH * hd

    def att_fwd(h, ref):
        q = ref.alloc((B, T, QKV), FLOAT32, tag="bench")
        o = ref.alloc((B, T, O), FLOAT32, tag="bench")
        lse = ref.alloc((B, NH, T), FLOAT32, tag="bench")
        ref.upload(q, h["qkv"])
        ref.attention_forward(o, lse, q, NH, NKV)
        h["out"], h["lse"] = ref.download(o).astype(np.float32), ref.download(lse).astype(np.float32)

    return [
        KernelCase("attention_fwd", "compute", shape,
                   {"out": Buf((B, T, O)), "lse": Buf((B, NH, T), "f32"), "qkv": Buf((B, T, QKV))}, ["out", "lse"],
                   lambda k, b: k.attention_forward(b["out"], b["lse"], b["qkv"], NH, NKV),
                   lambda s: (N * QKV + N * O) * s + 4 * B * NH * T, flops=2 * B * NH * T * T * hd),
        KernelCase("attention_bwd", "compute", shape,
                   {"dqkv": Buf((B, T, QKV)), "dout": Buf((B, T, O)), "qkv": Buf((B, T, QKV)), "out": Buf((B, T, O)),
                    "lse": Buf((B, NH, T), "f32")}, ["dqkv"],
                   lambda k, b: k.attention_backward(b["dqkv"], b["dout"], b["qkv"], b["out"], b["lse"], NH, NKV),
                   lambda s: (2 * N * QKV + 2 * N * O) * s + 4 * B * NH * T, flops=4 * B * NH * T * T * hd,
                   derive=att_fwd)]


def gpt2_kernel_cases(cfg, B: int, T: int) -> list[KernelCase]:
    C, NH, Vp, V = cfg.n_embd, cfg.n_head, cfg.padded_vocab_size, cfg.vocab_size
    hd = C // NH
    return (_gpt2_encoder_cases(B, T, C, Vp, V, cfg.block_size) + _layernorm_cases(B, T, C)
            + _gpt2_matmul_cases(B, T, C, Vp) + _gelu_cases(B, T, 4 * C)
            + _attention_cases(B, T, NH, NH, hd, {"B": B, "T": T, "NH": NH, "hd": hd})
            + _shared_tail_cases(B, T, Vp, V, num_parameters(cfg), NH, NH, hd))


def _gpt2_encoder_cases(B: int, T: int, C: int, Vp: int, V: int, maxT: int) -> list[KernelCase]:
    N = B * T
    shape = {"B": B, "T": T, "C": C, "Vp": Vp}
    return [
        KernelCase("encoder_fwd", "memory", shape,
                   {"out": Buf((B, T, C)), "inp": Buf((B, T), "i32", f"tokens:{V}"), "wte": Buf((Vp, C), init="weight"),
                    "wpe": Buf((maxT, C), init="weight")}, ["out"],
                   lambda k, b: k.encoder_forward(b["out"], b["inp"], b["wte"], b["wpe"]),
                   lambda s: 4 * N + 3 * N * C * s),
        KernelCase("encoder_bwd", "memory", shape,
                   {"dwte": Buf((Vp, C), init="small"), "dwpe": Buf((maxT, C), init="small"), "dout": Buf((B, T, C)),
                    "inp": Buf((B, T), "i32", f"tokens:{V}")}, ["dwte", "dwpe"],
                   lambda k, b: k.encoder_backward(b["dwte"], b["dwpe"], b["dout"], b["inp"]),
                   lambda s: 4 * N + N * C * s + 2 * N * C * s + 2 * T * C * s)]


def _layernorm_cases(B: int, T: int, C: int) -> list[KernelCase]:
    """LayerNorm forward and backward, the residual add, and the two fused (GPT-2's)."""
    N = B * T
    ln_in = {"inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma"), "bias": Buf((C,), init="weight")}

    def ln_stats(h, ref):
        x = h["inp"].astype(np.float64)
        h["mean"] = x.mean(-1).astype(np.float32)
        h["rstd"] = (1.0 / np.sqrt(x.var(-1) + 1e-5)).astype(np.float32)

    return [
        KernelCase("layernorm_fwd", "memory", {"N": N, "C": C},
                   {"out": Buf((B, T, C)), "mean": Buf((B, T), "f32"), "rstd": Buf((B, T), "f32"), **ln_in},
                   ["out", "mean", "rstd"],
                   lambda k, b: k.layernorm_forward(b["out"], b["mean"], b["rstd"], b["inp"], b["weight"], b["bias"]),
                   lambda s: 2 * N * C * s + 2 * C * s + 8 * N),
        KernelCase("layernorm_bwd", "memory", {"N": N, "C": C},
                   {"dinp": Buf((B, T, C)), "dweight": Buf((C,), init="small"), "dbias": Buf((C,), init="small"),
                    "dout": Buf((B, T, C)), "inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma"),
                    "mean": Buf((B, T), "f32", "small"), "rstd": Buf((B, T), "f32", "positive")},
                   ["dinp", "dweight", "dbias"],
                   lambda k, b: k.layernorm_backward(b["dinp"], b["dweight"], b["dbias"], b["dout"], b["inp"],
                                                     b["weight"], b["mean"], b["rstd"]),
                   lambda s: 4 * N * C * s + 5 * C * s + 8 * N, derive=ln_stats),
        _residual_case(B, T, C),
        KernelCase("fused_residual_layernorm_fwd", "memory", {"N": N, "C": C},
                   {"residual": Buf((B, T, C)), "out": Buf((B, T, C)), "mean": Buf((B, T), "f32"),
                    "rstd": Buf((B, T), "f32"), "inp1": Buf((B, T, C)), "inp2": Buf((B, T, C)),
                    "weight": Buf((C,), init="gamma"), "bias": Buf((C,), init="weight")},
                   ["residual", "out", "mean", "rstd"],
                   lambda k, b: k.fused_residual_layernorm_forward(b["residual"], b["out"], b["mean"], b["rstd"],
                                                                   b["inp1"], b["inp2"], b["weight"], b["bias"]),
                   lambda s: 4 * N * C * s + 2 * C * s + 8 * N)]


def _gpt2_matmul_cases(B: int, T: int, C: int, Vp: int) -> list[KernelCase]:
    """GPT-2's products forward, then backward: (name, in channels K, out channels OC, bias, GELU fused in the
    forward); the backward fuses GELU's derivative into fcproj's dinp (its input was gelu(fch))."""
    N, F = B * T, 4 * C
    mm = [("qkv", C, 3 * C, True, False), ("attproj", C, C, True, False), ("fc", C, F, True, True),
          ("fcproj", F, C, True, False), ("classifier", C, Vp, False, False)]
    cases = []
    for name, K, OC, bias, gelu in mm:
        bufs = {"out": Buf((B, T, OC)), "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}
        bufs |= ({"bias": Buf((OC,), init="weight")} if bias else {}) | ({"pre_gelu": Buf((B, T, OC))} if gelu else {})
        cases.append(KernelCase(
            f"matmul_fwd {name}" + (" +gelu" if gelu else ""), "compute",
            {"N": N, "K": K, "OC": OC, "bias": bias, "gelu": gelu}, bufs, ["out"] + (["pre_gelu"] if gelu else []),
            lambda k, b: k.matmul_forward(b["out"], b["inp"], b["weight"], b.get("bias"), pre_gelu=b.get("pre_gelu")),
            (lambda K, OC, bias, gelu: lambda s: (N * K + OC * K + N * OC * (2 if gelu else 1)) * s
             + (OC * s if bias else 0))(K, OC, bias, gelu),
            flops=2 * N * K * OC))
    for name, K, OC, bias, _ in mm:
        g = name == "fcproj"
        bufs = {"dinp": Buf((B, T, K)), "dweight": Buf((OC, K), init="small"), "dout": Buf((B, T, OC)),
                "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}
        bufs |= ({"dbias": Buf((OC,), init="small")} if bias else {}) | ({"pre_gelu": Buf((B, T, K))} if g else {})
        cases.append(KernelCase(
            f"matmul_bwd {name}" + (" +gelu'" if g else ""), "compute",
            {"N": N, "K": K, "OC": OC, "bias": bias, "gelu": g}, bufs,
            ["dinp", "dweight"] + (["dbias"] if bias else []),
            lambda k, b: k.matmul_backward(b["dinp"], b["dweight"], b.get("dbias"), b["dout"], b["inp"], b["weight"],
                                           pre_gelu=b.get("pre_gelu")),
            (lambda K, OC, bias, g: lambda s: (N * OC + 2 * N * K + 3 * OC * K + (N * K if g else 0)) * s
             + (2 * OC * s if bias else 0))(K, OC, bias, g),
            flops=4 * N * K * OC))
    return cases


def _gelu_cases(B: int, T: int, F: int) -> list[KernelCase]:
    """Elementwise GELU on the MLP's hidden activations."""
    N = B * T
    return [
        KernelCase("gelu_fwd", "memory", {"N": N, "C": F}, {"out": Buf((B, T, F)), "inp": Buf((B, T, F))}, ["out"],
                   lambda k, b: k.gelu_forward(b["out"], b["inp"]), lambda s: 2 * N * F * s),
        KernelCase("gelu_bwd", "memory", {"N": N, "C": F},
                   {"dinp": Buf((B, T, F)), "inp": Buf((B, T, F)), "dout": Buf((B, T, F))}, ["dinp"],
                   lambda k, b: k.gelu_backward(b["dinp"], b["inp"], b["dout"]), lambda s: 3 * N * F * s)]


def llama_kernel_cases(cfg, B: int, T: int) -> list[KernelCase]:
    """Llama 3's kernels on its shapes: rmsnorm, bias-free matmuls (fused qkv with grouped-query heads, fused
    gate/up), rotary embedding, GQA attention, SwiGLU, the untied (or tied) head and the shared ones."""
    C, NH, NKV, hd, H, V = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size
    QKV = (NH + 2 * NKV) * hd
    mm = [("qkv", C, QKV), ("wo", NH * hd, C), ("w13", C, 2 * H), ("w2", H, C), ("lm_head", C, V)]
    return (_llama_encoder_cases(B, T, C, V) + _rmsnorm_cases(B, T, C, cfg.norm_eps) + [_residual_case(B, T, C)]
            + _plain_matmul_cases(B, T, mm) + _rope_cases(freqs_cis(cfg, T), B, T, NH, NKV, hd)
            + _swiglu_cases(B, T, H)
            + _attention_cases(B, T, NH, NKV, hd, {"B": B, "T": T, "NH": NH, "NKV": NKV, "hd": hd})
            + _shared_tail_cases(B, T, V, V, llama_params(cfg), NH, NKV, hd))


def _llama_encoder_cases(B: int, T: int, C: int, V: int) -> list[KernelCase]:
    """The token embedding alone (rotary models have no position table)."""
    N = B * T
    return [
        KernelCase("encoder_fwd", "memory", {"B": B, "T": T, "C": C, "V": V},
                   {"out": Buf((B, T, C)), "inp": Buf((B, T), "i32", f"tokens:{V}"), "wte": Buf((V, C), init="weight")},
                   ["out"], lambda k, b: k.encoder_forward(b["out"], b["inp"], b["wte"], None),
                   lambda s: 4 * N + 2 * N * C * s),
        KernelCase("encoder_bwd", "memory", {"B": B, "T": T, "C": C, "V": V},
                   {"dwte": Buf((V, C), init="small"), "dout": Buf((B, T, C)),
                    "inp": Buf((B, T), "i32", f"tokens:{V}")},
                   ["dwte"], lambda k, b: k.encoder_backward(b["dwte"], None, b["dout"], b["inp"]),
                   lambda s: 4 * N + 3 * N * C * s)]


def _rmsnorm_cases(B: int, T: int, C: int, eps: float) -> list[KernelCase]:
    N = B * T

    def rms_stats(h, ref):
        x = h["inp"].astype(np.float64)
        h["rstd"] = (1.0 / np.sqrt((x * x).mean(-1) + eps)).astype(np.float32)

    return [
        KernelCase("rmsnorm_fwd", "memory", {"N": N, "C": C},
                   {"out": Buf((B, T, C)), "rstd": Buf((B, T), "f32"), "inp": Buf((B, T, C)),
                    "weight": Buf((C,), init="gamma")},
                   ["out", "rstd"], lambda k, b: k.rmsnorm_forward(b["out"], b["rstd"], b["inp"], b["weight"], eps),
                   lambda s: 2 * N * C * s + C * s + 4 * N),
        KernelCase("rmsnorm_bwd", "memory", {"N": N, "C": C},
                   {"dinp": Buf((B, T, C)), "dweight": Buf((C,), init="small"), "dout": Buf((B, T, C)),
                    "inp": Buf((B, T, C)), "weight": Buf((C,), init="gamma"), "rstd": Buf((B, T), "f32", "positive")},
                   ["dinp", "dweight"],
                   lambda k, b: k.rmsnorm_backward(b["dinp"], b["dweight"], b["dout"], b["inp"], b["weight"],
                                                   b["rstd"]),
                   lambda s: 4 * N * C * s + 3 * C * s + 4 * N, derive=rms_stats)]


def _plain_matmul_cases(B: int, T: int, mm: list[tuple[str, int, int]]) -> list[KernelCase]:
    """Bias-free products (name, in channels K, out channels OC), every forward, then every backward."""
    N = B * T
    fwd = [KernelCase(f"matmul_fwd {name}", "compute", {"N": N, "K": K, "OC": OC, "bias": False, "gelu": False},
                      {"out": Buf((B, T, OC)), "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}, ["out"],
                      lambda k, b: k.matmul_forward(b["out"], b["inp"], b["weight"]),
                      (lambda K, OC: lambda s: (N * K + OC * K + N * OC) * s)(K, OC), flops=2 * N * K * OC)
           for name, K, OC in mm]
    bwd = [KernelCase(f"matmul_bwd {name}", "compute", {"N": N, "K": K, "OC": OC, "bias": False, "gelu": False},
                      {"dinp": Buf((B, T, K)), "dweight": Buf((OC, K), init="small"), "dout": Buf((B, T, OC)),
                       "inp": Buf((B, T, K)), "weight": Buf((OC, K), init="weight")}, ["dinp", "dweight"],
                      lambda k, b: k.matmul_backward(b["dinp"], b["dweight"], None, b["dout"], b["inp"], b["weight"]),
                      (lambda K, OC: lambda s: (N * OC + 2 * N * K + 3 * OC * K) * s)(K, OC), flops=4 * N * K * OC)
           for name, K, OC in mm]
    return fwd + bwd


def _rope_cases(freqs: np.ndarray, B: int, T: int, NH: int, NKV: int, hd: int) -> list[KernelCase]:
    """Rotary embedding of q and k in place, forward and backward, on the model's frequencies."""
    N, QKV = B * T, (NH + 2 * NKV) * hd
    shape = {"B": B, "T": T, "NH": NH, "NKV": NKV, "hd": hd}

    def rope_bytes(s):  # (q and k rotated in place)
        return 2 * N * (NH + NKV) * hd * s + T * hd * 4

    def with_freqs(h, ref):
        h["freqs"] = freqs

    return [
        KernelCase("rope_fwd", "memory", shape, {"qkv": Buf((B, T, QKV)), "freqs": Buf((T, hd // 2, 2), "f32")},
                   ["qkv"], lambda k, b: k.rope_forward(b["qkv"], b["freqs"], NH, NKV), rope_bytes, derive=with_freqs),
        KernelCase("rope_bwd", "memory", shape, {"dqkv": Buf((B, T, QKV)), "freqs": Buf((T, hd // 2, 2), "f32")},
                   ["dqkv"], lambda k, b: k.rope_backward(b["dqkv"], b["freqs"], NH, NKV), rope_bytes,
                   derive=with_freqs)]


def _swiglu_cases(B: int, T: int, H: int) -> list[KernelCase]:
    N = B * T
    return [
        KernelCase("swiglu_fwd", "memory", {"N": N, "H": H}, {"out": Buf((B, T, H)), "inp": Buf((B, T, 2 * H))},
                   ["out"], lambda k, b: k.swiglu_forward(b["out"], b["inp"]), lambda s: 3 * N * H * s),
        KernelCase("swiglu_bwd", "memory", {"N": N, "H": H},
                   {"dinp": Buf((B, T, 2 * H)), "dout": Buf((B, T, H)), "inp": Buf((B, T, 2 * H))}, ["dinp"],
                   lambda k, b: k.swiglu_backward(b["dinp"], b["dout"], b["inp"]), lambda s: 5 * N * H * s)]


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


def _upload(case: KernelCase, backend: Backend, host: dict[str, np.ndarray]) -> dict:
    """The case's buffers on `backend`, filled with the host inputs."""
    bufs = {}
    for name, spec in case.bufs.items():
        buf = backend.alloc(spec.shape, _kind_dtype(spec.kind, backend), tag="bench")
        backend.upload(buf, host[name])
        bufs[name] = buf
    if case.name == "adamw" and backend.dtype != FLOAT32:  # bf16 parameters keep float32 master weights
        bufs["master"] = backend.alloc(case.bufs["param"].shape, FLOAT32, tag="bench")
        backend.upload(bufs["master"], host["param"])
    return bufs


def _clone(case: KernelCase, backend: Backend, bufs: dict) -> dict:
    """Fresh buffers holding what `bufs` hold, copied on the device (each variant starts from the same inputs)."""
    out = {}
    for name, buf in bufs.items():
        kind = case.bufs[name].kind if name in case.bufs else "f32"  # (adamw's master weights: float32)
        out[name] = backend.alloc(buf.shape, _kind_dtype(kind, backend), tag="bench")
        backend.copy(out[name], buf)
    return out


def _call_once(case: KernelCase, backend: Backend, bufs: dict) -> dict[str, np.ndarray]:
    """Call the kernel once; its outputs on the host."""
    case.call(backend, bufs)
    backend.synchronize()
    return {n: np.asarray(backend.download(bufs[n]), dtype=np.float32) for n in case.outputs}


def _run_once(case: KernelCase, backend: Backend, host: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """Allocate and fill the case's buffers on `backend`, call the kernel once; (buffers, outputs on the host,
    the inputs as the backend held them before the call)."""
    bufs = _upload(case, backend, host)
    held = _as_held(case, backend, bufs, host)  # before the call: kernels update buffers in place (+=, rope)
    return bufs, _call_once(case, backend, bufs), held


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


def _timed(case: KernelCase, be: Backend, bufs: dict, warmup: int, repeat: int) -> dict:
    """`warmup` untimed calls, the backend's tuning settled (so that none lands in a timed call), then `repeat`
    timed calls: their spread."""
    for _ in range(warmup):
        case.call(be, bufs)
    be.settle(lambda: case.call(be, bufs))
    timer = be.timer()
    times = []
    for _ in range(repeat):
        timer.start()
        case.call(be, bufs)
        times.append(timer.stop())
    return _spread(times)


def _rates(case: KernelCase, nbytes: int, median_ms: float) -> dict:
    med = median_ms / 1e3
    return {"gb_s": nbytes / med / 1e9 if med > 0 else None,
            "tflop_s": case.flops / med / 1e12 if (case.flops and med > 0) else None}


def _variant_rows(case: KernelCase, be: Backend, names: Sequence[str], inputs: dict, ref: dict | None,
                  limit: float, nbytes: int, warmup: int, repeat: int) -> list[dict]:
    """Each variant of the case's kernel on copies of the default's inputs: its error against `ref` (the
    reference's outputs; None: not checked) and its timing, or why it does not apply."""
    rows = []
    for name in names:
        try:
            bufs = _clone(case, be, inputs)
            with be.variant(case.kernel, name):
                try:
                    outs = _call_once(case, be, bufs)
                except VariantUnsupported as e:
                    rows.append({"variant": name, "skipped": str(e)})
                    continue
                err = None if ref is None else max(rel_error(outs[n], ref[n]) for n in case.outputs)
                del outs
                row = {"variant": name, **_timed(case, be, bufs, warmup, repeat)}
            del bufs
        except Exception as e:  # noqa: BLE001  (a variant that breaks: its row says so, the next one runs)
            why = failure_line(e)
            rows.append({"variant": name, "skipped": f"failed: {why}", "error": why})
            continue
        row.update(_rates(case, nbytes, row["median_ms"]))
        row["max_rel_err"] = err
        row["ok"] = None if err is None else bool(err <= limit)
        rows.append(row)
    return rows


def _fastest(r: dict) -> str | None:
    """"default" or the variant with the lowest median, among those not flagged as mismatches (ties: the
    default, then the first listed); None when every one is flagged."""
    timed = [("default", r)] + [(v["variant"], v) for v in r["variants"] if "skipped" not in v]
    good = [(n, x["median_ms"]) for n, x in timed if x["ok"] is not False]
    return min(good, key=lambda nm: nm[1])[0] if good else None


def _host_available() -> int | None:
    """MemAvailable from /proc/meminfo (bytes); None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_bytes_needed(case: KernelCase, cfg, B: int, T: int) -> int:
    """A lower bound on the host memory a case takes: its inputs drawn on the host, the reference's copy of them
    and the outputs compared (3x its buffers), and for attention the (B, NH, T, T) scores the numpy reference
    makes. Backends' own scratch comes on top."""
    n = 3 * sum(math.prod(b.shape) * 4 for b in case.bufs.values())
    if case.name in ("attention_fwd", "attention_bwd"):
        n += 4 * B * cfg.n_head * T * T
    return n


def check_host_memory(cases: Sequence[KernelCase], cfg, B: int, T: int, available: int | None = None) -> None:
    """Refuses shapes whose largest case cannot fit in the host memory available, before any is allocated: a
    case's buffers are allocated lazily, so past it the system's out-of-memory killer ended the command (SIGKILL,
    exit 137, no line) instead of a MemoryError."""
    available = _host_available() if available is None else available
    if available is None or not cases:
        return
    need, case = max((host_bytes_needed(c, cfg, B, T), c.name) for c in cases)
    if need > available:
        raise BenchError(f"{arg('B', B, cli='batch_size')} {arg('T', T, cli='seq_len')}: the kernel case {case} needs "
                         f"at least {need / 2**30:.1f} GiB of host memory, {available / 2**30:.1f} GiB is available; "
                         f"lower {arg_both('B', cli='batch_size')} or {arg_both('T', cli='seq_len')}, or leave it out "
                         f"with {arg('only')}")


def run_kernels(backends: Sequence[tuple[str, Backend]], cfg: GPT2Config, B: int, T: int, *, repeat: int = 10,
                warmup: int = 2, seed: int = 1337, reference: Backend | None = None,
                tol: float | None = None, only: Sequence[str] | None = None, variants: bool = False,
                progress: Callable[[str], None] | None = None) -> dict:
    """Time and check every kernel case on every backend. `reference`: the backend outputs are compared with
    (None: errors are not computed). `tol`: mismatch threshold (default by dtype, TOLERANCES). `only`: kernel
    name prefixes to keep. `variants`: also time and check every variant a backend has of each kernel
    (`Backend.variants`), each result then holding "variants" (one row each) and "fastest" (the default or a
    variant within the tolerance). A backend that raises on a case (a kernel it lacks, a bug) gets no result for
    it but a line in "failed" ({"kernel", "backend", "error"}), and the others are still measured. Returns
    {"config", "results": [...], "mismatches": [...], "failed": [...]}."""
    if repeat < 1 or warmup < 0:
        raise BenchError(f"{arg('repeat')} must be >= 1 and {arg('warmup')} >= 0 (got {repeat}, {warmup})")
    cases = kernel_cases(cfg, B, T)
    if only:
        cases = [c for c in cases if any(c.name.startswith(o) for o in only)]
        if not cases:
            raise BenchError(f"{arg('only')} {' '.join(only)}: matches no kernel")
    check_host_memory(cases, cfg, B, T)
    out = {"results": [], "mismatches": [], "failed": []}
    for case in cases:
        host = _host_inputs(case, seed)
        if not _derive(case, host, backends, reference, out["failed"]):
            continue
        refs: dict[str, dict | str] = {}  # by dtype the inputs were held in (a str: why the reference failed)
        for label, be in backends:
            if progress:
                progress(f"{case.name} on {label}")
            try:
                r = _case_on(case, label, be, host, reference, refs, tol, variants, warmup, repeat, progress)
            except Exception as e:  # noqa: BLE001  (one backend's failure is its line; the others are measured)
                out["failed"].append({"kernel": case.name, "backend": label, "error": failure_line(e)})
                gc.collect()
                continue
            if r is not None:
                _record(out, r, case, label, refs.get(be.dtype))
        refs.clear()
        del host
        gc.collect()
    results, mismatches, failed = out["results"], out["mismatches"], out["failed"]
    # one line per failure, the same failure of a reference once
    failed = list({(f["kernel"], f["backend"], f["error"]): f for f in failed}.values())
    return {"config": {**_cfg_dict(cfg), "B": B, "T": T, "repeat": repeat, "warmup": warmup, "seed": seed,
                       "reference": None if reference is None else reference.describe(), "variants": variants},
            "results": results, "mismatches": mismatches, "failed": failed}


def _derive(case: KernelCase, host: dict, backends, reference: Backend | None, failed: list) -> bool:
    """Fills the case's dependent inputs (on the reference, else the first backend); False, with a line in
    `failed`, when that backend fails: the case then cannot run anywhere."""
    if case.derive is None:
        return True
    helper = reference if reference is not None else backends[0][1]
    try:
        case.derive(host, helper)
    except Exception as e:  # noqa: BLE001
        who = "the reference" if reference is not None else backends[0][0]
        failed.append({"kernel": case.name, "backend": who, "error": f"preparing the inputs failed: {failure_line(e)}"})
        return False
    return True


def _record(out: dict, r: dict, case: KernelCase, label: str, ref) -> None:
    """One backend's result on a case into `out`: the result, its mismatches and its variants' (against the
    tolerance), a variant's failure, and the reference's failure on this dtype (`ref` a str)."""
    if r["ok"] is False:
        out["mismatches"].append({"kernel": case.name, "backend": label, "variant": None,
                                  "max_rel_err": r["max_rel_err"], "tol": r["tol"]})
    for v in r.get("variants", []):
        if v.get("ok") is False:
            out["mismatches"].append({"kernel": case.name, "backend": label, "variant": v["variant"],
                                      "max_rel_err": v["max_rel_err"], "tol": r["tol"]})
        if "error" in v:
            out["failed"].append({"kernel": case.name, "backend": f"{label} (variant {v['variant']})",
                                  "error": v["error"]})
    if isinstance(ref, str):
        out["failed"].append({"kernel": case.name, "backend": "the reference", "error": ref})
    out["results"].append(r)


def _case_on(case: KernelCase, label: str, be: Backend, host: dict, reference: Backend | None, refs: dict,
             tol: float | None, variants: bool, warmup: int, repeat: int,
             progress: Callable[[str], None] | None) -> dict | None:
    """One backend's result for one case (None where it lacks the capability the case needs); raises whatever
    the backend raised. `refs` holds the reference's outputs by dtype (or why the reference failed on them)."""
    if case.needs and case.needs not in be.capabilities:  # e.g. attention_decode without CAP_KV_CACHE
        return None
    names = list(be.variants(case.kernel)) if variants else []
    bufs = _upload(case, be, host)
    inputs = _clone(case, be, bufs) if names else None  # before the call: it may update them in place
    held = _as_held(case, be, bufs, host)
    outs = _call_once(case, be, bufs)
    err = None
    if reference is not None:
        if be.dtype not in refs:
            try:
                refs[be.dtype] = _run_once(case, reference, held)[1]
            except Exception as e:  # noqa: BLE001  (the reference's failure is not this backend's: unchecked)
                refs[be.dtype] = f"reference failed: {failure_line(e)}"
        if isinstance(refs[be.dtype], dict):
            err = max(rel_error(outs[n], refs[be.dtype][n]) for n in case.outputs)
    del held
    del outs
    timing = _timed(case, be, bufs, warmup, repeat)
    del bufs
    s = DTYPE_BYTES[be.dtype]
    # a backend whose matmuls round their operands (FP8, TF32) is held to that dtype's bound on them
    mm = getattr(be, "matmul_dtype", None) is not None and case.name.startswith("matmul")
    r = {"kernel": case.name, "kind": case.kind, "shape": case.shape, "backend": label,
         "dtype": be.matmul_dtype if mm else be.dtype, "bytes": case.bytes_fn(s), "flops": case.flops,
         **timing}
    r.update(_rates(case, r["bytes"], r["median_ms"]))
    limit = tol if tol is not None else TOLERANCES.get(be.matmul_dtype if mm else be.dtype, 3e-2)
    r["max_rel_err"] = err
    r["tol"] = limit
    r["ok"] = None if err is None else bool(err <= limit)
    if variants:
        if progress and names:
            progress(f"{case.name} on {label}: {len(names)} variants")
        ref = refs.get(be.dtype)
        r["variants"] = _variant_rows(case, be, names, inputs, ref if isinstance(ref, dict) else None, limit,
                                      r["bytes"], warmup, repeat) if names else []
        del inputs
        r["fastest"] = _fastest(r)
    return r


def _cfg_dict(cfg) -> dict:
    fam = family_of(cfg)
    d = {"family": fam.name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
         "vocab_size": cfg.vocab_size, "padded_vocab_size": cfg.padded_vocab_size, "block_size": cfg.block_size,
         "num_parameters": fam.num_parameters(cfg)}
    if hasattr(cfg, "n_kv_head"):
        d["n_kv_head"] = cfg.n_kv_head
    return d
