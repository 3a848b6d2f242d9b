"""Fixtures for llmc's own tests. The backend fixtures and hooks are the conformance kit's (`llmc_cli.testing`),
so llmc's tests and a third-party backend's run the same code: `backend` is parametrised over every installed
backend, and one that is installed but cannot run here is a skip with its reason. Helpers are in
llmc_test_support.py (``from llmc_test_support import run, to_device, ...``)."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("llmc_cli.testing", "llmc_test_support")

from llmc_cli.testing.plugin import *  # noqa: E402,F401,F403  (fixtures and hooks)
from llmc_test_support import phrase_tokens  # noqa: E402


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder with tiny_val_000000.bin (2,000 tokens) and tiny_train_000001.bin (4,800 tokens)."""
    from llmc_cli.formats.shards import write_shard
    d = tmp_path_factory.mktemp("data")
    tokens = phrase_tokens(120)
    write_shard(d / "tiny_val_000000.bin", tokens[:2000])
    write_shard(d / "tiny_train_000001.bin", tokens)
    return d


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny GPT-2 (1 layer, C=16, T=32, GPT-2's vocabulary) as an llm.c model file."""
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.models.gpt2 import GPT2Config, init_parameters
    cfg = GPT2Config(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    path = tmp_path_factory.mktemp("model") / "m.bin"
    write_model(path, cfg, init_parameters(cfg, 0))
    return path
