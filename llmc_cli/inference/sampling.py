"""Autoregressive sampling: temperature, top-k and top-p over the model's last-position logits."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from numbers import Integral, Real
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from llmc_cli.inference import decode
from llmc_cli.inference.stops import StopText
from llmc_cli.models.base import Model, unimplemented_kernel


MIN_TEMPERATURE = 1e-6  # below it (but above 0) the logits' quotient overflows to inf and every draw is token 0


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or infinity (weights or activations that overflow): no token can be drawn from
    them (a NaN compares false with everything, so every draw or argmax was token 0, printed as if sampled)."""


def check_sampling(temperature: float, top_k: int, top_p: float) -> tuple[float, int, float]:
    """A ValueError of one line for settings that would sample garbage without a sign: a NaN temperature drew
    token 0 every time, a negative one was greedy, a top_p of NaN or <= 0 and a negative top_k were ignored.
    Returns them as float, int, float (a Fraction temperature divided the logits into an array of objects)."""
    if isinstance(temperature, (bool, np.bool_)) or not (  # (True is no temperature: bools are not numbers)
            isinstance(temperature, Real) and math.isfinite(temperature)
            and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} "
                         f"(got {temperature!r})")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, Integral) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = all; got {top_k!r})")
    if isinstance(top_p, (bool, np.bool_)) or not (isinstance(top_p, Real) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off; got {top_p!r})")
    return float(temperature), int(top_k), float(top_p)


def check_penalty(repetition_penalty) -> float:
    """The repetition penalty as a float, else a ValueError of one line: 0 would divide by zero, a negative one
    would turn the logits' signs and NaN would make every logit of the context NaN."""
    p = repetition_penalty
    if isinstance(p, (bool, np.bool_)) or not (isinstance(p, Real) and math.isfinite(p) and p > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off; got {p!r})")
    return float(p)


def penalize(logits: np.ndarray, context, penalty: float) -> np.ndarray:
    """The logits with CTRL's repetition penalty (Keskar et al. 2019, transformers' RepetitionPenaltyLogitsProcessor):
    the logit of every id in `context` divided by `penalty` where it is positive, multiplied where it is not, so a
    penalty > 1 makes each such id less likely whatever its sign. Ids past the logits (a vocabulary limit) are
    skipped; a penalty of 1 returns the logits themselves."""
    if penalty == 1.0:
        return logits
    ids = np.unique(np.asarray(context, dtype=np.int64))
    ids = ids[ids < logits.size]
    out = np.array(logits, dtype=np.float64)
    x = out[ids]
    out[ids] = np.where(x > 0, x / penalty, x * penalty)
    return out


class Sampling(NamedTuple):
    """How a token is drawn from the logits, each setting checked (check_sampling, check_penalty)."""
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float

    def choose(self, logits: np.ndarray, context, rng: np.random.Generator) -> int:
        """The next token after `context` (the ids the penalty applies to)."""
        return choose_token(penalize(logits, context, self.repetition_penalty), rng, self.temperature, self.top_k,
                            self.top_p)

    def drawn_on_device(self, limit: int) -> bool:
        """True when the rule is the one Backend.sample_token applies: no top-k, top-p or repetition penalty."""
        return not 0 < self.top_k < limit and self.top_p == 1.0 and self.repetition_penalty == 1.0


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_generate(model: Model, prompt, max_new_tokens, rng, stop_token, kv_cache, vocab_limit) -> np.ndarray:
    """generate's arguments, each checked (a ValueError of one line naming it): returns the prompt's ids."""
    if not isinstance(model, Model):
        raise ValueError(f"generate: model must be a model from llmc.load_model (got {model!r:.80})")
    if model.B != 1:
        raise ValueError("generate needs a model planned for B=1")
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"the prompt must be a list of token ids (encode text with the model's tokenizer first; "
                         f"got {prompt!r:.40})")
    try:
        ids = np.asarray(prompt)
    except (ValueError, TypeError):  # (lists of different lengths)
        raise ValueError(f"the prompt must be one sequence of token ids, a list or a 1-D array (got "
                         f"{prompt!r:.80})") from None
    if ids.ndim != 1:
        raise ValueError(f"the prompt must be one sequence of token ids, a list or a 1-D array (got an array of "
                         f"shape {ids.shape})")
    if ids.size == 0:
        raise ValueError("the prompt must hold at least one token")
    if not _is_int(max_new_tokens):
        raise ValueError(f"max_new_tokens must be an integer >= 0 (got {max_new_tokens!r})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens is {max_new_tokens}, expected 0 or more")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator, e.g. np.random.default_rng(0) (got {rng!r:.80})")
    V = model.cfg.vocab_size
    if vocab_limit is not None and not (_is_int(vocab_limit) and 1 <= vocab_limit <= V):
        raise ValueError(f"vocab_limit must be None (the model's whole vocabulary) or an integer in 1..{V} "
                         f"(got {vocab_limit!r})")
    limit = V if vocab_limit is None else int(vocab_limit)
    if stop_token is not None and not (_is_int(stop_token) and 0 <= stop_token < limit):
        raise ValueError(f"stop_token must be None or a token id 0..{limit - 1} that can be generated (got "
                         f"{stop_token!r}); it would never be matched")
    if kv_cache is not None and not isinstance(kv_cache, (bool, np.bool_)):
        raise ValueError(f"kv_cache must be None (whenever the backend can), True or False (got {kv_cache!r})")
    return decode.check_token_ids(ids, V)


def choose_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """One token id from logits (V,): greedy at temperature 0, else softmax(logits / temperature) restricted
    to the top_k most likely (0 = all) and to the smallest set whose mass reaches top_p (ties: lower ids first).
    The draw is numpy's `rng.choice(V, p=probs)` done by hand (one uniform against the cumulative sums, the same
    tokens for the same seed) without its checks, and top-p sorts only the few most likely ids: at a 128k
    vocabulary both would otherwise cost more host time than a decoded token's GPU time."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"choose_token: logits must be one vector of the vocabulary's scores (got shape "
                         f"{logits.shape})")
    logits = logits.astype(np.float64)
    # NaN or +inf anywhere, or no finite logit at all (-inf alone is a masked token: a caller's ban, drawn never)
    if np.isnan(logits).any() or np.isposinf(logits).any() or np.isneginf(logits).all():
        raise non_finite(int(np.count_nonzero(np.isnan(logits) | np.isposinf(logits))) or logits.size, logits.size)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.size:
        kth = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


def non_finite(bad: int, size: int) -> NonFiniteLogits:
    """The error for logits of which `bad` (of `size`) are NaN or +inf (`size`: all are -inf)."""
    return NonFiniteLogits(f"the model's logits are not finite ({bad:,} of {size:,} are NaN or infinite): its "
                           "weights or activations overflow, so there is nothing to sample from")


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """probs kept on the smallest set, in descending order (ties: lower ids first), whose mass reaches top_p, and
    renormalised. Candidates: every id at least as likely as the k-th most likely, k growing until their running
    sum reaches top_p; its prefix is then exactly that of a stable sort of the whole vocabulary."""
    V, k = probs.size, 256
    while True:
        if k >= V:
            cand = np.arange(V)
        else:
            cand = np.flatnonzero(probs >= np.partition(probs, V - k)[V - k])
        order = cand[np.lexsort((cand, -probs[cand]))]
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or cand.size == V:
            break
        k = k * 16 if k * 128 < V else V  # a flat distribution: sorting everything at once is cheaper
    cut = int(np.searchsorted(cum, top_p)) + 1
    keep = np.zeros(V, dtype=bool)
    keep[order[:cut]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


_LOCKS_MADE = threading.Lock()  # (two threads' first calls on one model must not each make a lock of their own)


@contextmanager
def _one_caller(model: Model):
    """The model's computation for one caller at a time: generate() from another thread while one is mid-step
    would reset or overwrite the buffers and the cache under it (corrupted tokens, without a sign)."""
    with _LOCKS_MADE:
        lock = model.__dict__.get("_generate_lock")
        if lock is None:
            lock = model._generate_lock = threading.Lock()
    if not lock.acquire(blocking=False):
        raise ValueError("generate: another thread is running generate() on this model; call it from one thread at "
                         "a time, or load the model once per thread")
    try:
        yield
    finally:
        lock.release()


def _draw(dec, fed: np.ndarray, rng: np.random.Generator, temperature: float, limit: int) -> int:
    """The next token after `fed`, drawn on the device (decode.KVDecoder.draw) with the uniform choose_token would
    take from `rng`; logits it refuses leave `rng` as choose_token leaves it (nothing drawn)."""
    if temperature <= 0:
        tok, bad = dec.draw(fed, 0.0, 0.0, limit)
    else:
        state = rng.bit_generator.state
        tok, bad = dec.draw(fed, rng.random(), temperature, limit)
        if bad:
            rng.bit_generator.state = state
    if bad:
        raise non_finite(bad, limit)
    return tok


class _Cached:
    """Next tokens over the model's KV cache: the prompt computed once, then one position per token. The token is
    drawn on the device where `on_device` (the backend's sample_token), else by the host's rule."""

    def __init__(self, model: Model, rng: np.random.Generator, rule: Sampling, limit: int, on_device: bool):
        self.model, self.rng, self.rule, self.limit, self.on_device = model, rng, rule, limit, on_device

    def start(self, tokens: list[int]) -> None:
        with _one_caller(self.model):
            self.dec = decode.decoder_for(self.model)
            self.dec.reset()
            # the model's one cache now holds this generator's tokens; a second generate() on the model resets it,
            # and this one, resumed, went on from the other's context without a sign
            self.dec.owner = self.me = object()
            self._compute(np.asarray(tokens, dtype=np.int32))

    def feed(self, token: int) -> None:
        with _one_caller(self.model):
            if getattr(self.dec, "owner", None) is not self.me:
                raise ValueError("generate: another generate() on this model began since this one did (its cache "
                                 "is shared); run them in turn, or pass kv_cache=False")
            self._compute(np.asarray([token], dtype=np.int32))

    def _compute(self, fed: np.ndarray) -> None:
        if self.on_device:
            self.drawn = _draw(self.dec, fed, self.rng, self.rule.temperature, self.limit)
        else:
            self.logits = self.dec.feed(fed)[0]

    def next(self, tokens: list[int]) -> int:
        if self.on_device:
            return self.drawn
        return self.rule.choose(self.logits[:self.limit], tokens[-self.model.T:], self.rng)


class _Recomputed:
    """Next tokens by a forward pass over the whole window (left-aligned), dropping the oldest tokens past it."""

    def __init__(self, model: Model, rng: np.random.Generator, rule: Sampling, limit: int):
        self.model, self.rng, self.rule, self.limit = model, rng, rule, limit
        self.buf = np.zeros((1, model.T), dtype=np.int32)

    def start(self, tokens: list[int]) -> None:
        pass

    def feed(self, token: int) -> None:
        pass

    def next(self, tokens: list[int]) -> int:
        ctx = tokens[-self.model.T:]
        self.buf[0, :len(ctx)] = ctx
        self.buf[0, len(ctx):] = 0
        with _one_caller(self.model):
            self.model.forward(self.buf)
            logits = self.model.logits_host(len(ctx) - 1)[0]
        return self.rule.choose(logits[:self.limit], ctx, self.rng)


def _stop_text(stop, tokenizer) -> StopText | None:
    """generate's stop strings, watched over the tokenizer's bytes (None: there are none)."""
    if stop is None or (isinstance(stop, (list, tuple)) and not stop):
        return None
    if not callable(getattr(tokenizer, "decode_bytes", None)):
        raise ValueError(f"stop needs tokenizer=, the model's tokenizer (llmc.load_tokenizer), to read the text "
                         f"of the tokens (got tokenizer={tokenizer!r:.60})")
    return StopText(stop, tokenizer.decode_bytes)


def generate(model: Model, prompt: list[int], max_new_tokens: int, rng: np.random.Generator,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_token: int | None = None,
             kv_cache: bool | None = None, vocab_limit: int | None = None, repetition_penalty: float = 1.0,
             stop: str | Sequence[str] = (), tokenizer=None) -> Iterator[int]:
    """Yields new token ids one at a time from a model planned for B=1, T=window. With a KV cache (`kv_cache`
    None = whenever the backend announces CAP_KV_CACHE) the prompt is computed once and each new token costs one
    position; past the window the cache slides (rotary models) or refills from its newest half (learned absolute
    positions), see inference.decode. Without one the whole window is rerun per token (left-aligned), dropping
    the oldest tokens past it. Within the window both give the same logits, so the same tokens for the same rng.
    Where the backend draws tokens itself (CAP_SAMPLING) and neither top_k, top_p nor a repetition penalty changes
    the draw, the token is drawn where the logits are, by the same rule from the same uniform (the same tokens, but
    where the uniform lies within float64 rounding of a boundary). `vocab_limit` keeps ids below the tokenizer's
    size where the model's vocabulary is larger (rows no tokenizer id names). `repetition_penalty` (see penalize)
    applies to the ids in the window. Generation ends before `stop_token`, or after the token whose text
    (`tokenizer.decode_bytes`) completes one of the `stop` strings: that token is the last one yielded, as
    transformers' stop_strings keep it (inference.stops.StopText cuts the text there). One thread at a time per
    model: a call from another thread while one computes is a ValueError."""
    ids = check_generate(model, prompt, max_new_tokens, rng, stop_token, kv_cache, vocab_limit)
    rule = Sampling(*check_sampling(temperature, top_k, top_p), check_penalty(repetition_penalty))
    text = _stop_text(stop, tokenizer)
    if kv_cache is None:
        kv_cache = decode.has_kv_cache(model)
    limit = model.cfg.vocab_size if vocab_limit is None else int(vocab_limit)
    stop_id = None if stop_token is None else int(stop_token)
    if kv_cache:
        on_device = max_new_tokens > 0 and rule.drawn_on_device(limit) and decode.samples_on_device(model)
        source = _Cached(model, rng, rule, limit, on_device)
    else:
        source = _Recomputed(model, rng, rule, limit)
    tokens = [int(t) for t in ids]
    try:  # (a kernel a backend announces but lacks: one line naming it, see decode.KVDecoder.feed)
        source.start(tokens)
        for i in range(max_new_tokens):
            nxt = source.next(tokens)
            if nxt == stop_id:
                return
            tokens.append(nxt)
            yield nxt
            if text is not None:
                text.add(nxt)
                if text.stopped:
                    return
            if i + 1 < max_new_tokens:
                source.feed(nxt)
    except NotImplementedError as e:
        raise ValueError(unimplemented_kernel(model.backend, e)) from None
