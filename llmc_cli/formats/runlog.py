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

from llmc_cli.formats.rundir import step_folder_of


class LogError(ValueError):
    """A --log path llmc must not write to; the message names it."""


def _is_record(line: bytes) -> bool:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and type(rec.get("step")) is int


def is_llmc_log(path: str | Path) -> bool:
    """An empty file, or one whose lines are all llmc records (a torn last line from a kill is allowed)."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    complete, last = lines[:-1], lines[-1]
    return all(_is_record(line) for line in complete if line.strip()) and (
        not last.strip() or _is_record(last) or bool(complete))


def check_log(path: str | Path) -> None:
    """Refuses a --log path that is not new, not empty and not an llmc log, or that lies in a checkpoint."""
    path = Path(path)
    if (step := step_folder_of(path)) is not None:
        raise LogError(f"--log {path}: inside the checkpoint {step}; give a path outside the step folders")
    if not path.exists():
        return
    if not path.is_file():
        raise LogError(f"--log {path}: not a regular file")
    try:
        ok = is_llmc_log(path)
    except OSError as e:
        raise LogError(f"--log {path}: cannot read it ({e.strerror or e})") from None
    if not ok:
        raise LogError(f"--log {path}: exists and is not an llmc log (one JSON object with a 'step' per line); "
                       "llmc appends only to its own logs, so give a new path; nothing was changed")


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
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                s = int(rec["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if ("loss" in rec and s <= step) or ("loss" not in rec and s < step):
                keep.append(line if line.endswith(b"\n") else line + b"\n")
    from llmc_cli.formats.files import atomic_write_bytes
    atomic_write_bytes(path, keep)
