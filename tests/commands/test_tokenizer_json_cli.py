"""A Hugging Face Llama directory that ships tokenizer.json alone (as the hub does): `llmc convert` to a directory
or a run and `llmc train --init` copy its tokenizer as tokenizer.model in Meta's tiktoken format (a copy of the
JSON under that name was unreadable to every later command), and a tokenizer.json llmc cannot read as Llama 3's is
one line naming it, before anything is written."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.data.tokenizer import gpt2_ranks, llama3_ranks
from llmc_cli.formats.hf_llama3 import export_hf
from llmc_cli.formats.shards import write_shard
from llmc_cli.models import llama3


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(good HF dir, the same with a tokenizer.json of another split pattern, the tiktoken ranks file)."""
    d = tmp_path_factory.mktemp("tokjson_cli")
    ranks = {t: r for t, r in gpt2_ranks().items() if r < 1000}
    toy = d / "toy.model"
    toy.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    cfg = llama3.Llama3Config(block_size=32, vocab_size=128256, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                              multiple_of=16, ffn_dim_multiplier=None, rope_scaling=None, tie_embeddings=True)
    export_hf(d / "good", cfg, llama3.init_parameters(cfg, 0), tokenizer="llama3", tokenizer_file=toy)
    (d / "good" / "tokenizer.model").unlink()
    export_hf(d / "bad", cfg, llama3.init_parameters(cfg, 0), tokenizer="llama3", tokenizer_file=toy)
    (d / "bad" / "tokenizer.model").unlink()
    j = json.loads((d / "bad" / "tokenizer.json").read_text())
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (d / "bad" / "tokenizer.json").write_text(json.dumps(j))
    write_shard(d / "l3" / "l3_train_000001.bin", np.arange(2000) % 1000, tokenizer="llama3")
    return d / "good", d / "bad", toy


def test_convert_and_init_copy_tokenizer_json_as_tiktoken_ranks(hf, tmp_path):
    good, _, toy = hf
    sample = ["sample", "--backend", "cpu", "--prompt", "ROMEO:", "--max-new-tokens", 2, "--checkpoint"]
    run("convert", good, tmp_path / "hf2")
    run("convert", good, tmp_path / "run", "--to", "run")
    run("train", "--backend", "cpu", "--init", good, "-b", 2, "-t", 16, "--steps", 1, "--sample-every", 0,
        "--val-every", 0, "--data", good.parent / "l3" / "*train*.bin", "--out", tmp_path / "trained")
    for out in ("hf2", "run", "trained"):
        assert (tmp_path / out / "tokenizer.model").read_bytes() == toy.read_bytes(), out
        assert llama3_ranks(tmp_path / out / "tokenizer.model") == llama3_ranks(toy)
        assert run(*sample, tmp_path / out).stdout.startswith("ROMEO:")


def test_unreadable_tokenizer_json_is_one_line_and_writes_nothing(hf, tmp_path):
    _, bad, _ = hf
    before = {p: p.read_bytes() for p in bad.iterdir()}
    tj = bad / "tokenizer.json"
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", bad, "--max-new-tokens", 2, ok=False),
                   f"--checkpoint: {tj}: pre_tokenizer splits with", "expected Llama 3's split pattern")
    for dst in (["hf2"], ["run", "--to", "run"]):
        one_line_error(run("convert", bad, tmp_path / dst[0], *dst[1:], ok=False), f"SRC: {tj}: pre_tokenizer")
    one_line_error(run("train", "--backend", "cpu", "--init", bad, "-b", 2, "-t", 16, "--steps", 1,
                       "--sample-every", 0, "--val-every", 0, "--data", bad.parent / "l3" / "*train*.bin",
                       "--out", tmp_path / "trained", ok=False), f"--init: {tj}: pre_tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert {p: p.read_bytes() for p in bad.iterdir()} == before
