"""generate() on one model from several callers: the model's buffers and key/value cache hold one sequence, so a
second caller must not write them under the first (corrupted tokens, without a sign): it is refused with a
ValueError of one line, or the first, resumed after the second began, is."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_eval_sample import small_model

from llmc_cli.inference.decode import decoder_for
from llmc_cli.inference.sampling import generate


def test_generate_from_another_thread_while_one_computes_is_refused(cpu):
    m = small_model(cpu, 32)
    want = list(generate(m, [1, 2], 6, np.random.default_rng(0)))
    dec = decoder_for(m)
    inside, release = threading.Event(), threading.Event()
    feed = dec.feed

    def slow_feed(tokens):  # the first thread's step, held half-way until the second has tried
        inside.set()
        release.wait(30)
        return feed(tokens)
    dec.feed = slow_feed
    got = []
    first = threading.Thread(target=lambda: got.extend(generate(m, [1, 2], 6, np.random.default_rng(0))))
    first.start()
    try:
        assert inside.wait(30)
        for kv in (None, False):
            with pytest.raises(ValueError, match="another thread is running generate") as e:
                next(generate(m, [3, 4], 6, np.random.default_rng(1), kv_cache=kv))
            assert "\n" not in str(e.value)
    finally:
        release.set()
        first.join(30)
        del dec.feed
    assert got == want  # the first caller's tokens, untouched by the refused one


def test_a_generator_resumed_after_another_began_on_the_model_is_refused(cpu):
    m = small_model(cpu, 32)
    a = generate(m, [1, 2], 6, np.random.default_rng(0))
    next(a)
    b = threading.Thread(target=lambda: list(generate(m, [5], 6, np.random.default_rng(1))))
    b.start()
    b.join(30)
    with pytest.raises(ValueError, match="another generate\\(\\) on this model began since this one did"):
        next(a)
