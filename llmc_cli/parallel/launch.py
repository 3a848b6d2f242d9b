"""`llmc train --gpus N` / `--procs N`: start the ranks of a data-parallel run on this machine.

* ``--gpus N``: one process per GPU, started here (no extra tool). Rank r sees only GPU r
  (CUDA_VISIBLE_DEVICES), learns its place from LLMC_RANK / LLMC_WORLD_SIZE / LLMC_LOCAL_RANK, and the ranks
  share the device communicator's unique id through a fresh file (LLMC_INIT_FILE). Rank 0's output streams through; the others'
  goes to a log that is shown if that rank fails. When one rank fails, the others are stopped (SIGTERM, then
  SIGKILL after a grace period) and the launcher exits non-zero naming the rank. Ctrl-C / SIGTERM are passed on
  to every rank once, so they stop after the same step and rank 0 writes its checkpoint; Ctrl-Z suspends every
  rank with the launcher, and `fg` / `bg` continue them all (job_control).
* ``--procs N``: N ranks through ``mpiexec -n N`` (MPI moves the data: the cpu and OpenCL backends).

Both re-run the same `llmc train` command line without --gpus / --procs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable


STOPPED = 75  # a rank's exit status after a graceful stop with a checkpoint (llmc train's exit statuses)
# what the launcher passes on to its ranks, which run in their own session so that a terminal's Ctrl-C reaches them
# once, through here (SIGHUP: the terminal or ssh session went away; a rank stops on it as on SIGTERM)
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _forwarding(handler):
    """`handler` for FORWARDED while the block runs, except a signal the user ignored (nohup's SIGHUP stays ignored,
    and so does the ranks'); the handlers it replaced come back after."""
    old = {s: signal.signal(s, handler) for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _tree(pids: list[int]) -> list[int]:
    """`pids` and every process descended from them (Linux's /proc; elsewhere `pids` alone)."""
    children: dict[int, list[int]] = {}
    try:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        stat = f.read()
                    ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # (the name in parentheses may hold spaces)
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
    except OSError:
        return list(pids)
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


@contextlib.contextmanager
def job_control(pids: Callable[[], list[int]]):
    """Ctrl-Z (SIGTSTP) and `fg`/`bg` (SIGCONT) for ranks that run in a session of their own, which the terminal's
    signals never reach: on SIGTSTP every process under `pids()` is stopped, then the launcher stops itself as the
    shell expects; on SIGCONT they all continue. Without it Ctrl-Z suspended the launcher alone while the ranks
    went on training. Only in the main thread, where signal handlers can be set."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTSTP"):
        yield
        return

    def each(sig: int) -> None:
        for pid in _tree(pids()):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(signum, frame):
        each(signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # the launcher stops here until `fg` or `bg`
        signal.signal(signal.SIGTSTP, stop)
        each(signal.SIGCONT)

    old = {signal.SIGTSTP: signal.signal(signal.SIGTSTP, stop),
           signal.SIGCONT: signal.signal(signal.SIGCONT, lambda signum, frame: each(signal.SIGCONT))}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def stderr_say(msg: str) -> None:
    """The launcher's own lines (a rank failed, where the logs are): the supervisor has no console of its own,
    and rank 0's output owns stdout."""
    print(f"llmc launcher: {msg}", file=sys.stderr, flush=True)


Say = Callable[[str], None]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def exit_words(rc: int) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it, as subprocess and
    multiprocessing give it): 'was killed by SIGKILL', 'exited with status 1'."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def supervise(cmds: list[list[str]], envs: list[dict], logdir: Path, grace: float = 10.0,
              describe=lambda r: f"rank {r}", say: Say = stderr_say) -> int:
    """Run one process per rank; rank 0 streams to this terminal, rank r > 0 logs to logdir/rank{r}.log.
    Returns 0 when all succeed, else the failing rank's status (the others are stopped)."""
    procs: list[subprocess.Popen] = []
    logs = []
    signals_seen = []

    def forward(signum, frame):
        signals_seen.append(signum)
        if len(signals_seen) > 2:  # a third Ctrl-C: stop waiting for checkpoints
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    with _forwarding(forward), job_control(lambda: [p.pid for p in procs if p.poll() is None]):
        return _run_ranks(procs, logs, cmds, envs, logdir, grace, describe, say)


def _run_ranks(procs: list, logs: list, cmds, envs, logdir: Path, grace: float, describe, say: Say) -> int:
    """supervise's body: start the ranks (into `procs`, their logs into `logs`), wait, stop the others when one
    fails; every rank is gone when it returns."""
    try:
        for r, (cmd, env) in enumerate(zip(cmds, envs)):
            if r == 0:
                out, err = None, None
            else:
                f = open(logdir / f"rank{r}.log", "wb")
                logs.append(f)
                out, err = f, subprocess.STDOUT
            # own session: the terminal's Ctrl-C reaches the launcher alone, which passes it on exactly once
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True))
        failed = None
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
        r, rc = failed
        if rc == STOPPED:  # a graceful stop: the ranks checkpointed together; let the others end on their own
            deadline = time.monotonic() + grace
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
            if all(p.poll() is not None for p in procs):
                return STOPPED
        say(f"{describe(r)} {exit_words(rc)}; stopping the other {len(procs) - 1} rank(s)")
        if r != 0:
            tail = _tail(logdir / f"rank{r}.log")
            if tail:
                say(f"last lines of {describe(r)} ({logdir / f'rank{r}.log'}):\n{tail}\n---")
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # stuck in a collective whose peer is gone
                p.wait()
        return rc if rc > 0 else 128 + (-rc)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def launch_gpus(args: list[str], n: int, env: dict | None = None, say: Say = stderr_say) -> int:
    """`llmc <args>` on N GPUs of this machine, one process each, the communicator's id through a temporary file."""
    env = dict(os.environ if env is None else env)
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env:
        if len(visible) < n:
            say(f"--gpus {n}: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} lists {len(visible)} GPU(s)")
            return 2
        devices = visible[:n]
    else:
        devices = [str(i) for i in range(n)]
    logdir = Path(tempfile.mkdtemp(prefix="llmc-ranks-"))
    cmd = [sys.executable, "-m", "llmc_cli", *args]
    envs = []
    for r in range(n):
        e = dict(env)
        e.update(LLMC_RANK=str(r), LLMC_WORLD_SIZE=str(n), LLMC_LOCAL_RANK=str(r),
                 LLMC_INIT_FILE=str(logdir / "comm_id"), CUDA_VISIBLE_DEVICES=devices[r], PYTHONUNBUFFERED="1")
        envs.append(e)
    say(f"{n} ranks on GPUs {','.join(devices)}; rank 0's output follows, the others log to {logdir}")
    rc = supervise([cmd] * n, envs, logdir, describe=lambda r: f"rank {r} (GPU {devices[r]})", say=say)
    if rc in (0, STOPPED):  # (a failure keeps the logs its lines point to)
        shutil.rmtree(logdir, ignore_errors=True)
    return rc


def find_mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"  # PyPI's mpich installs it beside the interpreter
    if here.exists():
        return str(here)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def note_failure(rank: int, world: int, msg: str) -> None:
    """A failing rank leaves its message where the launcher finds it (MPI may kill the rank before its stderr
    is forwarded)."""
    d = os.environ.get("LLMC_FAILURE_DIR")
    if d:
        try:
            Path(d, f"rank{rank}.failed").write_text(f"rank {rank} of {world}: {msg}\n")
        except OSError:
            pass


def _relay_stdout(proc: subprocess.Popen) -> None:
    """mpiexec's standard output (the ranks') copied to ours. mpiexec writing into a pipe whose reader has gone
    (`llmc train --procs 2 | head`) would die of SIGPIPE and take the ranks down with nothing saved; here the ranks
    are asked to stop as on SIGTERM instead (a checkpoint after the step, exit 75), and what they still print is
    dropped."""
    reader_gone = False
    while chunk := proc.stdout.read1(1 << 16):
        if reader_gone:
            continue
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(1, view):]
        except OSError:  # (EPIPE; or a full disk behind stdout: the run is worth more than its lines either way)
            reader_gone = True
            stderr_say("standard output closed: asking the ranks to stop after their step and write a checkpoint")
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass


def launch_mpi(args: list[str], n: int, say: Say = stderr_say) -> int:
    """`llmc <args>` as N MPI ranks through mpiexec (the cpu / OpenCL backends reduce through MPI)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        say("--procs needs MPI: pip install mpich mpi4py (or pip install 'llmc[mpi]')")
        return 2
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        say("--procs needs mpi4py: pip install mpich mpi4py (or pip install 'llmc[mpi]')")
        return 2
    faildir = Path(tempfile.mkdtemp(prefix="llmc-mpi-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", LLMC_FAILURE_DIR=str(faildir))
    # N ranks share this machine's cores: without a limit each one's BLAS would start a thread per core
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    sys.stdout.flush()
    started, early = [], []

    def forward(signum, frame):  # mpiexec passes it on to the ranks, which checkpoint and exit 75
        if not started:  # (before mpiexec runs: passed on as soon as it does)
            early.append(signum)
            return
        try:  # (MPICH's mpiexec dies of a SIGHUP, passing nothing on: the ranks are told SIGTERM)
            started[0].send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
        except ProcessLookupError:
            pass
    # taken before mpiexec starts: a signal in between ended the launcher alone, and mpiexec, its output's reader
    # gone, took the ranks down with no checkpoint
    main = threading.current_thread() is threading.main_thread()
    with _forwarding(forward) if main else contextlib.nullcontext():
        try:
            proc = subprocess.Popen([mpiexec, "-n", str(n), sys.executable, "-m", "llmc_cli", *args], env=env,
                                    stdout=subprocess.PIPE, start_new_session=True)
        except BaseException:
            shutil.rmtree(faildir, ignore_errors=True)
            raise
        started.append(proc)
        for signum in early:
            forward(signum, None)
        relay = threading.Thread(target=_relay_stdout, args=(proc,), daemon=True)
        relay.start()
        with job_control(lambda: [proc.pid] if proc.poll() is None else []):
            rc = proc.wait()
    relay.join(timeout=5)
    notes = sorted(faildir.glob("rank*.failed"))
    if rc == STOPPED:
        say(f"all {n} ranks stopped after writing a checkpoint: continue with the same command and --resume")
    elif rc != 0:
        who = "; ".join(p.read_text().strip() for p in notes) or "a rank failed (its own message above names it)"
        say(f"mpiexec {exit_words(rc)}: {who}; all {n} ranks stopped")
    shutil.rmtree(faildir, ignore_errors=True)
    return rc
