"""Where a training step's time goes, rank by rank: `LLMC_STEP_PHASES=DIR` makes every rank append one JSON line a
step to DIR/rank<r>.jsonl (`bench/step_phases.py` summarizes them).

A step's device time (the backend's timer, events where it has them) is cut at the marks the trainer and the
optimizer set: `stage` (the first batch made the inputs; on the step that captures the graphs, the capture too),
`compute` (forward and backward of every micro-step), `reduce` (gradients averaged over the ranks), `guard` (norm,
loss and the skip verdict), `adamw` (the updates), `gather` (the rest: ZeRO's all-gather of the parameters or the
barrier that replaces it, the read of the step's result, FP8's amax all-reduce). Beside each, the host clock at the
same call, so a phase the device spent waiting for the host shows; `gap` is the host's time from the end of one
step's line to the start of the next step (logging, the stop check), which no step time counts. With a host-clock
timer every mark waits for the device, so there the marks change what they measure. Lines are appended: give each
run a directory of its own."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

ENV = "LLMC_STEP_PHASES"


class StepPhases:
    def __init__(self, directory: str | Path, rank: int):
        from llmc_cli.formats.runlog import is_llmc_log
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"rank{rank}.jsonl"  # one per rank: the ranks never share a file
        # appended to only if it is a file of step lines (or empty): anything else there is the user's and stays,
        # and a FIFO or a device would block or swallow the lines
        if self.path.exists() and not (self.path.is_file() and is_llmc_log(self.path)):
            raise FileExistsError(errno.EEXIST, "exists and is not a file of step lines (one JSON object with a "
                                  "'step' per line)", str(self.path))
        self.file = open(self.path, "a")
        self.timer = None
        self.names: list[str] = []
        self.host: list[float] = []
        self.last_end: float | None = None

    def begin(self, timer) -> None:
        """After timer.start(): the step's first host time."""
        self.timer, self.names, self.host = timer, [], [time.perf_counter()]

    def mark(self, name: str) -> None:
        if self.timer is None:  # (an optimizer step outside a training step: a profiler's, say)
            return
        self.timer.mark()
        self.names.append(name)
        self.host.append(time.perf_counter())

    def end(self, step: int, seconds: float) -> None:
        """After timer.stop() returned `seconds`: one line for `step`."""
        now = time.perf_counter()
        dev = [0.0] + self.timer.marks() + [seconds]
        host = self.host + [now]
        names = self.names + ["gather"]
        ms = lambda a, b: round((b - a) * 1e3, 4)  # noqa: E731
        rec = {"step": step, "ms": round(seconds * 1e3, 4),
               "device_ms": {n: ms(dev[i], dev[i + 1]) for i, n in enumerate(names)},
               "host_ms": {n: ms(host[i], host[i + 1]) for i, n in enumerate(names)},
               "gap_ms": None if self.last_end is None else ms(self.last_end, self.host[0])}
        try:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        except OSError as e:  # (a write's error names no file: a full disk would say only "No space left")
            raise OSError(e.errno, f"{e.strerror} (writing {ENV}'s step phases)", str(self.path)) from None
        self.last_end = time.perf_counter()
        self.timer = None

    def close(self) -> None:
        self.file.close()


def open_step_phases(backend, rank: int) -> StepPhases | None:
    """The recorder of this rank's step phases where ENV names a directory (None: it names none). ValueError where
    the backend's timer sets no marks or the directory takes no file."""
    where = os.environ.get(ENV)
    if not where:
        return None
    if not callable(getattr(backend.timer(), "marks", None)):
        raise ValueError(f"{ENV}: the {backend.name} backend's timer sets no marks (Timer.mark/marks)")
    try:
        return StepPhases(where, rank)
    except OSError as e:
        raise ValueError(f"{ENV}={where}: cannot write the step phases there "
                         f"({f'{e.filename}: ' if e.filename and str(e.filename) != where else ''}"
                         f"{e.strerror or type(e).__name__}); give a directory llmc may create or append to") from None
