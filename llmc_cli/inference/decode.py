"""Incremental decoding over a key/value cache (backends announcing CAP_KV_CACHE), for any model family whose
model offers the decode methods (GPT-2, Llama 3).

A decoder shares a model's parameters and runs the model's own layer loop (`_layers`, the one its forward runs),
but only for the new tokens and on scratch buffers planned once for (B, chunk): their q, k, v come from the usual
matmul, `attention_decode` writes k and v into per-layer caches (one per key/value head: grouped-query attention
caches NKV heads, not NH) and attends over what is cached. A prompt goes in as chunks of up to `chunk` tokens,
each following token as a chunk of one. Where the backend can capture graphs (CAP_GRAPHS) the one-token step is
recorded once and replayed: the model stages what the position changes (`decode_inputs`) and the position itself
goes in through a device buffer, so the step's launches cost one call. Where the backend can also draw the next
token itself (CAP_SAMPLING), `draw` samples it from the logits where they are, so a token's round trip to the
host is 8 bytes, not the vocabulary's logits and a pass over them in numpy.

The caches are rings of S slots (position p in slot p % S), and what happens once a sequence outgrows them
depends on how the model encodes positions (`model.decode_slides()`):
* relative positions (Llama's rotary embeddings): the window slides. Each new token overwrites the oldest slot
  and attends to the last S positions; nothing is recomputed, so a token costs the same past the window as in it.
* learned absolute positions (GPT-2's wpe has rows 0..block_size-1 only): keys computed at positions S.. cannot
  exist, so when the cache is full its newest S/2 tokens are fed again from position 0 (one chunked prefill per
  S/2 new tokens) and decoding goes on: the context holds between S/2 and S tokens.
"""

from __future__ import annotations

import numpy as np

from llmc_cli.kernels import CAP_GRAPHS, CAP_KV_CACHE, CAP_SAMPLING, INT32
from llmc_cli.models.base import Model, backend_capabilities, unimplemented_kernel


def check_token_ids(ids, vocab_size: int, what: str = "the prompt") -> np.ndarray:
    """`ids` as int32 when every one is an integer id of the model's vocabulary (0..vocab_size-1), else a ValueError
    of one line: an id outside it would read another row, or memory past the embedding table, without a sign."""
    a = np.asarray(ids)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{what} holds {a.dtype} values, expected integer token ids 0..{vocab_size - 1}")
    if a.size and not (0 <= a.min() and a.max() < vocab_size):
        bad = a.min() if a.min() < 0 else a.max()
        raise ValueError(f"{what} has token id {bad}, outside the model's vocabulary 0..{vocab_size - 1}")
    return a.astype(np.int32)


def has_kv_cache(model: Model) -> bool:
    """True when `model` can decode incrementally (it has the decode methods) and its backend announces
    CAP_KV_CACHE; other models and backends fall back to full recomputation."""
    return hasattr(model, "decode_forward") and CAP_KV_CACHE in backend_capabilities(model.backend)


def samples_on_device(model: Model) -> bool:
    """True when the model's backend draws tokens itself (CAP_SAMPLING, Backend.sample_token)."""
    return CAP_SAMPLING in backend_capabilities(model.backend)


class KVDecoder:
    """Decoding for batch B over a cache of `max_len` slots (default: the model's T), at most the model's maximum
    length (`model.decode_max_len()`, its block size)."""

    def __init__(self, model: Model, B: int = 1, max_len: int | None = None, chunk: int = 64):
        if not has_kv_cache(model):
            raise ValueError(f"backend '{model.backend.name}' does not announce {CAP_KV_CACHE!r}")
        cfg, k = model.cfg, model.backend
        limit = model.decode_max_len()
        S = model.T if max_len is None else max_len
        for name, v in (("B", B), ("max_len", S), ("chunk", chunk)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"KVDecoder: {name} must be an integer >= 1 (got {v!r})")
        B, S, chunk = int(B), int(S), int(chunk)
        if not 1 <= S <= limit:
            raise ValueError(f"a key/value cache of {S} positions: the model takes 1..{limit} (its block size)")
        if B < 1 or chunk < 1:
            raise ValueError(f"KVDecoder needs B >= 1 and chunk >= 1, got B={B}, chunk={chunk}")
        self.model, self.backend, self.cfg, self.B = model, k, cfg, B
        self.max_len, self.slides = S, model.decode_slides()
        self.chunk = min(chunk, S)
        self.plan = model.decode_plan(B, self.chunk, k.dtype)  # name -> (shape, dtype); (B, chunk, ...)
        self.bufs = {n: k.alloc(shape, d, tag="kv_decode") for n, (shape, d) in self.plan.items()}
        _, nkv, hd = model.decode_heads()
        L, dt = cfg.n_layer, k.dtype
        cache_shape = (B, nkv, S, hd)
        step = int(np.prod(cache_shape))
        self.k_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.v_all = k.alloc((L,) + cache_shape, dt, tag="kv_cache")
        self.k_cache = [k.view(self.k_all, l * step, cache_shape) for l in range(L)]
        self.v_cache = [k.view(self.v_all, l * step, cache_shape) for l in range(L)]
        self._views: dict[int, dict] = {}  # Tn -> the planned buffers' (B, Tn, ...) views
        self.graphs = CAP_GRAPHS in backend_capabilities(k)
        self.pos_buf = k.alloc((1,), INT32, tag="kv_decode") if self.graphs else None
        self._step, self._warm = None, False  # the captured one-token step, once a first one ran uncaptured
        self._drawn = None  # draw's [id, bad] on the device (Backend.sample_token), made on first use
        self.reset()

    def reset(self) -> None:
        """Forget the cached positions (the caches themselves need no clearing: no slot is read before written)."""
        self.pos = 0  # the position of the next token
        self.history = np.zeros((self.B, 0), dtype=np.int32)  # the cached tokens, oldest first (at most S)
        self.refills = 0  # times a full cache of an absolute-position model was refilled from its newest half

    def _v(self, name: str, Tn: int):
        """A (B, Tn, ...) view of the front of a planned buffer."""
        shape, _ = self.plan[name]
        new = (shape[0], Tn) + shape[2:]
        return self.backend.view(self.bufs[name], 0, new)

    def feed(self, tokens: np.ndarray) -> np.ndarray:
        """Appends tokens (B, n) (any n >= 1) and returns float32 logits (B, V) after the last. A first feed longer
        than the cache keeps its newest S tokens. A kernel the backend announces but lacks (NotImplementedError from
        attention_decode or capture) is a ValueError of one line naming the backend and the kernel."""
        try:
            return self._feed(tokens)
        except NotImplementedError as e:
            raise ValueError(unimplemented_kernel(self.backend, e)) from None

    def draw(self, tokens: np.ndarray, u: float, temperature: float, vocab_limit: int) -> tuple[int, int]:
        """Appends tokens (n,) or (1, n) like feed (B=1) and draws the next token on the device from the last
        position's logits (Backend.sample_token: choose_token's rule without top-k or top-p, over the ids below
        vocab_limit, `u` the uniform draw): (id, bad), bad > 0 counting logits that are NaN or infinite."""
        if self.B != 1:
            raise ValueError(f"KVDecoder.draw samples one sequence (B=1); this decoder is planned for B={self.B}")
        try:
            Tn = self._run(tokens)
            k = self.backend
            if self._drawn is None:
                self._drawn = k.alloc((2,), INT32, tag="kv_decode")
            Vp = self.plan["logits"][0][-1]
            k.sample_token(self._drawn, k.view(self.bufs["logits"], (Tn - 1) * Vp, (Vp,)), u, temperature,
                           vocab_limit)
            tok, bad = k.download(self._drawn)
        except NotImplementedError as e:
            raise ValueError(unimplemented_kernel(self.backend, e)) from None
        return int(tok), int(bad)

    def _feed(self, tokens: np.ndarray) -> np.ndarray:
        Tn = self._run(tokens)
        logits = self.backend.download(self._v("logits", Tn))
        return logits[:, Tn - 1, :self.cfg.vocab_size].astype(np.float32)

    def _run(self, tokens: np.ndarray) -> int:
        """The forward passes that append `tokens` to the cache; the last chunk's length (its logits' rows)."""
        tokens = check_token_ids(tokens, self.cfg.vocab_size, "the tokens fed")
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        if tokens.ndim != 2 or tokens.shape[0] != self.B or tokens.shape[1] < 1:
            raise ValueError(f"feed expects tokens (B={self.B}, n>=1), got {tokens.shape}")
        S = self.max_len
        if self.pos == 0 and tokens.shape[1] > S:
            tokens = tokens[:, -S:]
        pending = tokens
        while pending.shape[1]:
            if self.slides:  # chunks up to the end of the ring, one token at a time after it (the ring wraps)
                take = min(self.chunk, S - self.pos) if self.pos < S else 1
            else:
                if self.pos == S:  # full: start again from the newest half
                    keep = self.history[:, -(S // 2):] if S > 1 else self.history[:, :0]
                    self.pos, self.history = 0, self.history[:, :0]
                    self.refills += 1
                    pending = np.concatenate([keep, pending], axis=1)
                take = min(self.chunk, S - self.pos)
            Tn = self._forward(pending[:, :take])
            self.history = np.concatenate([self.history, pending[:, :take]], axis=1)[:, -S:]
            pending = pending[:, take:]
        return Tn

    def _forward(self, tokens: np.ndarray) -> int:
        Tn, k, model = tokens.shape[1], self.backend, self.model
        v = self._views.get(Tn)
        if v is None:
            v = self._views[Tn] = {name: self._v(name, Tn) for name in self.plan}
        k.upload(v["inputs"], tokens)
        model.decode_inputs(v, self.pos)
        if self.graphs and Tn == 1:
            k.upload(self.pos_buf, np.array([self.pos], dtype=np.int32))
            if self._step is None:
                def step():
                    model.decode_forward(v, self.pos_buf, self.k_cache, self.v_cache)
                if self._warm:
                    self._step = k.capture(step)
                else:  # the first run allocates and compiles what the step needs, which a capture must not
                    step()
                    self._warm = True
            if self._step is not None:
                self._step()
        else:
            model.decode_forward(v, self.pos, self.k_cache, self.v_cache)
        self.pos += Tn
        return Tn


def decoder_for(model: Model) -> KVDecoder:
    """The model's KV decoder (B=1, a cache of model.T positions), planned on first use and kept on the model."""
    dec = getattr(model, "_kv_decoder", None)
    if dec is None:
        dec = KVDecoder(model, B=1, max_len=model.T)
        model._kv_decoder = dec
    return dec
