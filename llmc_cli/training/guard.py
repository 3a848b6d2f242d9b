"""Keeping long runs alive and honest: outlier detection, graceful stop on SIGINT/SIGTERM, resume hints,
out-of-memory reports and missing optional packages.

* ``OutlierDetector`` is llm.c's (``llmc/outlier_detector.h``): a sliding window of the last 128 values; the
  z-score of a new value against the window, NaN until the window is (nearly) full.
* ``StopSignals`` turns the first SIGINT/SIGTERM/SIGHUP into a request the training loop honours after the
  current step (then it checkpoints, and `llmc train` exits 75); a second signal raises ``TrainAborted`` at once.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import threading
from collections import deque


class OutlierDetector:
    """z-score of each new value against the previous `window` values (llm.c's OutlierDetector).

    ``update(x)`` returns the z-score of x relative to the values seen before it and then adds x to the
    window; NaN while fewer than `min_count` values (default: the whole window) have been seen, or when x is
    not finite (non-finite values never enter the window)."""

    def __init__(self, window: int = 128, min_count: int | None = None):
        if window < 2:
            raise ValueError(f"outlier window must be >= 2 (got {window})")
        self.window = window
        self.min_count = window if min_count is None else max(2, min(min_count, window))
        self.values: deque[float] = deque(maxlen=window)

    def _stats(self) -> tuple[float, float]:
        n = len(self.values)
        mean = math.fsum(self.values) / n
        var = math.fsum((v - mean) ** 2 for v in self.values) / n
        return mean, math.sqrt(var)

    def bound(self, z: float) -> float:
        """The largest value whose z-score is not above `z` (> 0): mean + z * std of the window, so that
        `x > bound(z)` is `zscore(x) > z` (with std 0: any x above the mean); inf while z-scores are NaN (the
        window not yet full) or when z <= 0 (off). Lets the device take the skip decision (`step_guard`)."""
        if not z > 0 or len(self.values) < self.min_count:
            return float("inf")
        mean, std = self._stats()
        return mean + z * std

    def zscore(self, x: float) -> float:
        if not math.isfinite(x) or len(self.values) < self.min_count:
            return float("nan")
        mean, std = self._stats()
        if std == 0.0:
            return 0.0 if x == mean else math.copysign(float("inf"), x - mean)
        return (x - mean) / std

    def update(self, x: float) -> float:
        z = self.zscore(x)
        if math.isfinite(x):
            self.values.append(float(x))
        return z

    def state(self) -> list[float]:
        return list(self.values)

    def load_state(self, values) -> None:
        self.values = deque((float(v) for v in values), maxlen=self.window)


# ---- signals ----------------------------------------------------------------------------------------------------
class TrainAborted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM while the first was still being honoured: stop now, write nothing more."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


class StopSignals:
    """Context manager: the first SIGINT/SIGTERM sets ``requested`` (the loop finishes its step, checkpoints and
    returns); a second one raises TrainAborted from wherever the main thread is. Outside the main thread it
    installs nothing."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # SIGHUP: the terminal or ssh session went away

    def __init__(self, note=None):
        self.requested: str | None = None
        self._old: dict[int, object] = {}
        self._note = note if note is not None else self._stderr

    @staticmethod
    def _stderr(msg: str) -> None:
        try:
            os.write(2, (msg + "\n").encode())
        except OSError:
            pass

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            self._note(f"{name}: finishing the current step, then writing a checkpoint "
                       f"(send it again to abort at once)")
            return
        self.restore()
        raise TrainAborted(name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._old[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old = {}

    def __exit__(self, *exc) -> None:
        self.restore()


def resume_command(ctx) -> str:
    """The command line that was run (the options given explicitly, from click's context) plus --resume."""
    from llmc_cli.parallel.launch import child_args

    parts = ["llmc"] + child_args(ctx, drop=())
    if "--resume" not in parts:
        parts.append("--resume")
    return shlex.join(parts)


# ---- out of memory ----------------------------------------------------------------------------------------------
def is_out_of_memory(e: BaseException) -> bool:
    """MemoryError (numpy, CuPy's OutOfMemoryError) or a backend's allocation failure (OpenCL, CUDA)."""
    if isinstance(e, MemoryError):
        return True
    name = type(e).__name__.lower()
    text = str(e).lower()
    return ("outofmemory" in name or name == "memoryerror" or "out of memory" in text
            or "mem_object_allocation_failure" in text or "out_of_resources" in text
            or "cudaerrormemoryallocation" in text)


def out_of_memory_message(e: BaseException, backend, cfg, B: int, T: int) -> str:
    """One line: what the plan asks for, what the device has free (when it says), and what to lower."""
    asked = None
    try:
        from llmc_cli.models.families import memory_plan
        asked = sum(memory_plan(cfg, B, T, backend.dtype).values())
    except Exception:
        pass
    parts = [f"out of memory on --backend {getattr(backend, 'name', '?')} planning B={B} T={T}"]
    if asked:
        parts.append(f"the run needs {asked / 2**30:.2f} GiB")
    try:
        r = backend.memory_report()
        held = f"{r.allocated / 2**30:.2f} GiB allocated when it failed"
        if r.device_free is not None:
            held += f", {r.device_free / 2**30:.2f} GiB free"
            if r.device_total:
                held += f" of {r.device_total / 2**30:.2f} GiB"
        parts.append(held)
    except Exception:
        pass
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    return ("; ".join(parts) + f" ({detail}); lower -b/--batch-size (keep the step size with "
            "--total-batch-size) or -t/--seq-len, or activation --recompute where the backend offers it; "
            "`llmc train --dry-run` shows the plan")


# ---- missing optional packages ----------------------------------------------------------------------------------
PIP_NAMES = {"pyarrow": "pyarrow", "datasets": "datasets", "safetensors": "safetensors", "torch": "torch",
             "pyopencl": "'pyopencl[pocl]'", "cupy": "cupy-cuda12x", "tiktoken": "tiktoken",
             "hypothesis": "hypothesis", "huggingface_hub": "huggingface_hub", "transformers": "transformers",
             "nvmath": "nvmath-python", "cudnn": "nvidia-cudnn-frontend", "whisper": "--no-deps openai-whisper",
             "mpi4py": "mpi4py"}


def missing_package_message(e: ModuleNotFoundError) -> str:
    mod = (e.name or str(e)).split(".")[0]
    pip = PIP_NAMES.get(mod, mod)
    return f"this needs the optional package '{mod}', which is not installed: pip install {pip}"


def fault_delay(phase: str) -> None:
    """Test hook: LLMC_FAULT_CHECKPOINT_DELAY=seconds sleeps at each phase of a checkpoint write, so a test's
    SIGKILL lands inside one. Unset (always, outside tests): does nothing."""
    d = os.environ.get("LLMC_FAULT_CHECKPOINT_DELAY")
    if d:
        import time
        time.sleep(float(d))
