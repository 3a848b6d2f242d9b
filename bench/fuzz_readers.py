#!/usr/bin/env python
"""Fuzz every binary-format reader for minutes (tests/formats/test_fuzz.py is the bounded CI version).

    python bench/fuzz_readers.py                      # 60 s per format
    python bench/fuzz_readers.py --seconds 600 --only shard,model_bin

Each format: a valid seed file mutated by hypothesis (header fields overwritten with interesting values,
bytes flipped, cuts, garbage appended) plus pure noise. A reader may only raise its clean error class
(CheckpointError / DataError / TokenizerError); anything else is printed with the input that caused it and
the exit code is 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from fuzz_targets import TARGETS, check_target, mutated_bytes  # noqa: E402


def fuzz_one(name: str, seconds: float, batch: int = 300) -> tuple[int, str | None]:
    """Batches of `batch` random examples (fresh seed each) until `seconds` are up."""
    target = TARGETS[name]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        seed = target.seed(d)
        deadline = time.monotonic() + seconds
        count = [0]

        @settings(max_examples=batch, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=mutated_bytes(seed, target.header_ints))
        def run(data):
            count[0] += 1
            check_target(target, d, data)

        while time.monotonic() < deadline:
            try:
                run()
            except Exception as e:  # hypothesis re-raises the shrunk failure, with the falsifying input
                return count[0], f"{type(e).__name__}: {e}"
    return count[0], None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="time per format (default 60)")
    ap.add_argument("--only", default="", help=f"comma-separated formats (of: {', '.join(sorted(TARGETS))})")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or sorted(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(sorted(TARGETS))}")
    bad = 0
    for name in names:
        t0 = time.monotonic()
        n, err = fuzz_one(name, args.seconds)
        dt = time.monotonic() - t0
        status = "ok" if err is None else f"FAIL {err}"
        print(f"{name:16s} {n:8d} inputs in {dt:6.1f} s ({n / max(dt, 1e-9):7.0f}/s)  {status}", flush=True)
        bad += err is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
