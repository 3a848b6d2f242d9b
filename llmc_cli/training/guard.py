"""Outlier detection for the step guard: llm.c's ``llmc/outlier_detector.h``, a sliding window of the last 128
values and the z-score of a new value against it, NaN until the window is (nearly) full; and why a step's update
was skipped, in words."""

from __future__ import annotations

import math
from collections import deque

from llmc_cli.kernels import update_applies
from llmc_cli.naming import arg


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




def skip_reason(a, lr: float, loss: float, norm: float, zloss: float, znorm: float, max_loss: float) -> str:
    """Why the step guard skipped an update, given the run's arguments `a` and the step's values."""
    if not math.isfinite(lr):
        return f"non-finite learning rate {lr}"
    if not math.isfinite(loss) or not math.isfinite(norm):
        return "non-finite loss" if not math.isfinite(loss) else "non-finite grad norm"
    if not update_applies(loss, 0.0, max_loss, float("inf")):
        return f"loss z-score {zloss:.1f} > {arg('skip_loss_z')} {a.skip_loss_z:g}"
    return f"grad norm z-score {znorm:.1f} > {arg('skip_grad_z')} {a.skip_grad_z:g}"
