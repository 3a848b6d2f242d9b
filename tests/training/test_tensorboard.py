"""--tensorboard DIR: TensorBoard event files beside log.jsonl, written by hand (no TensorFlow), read back here by
tensorboard's own reader with the same scalars as the log."""

from __future__ import annotations

import pytest

from llmc_test_support import TINY, losses, run

tb = pytest.importorskip("tensorboard", reason="the reader the event files are checked with: pip install tensorboard")


def test_event_files_hold_what_the_log_holds(shards, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmc_cli.formats.tensorboard import crc32c
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    log, tbdir = tmp_path / "log.jsonl", tmp_path / "tb"
    run(*TINY, "--data", shards / "*train*.bin", "--val-data", shards / "*val*.bin", "--steps", 3, "--val-every", 3,
        "--val-batches", 1, "--log", log, "--tensorboard", tbdir)
    files = list(tbdir.glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tbdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "val/loss"} <= tags, tags
    got = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert got == pytest.approx(losses(log), rel=1e-6)  # float32 in the event, float64 in the log


def test_tensorboard_dir_that_is_a_file_is_one_line(shards, tmp_path):
    (tmp_path / "f").write_text("mine")
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--tensorboard", tmp_path / "f", ok=False)
    assert r.exit_code == 2 and "--tensorboard" in r.output.strip().splitlines()[-1], r.output
    assert (tmp_path / "f").read_text() == "mine"
