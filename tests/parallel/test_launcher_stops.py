"""A data-parallel run stops as a one-process run does, with a checkpoint and exit 75, when the launcher is told to
stop (SIGTERM from a scheduler, SIGHUP from a lost terminal, Ctrl-C) or when its standard output's reader goes
(`llmc train --procs 2 | head`). Before, mpiexec died of the SIGPIPE or SIGHUP and took the ranks down with nothing
saved, and a SIGINT or SIGTERM sent to the launcher alone never reached the ranks."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from llmc_test_support import TINY, phrase_tokens

from llmc_cli.formats.shards import write_shard
from llmc_cli.parallel.launch import find_mpiexec

try:
    import mpi4py  # noqa: F401
    HAVE_MPI = find_mpiexec() is not None
except ImportError:
    HAVE_MPI = False

needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs MPI: pip install mpich mpi4py (llmc[mpi])")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch_data")
    write_shard(d / "x_train_000000.bin", phrase_tokens(200))
    write_shard(d / "x_val_000000.bin", phrase_tokens(20, 1))
    return d


@needs_mpi
@pytest.mark.parametrize("how", ["stdout closed", "SIGTERM", "SIGHUP", "SIGINT"])
def test_two_ranks_stop_with_a_checkpoint(how, data, tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "llmc_cli", *TINY, "--data", str(data), "--steps", "300", "--out",
                          str(run), "--procs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in p.stdout:  # once the first step is shown
            if line.startswith(b"step"):
                break
        if how == "stdout closed":
            p.stdout.close()
        else:
            p.send_signal(getattr(signal, how))
            p.stdout.read()
        code, err = p.wait(timeout=240), p.stderr.read().decode()
    finally:
        p.kill()
    assert code == 75, (code, err)
    assert "stopped after writing a checkpoint" in err, err
    assert (run / "latest").is_file() and list(run.glob("step_*")), sorted(x.name for x in run.iterdir())


def test_supervise_takes_a_graceful_stop_as_one_and_forwards_sighup(tmp_path):
    """--gpus N's launcher (no MPI needed): ranks that all exit 75 are one stop, not a failure whose fellows are
    terminated; a SIGHUP the launcher receives reaches every rank (they run in their own session)."""
    import os
    import threading
    import time

    from llmc_cli.parallel.launch import supervise
    said = []
    rank = ("import signal, sys, time, pathlib\n"
            "signal.signal(signal.SIGHUP, lambda s, f: (pathlib.Path(sys.argv[1]).write_text('hup'), sys.exit(75)))\n"
            "pathlib.Path(sys.argv[1] + '.ready').write_text('')\n"
            "time.sleep(60)\n")
    cmds = [[sys.executable, "-c", rank, str(tmp_path / f"r{r}")] for r in range(2)]

    def hang_up():
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"r{r}.ready").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)
    threading.Thread(target=hang_up, daemon=True).start()
    rc = supervise(cmds, [dict(os.environ)] * 2, tmp_path, say=said.append)
    assert rc == 75 and said == [], (rc, said)
    assert all((tmp_path / f"r{r}").read_text() == "hup" for r in range(2))


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


def _wait_for(cond, what: str, timeout: float = 30.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
@pytest.mark.parametrize("launcher", ["supervise", pytest.param("mpiexec", marks=needs_mpi)])
def test_ctrl_z_suspends_the_ranks_with_the_launcher_and_fg_resumes_them(tmp_path, launcher):
    """The ranks run in a session of their own, which the terminal's Ctrl-Z never reaches: the launcher stops them
    before it stops itself, and continues them when it is continued (`fg`). Before, Ctrl-Z suspended the launcher
    alone while the ranks went on training. (The launcher runs in a process group of its own under this test, as a
    shell's job does: a stop signal sent to an orphaned group is discarded.)"""
    import os
    import time

    from llmc_cli.parallel.launch import _tree
    rank = ("import os, sys, time, pathlib\n"
            "d = pathlib.Path(sys.argv[1]); me = d / f'tick{os.environ.get(\"PMI_RANK\", sys.argv[2])}'\n"
            "t0 = time.monotonic()\n"
            "while not (d / 'done').exists() and time.monotonic() - t0 < 120:\n"
            "    with open(me, 'a') as f: f.write('.')\n"
            "    time.sleep(0.01)\n")
    if launcher == "supervise":
        script = ("import os, sys\nfrom pathlib import Path\nfrom llmc_cli.parallel.launch import supervise\n"
                  f"cmds = [[sys.executable, '-c', {rank!r}, {str(tmp_path)!r}, str(r)] for r in range(2)]\n"
                  f"sys.exit(supervise(cmds, [dict(os.environ)] * 2, Path({str(tmp_path)!r})))\n")
    else:  # launch_mpi's own wait, with the rank script in place of llmc (mpiexec runs it as N ranks)
        script = ("import sys\nfrom unittest import mock\nfrom llmc_cli.parallel import launch\n"
                  "real = launch.subprocess.Popen\n"
                  f"def popen(cmd, **kw):\n    return real([cmd[0], cmd[1], cmd[2], sys.executable, '-c', {rank!r}, "
                  f"{str(tmp_path)!r}, '0'], **kw)\n"
                  "with mock.patch.object(launch.subprocess, 'Popen', popen):\n"
                  "    sys.exit(launch.launch_mpi([], 2))\n")
    p = subprocess.Popen([sys.executable, "-c", script], process_group=0) if sys.version_info >= (3, 11) else \
        subprocess.Popen([sys.executable, "-c", script], preexec_fn=os.setpgrp)
    ticks = [tmp_path / f"tick{r}" for r in range(2)]
    size = lambda: [t.stat().st_size if t.exists() else 0 for t in ticks]  # noqa: E731
    try:
        _wait_for(lambda: all(n > 5 for n in size()), "both ranks to tick")
        ranks = [q for q in _tree([p.pid]) if q != p.pid]
        os.kill(p.pid, signal.SIGTSTP)
        _wait_for(lambda: _state(p.pid) == "T", "the launcher to stop")
        before = size()
        time.sleep(0.5)
        assert size() == before, "the ranks went on while the launcher was stopped"
        assert all(_state(q) == "T" for q in ranks if os.path.exists(f"/proc/{q}"))
        os.kill(p.pid, signal.SIGCONT)
        _wait_for(lambda: all(a > b + 5 for a, b in zip(size(), before)), "the ranks to go on after SIGCONT")
        (tmp_path / "done").write_text("")
        assert p.wait(timeout=60) == 0
    finally:
        (tmp_path / "done").write_text("")
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's descendants (mpiexec's ranks carry PMI_RANK, --gpus's LLMC_RANK)."""
    from llmc_cli.parallel.launch import _tree
    for q in _tree([launcher]):
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{q}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if "llmc_cli" in open(f"/proc/{q}/cmdline").read() and \
                env.get("PMI_RANK", env.get("LLMC_RANK")) == str(rank):
            return q
    return None


def _signals_while_rank_0_writes(data, run, delay: str, to_rank_1: list) -> tuple[int, str]:
    """`--procs 2` with rank 0's checkpoint slowed (LLMC_FAULT_CHECKPOINT_DELAY seconds at each of its phases):
    SIGTERM to rank 0 alone, which both ranks stop on (the vote); once rank 0 writes, `to_rank_1`'s signals to
    rank 1, half a second apart. (exit status, stderr)."""
    import os
    import time
    env = dict(os.environ, LLMC_FAULT_CHECKPOINT_DELAY=delay)
    p = subprocess.Popen([sys.executable, "-m", "llmc_cli", *TINY, "--data", str(data), "--steps", "300", "--out",
                          str(run), "--procs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        for line in p.stdout:
            if line.startswith(b"step"):
                break
        r0, r1 = _rank_pid(p.pid, 0), _rank_pid(p.pid, 1)
        assert r0 and r1, (r0, r1)
        os.kill(r0, signal.SIGTERM)
        _wait_for(lambda: any(run.glob(".step_*")) or any(run.glob("step_*")), "rank 0's checkpoint to begin")
        for sig in to_rank_1:
            time.sleep(0.5)
            os.kill(r1, sig)
        _, err = p.communicate(timeout=240)
        return p.returncode, err.decode()
    finally:
        p.kill()


@needs_mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks in /proc")
def test_a_rank_that_stopped_keeps_its_handlers_while_rank_0_writes_the_checkpoint(data, tmp_path):
    """SIGTERM to rank 0 alone: both ranks stop after the same step (the vote), and rank 0 writes the checkpoint
    (slowed here, as a big model's is). A first signal reaching rank 1 meanwhile used to find it past its training
    loop with the default handlers back: it died, and mpiexec took rank 0 down mid-write (exit 1, no checkpoint).
    Every rank now waits inside the loop's handlers until rank 0 has written."""
    run = tmp_path / "run"
    code, err = _signals_while_rank_0_writes(data, run, "1", [signal.SIGHUP])
    assert code == 75, (code, err[-2000:])
    assert (run / "latest").is_file() and len(list(run.glob("step_*"))) == 1, sorted(x.name for x in run.iterdir())


@needs_mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks in /proc")
def test_a_second_signal_aborts_a_rank_waiting_for_rank_0s_checkpoint(data, tmp_path):
    """Rank 1 waits for rank 0's last checkpoint inside its stop handlers; a blocking MPI_Barrier held them off, so
    a second signal there ("send it again to abort at once") was lost and the rank waited on. Now it aborts.
    Rank 0's checkpoint would take hours: a rank that waited for it outlasts the helper's timeout."""
    code, err = _signals_while_rank_0_writes(data, tmp_path / "run", "3600", [signal.SIGTERM, signal.SIGTERM])
    assert code == 130 and "aborted by a second SIGTERM" in err, (code, err[-2000:])
    # (the run had no checkpoint yet: it used to say that it kept its last complete one, and how to resume it)
    assert "holds no complete checkpoint yet" in err and "--resume" not in err, err[-2000:]


@pytest.mark.parametrize("rc, kept", [(0, False), (75, False), (1, True)])
def test_gpus_launcher_keeps_the_rank_logs_only_after_a_failure(tmp_path, monkeypatch, rc, kept):
    """A run stopped with its checkpoint (exit 75) is no failure: its ranks' log directory went to $TMPDIR for good,
    one per stop."""
    import tempfile

    from llmc_cli.parallel import launch
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch, "supervise", lambda *a, **k: rc)
    assert launch.launch_gpus(["train"], 2, env={"CUDA_VISIBLE_DEVICES": "0,1"}, say=lambda m: None) == rc
    assert bool(list(tmp_path.glob("llmc-ranks-*"))) == kept
