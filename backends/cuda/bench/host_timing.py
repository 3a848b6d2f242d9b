"""The wall-clock timer the decode profiles share (decode_profile.py, sample_profile.py): imported from this
folder, which is a script's first path."""

from __future__ import annotations

import time


def per_call_ms(be, fn, n: int) -> float:
    """Milliseconds a call of `fn` takes over `n` calls, the backend's queue drained before and after."""
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    be.synchronize()
    return (time.perf_counter() - t0) / n * 1e3
