"""`llmc train --out RUN --resume` alone continues the run as recorded (nanoGPT's init_from='resume'): every
option not given takes the value in the newest checkpoint's state.json, the continuation is bit-identical to an
uninterrupted run, and options given explicitly must still agree with the run."""

from __future__ import annotations

from llmc_test_support import TINY, line_of, losses, run


def test_resume_needs_only_the_run_directory(shards, tmp_path):
    args = [*TINY, "--data", shards / "*train*.bin", "--lr", "1e-3", "--warmup", "2", "--seed", "7"]
    run(*args, "--steps", 4, "--log", tmp_path / "straight.jsonl")
    rd = tmp_path / "run"
    run(*args, "--steps", 2, "--out", rd, "--checkpoint-every", 1)
    r = run("train", "--out", rd, "--resume", "--steps", 4)
    taken = line_of(r.output, "options from")
    for flag in ("--model d2", "--n-embd 64", "--lr 0.001", "--warmup 2", "--seed 7", "--data"):
        assert flag in taken, taken
    assert "resumed from" in r.output
    assert losses(rd / "log.jsonl") == losses(tmp_path / "straight.jsonl")


def test_options_given_on_resume_must_agree(shards, tmp_path):
    rd = tmp_path / "run"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", rd)
    r = run("train", "--out", rd, "--resume", "--steps", 2, "-b", "4", ok=False)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "--batch-size is 4 but the run" in line, r.output


def test_resume_of_a_directory_without_checkpoints_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run("train", "--out", tmp_path / "empty", "--resume", ok=False)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error:"), r.output
