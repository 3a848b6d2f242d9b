"""Runs that die: `llmc train` killed with SIGKILL at random moments during checkpoint writes (each trial
resumes the run the previous trial killed, from its last complete checkpoint, and every step any of them
logged must equal an uninterrupted reference run's loss bit for bit); SIGINT/SIGTERM stop gracefully with a
checkpoint and a resume command; a second signal aborts at once."""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from llmc_test_support import phrase_tokens

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.shards import write_shard

TRIALS = int(os.environ.get("LLMC_KILL_TRIALS", "20"))
BASE = [sys.executable, "-m", "llmc_cli", "train", "--backend", "cpu", "--model", "d2", "--n-embd", "64",
        "-b", "2", "-t", "32", "--val-every", "0", "--sample-every", "0", "--lr", "1e-3", "--shuffle",
        "--weight-decay", "0.1"]
STEPS = 100000  # never reached: every run here is stopped by a signal


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    d = tmp_path_factory.mktemp("crashdata")
    write_shard(d / "crash_train_000001.bin", phrase_tokens(120))
    return d / "crash_train_000001.bin"


class Proc:
    """`llmc train` in a subprocess, its output lines collected as they come."""

    def __init__(self, args, env_extra=None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", **(env_extra or {}))
        self.p = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=env, text=True, bufsize=1)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pred, timeout=120.0):
        end = time.monotonic() + timeout
        with self.cond:
            while not pred(self.lines):
                if self.p.poll() is not None and not self.t.is_alive():
                    raise AssertionError(f"process exited {self.p.returncode}:\n" + "\n".join(self.lines))
                left = end - time.monotonic()
                if left <= 0:
                    self.p.kill()
                    raise AssertionError("timed out waiting; output:\n" + "\n".join(self.lines))
                self.cond.wait(min(left, 0.5))

    def steps_done(self) -> int:
        return sum(1 for l in self.lines if l.lstrip().startswith("step ") and "| loss" in l)

    def finish(self, timeout=120.0) -> tuple[int, str]:
        rc = self.p.wait(timeout)
        self.t.join(10)
        return rc, "\n".join(self.lines)


def log_losses(path) -> dict[int, float]:
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line torn by SIGKILL
            if "loss" in rec:
                out[rec["step"]] = rec["loss"]
    return out


def _kill_chain(shard, run_dir, log, trials, seed, result):
    """`trials` runs of one run directory, each resuming the last and SIGKILLed a random moment after its
    first (or second) step, i.e. inside that step's checkpoint write (or just after it)."""
    rnd = random.Random(seed)
    args = [*BASE, "--data", shard, "--steps", STEPS, "--checkpoint-every", 1, "--keep", 3, "--out", run_dir,
            "--log", log]
    # each checkpoint write pauses a little at each of its phases so that the random kills land inside them
    env = {"LLMC_FAULT_CHECKPOINT_DELAY": "0.03"}
    seen: dict[int, list[float]] = {}
    mid_write = resumed = 0
    for _ in range(trials):
        resume = (run_dir / "latest").exists()
        before = ckpt.read_run_state(ckpt.resolve_checkpoint(run_dir).parent / "state.json")["step"] if resume else 0
        p = Proc(args + (["--resume"] if resume else []), env)
        n = rnd.choice([1, 1, 1, 2])
        p.wait_for(lambda lines: sum(1 for l in lines if "| loss" in l) >= n)
        time.sleep(rnd.uniform(0.0, 0.3))
        p.p.send_signal(signal.SIGKILL)
        rc, out = p.finish()
        assert rc == -signal.SIGKILL, out
        assert "Traceback" not in out, out
        if run_dir.exists() and any(x.name.startswith(".step_") for x in run_dir.iterdir()):
            mid_write += 1
        for s, v in log_losses(log).items():
            seen.setdefault(s, []).append(v)
        # the last complete checkpoint always loads, and never goes backwards
        if (run_dir / "latest").exists():
            cfg, params, opt, state = ckpt.read_run_checkpoint(run_dir)
            assert state["step"] >= before and np.isfinite(params).all()
            resumed += resume
    result.update(seen=seen, mid_write=mid_write, resumed=resumed)


def test_sigkill_during_checkpoints_resumes_bit_exact(shard, tmp_path):
    """TRIALS kills over two run directories killed and resumed side by side (the machine has 2 cores)."""
    t0 = time.monotonic()
    chains = 2
    results = [{} for _ in range(chains)]
    errors = []

    def chain(i):
        try:
            _kill_chain(shard, tmp_path / f"run{i}", tmp_path / f"run{i}.jsonl", -(-TRIALS // chains) if i == 0
                        else TRIALS // chains, 1234 + i, results[i])
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=chain, args=(i,)) for i in range(chains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    elapsed = time.monotonic() - t0
    seen: dict[int, list[float]] = {}
    for r in results:
        for s, vs in r["seen"].items():
            seen.setdefault(s, []).extend(vs)
    mid_write = sum(r["mid_write"] for r in results)
    resumed = sum(r["resumed"] for r in results)
    last = max(seen)
    # the reference: one uninterrupted run (no checkpoints), stopped by SIGTERM once it has passed `last`
    ref_log = tmp_path / "ref.jsonl"
    p = Proc([*BASE, "--data", shard, "--steps", STEPS, "--log", ref_log])
    p.wait_for(lambda lines: sum(1 for l in lines if "| loss" in l) >= last)
    p.p.send_signal(signal.SIGTERM)
    rc, out = p.finish()
    assert rc == 130, out  # stopped by a signal with nothing saved (no --out)
    assert "nothing can be saved" in out and "Traceback" not in out, out
    ref = log_losses(ref_log)
    assert len(ref) >= last
    mismatched = {s: (vs, ref.get(s)) for s, vs in seen.items() if any(v != ref.get(s) for v in vs)}
    assert not mismatched, f"losses differ from the uninterrupted run at steps {sorted(mismatched)[:10]}"
    assert resumed >= TRIALS // 2, (resumed, TRIALS)
    assert mid_write >= 3, f"only {mid_write} of {TRIALS} kills landed inside a checkpoint write"
    print(f"{TRIALS} kills in {elapsed:.1f} s, {mid_write} inside a checkpoint write, {resumed} resumed runs; "
          f"{last} steps compared bit for bit ({sum(map(len, seen.values()))} logged values)")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_with_checkpoint_and_resume_command(sig, shard, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "log.jsonl"
    steps = 6
    p = Proc([*BASE, "--data", shard, "--steps", steps, "--out", run_dir, "--log", log])
    p.wait_for(lambda lines: sum(1 for l in lines if "| loss" in l) >= 1)
    p.p.send_signal(sig)
    rc, out = p.finish()
    assert rc == 75, out  # stopped by a signal after writing a checkpoint: resumable
    assert "Traceback" not in out
    stopped = [l for l in out.splitlines() if l.startswith("stopped by")]
    assert stopped and sig.name in stopped[0] and "checkpoint" in stopped[0], out
    cmd = out.splitlines()[-1].strip()
    assert cmd.startswith("llmc train ") and cmd.endswith("--resume"), out
    state = ckpt.read_run_checkpoint(run_dir)[3]
    assert 1 <= state["step"] < steps
    # the printed command, run as printed, finishes the run; every step is logged once
    argv = shlex.split(cmd)
    r = subprocess.run([sys.executable, "-m", "llmc_cli", *argv[1:]], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {run_dir} at step {state['step']}" in r.stdout
    steps_logged = [json.loads(l)["step"] for l in open(log) if "loss" in json.loads(l)]
    assert steps_logged == list(range(1, steps + 1))


def wait_until(cond, what: str, timeout: float = 120.0) -> None:
    """Polls `cond` until it holds; the timeout only guards against a hang."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_second_signal_aborts_at_once(shard, tmp_path):
    """The checkpoint write the first signal starts would take an hour: a second signal that waited for it
    outlasts finish()'s timeout."""
    run_dir = tmp_path / "run"
    p = Proc([*BASE, "--data", shard, "--steps", 50, "--out", run_dir], {"LLMC_FAULT_CHECKPOINT_DELAY": "3600"})
    try:
        p.wait_for(lambda lines: sum(1 for l in lines if "| loss" in l) >= 1)
        p.p.send_signal(signal.SIGINT)
        p.wait_for(lambda lines: any("send it again" in l for l in lines))
        wait_until(lambda: any(run_dir.glob(".step_*.tmp-*")), "the checkpoint write to begin")
        p.p.send_signal(signal.SIGINT)
        rc, out = p.finish()
    finally:
        p.p.kill()
    assert rc == 130, out
    assert "Traceback" not in out
    # (aborted inside the first checkpoint: nothing to resume, and the line no longer says how to resume it)
    assert "aborted by a second SIGINT" in out and "holds no complete checkpoint yet" in out, out
    assert "--resume" not in out, out
    # nothing half-written is presented as a checkpoint
    assert not (run_dir / "latest").exists()
    assert not list(run_dir.glob("step_*"))
