"""SIGINT, SIGTERM and SIGHUP outside a training loop (commands/interrupts.py), from an adversarial pass over every
command: SIGTERM and SIGHUP killed a command where it stood, silently, and `llmc bench train` so killed left its
temporary directory in $TMPDIR for good; a second Ctrl-C while the first unwound printed a traceback from the cleanup
it interrupted (the worker pool's join, the logging lock, threading's shutdown), or click's "Aborted!" with exit 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from test_killed_writers import Held


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_unwinds_bench_train_and_its_temporary_directory_goes(tmp_path, monkeypatch, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    held = Held(tmp_path, "llmc_cli.bench.train_steps:train_llmc",
                ["bench", "train", "--backend", "cpu", "--model", "d2", "-b", "2", "-t", "32", "--steps", "3",
                 "--warmup", "0"], when="before")
    assert [p.name for p in tmp.iterdir()], "the temporary shard's directory was not made"
    held.p.send_signal(sig)
    out, _ = held.p.communicate(timeout=60)
    out = out.decode()
    assert held.p.returncode == 130, out
    said = "interrupted" if sig == signal.SIGINT else f"interrupted by {sig.name}"
    assert out.strip().splitlines()[-1] == f"error: {said}", out
    assert "Traceback" not in out
    assert list(tmp.iterdir()) == []


_PROBE = textwrap.dedent(r'''
    import os, signal, sys, time
    from llmc_cli.commands import interrupts
    case = sys.argv[1]
    def wait(seconds):  # (short sleeps: a signal taken by another thread, OpenBLAS's, does not cut a long one short)
        for _ in range(int(seconds / 0.01)):
            time.sleep(0.01)
    if case == "nohup":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    interrupts.install()
    if case == "nohup":
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.2)
        print("still here")
    elif case == "second":
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            wait(5)
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)  # while the first unwinds, before its line is out
            wait(5)
            print("not ended")
    elif case == "said":
        try:
            os.kill(os.getpid(), signal.SIGINT)
            wait(5)
        except KeyboardInterrupt as e:
            interrupts.say_once(lambda: (os.kill(os.getpid(), signal.SIGTERM), print("error: " +
                                         interrupts.interrupted_line(e), file=sys.stderr, flush=True)))
            wait(5)
            print("not ended")
    elif case == "forced":  # a second signal skips the unwinding: the temporary directory goes all the same
        from llmc_cli.formats.files import temporary_directory
        with temporary_directory("llmc-probe-") as d:
            print(d, flush=True)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                wait(5)
            except KeyboardInterrupt:
                os.kill(os.getpid(), signal.SIGINT)
                wait(5)
    elif case == "child":
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            wait(5)
            os._exit(0)
        print(os.waitpid(pid, 0)[1] & 0x7f)
''')


def _probe(tmp_path, case: str):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    return subprocess.run([sys.executable, str(script), case], capture_output=True, text=True, timeout=60)


def test_a_second_signal_while_the_first_unwinds_ends_the_process_with_one_line(tmp_path):
    r = _probe(tmp_path, "second")
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "error: interrupted by SIGTERM\n")
    r = _probe(tmp_path, "said")  # the line being said: not said twice, and the process ends once it is out
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "error: interrupted\n")


def test_an_ignored_hangup_stays_ignored_and_a_forked_child_dies_of_its_signal(tmp_path):
    r = _probe(tmp_path, "nohup")
    assert (r.returncode, r.stdout.strip()) == (0, "still here"), r.stderr
    r = _probe(tmp_path, "child")  # (a tokenizer worker stopped by the pool: no KeyboardInterrupt of the parent's)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, str(int(signal.SIGTERM)), "")


def test_training_leaves_an_ignored_hangup_ignored():
    """nohup llmc train ...: the terminal going away is no stop request."""
    import os

    from llmc_cli.training.signals import StopSignals
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals(note=lambda m: None) as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.requested is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_forced_exit_still_removes_the_temporary_directories(tmp_path):
    import os
    r = _probe(tmp_path, "forced")
    assert (r.returncode, r.stderr) == (130, "error: interrupted by SIGTERM\n")
    assert not os.path.exists(r.stdout.strip()), r.stdout


def test_in_process_use_gives_the_handlers_back(monkeypatch):
    """click's CliRunner (or any program calling main) keeps its own signals after llmc returns, and a command that
    ended interrupted leaves no state behind (the host's next Ctrl-C was taken as a second signal: a silent exit)."""
    import click
    from click.testing import CliRunner

    from llmc_cli.commands import interrupts, main

    def interrupted(self, ctx):
        raise interrupts.Interrupted("SIGTERM")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    monkeypatch.setattr(click.Group, "invoke", interrupted)
    r = CliRunner().invoke(main, ["plot", "nothing"])
    assert r.exit_code == 130 and "interrupted by SIGTERM" in r.output, r.output
    assert {s: signal.getsignal(s) for s in before} == before
    assert interrupts._STATE["signame"] is None and not interrupts._STATE["said"]


def test_tokenize_names_the_signal_and_says_its_line_once(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from llmc_cli.commands import interrupts, main

    def stopped(*a, **k):
        raise interrupts.Interrupted("SIGHUP")
    src = tmp_path / "a.txt"
    src.write_text("hello world\n" * 10)
    import llmc_cli.tokenizing.pipeline as pipeline
    monkeypatch.setattr(pipeline, "encoded", stopped)
    r = CliRunner().invoke(main, ["tokenize", "text", str(src), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 130, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error")]
    assert lines == ["error: interrupted by SIGHUP; run the same command again to resume after the last finished "
                     "shard"], r.output


def test_launchers_leave_an_ignored_hangup_ignored():
    from llmc_cli.parallel.launch import _forwarding

    def forward(signum, frame):
        pass
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        with _forwarding(forward):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is forward
        assert signal.getsignal(signal.SIGTERM) is old_term
    finally:
        signal.signal(signal.SIGHUP, old_hup)
