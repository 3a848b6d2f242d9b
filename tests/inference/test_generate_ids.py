"""`generate` (and a KVDecoder's `feed`) take token ids of the model's vocabulary only: a negative id, one past the
vocabulary (GPT-2's padded rows included) or a non-integer was embedded without a sign (another row, or memory
past the table on a device) and sampled from; now a one-line ValueError. So is a negative max_new_tokens."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.inference.decode import KVDecoder, has_kv_cache
from llmc_cli.inference.sampling import generate
from llmc_cli.models import gpt2, llama3

CFGS = {
    "gpt2": gpt2.GPT2Config(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=16),  # padded to 128
    "llama3": llama3.Llama3Config(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                                  multiple_of=16, ffn_dim_multiplier=None, rope_scaling=None),
}


@pytest.mark.parametrize("family", sorted(CFGS))
@pytest.mark.parametrize("prompt, expect", [
    ([3, -1], "the prompt has token id -1, outside the model's vocabulary 0..99"),
    ([100], "the prompt has token id 100, outside the model's vocabulary 0..99"),
    ([2**40], "has token id 1099511627776, outside"),
    ([1.5], "the prompt holds float64 values, expected integer token ids 0..99"),
])
def test_generate_refuses_ids_outside_the_vocabulary(backend, family, prompt, expect):
    mod = gpt2 if family == "gpt2" else llama3
    cfg = CFGS[family]
    model = (mod.GPT2 if family == "gpt2" else mod.Llama3)(cfg, backend, 1, 16, training=False)
    model.load_parameters(mod.init_parameters(cfg, 0))
    for kv in (False, True) if has_kv_cache(model) else (False,):
        with pytest.raises(ValueError) as e:
            list(generate(model, prompt, 3, np.random.default_rng(0), kv_cache=kv))
        assert str(e.value) == expect or expect in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="max_new_tokens is -1, expected 0 or more"):
        list(generate(model, [1], -1, np.random.default_rng(0)))
    assert len(list(generate(model, [1, 99], 40, np.random.default_rng(0)))) <= 40  # past the window: fine
    if has_kv_cache(model):
        dec = KVDecoder(model, B=1)
        with pytest.raises(ValueError, match="^the tokens fed (has|holds) "):
            dec.feed(np.asarray(prompt))
