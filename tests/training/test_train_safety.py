"""`llmc train` never trains on impossible options, never writes over a file it did not create, owns its run
directory alone, survives a full disk or a bad shard with its last completed step on disk, and tells a
scheduler how it ended (exit status)."""

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from llmc_test_support import TINY, losses, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.shards import write_shard
from llmc_cli.optim import AdamWConfig
from llmc_cli.registry import create_backend
from llmc_cli.formats.rundir import RunLock
from llmc_cli.training.args import TrainArgs, TrainError
from llmc_cli.training.trainer import Trainer


def tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def one_line_error(r, code=2, mid_run=False):
    """The error line of a command that failed before doing anything (the whole output), or mid-run (the
    last line, after the run's progress)."""
    out = r.output.strip()
    assert r.exit_code == code and "Traceback" not in out, out
    msg = out.splitlines()[-1] if mid_run else out
    assert msg.startswith("error:") and "\n" not in msg, out
    return msg


# ---- numbers are checked when the command line is parsed ------------------------------------------------------
BAD_OPTIONS = [
    (["--lr", "nan"], "--lr must be a finite number"), (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "-1e-3"], "--lr must be >= 0"), (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--beta1", "1"], "--beta1 must be in [0, 1)"), (["--beta2", "nan"], "--beta2 must be a finite number"),
    (["--beta2", "-0.5"], "--beta2 must be in [0, 1)"), (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--weight-decay", "-inf"], "--weight-decay must be a finite number"),
    (["--lr-decay-frac", "nan"], "--lr-decay-frac must be a finite number"),
    (["--lr-decay-frac", "1.5"], "--lr-decay-frac must be in [0, 1]"),
    (["--total-batch-size", "-256"], "--total-batch-size must be >= 1"),
    (["--total-batch-size", "0"], "--total-batch-size must be >= 1"), (["--n-layer", "0"], "--n-layer must be >= 1"),
    (["--n-embd", "0"], "--n-embd must be >= 1"), (["--n-head", "-2"], "--n-head must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"), (["-b", "0"], "--batch-size must be >= 1"),
    (["-t", "-5"], "--seq-len must be >= 1"), (["--seed", "-1"], "--seed must be in [0, 4294967295]"),
    (["--steps", "-1"], "--steps must be >= 0"), (["--steps", "1.5"], "--steps must be an integer"),
    (["--warmup", "x"], "--warmup must be an integer"), (["--skip-loss-z", "inf"], "--skip-loss-z must be a finite"),
    (["--skip-grad-z", "-1"], "--skip-grad-z must be >= 0"), (["--max-bad-steps", "-1"], "--max-bad-steps must be >= 0"),
    (["--val-batches", "-3"], "--val-batches must be >= 0"), (["--keep", "-1"], "--keep must be >= 0"),
    (["--gpus", "-2"], "--gpus must be >= 0"), (["--dtype", "fp64"], "--dtype: 'fp64' is not one of"),
    (["--n-embd", "65"], "--n-embd 65 is not a multiple of --n-head"),
]


@pytest.mark.parametrize("extra, expect", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_numbers_are_one_line_and_touch_nothing(extra, expect, shards, tmp_path):
    before = tree(tmp_path)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", tmp_path / "r", *extra, ok=False)
    assert expect in one_line_error(r)
    assert tree(tmp_path) == before  # no run directory, no log


def test_python_api_refuses_what_the_command_line_refuses(shards):
    base = dict(data=str(shards / "*train*.bin"), model="d2", n_embd=64, batch_size=2, seq_len=32, steps=1,
                val_every=0, sample_every=0)
    for kw, expect in ((dict(optim=AdamWConfig(lr=float("nan"))), "lr must be a finite number"),
                       (dict(optim=AdamWConfig(beta1=1.0)), "beta1 must be a finite number in [0, 1)"),
                       (dict(lr_decay_frac=float("inf")), "lr_decay_frac must be"),
                       (dict(total_batch_size=-256), "total_batch_size must be positive"),
                       (dict(n_layer=0), "n_layer must be a positive integer")):
        with pytest.raises((TrainError, ValueError), match=None) as e:
            Trainer(TrainArgs(**(base | kw)), create_backend("cpu"), say=lambda s: None)
        assert expect in str(e.value), (kw, str(e.value))


# ---- the log: appended to llmc logs only --------------------------------------------------------------------
def test_log_never_truncates_another_file(shards, tmp_path):
    victim = tmp_path / "victim.bin"
    write_shard(victim, np.arange(3000) % 50257)
    state = tmp_path / "notes.json"
    state.write_text('{\n "step": 3\n}\n')
    for target in (victim, state, tmp_path):
        before = tree(tmp_path)
        r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--log", target, ok=False)
        msg = one_line_error(r)
        assert f"--log {target}" in msg, msg
        assert tree(tmp_path) == before


def test_log_appends_to_an_llmc_log_and_is_strict_json(shards, tmp_path):
    log = tmp_path / "log.jsonl"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--log", log)
    first = log.read_text()
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--log", log)
    text = log.read_text()
    assert text.startswith(first) and len(text.splitlines()) == 4

    def no_constants(name):
        raise AssertionError(f"{name} in the log: not JSON")
    for line in text.splitlines():
        json.loads(line, parse_constant=no_constants)


def test_log_inside_a_checkpoint_is_refused(shards, tmp_path):
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", tmp_path / "r")
    state = tmp_path / "r" / "step_00000001" / "state.json"
    before = tree(tmp_path)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", tmp_path / "r", "--resume",
            "--log", state, ok=False)
    assert "inside the checkpoint" in one_line_error(r)
    assert tree(tmp_path) == before


# ---- one process per run directory ----------------------------------------------------------------------------
def test_second_process_on_a_run_directory_is_refused(shards, tmp_path):
    rd = tmp_path / "r"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", rd)
    before = tree(tmp_path)
    with RunLock(rd):  # another llmc holds it (flock conflicts across open files, even in one process)
        r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", rd, "--resume", ok=False)
        msg = one_line_error(r)
        assert f"--out {rd} is in use by another llmc process (pid {os.getpid()})" in msg, msg
    after = tree(tmp_path)
    assert after == before  # the lock file goes with its holder
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", rd, "--resume")
    assert not (rd / ".lock").exists()


def test_a_fresh_run_that_fails_leaves_no_directory(tmp_path):
    r = run(*TINY, "--data", tmp_path / "none*.bin", "--steps", 1, "--out", tmp_path / "r", ok=False)
    one_line_error(r)
    assert not (tmp_path / "r").exists()


# ---- a run directory is any directory with step folders -------------------------------------------------------
def test_a_lone_latest_file_is_named_as_such(shards, tmp_path):
    """A directory whose only llmc-like file is 'latest' (a user's, or a run's pointer whose checkpoints are gone) was
    refused as "already holds a run (checkpoints up to ?)"."""
    d = tmp_path / "notes"
    d.mkdir()
    (d / "latest").write_text("my latest notes\n")
    before = tree(d)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", d, ok=False)
    msg = one_line_error(r)
    assert "holds a file named 'latest'" in msg and "no step_NNNNNNNN checkpoint folder" in msg and "?" not in msg, msg
    assert tree(d) == before


def test_run_without_latest_is_a_run(shards, tmp_path):
    rd = tmp_path / "r"
    log = tmp_path / "log.jsonl"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--checkpoint-every", 1, "--out", rd, "--log", log)
    (rd / "latest").unlink()  # killed between the first rename and `latest`, or `latest` lost
    before = tree(tmp_path)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 3, "--keep", 1, "--out", rd, ok=False)
    assert "already holds a run (checkpoints up to step_00000002); add --resume" in one_line_error(r)
    assert tree(tmp_path) == before  # --keep 1 deleted nothing
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 3, "--out", rd, "--log", log, "--resume")
    assert "resumed from" in r.output and "at step 2" in r.output
    assert (rd / "latest").read_text().strip() == "step_00000003"


# ---- errors mid-run: one line, nothing half-written, the last completed step kept -----------------------------
def test_disk_full_during_a_checkpoint(shards, tmp_path, monkeypatch):
    rd = tmp_path / "r"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", rd)
    kept = tree(rd / "step_00000001")
    real_savez = np.savez

    def full(f, **arrays):
        real_savez(f, **{k: v[:10] for k, v in arrays.items()})
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(np, "savez", full)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", rd, "--resume", ok=False)
    msg = one_line_error(r, mid_run=True)
    assert "cannot write the checkpoint" in msg and "No space left on device" in msg and "step_00000002" in msg
    # (the error said once: the rescue's second try at the same checkpoint had repeated the whole line)
    assert msg.count("cannot write") == 1 and "the earlier checkpoints are untouched" in msg, msg
    assert sorted(p.name for p in rd.iterdir()) == ["config.toml", "latest", "log.jsonl", "run_id", "step_00000001"]  # no temp dir
    assert tree(rd / "step_00000001") == kept and (rd / "latest").read_text().strip() == "step_00000001"
    # the run's first checkpoint: no "earlier checkpoints" to speak of
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--checkpoint-every", 1, "--out", tmp_path / "n",
            ok=False)
    msg = one_line_error(r, mid_run=True)
    assert msg.count("cannot write") == 1 and "the run has no earlier checkpoint" in msg, msg
    assert "untouched" not in msg, msg


def test_file_size_limit_is_one_line(shards, tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE), in a child process: no traceback, no temp folder."""
    rd = tmp_path / "r"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20)); "
            "from llmc_cli.commands import main; sys.argv = ['llmc'] + sys.argv[1:]; main()")
    args = [str(a) for a in (*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--checkpoint-every", 1,
                              "--out", rd)]
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip()
    assert "\n" not in err and "Traceback" not in err and "File too large" in err, err
    assert not [q for q in rd.iterdir() if q.name.startswith(".step_")]


def test_bad_token_in_a_later_shard_keeps_the_last_completed_step(tmp_path):
    d = tmp_path / "data"
    tokens = np.random.default_rng(0).integers(0, 50257, 3000)
    write_shard(d / "x_train_000000.bin", tokens)
    bad = tokens.copy()
    bad[100] = 60000
    write_shard(d / "x_train_000001.bin", bad)
    rd = tmp_path / "r"
    r = run(*TINY, "--data", d / "*train*.bin", "--steps", 100, "--out", rd, ok=False)
    msg = one_line_error(r, mid_run=True)
    assert "token id 60000" in msg and "written (the last completed step), resume with:" in msg, msg
    last = (rd / "latest").read_text().strip()
    n = int(last.split("_")[1])
    assert n >= 1 and f"checkpoint {rd / last} written" in msg
    state = json.loads((rd / last / "state.json").read_text())
    assert state["step"] == n and state["dataloader"]  # the position before the failed step
    write_shard(d / "x_train_000001.bin", tokens)  # the shard mended: the run goes on from there
    run(*TINY, "--data", d / "*train*.bin", "--steps", n + 2, "--out", rd, "--resume")
    assert (rd / "latest").read_text().strip() == ckpt.step_dir_name(n + 2)


def test_nonfinite_weights_are_never_checkpointed(shards, tmp_path, monkeypatch):
    from llmc_cli.models import base as model_mod
    rd = tmp_path / "r"
    real = model_mod.Model.parameters_host

    def nan_params(self):
        p = real(self).copy()
        p[7] = np.nan
        return p
    monkeypatch.setattr(model_mod.Model, "parameters_host", nan_params)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", rd, ok=False)
    assert "the weights hold NaN or inf, so no checkpoint was written" in one_line_error(r, mid_run=True)
    assert not rd.exists() or not list(rd.glob("step_*"))


# ---- how a run ended: exit status ------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGHUP])
def test_sighup_stops_like_sigterm(sig, shards, tmp_path):
    rd = tmp_path / "r"
    args = [str(a) for a in (*TINY, "--data", shards / "*train*.bin", "--steps", 100000, "--out", rd)]
    p = subprocess.Popen([sys.executable, "-m", "llmc_cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        if "| loss" in line:
            break
    p.send_signal(sig)
    out = p.stdout.read()
    assert p.wait(timeout=120) == 75, out  # stopped after a checkpoint: resumable
    assert f"stopped by {signal.Signals(sig).name}" in out and "--resume" in out and "Traceback" not in out
    assert (rd / "latest").is_file()


def test_plot_replaces_only_pngs(tmp_path, shards):
    log = tmp_path / "log.jsonl"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--log", log)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not a picture")
    pytest.importorskip("matplotlib")
    r = run("plot", log, "--out", victim, ok=False)
    assert "exists and is not a PNG" in one_line_error(r)
    assert victim.read_bytes() == b"not a picture"
    r = run("plot", log, "--smooth", "nan", ok=False)
    assert "--smooth must be a finite number" in one_line_error(r)


def test_out_inside_a_checkpoint_and_unreadable_eval_file(shards, tmp_path):
    rd = tmp_path / "r"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", rd)
    before = tree(tmp_path)
    for out in (rd / "step_00000001", rd / "step_00000001" / "deeper"):
        r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", out, ok=False)
        assert "is inside the checkpoint" in one_line_error(r)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--hellaswag", tmp_path, "--hellaswag-every", 1,
            ok=False)
    assert "cannot read the eval file" in one_line_error(r)
    assert tree(tmp_path) == before


def test_an_error_between_steps_keeps_the_completed_steps(shards, tmp_path, monkeypatch):
    """Validation failing at step 3 (a val shard that went bad): the 3 completed steps are checkpointed with
    the loader's own position, and the run resumes from there to the same losses as one that never failed."""
    from llmc_cli.formats.files import DataError
    from llmc_cli.training.trainer import Trainer as T
    real, calls = T.validate, {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise DataError("val.bin: a damaged shard")
        return real(self)
    monkeypatch.setattr(T, "validate", flaky)
    args = [*TINY, "--data", shards / "*train*.bin", "--val-data", shards / "*val*.bin", "--val-every", 3,
            "--steps", 6]
    r = run(*args, "--out", tmp_path / "r", "--log", tmp_path / "r.jsonl", ok=False)
    msg = one_line_error(r, mid_run=True)
    assert "a damaged shard" in msg and "step_00000003 written (the last completed step)" in msg, msg
    monkeypatch.undo()
    run(*args, "--out", tmp_path / "r", "--log", tmp_path / "r.jsonl", "--resume")
    run(*args, "--log", tmp_path / "ref.jsonl")
    assert losses(tmp_path / "r.jsonl") == losses(tmp_path / "ref.jsonl")
