"""The run log: one JSON object per line (`log.jsonl`), what `llmc plot` reads and `--resume` trims.

llmc appends only to a file that is already one of its logs (or new, or empty): `--log` pointed at a data
shard, a checkpoint's state.json or any other file is refused, never truncated. Records are strict JSON
(a non-finite value is written as null), so every reader of the format can parse them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO

from llmc_cli.formats.rundir import check_outside_checkpoints
from llmc_cli.naming import arg


class LogError(ValueError):
    """A --log path llmc must not write to; the message names it."""


def _is_record(line: bytes) -> bool:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and type(rec.get("step")) is int


LINE_MAX_BYTES = 1 << 20  # a record is a few hundred bytes: a longer line is no record (a sparse or stray big file)


def log_lines(f: IO[bytes]):
    """The lines of a log opened in binary, each read at most LINE_MAX_BYTES + 1 bytes at a time: a file that is
    one line of gigabytes (a sparse file, a stray dump) is never held whole. A longer line comes out cut at that
    length, without its newline, which no reader takes for a record."""
    while line := f.readline(LINE_MAX_BYTES + 1):
        yield line
        if len(line) > LINE_MAX_BYTES and not line.endswith(b"\n"):
            return  # (what follows the cut is no record either: the caller has its verdict)


def is_llmc_log(path: str | Path) -> bool:
    """An empty file, or one whose lines are all llmc records (a torn last line from a kill is allowed). Read
    line by line: a big file that is not a log is refused at its first long line, not read whole."""
    seen_complete = False
    with open(path, "rb") as f:
        for line in log_lines(f):
            if len(line) > LINE_MAX_BYTES:
                return False
            if not line.endswith(b"\n"):  # the last line, torn by a kill mid-write
                return not line.strip() or _is_record(line) or seen_complete
            if line.strip() and not _is_record(line):
                return False
            seen_complete = True
    return True


def check_log(path: str | Path) -> None:
    """Refuses a --log path that is not new, not empty and not an llmc log, or that lies in a checkpoint."""
    path, opt = Path(path), arg("log")
    check_outside_checkpoints(path, opt, LogError)
    if not path.exists():
        return
    if not path.is_file():
        raise LogError(f"{opt} {path}: not a regular file")
    try:
        ok = is_llmc_log(path)
    except OSError as e:
        raise LogError(f"{opt} {path}: cannot read it ({e.strerror or e})") from None
    if not ok:
        raise LogError(f"{opt} {path}: exists and is not an llmc log (one JSON object with a 'step' per line); "
                       "give a new path; nothing was changed")


def log_lock(path: str | Path):
    """The lock that makes one run at a time the writer of the log at `path` (`.<name>.lock` beside the file it
    names, so two spellings or a symbolic link of one log meet): a second run given the same --log is refused in
    one line rather than interleaving its records with the first's (and, on --resume, trimming them away)."""
    import os

    from llmc_cli.formats.files import DirectoryLock, sibling_stem
    real = Path(os.path.realpath(path))
    return DirectoryLock(real.parent, f".{sibling_stem(real.name)}.lock", arg("log"), "the log's directory", LogError,
                         f"give another {arg('log')}", label=arg("log", path))


def is_runs_own_log(path: str | Path, out: str | Path | None, recorded: dict) -> bool:
    """Whether a resumed run's --log is the log that run wrote (inside its directory, or the --log it recorded):
    only that one is trimmed back to the checkpoint. Another run's log, given by mistake, is appended to whole."""
    import os
    real = Path(os.path.realpath(path))
    if out and real.is_relative_to(os.path.realpath(out)):
        return True
    rec = recorded.get("log")
    return isinstance(rec, str) and bool(rec) and Path(os.path.realpath(rec)) == real


def open_log(path: str | Path, resume_step: int | None) -> IO[str]:
    """The log opened for appending; on resume, first trimmed back to what the checkpoint at `resume_step`
    had logged. The caller has passed `path` through check_log (the Trainer does, as it starts)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        trim_log(path, resume_step)
    return open(path, "a")


def record_line(rec: dict) -> str:
    """One record as a strict JSON line (NaN and infinities become null)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def trim_log(path: str | Path, step: int) -> None:
    """Keep only what a run resumed at `step` will not write again: training records up to `step`, validation
    records before it; drops torn lines (a kill mid-write). Rewritten atomically."""
    import os
    path = Path(path)
    if not path.is_file():
        return
    path = Path(os.path.realpath(path))  # a --log given as a symbolic link: the log it names is trimmed, the link kept
    keep = []
    with open(path, "rb") as f:
        for line in log_lines(f):
            try:
                rec = json.loads(line)
                s = int(rec["step"])
            except (ValueError, KeyError, TypeError, RecursionError):  # (a torn or "[[[..." line is dropped)
                continue
            if ("loss" in rec and s <= step) or ("loss" not in rec and s < step):
                keep.append(line if line.endswith(b"\n") else line + b"\n")
    from llmc_cli.formats.files import atomic_write_bytes
    atomic_write_bytes(path, keep)
