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

pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="needs MPI: pip install mpich mpi4py (llmc[mpi])")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch_data")
    write_shard(d / "x_train_000000.bin", phrase_tokens(200))
    write_shard(d / "x_val_000000.bin", phrase_tokens(20, 1))
    return d


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
