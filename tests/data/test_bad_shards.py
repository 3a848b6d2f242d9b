"""Shards that `llmc train` and `llmc eval` must refuse before the first step, in one line naming the shard: GPT-2
and Llama 3 shards mixed in one data set, a FIFO or a device where a shard belongs (reading one never ends), a
later val shard with ids past the model's vocabulary met only at a validation mid-run, a FIFO as the HellaSwag
file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llmc_test_support import TINY, fifo, phrase_tokens, run

from llmc_cli.data.loader import DataLoader, ValLoader
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import read_shard_header, write_shard


def one_line_error(r) -> str:
    line = r.output.strip().splitlines()[-1] if r.output.strip() else ""
    assert r.exit_code == 2 and line.startswith("error:") and "Traceback" not in r.output, r.output
    return line


def test_gpt2_and_llama3_shards_in_one_data_set_are_refused(tmp_path):
    toks = phrase_tokens(120)
    write_shard(tmp_path / "x_val_000000.bin", toks[:2000])
    write_shard(tmp_path / "x_train_000001.bin", toks)
    write_shard(tmp_path / "x_train_000002.bin", toks, "llama3")  # ids all < 50,257: no vocabulary check notices
    with pytest.raises(DataError, match=r"x_train_000002.bin is tokenized with llama3 but .*x_train_000001.bin with "
                                        r"gpt2; give shards of one tokenizer"):
        DataLoader(tmp_path, 2, 32)
    with pytest.raises(DataError, match="tokenized with llama3"):
        ValLoader(str(tmp_path / "*.bin"), 2, 32)
    r = run(*TINY, "--data", tmp_path, "--steps", 1, ok=False)
    assert "x_train_000002.bin is tokenized with llama3" in one_line_error(r)


def test_a_fifo_or_a_device_where_a_shard_belongs_is_refused_without_waiting(tmp_path):
    write_shard(tmp_path / "x_train_000001.bin", phrase_tokens(120))
    with fifo(tmp_path / "x_train_000002.bin") as f:
        with pytest.raises(DataError, match=r"x_train_000002.bin is a FIFO, expected a .bin file"):
            DataLoader(tmp_path, 2, 32)
        with pytest.raises(DataError, match="is a FIFO"):
            read_shard_header(f)
        r = run(*TINY, "--data", tmp_path, "--steps", 1, ok=False)
        assert "x_train_000002.bin is a FIFO" in one_line_error(r)
    with pytest.raises(DataError, match=r"data shard /dev/null is a device"):
        DataLoader([str(tmp_path / "x_train_000001.bin"), "/dev/null"], 2, 32)


def test_a_fifo_as_the_hellaswag_file_is_refused(tmp_path, shards):
    with fifo(tmp_path / "hellaswag_val.bin") as f:
        r = run(*TINY, "--data", shards, "--steps", 1, "--hellaswag", f, ok=False)
    assert "hellaswag_val.bin: is a FIFO, not an eval file" in one_line_error(r)


def _val_with_a_bad_later_shard(d: Path) -> None:
    toks = phrase_tokens(120)
    write_shard(d / "x_train_000001.bin", toks)
    write_shard(d / "x_val_000000.bin", toks[:2000])  # (2000 - 1) // 64 = 31 batches of 2x32
    bad = toks[:2000].astype(np.int64)
    bad[7] = 60000
    write_shard(d / "x_val_000001.bin", bad)


def test_val_shards_a_validation_reads_are_checked_up_front(tmp_path):
    _val_with_a_bad_later_shard(tmp_path)
    loader = ValLoader(tmp_path, 2, 32, vocab_size=50257)
    loader.check_vocab_of_batches(31)  # the first shard alone serves 31 batches
    with pytest.raises(DataError, match=r"x_val_000001.bin: token id 60000 at position 7"):
        loader.check_vocab_of_batches(32)
    with pytest.raises(DataError, match="token id 60000"):
        ValLoader(tmp_path, 2, 32, vocab_size=50257).check_vocab_of_batches(0)  # 0: every batch


def test_a_resumed_run_meets_a_bad_later_val_shard_before_its_first_step(tmp_path):
    """Resumed at step 2 with --val-every 5, the first validation is at step 5: the bad shard it reads is refused
    before step 3 is trained, and the run directory keeps step 2 as its latest."""
    d = tmp_path / "data"
    d.mkdir()
    _val_with_a_bad_later_shard(d)
    rd = tmp_path / "run"
    run(*TINY, "--data", d / "*train*.bin", "--steps", 2, "--out", rd)
    r = run(*TINY[:-4], "--data", d, "--steps", 6, "--out", rd, "--resume", "--val-every", 5, "--val-batches", 40,
            "--sample-every", 0, ok=False)
    line = one_line_error(r)
    assert "x_val_000001.bin: token id 60000" in line, line
    assert (rd / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in rd.glob("step_*")) == ["step_00000002"]
