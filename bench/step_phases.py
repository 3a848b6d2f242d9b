"""Summarize the phase files `LLMC_STEP_PHASES=DIR llmc train ...` wrote (llmc_cli/training/phases.py): per run
directory and rank, the median device and host milliseconds of each phase over the steps after --skip, and the
spread of the step (so a rank that waits for the other shows as a longer `reduce` there).

    python bench/step_phases.py DIR [DIR ...] [--skip 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(path: Path, skip: int) -> dict:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r["step"] > skip]
    if not recs:
        return {}
    names = list(recs[0]["device_ms"])
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    q = lambda xs, p: round(sorted(xs)[min(len(xs) - 1, int(p * len(xs)))], 3)  # noqa: E731
    steps = [r["ms"] for r in recs]
    gaps = [r["gap_ms"] for r in recs if r.get("gap_ms") is not None]
    return {"steps": len(recs), "ms": med(steps), "ms_p10": q(steps, 0.1), "ms_p90": q(steps, 0.9),
            "device_ms": {n: med([r["device_ms"][n] for r in recs]) for n in names},
            "host_ms": {n: med([r["host_ms"][n] for r in recs]) for n in names},
            "gap_ms": med(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    o = ap.parse_args()
    out = {}
    names = [Path(d).name for d in o.dirs]
    for d, name in zip(o.dirs, names):
        if names.count(name) > 1:  # two runs' directories of one name: told apart by their whole paths
            name = str(Path(d))
        for f in sorted(Path(d).glob("rank*.jsonl")):
            s = summarize(f, o.skip)
            if s:
                out[f"{name}/{f.stem}"] = s
    if o.json:
        print(json.dumps(out, indent=1))
        return
    for key, s in out.items():
        dev = " ".join(f"{n} {v:.2f}" for n, v in s["device_ms"].items())
        host = " ".join(f"{n} {v:.2f}" for n, v in s["host_ms"].items())
        print(f"{key}: {s['steps']} steps, median {s['ms']:.2f} ms (p10 {s['ms_p10']:.2f}, p90 {s['ms_p90']:.2f}), "
              f"host gap {s['gap_ms']} ms\n  device: {dev}\n  host:   {host}")


if __name__ == "__main__":
    main()
