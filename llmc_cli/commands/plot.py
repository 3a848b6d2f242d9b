"""`llmc plot`: training curves from run logs (the JSON lines `llmc train --log` writes) into one PNG.

Train records carry step, loss, norm, lr, ms, tok_per_s; validation records step and val_loss; HellaSwag records
hellaswag_acc_norm. matplotlib is optional (`pip install 'llmc[plot]'`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click

from llmc_cli.commands.options import Real

PANELS = [  # (title, [(record key, label suffix, line style)], log-scale y)
    ("loss", [("loss", "train", "-"), ("val_loss", "val", "--")], False),
    ("learning rate", [("lr", "", "-")], False),
    ("grad norm", [("norm", "", "-")], True),
    ("tokens/s", [("tok_per_s", "", "-")], False),
    ("HellaSwag acc_norm", [("hellaswag_acc_norm", "", "-o")], False),
]


class PlotError(ValueError):
    pass


def resolve_log(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        for name in ("log.jsonl", "train.jsonl"):
            if (p / name).is_file():
                return p / name
        found = sorted(p.glob("*.jsonl"))
        if len(found) == 1:
            return found[0]
        raise PlotError(f"{p}: no log.jsonl in this run directory (write one with `llmc train --log`)")
    if not p.is_file():
        raise PlotError(f"{p}: no such log file or run directory")
    return p


def read_log(path: str | Path) -> list[dict]:
    p = resolve_log(path)
    recs = []
    with open(p) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except ValueError:
                raise PlotError(f"{p}:{i}: not a JSON line (expected the log `llmc train --log` writes)") from None
            if isinstance(r, dict) and "step" in r:
                recs.append(r)
    if not recs:
        raise PlotError(f"{p}: no step records")
    return recs


def tokens_per_step(recs: list[dict]) -> float | None:
    for r in recs:
        if "tokens_per_step" in r:
            return float(r["tokens_per_step"])
        if "tok_per_s" in r and "ms" in r:
            return round(r["tok_per_s"] * r["ms"] / 1e3)
    return None


def ema(values: list[float], factor: float) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard-style smoothing), factor in [0, 1)."""
    if factor <= 0:
        return list(values)
    out, acc, w = [], 0.0, 0.0
    for v in values:
        acc = factor * acc + (1 - factor) * v
        w = factor * w + (1 - factor)
        out.append(acc / w)
    return out


def series(recs: list[dict], key: str, x: str, tps: float | None) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        step = r["step"]
        xs.append(r["tokens"] if x == "tokens" and "tokens" in r else step * tps if x == "tokens" else step)
        ys.append(float(v))
    return xs, ys


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png_target(path: str | Path, option: str = "--out") -> None:
    """A picture may replace only a PNG: anything else already at `path` is the user's and stays."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_file():
        raise PlotError(f"{option} {path}: not a file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(PNG_MAGIC))
    except OSError as e:
        raise PlotError(f"{option} {path}: cannot read it ({e.strerror or e})") from None
    if head != PNG_MAGIC:
        raise PlotError(f"{option} {path}: exists and is not a PNG; llmc replaces only PNG files, so give a new "
                        "path; nothing was changed")


def save_png(fig, path: str | Path, dpi: int, option: str = "--out") -> Path:
    """`fig` as a PNG at `path`, written under a temporary name and renamed (see check_png_target)."""
    check_png_target(path, option)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise PlotError(f"{option} {path}: cannot write it ({e.strerror or e})") from None
    return path


def plot_runs(runs: list[str], out: str | Path, x: str = "step", smooth: float = 0.0) -> Path:
    check_png_target(out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("matplotlib is not installed (pip install 'llmc[plot]' or pip install matplotlib)") from None
    logs = [(str(r), read_log(r)) for r in runs]
    panels = [p for p in PANELS if any(k in rec for _, recs in logs for rec in recs for k, _, _ in p[1])]
    ncol = 2 if len(panels) > 1 else 1
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.6 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys, logy) in zip(axes.flat, panels):
        for i, (name, recs) in enumerate(logs):
            tps = tokens_per_step(recs)
            if x == "tokens" and tps is None:
                raise PlotError(f"{name}: the log has no tok_per_s/ms to count tokens; plot against step")
            for key, suffix, style in keys:
                xs, ys = series(recs, key, x, tps)
                if not xs:
                    continue
                if key in ("loss", "norm", "tok_per_s"):
                    ys = ema(ys, smooth)
                label = name + (f" {suffix}" if suffix else "")
                ax.plot(xs, ys, style, color=colors[i % len(colors)], label=label, lw=1.2, ms=3)
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(logs) > 1 or len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    try:
        return save_png(fig, out, dpi=110)
    finally:
        plt.close(fig)


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", default="plot.png", show_default=True, type=click.Path(), help="PNG file to write.")
@click.option("--x", "x", type=click.Choice(["step", "tokens"]), default="step", show_default=True,
              help="Horizontal axis.")
@click.option("--smooth", type=Real(0, 1, max_open=True), default=0.0, show_default=True,
              help="EMA factor in [0, 1) applied to train loss, grad norm and tok/s (0 = raw).")
def plot(runs, out, x, smooth) -> None:
    """Plot loss (train and val), learning rate, grad norm and tok/s of one or more runs into a PNG.
    Each RUN is a run directory holding log.jsonl or a .jsonl log written by `llmc train --log`.

    \b
    Example:
      llmc plot checkpoints/run1 checkpoints/run2/log.jsonl --smooth 0.9 --x tokens --out curves.png
    """
    from llmc_cli.commands import console, fail
    try:
        path = plot_runs(list(runs), out, x, smooth)
    except PlotError as e:
        fail(str(e))
    console.print(f"wrote {path}")
