"""Decoding speed over a key/value cache: tokens/s inside the window and past it, per backend.

A model of the chosen shape (seeded random weights: speed does not depend on them) decodes greedily: a prompt,
then one token at a time until the cache's S slots are full (inside the window), then as many again (past it,
where the cache slides or refills, inference.decode). Every token includes its host round trip (the logits
download and the argmax), as `llmc sample` pays it.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Sequence

import numpy as np

from llmc_cli.bench.backends import failure_line
from llmc_cli.inference.decode import KVDecoder, has_kv_cache
from llmc_cli.kernels import Backend
from llmc_cli.models.families import family_of
from llmc_cli.naming import arg, arg_both


def _greedy(dec: KVDecoder, logits: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    """n greedy tokens after `logits`; (the last logits, seconds)."""
    t0 = time.perf_counter()
    for _ in range(n):
        logits = dec.feed(np.argmax(logits, axis=-1).astype(np.int32)[:, None])
    dec.backend.synchronize()
    return logits, time.perf_counter() - t0


def time_decode(label: str, backend: Backend, cfg, B: int, S: int, *, prompt_len: int, tokens: int | None,
                warmup: int, seed: int, params: np.ndarray) -> dict:
    """One backend's record: prefill and per-phase tokens/s (tokens = new tokens per sequence, times B)."""
    fam = family_of(cfg)
    model = fam.model_class(cfg, backend, B, S, training=False)
    if not has_kv_cache(model):
        return {"backend": label, "skipped": f"backend '{backend.name}' has no KV cache"}
    model.load_parameters(params)
    dec = KVDecoder(model, B, max_len=S)
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, prompt_len)).astype(np.int32)
    logits = dec.feed(prompt)
    _greedy(dec, logits, warmup)  # kernels compiled and plans made before anything is timed
    dec.reset()
    t0 = time.perf_counter()
    logits = dec.feed(prompt)
    backend.synchronize()
    prefill = time.perf_counter() - t0
    inside = S - prompt_len if tokens is None else min(tokens, S - prompt_len)
    logits, t_in = _greedy(dec, logits, inside)
    if dec.pos < S:  # the rest of the window, untimed and chunked, so that the next token is past it
        rest = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, (B, S - dec.pos)).astype(np.int32)
        logits = dec.feed(rest)
    past = S if tokens is None else tokens
    logits, t_past = _greedy(dec, logits, past)
    rec = {"backend": label, "device": backend.describe(), "dtype": backend.dtype,
           "prefill_tokens": prompt_len, "prefill_s": prefill,
           "window_tokens": inside, "window_tok_s": B * inside / t_in if inside else None,
           "past_tokens": past, "past_tok_s": B * past / t_past, "refills": dec.refills,
           "slides": dec.slides}
    rec["past_over_window"] = rec["past_tok_s"] / rec["window_tok_s"] if rec["window_tok_s"] else None
    del dec, model
    return rec


def run_decode(backends: Sequence[tuple[str, Backend]], cfg, B: int, S: int, *, prompt_len: int = 16,
               tokens: int | None = None, warmup: int = 3, seed: int = 1337,
               progress: Callable[[str], None] | None = None) -> dict:
    """Every backend decodes the same model from the same prompt: {"config", "results"}. A backend that raises
    gets a result {"backend", "failed": one line} and the others still run."""
    if S < 2:  # (no prompt length fits a window of one: the window is what is wrong)
        raise ValueError(f"{arg_both('S', S, cli='seq_len')}: the window must hold the prompt and at least one new "
                         "token (2 or more)")
    if not 1 <= prompt_len < S:
        raise ValueError(f"{arg('prompt_len', prompt_len)} must be at least 1 and shorter than the window ({S})")
    params = family_of(cfg).init_parameters(cfg, seed)
    results = []
    for label, be in backends:
        if progress:
            progress(f"decoding on {label}")
        try:
            results.append(time_decode(label, be, cfg, B, S, prompt_len=prompt_len, tokens=tokens, warmup=warmup,
                                       seed=seed, params=params))
        except Exception as e:  # noqa: BLE001  (e.g. kv_cache announced without attention_decode: its row says so)
            results.append({"backend": label, "failed": failure_line(e)})
            gc.collect()
    config = {"model": type(cfg).__name__, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
              "vocab_size": cfg.vocab_size, "B": B, "window": S, "prompt_len": prompt_len, "warmup": warmup}
    return {"config": config, "results": results}
