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

from llmc_cli.formats.files import DirectoryLock, non_folder_above
from llmc_cli.naming import arg

_STEP_NAME = re.compile(r"step_([0-9]{8,20})")  # (int() of a name of 5,000 digits would raise)
STEP_DIGITS = 8  # the least a step folder's number is written with: step_00000042 ... step_100000000
LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message names it and says what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:0{STEP_DIGITS}d}"


def step_of(name: str) -> int | None:
    """The step a folder name is llmc's name for (step_dir_name's inverse), else None. Every reader of step folder
    names goes through here: a pattern of eight digits left step_100000000 unpruned by --keep and unseen by a
    resume. A name llmc never writes (step_000000042, step_best, step_00000003.bak) is the user's, never a step."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m is not None and step_dir_name(int(m.group(1))) == name else None


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The step folders of a directory, oldest (lowest step) first, complete or not."""
    try:
        found = [(step, p) for p in Path(run_dir).iterdir() if (step := step_of(p.name)) is not None and p.is_dir()]
    except OSError:
        return []
    return [p for _, p in sorted(found)]


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "latest").exists() or bool(step_dirs(path)))


def step_folder_of(path: str | Path) -> Path | None:
    """The checkpoint folder (a run's `step_NNNNNNNN`) that `path` is or lies inside, else None: llmc writes
    nothing there but the checkpoint itself."""
    for p in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):  # (and through links)
        for d in (p, *p.parents):
            if step_of(d.name) is not None and is_run_dir(d.parent):
                return d
    return None


def check_outside_checkpoints(path: str | Path, option: str, error: type[Exception] = RunDirError) -> None:
    """What a command writes (a plot, shards, a log) never goes into a checkpoint folder: `--keep` deletes the
    folder with whatever else is in it, and a resume would read a folder changed after it was written."""
    if (step := step_folder_of(path)) is not None:
        raise error(f"{option} {path} is inside the checkpoint {step}, which llmc deletes whole under "
                    f"{arg('keep')}; give a path outside the step folders")


def check_out(out: str | Path, resume: bool) -> None:
    """A fresh run must not write into another run's directory; --resume needs one to continue."""
    out, opt, again = Path(out), arg("out"), arg("resume", True)
    if out.is_symlink() and not out.exists():  # (mkdir would say only "File exists")
        raise RunDirError(f"{opt} {out} is a symbolic link to nothing (or a loop of links); expected a run directory "
                          f"(new, or holding a run to {again})")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{opt} {out} is a file; expected a run directory (new, or holding a run to {again})")
    if not os.path.lexists(out) and (above := non_folder_above(out.absolute())) is not None:  # (made at the start)
        raise RunDirError(f"{opt} {out}: {above} is not a directory; give a run directory in a directory")
    check_outside_checkpoints(out, opt)
    if out.is_dir():  # a file or a link to nothing under a step's name: its checkpoint could not be written there
        for p in sorted(out.iterdir()):
            if step_of(p.name) is not None and not p.is_dir():
                raise RunDirError(f"{opt} {out}: {p.name} is not a checkpoint folder; llmc will not replace it, so "
                                  f"move it or give another {opt}")
    latest = out / "latest"
    if os.path.lexists(latest) and not latest.is_file():  # a run writes it after every checkpoint: refused now,
        # not after the steps it took (and a directory, a FIFO or a link to nothing there is not llmc's pointer)
        from llmc_cli.formats.files import not_a_file
        raise RunDirError(f"{opt} {out}: {latest} is {not_a_file(latest)}, not llmc's pointer to the newest checkpoint "
                          f"(a file naming a step_NNNNNNNN folder); move it, or give another {opt}; nothing was "
                          "changed")
    if resume and not is_run_dir(out):
        raise RunDirError(f"{again}: {opt} {out} holds no run to continue (no 'latest' and no step_NNNNNNNN "
                          f"checkpoint folder); leave out {again} to start a new run there")
    if not resume and is_run_dir(out):
        held = step_dirs(out)
        if not held:  # ('latest' alone: a pointer to no checkpoint, perhaps not llmc's at all)
            raise RunDirError(f"{opt} {out} holds a file named 'latest' but no step_NNNNNNNN checkpoint folder; "
                              f"move it, or give another {opt}; nothing was changed")
        raise RunDirError(f"{opt} {out} already holds a run (checkpoints up to {held[-1].name}); "
                          f"add {again} to continue it, or give another {opt}; nothing was changed")


class RunLock(DirectoryLock):
    """Exclusive ownership of a run directory for this process's life (flock on RUN/.lock; see DirectoryLock)."""

    def __init__(self, run_dir: str | Path):
        super().__init__(run_dir, LOCK_FILE, arg("out"), "the run directory", RunDirError, f"give another {arg('out')}")
        self.run_dir = self.directory
