"""Llama 3 as a spec on the same kernel interface as GPT-2: RMSNorm, rotary embeddings with Llama 3.1's
frequency scaling, grouped-query attention, a SwiGLU MLP, no biases, and an output head that is untied (Llama
3.1 8B) or tied to the embedding (Llama 3.2 1B / 3B, as Meta ships them).

Fused layouts: q, k and v projections are one matrix wqkv (q rows, then k rows, then v rows), so one matmul
feeds the attention kernel's packed qkv; the gate (w1) and up (w3) projections are one matrix w13 (gate rows,
then up rows), the layout the swiglu kernel takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from llmc_cli.kernels import FLOAT32, INT32, Backend
from llmc_cli.models.base import (STAGED, Model, Tensors, check_backend, check_config_fields, check_plan,
                                   check_recompute, check_seq_len, init_normal, pick_classifier_chunks, split_flat)


@dataclass(frozen=True)
class Llama3Config:
    family: ClassVar[str] = "llama3"  # names its Family (models.families)
    block_size: int = 8192          # max sequence length planned for (T at most this)
    vocab_size: int = 128256
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    n_embd: int = 4096
    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: float | None = 8.0  # Llama 3.1 frequency scaling factor; None = plain RoPE
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    tie_embeddings: bool = False
    intermediate_size: int | None = None  # the MLP width given outright (Hugging Face configs) instead of the rule

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden_dim(self) -> int:
        """Meta's rule: 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to a multiple of multiple_of."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        h = int(2 * (4 * self.n_embd) / 3)
        if self.ffn_dim_multiplier is not None:
            h = int(self.ffn_dim_multiplier * h)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_size  # 128256 is already a multiple of 128; no padding row semantics needed

    def validate(self) -> None:
        check_config_fields(self)
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_kv_head, self.n_embd) <= 0:
            raise ValueError(f"model shape must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            # (rope_frequencies divides by their difference: equal ones are a division by zero)
            raise ValueError(f"rope_high_freq_factor {self.rope_high_freq_factor} must be greater than "
                             f"rope_low_freq_factor {self.rope_low_freq_factor}")


PRESETS: dict[str, Llama3Config] = {
    # a tiny model for tests and demos, GPT-2's vocabulary so it trains on the same shards
    "llama3-tiny": Llama3Config(block_size=256, vocab_size=50257, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                multiple_of=32, ffn_dim_multiplier=None, rope_scaling=None),
    # the real shapes (Meta's params.json / Hugging Face config.json)
    "llama3.2-1b": Llama3Config(block_size=131072, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                                multiple_of=256, ffn_dim_multiplier=1.5, rope_scaling=32.0, tie_embeddings=True),
    "llama3.2-3b": Llama3Config(block_size=131072, n_layer=28, n_head=24, n_kv_head=8, n_embd=3072,
                                multiple_of=256, ffn_dim_multiplier=1.0, rope_scaling=32.0, tie_embeddings=True),
    "llama3.1-8b": Llama3Config(block_size=131072, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                multiple_of=1024, ffn_dim_multiplier=1.3, rope_scaling=8.0),
}
ALIASES = {"llama3-1b": "llama3.2-1b", "llama3-3b": "llama3.2-3b", "llama3-8b": "llama3.1-8b"}


def preset(name: str, **overrides) -> Llama3Config:
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise ValueError(f"unknown model '{name}' (Llama presets: {', '.join(list(PRESETS) + list(ALIASES))})")
    return replace(PRESETS[key], **overrides)


def parameter_shapes(cfg: Llama3Config) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter tensors in order; per-layer tensors are stacked over layers."""
    V, C, L, H = cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.hidden_dim
    qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    shapes = [
        ("wte", (V, C)),
        ("attn_norm", (L, C)), ("wqkv", (L, qkv, C)), ("wo", (L, C, cfg.n_head * cfg.head_dim)),
        ("ffn_norm", (L, C)), ("w13", (L, 2 * H, C)), ("w2", (L, C, H)),
        ("norm", (C,)),
    ]
    if not cfg.tie_embeddings:
        shapes.append(("lm_head", (V, C)))
    return shapes


DECAYED = {"wte", "wqkv", "wo", "w13", "w2", "lm_head"}


def num_parameters(cfg: Llama3Config) -> int:
    return sum(int(np.prod(s)) for _, s in parameter_shapes(cfg))


def init_parameters(cfg: Llama3Config, seed: int) -> np.ndarray:
    """N(0, 0.02) matrices, output projections (wo, w2) scaled by 1/sqrt(2L), norms 1 (host, seeded)."""
    out = np.zeros(num_parameters(cfg), dtype=np.float32)
    normal = []
    for name, t in split_flat(out, parameter_shapes(cfg)).items():
        if name in ("attn_norm", "ffn_norm", "norm"):
            t[...] = 1.0
        else:
            normal.append((t, 0.02 / math.sqrt(2 * cfg.n_layer) if name in ("wo", "w2") else 0.02))
    init_normal(normal, seed)
    return out


def rope_frequencies(cfg: Llama3Config) -> np.ndarray:
    """Per-pair inverse frequencies (hd/2,), with Llama 3.1's scaling of the low frequencies."""
    hd = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2)[: hd // 2].astype(np.float64) / hd)
    if cfg.rope_scaling is None:
        return freqs
    low_wavelen = cfg.rope_original_context / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_context / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (cfg.rope_original_context / wavelen - cfg.rope_low_freq_factor) / \
        (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    mid = (1 - smooth) * freqs / cfg.rope_scaling + smooth * freqs
    return np.where(wavelen < high_wavelen, freqs, np.where(wavelen > low_wavelen, freqs / cfg.rope_scaling, mid))


def freqs_cis(cfg: Llama3Config, T: int, start: int = 0) -> np.ndarray:
    """(T, hd/2, 2) float32 = (cos, sin) of position * frequency for positions start..start+T-1, the layout the
    rope kernels take."""
    ang = np.outer(np.arange(start, start + T, dtype=np.float64), rope_frequencies(cfg))
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)


def auto_classifier_chunks(cfg: Llama3Config, B: int, T: int, training: bool, act_bytes: int = 2) -> int:
    """How many chunks of the B*T rows the training classifier runs in (models.base: pick_classifier_chunks, the
    least logits memory). Rows, not whole sequences: Llama 3.1 8B trains at B=1, T=8192, where one sequence's
    logits are 2.1 GB in bf16. Inference keeps the whole logits (sampling reads them back), so it is 1 there."""
    if not training:
        return 1
    N, V = B * T, cfg.vocab_size
    return pick_classifier_chunks(N, V * act_bytes, lambda n: -(-N // n) * V, ragged=True)


def chunk_rows(N: int, chunks: int) -> int:
    """Rows of one classifier chunk: ceil(N/chunks), from 256 rows up rounded up to a multiple of 16 (the
    granularity of tensor-core tiles, and what FP8 matmuls require), so that every chunk but a ragged last one
    runs at full speed; the count of chunks may then drop by one."""
    r = -(-N // chunks)
    return r if r < 256 else min(N, -(-r // 16) * 16)


def activation_shapes(cfg: Llama3Config, B: int, T: int, training: bool, recompute: str = "none",
                      chunks: int = 1) -> list[tuple[str, tuple, str, bool]]:
    """(name, shape, dtype, one per layer) planned once for (B, T); "act" is the backend's compute dtype.
    Without training nothing is kept per layer (one buffer serves every layer). `recompute` (models.base:
    RECOMPUTE) keeps one shared SwiGLU output ("gelu": hs) and/or shared RMSNorm outputs ("layernorm": ln1,
    ln2) that the backward pass recomputes. With `chunks` > 1 the logits buffer holds chunk_rows(B*T, chunks) rows
    (see auto_classifier_chunks); the last chunk may be smaller."""
    check_recompute(recompute)
    N = B * T
    if not 1 <= chunks <= N:
        raise ValueError(f"classifier chunks {chunks} must be between 1 and B*T = {N}")
    shared = set() if training else {"all"}
    if "gelu" in recompute:
        shared.add("hs")
    if "layernorm" in recompute:
        shared |= {"ln1", "ln2"}
    C, NH, V, H = cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.hidden_dim
    qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    act = "act"
    plan = [
        ("freqs", (T, cfg.head_dim // 2, 2), FLOAT32, False),  # the rotary table (freqs_cis), uploaded once
        ("encoded", (B, T, C), act, False),
        ("ln1", (B, T, C), act, True), ("ln1_rstd", (B, T), FLOAT32, True),
        ("qkv", (B, T, qkv), act, True), ("atty", (B, T, NH * cfg.head_dim), act, True),
        ("att_lse", (B, NH, T), FLOAT32, True),
        ("residual2", (B, T, C), act, True),
        ("ln2", (B, T, C), act, True), ("ln2_rstd", (B, T), FLOAT32, True),
        ("h13", (B, T, 2 * H), act, True), ("hs", (B, T, H), act, True),
        ("residual3", (B, T, C), act, True),
        ("lnf", (B, T, C), act, False), ("lnf_rstd", (B, T), FLOAT32, False),
        ("logits", (B, T, V) if chunks == 1 else (chunk_rows(N, chunks), V), act, False),
        ("losses", (B, T), FLOAT32, False),
        ("inputs", (B, T), INT32, False), ("targets", (B, T), INT32, False),
        ("btc", (B, T, C), act, False),
    ]
    if training:
        plan += [("dresidual", (B, T, C), act, False), ("dbtc", (B, T, C), act, False),
                 ("dhs", (B, T, H), act, False), ("dh13", (B, T, 2 * H), act, False),
                 ("dqkv", (B, T, qkv), act, False)]
    return [(n, s, k, per and "all" not in shared and n not in shared) for n, s, k, per in plan]


# Norm outputs that live in ln1's memory when ln1 is one buffer for every layer (under --recompute layernorm,
# and in an inference model): a layer's ln1 is dead once qkv is computed, its ln2 once h13 is, and lnf once the
# lm-head has run (the lm-head backward runs inside the training forward; rmsnorm_backward reads the residual
# stream, not the norm's output), and backward recomputes ln2 and ln1 just before it reads them.
IN_LN1 = ("ln2", "lnf")


def _in_ln1(plan: list[tuple[str, tuple, str, bool]]) -> set[str]:
    """The IN_LN1 buffers of this plan that are views of ln1 (when neither is kept per layer)."""
    per_layer = {name: per for name, _, _, per in plan}
    return set() if per_layer["ln1"] else {n for n in IN_LN1 if not per_layer[n]}


def activation_bytes(cfg: Llama3Config, B: int, T: int, training: bool, act_bytes: int,
                     recompute: str = "none") -> int:
    """Bytes of the activations Llama3.__init__ allocates for (B, T), without allocating: the same classifier
    chunking, and nothing for the buffers that live in ln1's memory."""
    plan = activation_shapes(cfg, B, T, training, recompute, auto_classifier_chunks(cfg, B, T, training, act_bytes))
    aliased = _in_ln1(plan)
    return sum(int(np.prod(shape)) * (cfg.n_layer if per_layer else 1) * (act_bytes if kind == "act" else 4)
               for name, shape, kind, per_layer in plan if name not in aliased)


class Llama3(Model):
    """Parameters, gradients and activations of one Llama 3, planned once for batch (B, T)."""

    param_shapes = staticmethod(parameter_shapes)
    DECAYED = frozenset(DECAYED)

    @staticmethod
    def stacked_tensors(cfg) -> set[str]:
        """The parameter tensors stacked over the layers (one slice per layer)."""
        return {n for n, _ in parameter_shapes(cfg) if n not in ("wte", "lm_head", "norm")}

    def __init__(self, cfg: Llama3Config, backend: Backend, B: int, T: int, training: bool = True,
                 share_params: "Llama3 | None" = None, recompute: str = "none", classifier_chunks: int | None = None,
                 layer_grads: bool = False):
        """As GPT2.__init__; `classifier_chunks`: chunks of the B*T rows the training classifier runs in (None =
        auto_classifier_chunks)."""
        cfg.validate()
        check_backend(backend)
        B, T = check_plan(B, T)  # (numpy's integers as ints: np.uint8(255) overflowed the comparisons below)
        check_recompute(recompute)
        check_seq_len(T, cfg.block_size)
        self.cfg, self.backend, self.B, self.T = cfg, backend, B, T
        dt = backend.dtype
        self._alloc_parameters(self.stacked_tensors(cfg), training, share_params, layer_grads)
        self.recompute = recompute
        if classifier_chunks is None:
            classifier_chunks = auto_classifier_chunks(cfg, B, T, training, 4 if dt == FLOAT32 else 2)
        if not training and classifier_chunks != 1:
            raise ValueError("an inference model keeps the whole logits (classifier_chunks must be 1)")
        self.acts, self.acts_layer = {}, {}
        L = cfg.n_layer
        plan = activation_shapes(cfg, B, T, training, recompute, classifier_chunks)
        aliased = _in_ln1(plan)
        for name, shape, kind, per_layer in plan:  # (ln1 comes before the buffers that live in it)
            full = (L,) + shape if per_layer else shape
            if name in aliased:
                buf = backend.view(self.acts["ln1"], 0, full)
            else:
                buf = backend.alloc(full, dt if kind == "act" else kind, tag="activations")
            self.acts[name] = buf
            step = int(np.prod(shape))  # (a buffer that is not per layer serves every layer: L times the same)
            self.acts_layer[name] = [backend.view(buf, l * step, shape) if per_layer else buf for l in range(L)]
        self.freqs = self.acts["freqs"]
        backend.upload(self.freqs, freqs_cis(cfg, T))
        # per chunk of rows: (lnf rows, dlnf rows, losses rows, targets rows, logits rows), contiguous views; the
        # last chunk may be shorter
        N, C, V, a = B * T, cfg.n_embd, cfg.vocab_size, self.acts
        R = chunk_rows(N, classifier_chunks)
        self.chunk_views = [
            (backend.view(a["lnf"], r * C, (n, C)), backend.view(a["dbtc"], r * C, (n, C)) if training else None,
             backend.view(a["losses"], r, (n,)), backend.view(a["targets"], r, (n,)),
             backend.view(a["logits"], 0, (n, V)))
            for r in range(0, N, R) for n in [min(R, N - r)]]
        self.chunks = len(self.chunk_views)

    def head(self, tensors: Tensors):
        return tensors.wte if self.cfg.tie_embeddings else tensors.lm_head

    def forward(self, inputs: np.ndarray, targets: np.ndarray | None = None, dloss: float | None = None) -> None:
        """As GPT2.forward: losses with `targets`; with `dloss` too, the lm-head's backward runs here as well,
        chunk by chunk over the B*T rows (the fused classifier turns each chunk's logits into dlogits, which the
        lm-head backward consumes at once): dlnf lands in acts['dbtc'] and the head's gradient accumulates, for
        `backward` to continue from. Without targets (a model planned with classifier chunks cannot do that)
        the logits buffer keeps the whole (B, T, V) logits."""
        k, p, a, al, cfg = self.backend, self.params, self.acts, self.acts_layer, self.cfg
        NH, NKV = cfg.n_head, cfg.n_kv_head
        if targets is None and self.chunks > 1:
            raise ValueError(f"this model computes its logits in {self.chunks} chunks of the B*T rows (a training "
                             f"plan); a forward without targets needs an inference model (training=False)")
        if inputs is not STAGED:  # both uploads first: none waits behind the forward pass queued after it
            self.stage(inputs, targets)
        k.encoder_forward(a["encoded"], a["inputs"], p.wte, None)
        self._layers(a["encoded"], lambda name, l: al[name][l], self.freqs,
                     lambda l, atty, qkv: k.attention_forward(atty, al["att_lse"][l], qkv, NH, NKV))
        if targets is None:
            k.matmul_forward(a["logits"], a["lnf"], self.head(p), **self.head_kw)
            return
        head_next = self.fp8_next(self.head(p)) if dloss is not None else {}  # (the head's backward reads it next)
        for lnf, dlnf, losses, tgt, logits in self.chunk_views:
            k.matmul_forward(logits, lnf, self.head(p), **self.head_kw)
            k.classifier_forward_backward(logits, losses, tgt, cfg.vocab_size, dloss, **head_next)
            if dloss is not None:  # the head's gradient accumulates over the chunks (the interface's += on dweight)
                k.matmul_backward(dlnf, self.head(self.grads), None, logits, lnf, self.head(p),
                                  **self.head_kw)

    def _layers(self, encoded, act, freqs, attend) -> None:
        """The layer loop, written once for the forward pass and for decoding (see GPT2._layers); `freqs` is the
        rotary table from the first new position on. Ends with the final rmsnorm in act("lnf", L - 1)."""
        k, p, cfg = self.backend, self.params, self.cfg
        NH, NKV, eps, L = cfg.n_head, cfg.n_kv_head, cfg.norm_eps, cfg.n_layer
        for l in range(L):
            residual = encoded if l == 0 else act("residual3", l - 1)
            # attention block: rmsnorm -> fused qkv -> rope -> GQA attention -> output projection -> residual
            k.rmsnorm_forward(act("ln1", l), act("ln1_rstd", l), residual, p.layer("attn_norm", l), eps,
                              **self.fp8_next(p.layer("wqkv", l)))
            k.matmul_forward(act("qkv", l), act("ln1", l), p.layer("wqkv", l))
            k.rope_forward(act("qkv", l), freqs, NH, NKV)
            attend(l, act("atty", l), act("qkv", l))
            k.matmul_forward(act("btc", l), act("atty", l), p.layer("wo", l))
            k.residual_forward(act("residual2", l), residual, act("btc", l))
            # MLP block: rmsnorm -> fused gate/up -> swiglu -> down projection -> residual
            k.rmsnorm_forward(act("ln2", l), act("ln2_rstd", l), act("residual2", l), p.layer("ffn_norm", l), eps,
                              **self.fp8_next(p.layer("w13", l)))
            k.matmul_forward(act("h13", l), act("ln2", l), p.layer("w13", l))
            k.swiglu_forward(act("hs", l), act("h13", l), **self.fp8_next(p.layer("w2", l)))
            k.matmul_forward(act("btc", l), act("hs", l), p.layer("w2", l))
            k.residual_forward(act("residual3", l), act("residual2", l), act("btc", l))
        k.rmsnorm_forward(act("lnf", L - 1), act("lnf_rstd", L - 1), act("residual3", L - 1), p.norm, eps)

    # ---- decoding over a key/value cache (inference.decode.KVDecoder drives it) -----------------------------
    _DECODE_SHARED = {"residual2": "r2", "residual3": "r3", "ln1": "ln", "ln2": "ln", "lnf": "ln",
                      "ln1_rstd": "rstd", "ln2_rstd": "rstd", "lnf_rstd": "rstd"}

    def decode_plan(self, B: int, S: int, dt: str) -> dict[str, tuple[tuple[int, ...], str]]:
        cfg = self.cfg
        C, H, V = cfg.n_embd, cfg.hidden_dim, cfg.vocab_size
        qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        return {
            "inputs": ((B, S), INT32), "x": ((B, S, C), dt), "r2": ((B, S, C), dt), "r3": ((B, S, C), dt),
            "ln": ((B, S, C), dt), "rstd": ((B, S), FLOAT32), "qkv": ((B, S, qkv), dt),
            "atty": ((B, S, cfg.n_head * cfg.head_dim), dt), "btc": ((B, S, C), dt),
            "h13": ((B, S, 2 * H), dt), "hs": ((B, S, H), dt), "logits": ((B, S, V), dt),
            "freqs": ((1, S, cfg.head_dim // 2, 2), FLOAT32),  # (the decoder's views are (B or 1, Tn, ...))
        }

    def decode_heads(self) -> tuple[int, int, int]:
        return self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim

    def decode_max_len(self) -> int:
        return self.cfg.block_size

    def decode_slides(self) -> bool:
        return True  # rotary positions are relative: a cached key stays valid as the window slides past it

    def decode_inputs(self, v: dict, pos: int) -> None:
        """As GPT2.decode_inputs: the rotary rows of positions pos.., computed here (a sliding window takes
        positions past any table planned ahead), uploaded into v["freqs"]."""
        Tn = v["inputs"].shape[1]
        self.backend.upload(self.backend.view(v["freqs"], 0, (Tn, self.cfg.head_dim // 2, 2)),
                            freqs_cis(self.cfg, Tn, start=pos))

    def decode_forward(self, v: dict, pos, k_cache: list, v_cache: list) -> None:
        """As GPT2.decode_forward."""
        k, p, cfg = self.backend, self.params, self.cfg
        NH, NKV, Tn = cfg.n_head, cfg.n_kv_head, v["inputs"].shape[1]
        freqs = k.view(v["freqs"], 0, (Tn, cfg.head_dim // 2, 2))
        k.encoder_forward(v["x"], v["inputs"], p.wte, None)
        shared = self._DECODE_SHARED
        self._layers(v["x"], lambda name, l: v[shared.get(name, name)], freqs,
                     lambda l, atty, qkv: k.attention_decode(atty, qkv, k_cache[l], v_cache[l], pos, NH, NKV))
        k.matmul_forward(v["logits"], v["ln"], self.head(p), **self.head_kw)

    def backward(self) -> None:
        """Accumulates every parameter gradient; needs forward(..., dloss=...) first, which already ran the lm-head's
        backward (as GPT2.backward)."""
        k, p, g, a, al, cfg = self.backend, self.params, self.grads, self.acts, self.acts_layer, self.cfg
        NH, NKV, L = cfg.n_head, cfg.n_kv_head, cfg.n_layer
        dres, dbtc = a["dresidual"], a["dbtc"]
        k.fill(dres, 0.0)
        k.rmsnorm_backward(dres, g.norm, dbtc, al["residual3"][L - 1], p.norm, a["lnf_rstd"])
        recompute_norm, recompute_act = "layernorm" in self.recompute, "gelu" in self.recompute
        for l in reversed(range(L)):
            residual = a["encoded"] if l == 0 else al["residual3"][l - 1]
            if recompute_act:  # the SwiGLU output (and/or the rmsnorm outputs) were not kept: recompute them
                k.swiglu_forward(al["hs"][l], al["h13"][l], **self.fp8_next(p.layer("w2", l)))
            if recompute_norm:  # (rstd is rewritten with the value it had: the same kernel on the same input)
                k.rmsnorm_forward(al["ln2"][l], al["ln2_rstd"][l], al["residual2"][l], p.layer("ffn_norm", l),
                                  cfg.norm_eps, **self.fp8_next(p.layer("w13", l)))
            # MLP block
            k.matmul_backward(a["dhs"], g.layer("w2", l), None, dres, al["hs"][l], p.layer("w2", l))
            k.swiglu_backward(a["dh13"], a["dhs"], al["h13"][l], **self.fp8_next(p.layer("w13", l)))
            k.matmul_backward(dbtc, g.layer("w13", l), None, a["dh13"], al["ln2"][l], p.layer("w13", l))
            k.rmsnorm_backward(dres, g.layer("ffn_norm", l), dbtc, al["residual2"][l], p.layer("ffn_norm", l),
                               al["ln2_rstd"][l])
            # attention block
            k.matmul_backward(dbtc, g.layer("wo", l), None, dres, al["atty"][l], p.layer("wo", l))
            k.attention_backward(a["dqkv"], dbtc, al["qkv"][l], al["atty"][l], al["att_lse"][l], NH, NKV)
            k.rope_backward(a["dqkv"], self.freqs, NH, NKV)
            if recompute_norm:
                k.rmsnorm_forward(al["ln1"][l], al["ln1_rstd"][l], residual, p.layer("attn_norm", l), cfg.norm_eps,
                                  **self.fp8_next(p.layer("wqkv", l)))
            k.matmul_backward(dbtc, g.layer("wqkv", l), None, a["dqkv"], al["ln1"][l], p.layer("wqkv", l))
            k.rmsnorm_backward(dres, g.layer("attn_norm", l), dbtc, residual, p.layer("attn_norm", l),
                               al["ln1_rstd"][l])
            if self.on_layer_grads is not None:
                self.on_layer_grads(l)
        k.encoder_backward(g.wte, None, dres, a["inputs"])
