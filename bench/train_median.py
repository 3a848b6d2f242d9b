"""Median step time and tok/s of an `llmc train` log (stdout lines), skipping the first steps.

    python bench/train_median.py LOG [--skip 3]
"""

from __future__ import annotations

import argparse
import re
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--skip", type=int, default=3, help="leading steps left out (compilation, tuning, warm-up)")
    o = ap.parse_args()
    ms = []
    for line in open(o.log):
        m = re.search(r"step +(\d+)/\d+ \|.*\| ([\d.]+) ms \| (\d+) tok/s", line)
        if m and int(m.group(1)) > o.skip:
            ms.append((float(m.group(2)), int(m.group(3)) * float(m.group(2))))
    if not ms:
        raise SystemExit(f"{o.log}: no step lines")
    med = statistics.median(t for t, _ in ms)
    tokens = ms[0][1] / 1000.0
    print(f"{o.log}: {len(ms)} steps after step {o.skip}: median {med:.1f} ms/step, {tokens / med * 1000 / 1000:.0f}k "
          f"tok/s (min {min(t for t, _ in ms):.1f}, max {max(t for t, _ in ms):.1f} ms)")


if __name__ == "__main__":
    main()
