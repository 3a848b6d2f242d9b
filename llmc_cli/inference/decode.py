"""Incremental decoding over a key/value cache (backends announcing CAP_KV_CACHE), for GPT-2 and Llama 3.

A decoder shares a model's parameters and runs the same straight-line layer calls as its forward, but only for
the new tokens: their q, k, v come from the usual matmul, `attention_decode` appends k and v to per-layer caches
(one per key/value head: grouped-query attention caches NKV heads, not NH) and attends over everything cached so
far. Positions enter at the current offset through a view: GPT-2's `wpe` rows, Llama's rotary (cos, sin) table.
A prompt goes in as chunks of up to `chunk` tokens, each following token as a chunk of one. The other layers
are the ordinary kernels on (B, Tn, C) views of buffers planned once.
"""

from __future__ import annotations

import numpy as np

from llmc_cli.models.gpt2 import GPT2
from llmc_cli.kernels import CAP_KV_CACHE, FLOAT32, INT32
from llmc_cli.models.llama3 import Llama3
from llmc_cli.models.base import Model


def has_kv_cache(model: Model) -> bool:
    """True when `model` has a decoder here (GPT-2, Llama 3) and its backend announces CAP_KV_CACHE; other
    models and backends fall back to full recomputation."""
    return type(model) in _DECODERS and CAP_KV_CACHE in model.backend.capabilities


class KVDecoder:
    """GPT-2's decoder, for batch B up to `max_len` positions (default: the model's T, at most its block
    size). Subclasses plan their family's buffers (`_plan`) and layers (`_forward`)."""

    def __init__(self, model: Model, B: int = 1, max_len: int | None = None, chunk: int = 64):
        if not has_kv_cache(model):
            raise ValueError(f"backend '{model.backend.name}' does not announce {CAP_KV_CACHE!r}")
        cfg, k = model.cfg, model.backend
        self.model, self.backend, self.cfg, self.B = model, k, cfg, B
        self.max_len = min(max_len or model.T, cfg.block_size)
        self.chunk = max(1, min(chunk, self.max_len))
        self.plan = self._plan(B, self.chunk, k.dtype)  # name -> (shape, dtype); (B, chunk, ...), every layer's
        self.bufs = {n: k.alloc(shape, d, tag="kv_decode") for n, (shape, d) in self.plan.items()}
        L, hd, dt = cfg.n_layer, cfg.n_embd // cfg.n_head, k.dtype
        cache_shape = (B, getattr(cfg, "n_kv_head", cfg.n_head), self.max_len, hd)
        step = int(np.prod(cache_shape))
        self.k_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.v_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.k_cache = [k.view(self.k_all, l * step, cache_shape) for l in range(L)]
        self.v_cache = [k.view(self.v_all, l * step, cache_shape) for l in range(L)]
        self.pos = 0

    def _plan(self, B: int, S: int, dt: str) -> dict[str, tuple[tuple[int, ...], str]]:
        C, Vp = self.cfg.n_embd, self.cfg.padded_vocab_size
        return {
            "inputs": ((B, S), INT32), "x": ((B, S, C), dt), "r2": ((B, S, C), dt), "r3": ((B, S, C), dt),
            "ln": ((B, S, C), dt), "mean": ((B, S), FLOAT32), "rstd": ((B, S), FLOAT32),
            "qkv": ((B, S, 3 * C), dt), "atty": ((B, S, C), dt), "btc": ((B, S, C), dt),
            "fch": ((B, S, 4 * C), dt), "fch_gelu": ((B, S, 4 * C), dt), "logits": ((B, S, Vp), dt),
        }

    def reset(self) -> None:
        """Forget the cached positions (the caches themselves need no clearing: unread past `pos`)."""
        self.pos = 0

    def _v(self, name: str, Tn: int):
        """A (B, Tn, ...) view of the front of a planned buffer."""
        shape, _ = self.plan[name]
        new = (shape[0], Tn) + shape[2:]
        return self.backend.view(self.bufs[name], 0, new)

    def feed(self, tokens: np.ndarray) -> np.ndarray:
        """Appends tokens (B, n) (any n >= 1, fed in chunks) and returns float32 logits (B, V) after the last."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        if tokens.shape[0] != self.B or tokens.shape[1] < 1:
            raise ValueError(f"feed expects tokens (B={self.B}, n>=1), got {tokens.shape}")
        if self.pos + tokens.shape[1] > self.max_len:
            raise ValueError(f"{self.pos + tokens.shape[1]} positions overrun the cache ({self.max_len})")
        for i in range(0, tokens.shape[1], self.chunk):
            Tn = self._forward(tokens[:, i:i + self.chunk])
        logits = self.backend.download(self._v("logits", Tn))
        return logits[:, Tn - 1, :self.cfg.vocab_size].astype(np.float32)

    def _forward(self, tokens: np.ndarray) -> int:
        k, p, cfg, pos = self.backend, self.model.params, self.cfg, self.pos
        B, Tn = tokens.shape
        C, L, NH = cfg.n_embd, cfg.n_layer, cfg.n_head
        v = {name: self._v(name, Tn) for name in self.plan}
        k.upload(v["inputs"], tokens)
        wpe = k.view(p.wpe, pos * C, (cfg.block_size - pos, C))  # row t of this view is position pos + t
        k.encoder_forward(v["x"], v["inputs"], p.wte, wpe)
        k.layernorm_forward(v["ln"], v["mean"], v["rstd"], v["x"], p.layer("ln1w", 0), p.layer("ln1b", 0))
        for l in range(L):
            residual = v["x"] if l == 0 else v["r3"]
            k.matmul_forward(v["qkv"], v["ln"], p.layer("qkvw", l), p.layer("qkvb", l))
            k.attention_decode(v["atty"], v["qkv"], self.k_cache[l], self.v_cache[l], pos, NH, NH)
            k.matmul_forward(v["btc"], v["atty"], p.layer("attprojw", l), p.layer("attprojb", l))
            k.fused_residual_layernorm_forward(v["r2"], v["ln"], v["mean"], v["rstd"], residual, v["btc"],
                                               p.layer("ln2w", l), p.layer("ln2b", l))
            k.matmul_forward(v["fch_gelu"], v["ln"], p.layer("fcw", l), p.layer("fcb", l), pre_gelu=v["fch"])
            k.matmul_forward(v["btc"], v["fch_gelu"], p.layer("fcprojw", l), p.layer("fcprojb", l))
            w, b = (p.layer("ln1w", l + 1), p.layer("ln1b", l + 1)) if l + 1 < L else (p.lnfw, p.lnfb)
            k.fused_residual_layernorm_forward(v["r3"], v["ln"], v["mean"], v["rstd"], v["r2"], v["btc"], w, b)
        k.matmul_forward(v["logits"], v["ln"], p.wte)
        self.pos += Tn
        return Tn


class LlamaKVDecoder(KVDecoder):
    """Llama 3's layers for the new tokens; rope reads the (cos, sin) rows of positions pos.. from a view of
    the model's table, so the model's window bounds the cache as it bounds its forward."""

    def __init__(self, model: Llama3, B: int = 1, max_len: int | None = None, chunk: int = 64):
        super().__init__(model, B, min(max_len or model.T, model.T), chunk)

    def _plan(self, B: int, S: int, dt: str) -> dict[str, tuple[tuple[int, ...], str]]:
        cfg = self.cfg
        C, H, V = cfg.n_embd, cfg.hidden_dim, cfg.vocab_size
        qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        return {
            "inputs": ((B, S), INT32), "x": ((B, S, C), dt), "r2": ((B, S, C), dt), "r3": ((B, S, C), dt),
            "ln": ((B, S, C), dt), "rstd": ((B, S), FLOAT32), "qkv": ((B, S, qkv), dt),
            "atty": ((B, S, cfg.n_head * cfg.head_dim), dt), "btc": ((B, S, C), dt),
            "h13": ((B, S, 2 * H), dt), "hs": ((B, S, H), dt), "logits": ((B, S, V), dt),
        }

    def _forward(self, tokens: np.ndarray) -> int:
        k, m, cfg, pos = self.backend, self.model, self.cfg, self.pos
        p = m.params
        B, Tn = tokens.shape
        NH, NKV, eps, half = cfg.n_head, cfg.n_kv_head, cfg.norm_eps, cfg.head_dim // 2
        v = {name: self._v(name, Tn) for name in self.plan}
        freqs = k.view(m.freqs, pos * half * 2, (m.T - pos, half, 2))  # row t is position pos + t
        k.upload(v["inputs"], tokens)
        k.encoder_forward(v["x"], v["inputs"], p.wte, None)
        for l in range(cfg.n_layer):
            residual = v["x"] if l == 0 else v["r3"]
            k.rmsnorm_forward(v["ln"], v["rstd"], residual, p.layer("attn_norm", l), eps)
            k.matmul_forward(v["qkv"], v["ln"], p.layer("wqkv", l))
            k.rope_forward(v["qkv"], freqs, NH, NKV)
            k.attention_decode(v["atty"], v["qkv"], self.k_cache[l], self.v_cache[l], pos, NH, NKV)
            k.matmul_forward(v["btc"], v["atty"], p.layer("wo", l))
            k.residual_forward(v["r2"], residual, v["btc"])
            k.rmsnorm_forward(v["ln"], v["rstd"], v["r2"], p.layer("ffn_norm", l), eps)
            k.matmul_forward(v["h13"], v["ln"], p.layer("w13", l))
            k.swiglu_forward(v["hs"], v["h13"])
            k.matmul_forward(v["btc"], v["hs"], p.layer("w2", l))
            k.residual_forward(v["r3"], v["r2"], v["btc"])
        k.rmsnorm_forward(v["ln"], v["rstd"], v["r3"], p.norm, eps)
        k.matmul_forward(v["logits"], v["ln"], m.head(p))
        self.pos += Tn
        return Tn


_DECODERS: dict[type, type[KVDecoder]] = {GPT2: KVDecoder, Llama3: LlamaKVDecoder}  # model class -> its decoder


def decoder_for(model: Model) -> KVDecoder:
    """The model's KV decoder (B=1, window model.T), planned on first use and kept on the model."""
    dec = getattr(model, "_kv_decoder", None)
    if dec is None:
        dec = _DECODERS[type(model)](model, B=1, max_len=model.T)
        model._kv_decoder = dec
    return dec
