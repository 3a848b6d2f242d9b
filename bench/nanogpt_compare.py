"""llmc's Quick start against nanoGPT's CPU recipe on the same characters: loss against wall-clock seconds for both,
alternated run by run on one machine, in one plot.

    python bench/nanogpt_compare.py --nanogpt ~/src/nanoGPT [--rounds 1] [--work /tmp/llmc-vs-nanogpt] \
        [--png docs/quickstart-vs-nanogpt.png] [--json results.json]

Both train on the byte shards of `llmc tokenize shakespeare --tokenizer bytes` (42 plays and poems): nanoGPT reads
the same token streams, each byte mapped to a character index of its own (85 symbols: 84 characters and the
end-of-text between documents), so a loss per character is a loss per byte and both validate on the same text.
nanoGPT runs its shakespeare-char config with the CPU overrides from its README (`--device=cpu --compile=False
--eval_iters=20 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0`); llmc runs the README's Quick start training command (QUICKSTART_TRAIN).
Each process is timed from its start (imports included) by when its lines arrive; tok/s is tokens trained over
that time. nanoGPT's code is read from --nanogpt (a checkout of karpathy/nanoGPT), never copied here; PyTorch (CPU)
is a test-only tool of llmc's.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# the README's Quick start, word for word but for --out and the data directory (tests/bench checks it is)
QUICKSTART_TRAIN = ("llmc train --backend cpu --model bytes-d4 -b 12 -t 64 --steps 2000 --lr 2e-3 --warmup 50 "
                    "--lr-decay-frac 0.1 --weight-decay 0.1 --beta2 0.99 --shuffle --val-every 250 --sample-every 0 "
                    "--data datasets/shakespeare --out checkpoints/shakespeare")
NANOGPT_ARGS = ["--device=cpu", "--compile=False", "--eval_iters=20", "--block_size=64", "--batch_size=12",
                "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000",
                "--dropout=0.0"]
TOKENS_PER_STEP = 12 * 64  # both: B=12, T=64, no accumulation
TARGET = 1.87  # nanoGPT's val loss at its end on this machine (issue 39)

_LLMC_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss ([\d.]+)")
_LLMC_VAL = re.compile(r"^step (\d+): val loss ([\d.]+)")
_NANO_STEP = re.compile(r"^iter (\d+): loss ([\d.]+)")
_NANO_VAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def llmc_command(work: Path) -> list[str]:
    cmd = shlex.split(QUICKSTART_TRAIN)
    cmd[cmd.index("--data") + 1] = str(work / "datasets" / "shakespeare")
    cmd[cmd.index("--out") + 1] = str(work / "run")
    return [sys.executable, "-m", "llmc_cli"] + cmd[1:]


def prepare(work: Path, nanogpt: Path) -> Path:
    """The byte shards (llmc tokenize) and nanoGPT's copy of them; returns nanoGPT's working directory."""
    data = work / "datasets" / "shakespeare"
    subprocess.run([sys.executable, "-m", "llmc_cli", "tokenize", "shakespeare", "--tokenizer", "bytes",
                    "--out-dir", str(data)], check=True)
    nano = work / "nanogpt"
    out = nano / "data" / "shakespeare_bytes"
    out.mkdir(parents=True, exist_ok=True)
    train = np.fromfile(next(data.glob("*_train_*.bin")), "<u2", offset=1024)
    val = np.fromfile(next(data.glob("*_val_*.bin")), "<u2", offset=1024)
    ids = np.unique(np.concatenate([train, val]))
    index = np.zeros(257, np.uint16)
    index[ids] = np.arange(len(ids))
    index[train].tofile(out / "train.bin")
    index[val].tofile(out / "val.bin")
    itos = {i: chr(b) if b < 256 else "\n" for i, b in enumerate(ids.tolist())}
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(ids), "itos": itos, "stoi": {c: i for i, c in itos.items()}}, f)
    link = nano / "configurator.py"  # (train.py reads it from the working directory)
    if not link.exists():
        link.symlink_to(nanogpt / "configurator.py")
    return nano


def timed(cmd: list[str], cwd: Path, patterns: dict[str, re.Pattern], log: Path, limit: float | None,
          env: dict | None = None) -> dict:
    """Run `cmd` (stopped after `limit` seconds), noting when each line arrives in `log`; its curves (read_log)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", **(env or {}))
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p, \
            open(log, "w") as f:
        stopper = threading.Timer(limit, p.terminate) if limit else None
        if stopper:
            stopper.start()
        for line in p.stdout:
            f.write(f"{time.perf_counter() - t0:9.3f} {line}")
            f.flush()
        if stopper:
            stopper.cancel()
    if p.returncode and not (limit and time.perf_counter() - t0 >= limit):
        raise SystemExit(f"{cmd[0]} ... exited {p.returncode}; see {log}")
    return read_log(log, patterns)


def read_log(log: Path, patterns: dict[str, re.Pattern]) -> dict:
    """{name: [(seconds, step, loss)] of the lines `patterns[name]` matches, "seconds": the last line's time}."""
    curves: dict = {k: [] for k in patterns}
    t = 0.0
    for row in log.read_text().splitlines():
        stamp, _, line = row.strip().partition(" ")
        try:
            t = float(stamp)
        except ValueError:
            continue
        for name, pat in patterns.items():
            if m := pat.match(line.strip()):
                curves[name].append((round(t, 3), int(m.group(1)), float(m.group(2))))
    curves["seconds"] = round(t, 3)
    return curves


def summary(name: str, c: dict) -> dict:
    steps = max((s for _, s, _ in c["train"]), default=0)
    reach = next((t for t, _, v in c["val"] if v < TARGET), None)
    final = c["val"][-1][2] if c["val"] else None
    return {"name": name, "seconds": c["seconds"], "tok_per_s": round(steps * TOKENS_PER_STEP / c["seconds"]),
            "final_val": final, f"seconds_to_val_below_{TARGET}": reach}


def plot(runs: list[dict], png: Path) -> None:
    import matplotlib  # (a plotting library for this script alone)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colours = {"llmc": "tab:blue", "nanoGPT": "tab:orange"}
    for k, r in enumerate(runs):
        c, first = colours[r["name"]], k < 2
        t, _, loss = zip(*r["curves"]["train"])
        ax.plot(t, loss, color=c, alpha=0.2, lw=0.6)
        t, _, val = zip(*r["curves"]["val"])
        ax.plot(t, val, color=c, marker="o", ms=3, lw=1.5,
                label=f"{r['label']} val ({r['tok_per_s']:,} tok/s)" if first else None)
    ax.axhline(TARGET, color="grey", ls="--", lw=0.8, label=f"val {TARGET}")
    ax.set_xlabel("seconds since the process started")
    ax.set_ylabel("loss per byte (nats)")
    ax.set_ylim(1.4, 4.6)
    loads = [r["load_average"] for r in runs if r.get("load_average") is not None]
    where = f", load average {max(loads):.0f} at the start" if loads else ""
    ax.set_title(f"Shakespeare bytes, 4 layers x 128 channels, B=12 T=64, {os.cpu_count()} CPU cores{where}",
                 fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each, alternated")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmc-vs-nanogpt"))
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "quickstart-vs-nanogpt.png")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--time-limit", type=float, default=None, help="stop each run after this many seconds")
    ap.add_argument("--replot", action="store_true", help="plot the logs an earlier run left in --work")
    ap.add_argument("--nanogpt-threads", type=int, default=None,
                    help="PyTorch's threads for nanoGPT (OMP_NUM_THREADS; default: PyTorch's, one per core)")
    a = ap.parse_args()
    nanogpt = a.nanogpt.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    nano = a.work / "nanogpt" if a.replot else prepare(a.work, nanogpt)
    nano_cmd = [sys.executable, str(nanogpt / "train.py"), str(nanogpt / "config" / "train_shakespeare_char.py"),
                "--dataset=shakespeare_bytes", f"--out_dir={nano / 'out'}"] + NANOGPT_ARGS
    patterns = {"llmc": {"train": _LLMC_STEP, "val": _LLMC_VAL}, "nanoGPT": {"train": _NANO_STEP, "val": _NANO_VAL}}
    runs = []
    for r in range(a.rounds):
        for name in ("llmc", "nanoGPT"):
            log = a.work / f"{name.lower()}_{r}.log"
            if a.replot:
                c = read_log(log, patterns[name])
            elif name == "llmc":
                shutil.rmtree(a.work / "run", ignore_errors=True)
                c = timed(llmc_command(a.work), REPO, patterns[name], log, a.time_limit)
            else:
                threads = {"OMP_NUM_THREADS": str(a.nanogpt_threads)} if a.nanogpt_threads else {}
                c = timed(nano_cmd, nano, patterns[name], log, a.time_limit, threads)
            label = f"nanoGPT, {a.nanogpt_threads} PyTorch thread(s)" if name == "nanoGPT" and a.nanogpt_threads \
                else name
            load = None if a.replot else os.getloadavg()[0]
            runs.append(summary(name, c) | {"label": label, "load_average": load, "curves": c})
            print(json.dumps(runs[-1] | {"curves": None}), flush=True)
    plot(runs, a.png)
    if a.json:
        a.json.write_text(json.dumps(runs, indent=1))
    print(f"plot: {a.png}")


if __name__ == "__main__":
    main()
