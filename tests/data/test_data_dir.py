"""--data DIR reads the directory's training shards only (llm.c's NAME_train_* naming), its val shards validate
unless --val-data says otherwise, and the run says which shards it picked; an unquoted glob the shell expanded
gets a hint to quote it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import has_split, resolve_shards, split_of, write_shard
from llmc_test_support import TINY, line_of, phrase_tokens, run


def test_a_directory_gives_one_split(tmp_path):
    toks = phrase_tokens(80)
    for name in ("x_val_000000.bin", "x_train_000001.bin", "x_train_000002.bin"):
        write_shard(tmp_path / name, toks)
    assert [split_of(p) for p in sorted(tmp_path.iterdir())] == ["train", "train", "val"]
    train = resolve_shards(tmp_path, split="train")
    assert [p.rsplit("/", 1)[1] for p in train] == ["x_train_000001.bin", "x_train_000002.bin"]
    assert [p.rsplit("/", 1)[1] for p in resolve_shards(tmp_path, split="val")] == ["x_val_000000.bin"]
    assert len(resolve_shards(tmp_path)) == 3  # no split asked: everything, as a glob would
    assert has_split(tmp_path, "val") and not has_split(tmp_path / "nope", "val")
    only = tmp_path / "only_val"
    only.mkdir()
    write_shard(only / "y_val_000000.bin", toks)
    with pytest.raises(DataError, match=r"no train shards \(llm.c names them NAME_train_NNNNNN.bin; the directory "
                                        r"holds y_val_000000.bin\)"):
        resolve_shards(only, split="train")


def test_train_on_a_directory_picks_train_and_validates_on_val(shards, tmp_path):
    log = tmp_path / "log.jsonl"
    r = run(*TINY, "--data", shards, "--steps", 2, "--val-every", 2, "--val-batches", 1, "--log", log)
    line = line_of(r.output, "data:")
    assert "train 1 shard(s), 4,800 tokens" in line and "tiny_train_000001.bin" in line, line
    assert "val 1 shard(s), 2,000 tokens" in line and "tiny_val_000000.bin" in line, line
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert any("val_loss" in r for r in recs), recs


def test_an_expanded_glob_is_told_to_quote_it(shards):
    r = run("train", "--backend", "cpu", "--data", shards / "tiny_train_000001.bin", shards / "tiny_val_000000.bin",
            ok=False)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "quote it" in line and "Got unexpected extra argument" in line, r.output


def test_eval_on_a_directory_reads_its_val_shards(shards, tmp_path):
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.models.gpt2 import init_parameters, preset
    cfg = preset("d2", n_embd=64)
    write_model(tmp_path / "m.bin", cfg, init_parameters(cfg, 0))
    r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--data", shards, "-b", "2", "-t", "32",
            "--json")
    assert np.isfinite(json.loads(r.output.strip().splitlines()[-1])["loss"])
