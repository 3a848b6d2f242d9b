"""Run directories: what counts as one, and the lock that makes one process at a time its only writer.

A run directory is any directory holding `step_NNNNNNNN/` folders or a `latest` file: `latest` is only a
pointer, written last, so a run killed before its first pointer is still a run (and `--resume` finds its
newest complete step). Writes inside one belong to the training process that holds `RUN/.lock` (an OS file
lock, released by the kernel when the process dies, so a killed run never leaves a stale lock behind).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"step_\d{8}")
LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message names it and says what to do."""


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The `step_NNNNNNNN` folders of a directory, oldest first (complete or not)."""
    try:
        return sorted(p for p in Path(run_dir).iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir())
    except OSError:
        return []


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "latest").exists() or bool(step_dirs(path)))


def step_folder_of(path: str | Path) -> Path | None:
    """The checkpoint folder (a run's `step_NNNNNNNN`) that `path` is or lies inside, else None: llmc writes
    nothing there but the checkpoint itself."""
    p = Path(os.path.abspath(path))
    for d in (p, *p.parents):
        if STEP_DIR.fullmatch(d.name) and is_run_dir(d.parent):
            return d
    return None


def check_out(out: str | Path, resume: bool) -> None:
    """A fresh run must not write into another run's directory; --resume needs one to continue."""
    out = Path(out)
    if out.is_symlink() and not out.exists():  # (mkdir would say only "File exists")
        raise RunDirError(f"--out {out} is a symbolic link to nothing (or a loop of links); expected a run directory "
                          "(new, or holding a run to --resume)")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file; expected a run directory (new, or holding a run to --resume)")
    if (step := step_folder_of(out)) is not None:
        raise RunDirError(f"--out {out} is inside the checkpoint {step}; give a directory outside the step folders")
    latest = out / "latest"
    if os.path.lexists(latest) and not latest.is_file():  # a run writes it after every checkpoint: refused now,
        # not after the steps it took (and a directory, a FIFO or a link to nothing there is not llmc's pointer)
        from llmc_cli.formats.files import special_file
        what = ("a directory" if latest.is_dir() else special_file(latest)
                or "a symbolic link to nothing (or a loop of links)")
        raise RunDirError(f"--out {out}: {latest} is {what}, not llmc's pointer to the newest checkpoint (a file "
                          "naming a step_NNNNNNNN folder); move it, or give another --out; nothing was changed")
    if resume and not is_run_dir(out):
        raise RunDirError(f"--resume: --out {out} holds no run to continue (no 'latest' and no step_NNNNNNNN "
                          "checkpoint folder); leave out --resume to start a new run there")
    if not resume and is_run_dir(out):
        held = step_dirs(out)
        raise RunDirError(f"--out {out} already holds a run (checkpoints up to {held[-1].name if held else '?'}); "
                          "add --resume to continue it, or give another --out; nothing was changed")


class RunLock:
    """Exclusive ownership of a run directory for this process's life (flock on RUN/.lock).

    `acquire` creates the directory if needed; `release` removes the lock file, and the directory too when
    this process created it and left nothing in it (a run that failed before writing anything)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> "RunLock":
        import fcntl
        path = self.run_dir / LOCK_FILE
        try:
            self._created = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"--out {self.run_dir}: cannot create the run directory ({e.strerror or e})") from None
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunDirError(f"--out {self.run_dir}: cannot create its lock file {LOCK_FILE} "
                                  f"({e.strerror or e})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise RunDirError(f"--out {self.run_dir} is in use by another llmc process (pid {holder}); wait for "
                                  "it to finish or stop it, or give another --out; nothing was changed") from None
            except OSError as e:  # a file system without locks: say so rather than run unprotected
                os.close(fd)
                raise RunDirError(f"--out {self.run_dir}: cannot lock {LOCK_FILE} ({e.strerror or e}); "
                                  "this file system does not support file locks") from None
            try:  # the holder unlinks the file as it lets go: a lock on an unlinked file guards nothing
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:  # who holds it, for the message another process prints
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # unlinked while still held, so no one can lock the old file after us (see acquire)
            (self.run_dir / LOCK_FILE).unlink()
            if self._created and not any(self.run_dir.iterdir()):  # a run that failed before writing anything
                self.run_dir.rmdir()
        except OSError:
            pass
        os.close(fd)  # closing drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
