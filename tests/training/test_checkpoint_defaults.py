"""Checkpoints without asking: by time (--checkpoint-minutes, default 30) as well as by steps, and a bounded
--keep (default 3) that never deletes the newest complete step."""

from __future__ import annotations

from llmc_cli.registry import create_backend
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer
from llmc_test_support import TINY, run


def _steps(rd):
    return sorted(p.name for p in rd.glob("step_*"))


def test_time_based_checkpoints_and_keep(shards, tmp_path):
    rd = tmp_path / "run"
    a = TrainArgs(data=str(shards / "*train*.bin"), model="d2", n_embd=64, batch_size=2, seq_len=32, steps=4,
                  val_every=0, sample_every=0, out=str(rd), checkpoint_minutes=1e-9, keep=2)
    t = Trainer(a, create_backend("cpu"), say=lambda s: None)
    try:
        t.run()
    finally:
        t.close()
    assert _steps(rd) == ["step_00000003", "step_00000004"]
    assert (rd / "latest").read_text().strip() == "step_00000004"


def test_the_defaults_keep_three_and_checkpoint_by_time():
    a = TrainArgs(data="x")
    assert a.keep == 3 and a.checkpoint_minutes == 30.0 and a.checkpoint_every == 0


def test_keep_default_on_the_command_line(shards, tmp_path):
    rd = tmp_path / "run"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 5, "--checkpoint-every", 1, "--out", rd)
    assert _steps(rd) == ["step_00000003", "step_00000004", "step_00000005"]
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--checkpoint-minutes", "nan", "--out",
            tmp_path / "r2", ok=False)
    assert r.exit_code == 2 and "--checkpoint-minutes" in r.output, r.output
