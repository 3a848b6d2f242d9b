"""Incremental decoding over a key/value cache (backends announcing CAP_KV_CACHE), for any model family whose
model offers the decode methods (GPT-2, Llama 3).

A decoder shares a model's parameters and runs the model's own layer loop (`_layers`, the one its forward runs),
but only for the new tokens and on scratch buffers planned once for (B, chunk): their q, k, v come from the usual
matmul, `attention_decode` appends k and v to per-layer caches (one per key/value head: grouped-query attention
caches NKV heads, not NH) and attends over everything cached so far. Positions enter at the current offset through
a view (GPT-2's `wpe` rows, Llama's rotary table). A prompt goes in as chunks of up to `chunk` tokens, each
following token as a chunk of one.
"""

from __future__ import annotations

import numpy as np

from llmc_cli.kernels import CAP_KV_CACHE
from llmc_cli.models.base import Model


def has_kv_cache(model: Model) -> bool:
    """True when `model` can decode incrementally (it has the decode methods) and its backend announces
    CAP_KV_CACHE; other models and backends fall back to full recomputation."""
    return hasattr(model, "decode_forward") and CAP_KV_CACHE in model.backend.capabilities


class KVDecoder:
    """Decoding for batch B up to `max_len` positions (default: the model's T; at most what the model's position
    tables hold, `model.decode_max_len()`)."""

    def __init__(self, model: Model, B: int = 1, max_len: int | None = None, chunk: int = 64):
        if not has_kv_cache(model):
            raise ValueError(f"backend '{model.backend.name}' does not announce {CAP_KV_CACHE!r}")
        cfg, k = model.cfg, model.backend
        self.model, self.backend, self.cfg, self.B = model, k, cfg, B
        self.max_len = min(max_len or model.T, model.decode_max_len())
        self.chunk = max(1, min(chunk, self.max_len))
        self.plan = model.decode_plan(B, self.chunk, k.dtype)  # name -> (shape, dtype); (B, chunk, ...)
        self.bufs = {n: k.alloc(shape, d, tag="kv_decode") for n, (shape, d) in self.plan.items()}
        _, nkv, hd = model.decode_heads()
        L, dt = cfg.n_layer, k.dtype
        cache_shape = (B, nkv, self.max_len, hd)
        step = int(np.prod(cache_shape))
        self.k_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.v_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.k_cache = [k.view(self.k_all, l * step, cache_shape) for l in range(L)]
        self.v_cache = [k.view(self.v_all, l * step, cache_shape) for l in range(L)]
        self.pos = 0

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
        Tn = tokens.shape[1]
        v = {name: self._v(name, Tn) for name in self.plan}
        self.backend.upload(v["inputs"], tokens)
        self.model.decode_forward(v, self.pos, self.k_cache, self.v_cache)
        self.pos += Tn
        return Tn


def decoder_for(model: Model) -> KVDecoder:
    """The model's KV decoder (B=1, window model.T), planned on first use and kept on the model."""
    dec = getattr(model, "_kv_decoder", None)
    if dec is None:
        dec = KVDecoder(model, B=1, max_len=model.T)
        model._kv_decoder = dec
    return dec
