"""`llmc train`'s options and run control at their edges: signals
delivered together (one request, as they must stay: a single Ctrl-C can reach a rank twice), `--dry-run`
with a backend that is not installed (planned float32, exit 0), `--init` beside a `--model` naming another model
(ignored silently), launcher variables whose message named `None`, a `--config` giving one option under two
spellings, a missing shard that did not say whether it was `--data`'s or `--val-data`'s, `--overlap` on one rank
(silently nothing), and a long `--sample-tokens` that held a graceful stop."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from llmc_test_support import TINY, last_line_error, run
from llmc_test_support import train_tiny as train

from llmc_cli.formats.shards import write_shard
from llmc_cli.parallel.comm import CommError, discover
from llmc_cli.training.signals import StopSignals


one_line_error = last_line_error


TWO_TOGETHER = """
import os, signal, threading, time
import numpy as np
from llmc_cli.training.signals import StopSignals, TrainAborted
def send_two():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
a = np.random.default_rng(0).random((3000, 3000))
try:
    with StopSignals(note=lambda m: None) as stop:
        threading.Timer(0.1, send_two).start()
        a @ a  # one C call of about half a second: both signals arrive inside it
        for _ in range(50):
            time.sleep(0.01)
    print("stop requested", stop.requested)
except TrainAborted as e:
    print("aborted", e.signame)
"""


def test_two_signals_delivered_together_are_one_stop_request():
    """One user action can deliver a signal twice at once: Ctrl-C under `mpiexec -n 2 llmc train` reaches a rank
    from the terminal and again from mpiexec, a scheduler may signal the job's processes and forward as well. Signals
    that arrive together inside one C call (a matmul, a device wait) are one request, a checkpoint after the step:
    taken as two they aborted the run with nothing saved. (A second request the handler sees is an abort, as before.)"""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", TWO_TOGETHER], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout.strip()) == (0, "stop requested SIGTERM"), p.stdout + p.stderr


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_one_signal_is_still_a_graceful_stop_request():
    with StopSignals(note=lambda m: None) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(20):
            time.sleep(0.01)
        assert stop.requested == "SIGTERM"


def test_dry_run_of_a_backend_that_is_not_installed_is_refused():
    r = run("train", "--dry-run", "--backend", "nope", "--model", "d2", ok=False)
    one_line_error(r, "--backend nope", "unknown backend 'nope'")
    assert "parameters" not in r.output


def test_dry_run_of_an_installed_backend_that_cannot_run_here_plans_and_says_so(monkeypatch):
    from llmc_cli import registry
    from llmc_cli.kernels import BackendUnavailable

    def unusable(name="auto"):
        raise BackendUnavailable(f"backend '{name}' is installed but cannot run here: no device (a test)")
    monkeypatch.setattr(registry, "usable_plugin", unusable)
    r = run("train", "--dry-run", "--backend", "cpu", "--model", "d2")
    assert "6,966,784 parameters" in r.output
    assert "note: --backend cpu: backend 'cpu' is installed but cannot run here: no device (a test); planned as on a " \
           "machine where it runs" in r.output


def test_init_beside_a_model_that_names_another_model_is_refused(tmp_path, data):
    out = tmp_path / "r"
    train(data, "--steps", 1, "--out", out)  # (a d2 with 64 channels)
    for model in ("d6", "llama3-tiny"):
        one_line_error(train(data, "--steps", 1, "--init", out, "--model", model, ok=False),
                       f"--model {model}: --init {out} is another model (GPT-2, 2 layers, 2 heads, 64 channels)",
                       "leave --model out")
    one_line_error(train(data, "--steps", 1, "--init", out, "--model", "nope", ok=False), "unknown model 'nope'")
    train(data, "--steps", 1, "--init", out, "--model", "d2")  # (TINY's --n-embd 64: --init's model itself)
    # a --model from a --config (a run's config.toml records the default beside --init) is not refused
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "d12"\n')
    run("train", "--config", cfg, "--backend", "cpu", "--data", data, "--init", out, "--steps", 1, "--val-every", 0,
        "--sample-every", 0)


def test_launcher_variables_out_of_range_are_named():
    with pytest.raises(CommError, match=r"^llmc launcher: rank -1 is not in 0\.\.1 \(LLMC_RANK, LLMC_WORLD_SIZE\)$"):
        discover({"LLMC_RANK": "-1", "LLMC_WORLD_SIZE": "2"})
    with pytest.raises(CommError, match=r"^llmc launcher: LLMC_WORLD_SIZE=0 is not a number of ranks"):
        discover({"LLMC_RANK": "0", "LLMC_WORLD_SIZE": "0"})


def test_a_config_giving_one_option_under_two_spellings_is_refused(tmp_path, data):
    cfg = tmp_path / "c.toml"
    cfg.write_text("overfit_batch = true\noverfit-batch = false\n")
    one_line_error(train(data, "--config", cfg, "--steps", 1, ok=False),
                   "'overfit_batch' and 'overfit-batch' are the same option; give it once")


def test_a_missing_shard_names_its_option(tmp_path, data):
    one_line_error(train(data, "--steps", 1, "--val-data", tmp_path / "nope.bin", ok=False), "error: --val-data: ",
                   "nope.bin not found")
    one_line_error(run(*TINY, "--data", tmp_path / "nope.bin", "--steps", 1, ok=False), "error: --data: ",
                   "nope.bin not found")


def test_overlap_on_one_rank_says_it_has_nothing_to_overlap(tmp_path, data):
    r = train(data, "--steps", 1, "--zero", "1", "--overlap")
    assert "--overlap: data parallel only, and this run has one rank: nothing to overlap" in r.output


def test_a_stop_request_cuts_a_long_sample_short(tmp_path):
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "x_train_000000.bin", rng.integers(0, 50257, 4096))
    args = TrainArgs(data=str(tmp_path / "x_train_000000.bin"), model="d2", n_embd=32, batch_size=2, seq_len=16,
                     steps=1, val_every=0, sample_every=1, sample_tokens=5000)
    t = Trainer(args, create_backend("cpu"), say=lambda s: None, decode=lambda ids: f"{len(ids)} tokens", eot=50256)
    try:
        t.stop_requested = lambda: "SIGTERM"
        assert t.sample_text() == "1 tokens"
    finally:
        t.close()
