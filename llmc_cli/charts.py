"""PNG charts: training curves of run logs (`llmc plot`) and benchmark results (`llmc bench --plot`).
matplotlib is optional (`pip install 'llmc[plot]'`); files are written only where a PNG (or nothing) was."""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np

from llmc_cli.bench.backends import BenchError
from llmc_cli.formats.files import atomic_file, non_folder_above
from llmc_cli.formats.rundir import check_outside_checkpoints


def quiet(draw):
    """`draw` with Python's warnings ignored: matplotlib's (an empty legend, a log axis with no positive value,
    an overflow in its limits) are about the picture, nothing the user can act on, and stderr holds llmc's own
    lines only."""
    @functools.wraps(draw)
    def drawn(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return draw(*args, **kwargs)
    return drawn


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None


@quiet
def plot_kernels(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = list(dict.fromkeys(r["backend"] for r in res["results"]))
    kernels = list(dict.fromkeys(r["kernel"] for r in res["results"]))
    by = {(r["kernel"], r["backend"]): r for r in res["results"]}
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(kernels) * max(1, len(labels)) + 1.5))
    h = 0.8 / len(labels)
    for i, l in enumerate(labels):
        ys = [k_i + i * h for k_i in range(len(kernels))]
        med = [by[(k, l)]["median_ms"] if (k, l) in by else np.nan for k in kernels]
        lo = [m - by[(k, l)]["min_ms"] if (k, l) in by else 0 for k, m in zip(kernels, med)]
        hi = [by[(k, l)]["max_ms"] - m if (k, l) in by else 0 for k, m in zip(kernels, med)]
        ax.barh(ys, med, height=h, xerr=[lo, hi], label=l, capsize=2)
    ax.set_yticks([k + 0.4 - h / 2 for k in range(len(kernels))])
    ax.set_yticklabels(kernels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms per call (median, min-max bars)")
    c = res["config"]
    ax.set_title(f"llmc kernels, L={c['n_layer']} C={c['n_embd']} B={c['B']} T={c['T']}")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    try:
        save_png(fig, path, dpi=120, option="--plot")
    except PlotError as e:
        raise BenchError(str(e)) from None
    finally:
        plt.close(fig)


@quiet
def plot_train(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rs = res["results"]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rs) + 2), 4))
    names = [r["name"] for r in rs]
    tok = [r["tok_s"] for r in rs]
    # tokens/s from the slowest and fastest steps
    lo = [t - r["tok_s"] * r["median_ms"] / r["max_ms"] for t, r in zip(tok, rs)]
    hi = [r["tok_s"] * r["median_ms"] / r["min_ms"] - t for t, r in zip(tok, rs)]
    ax.bar(names, tok, yerr=[lo, hi], capsize=4, color=["C0" if r["kind"] == "llmc" else "C1" for r in rs])
    ax.set_ylabel("tokens / s (median, min-max bars)")
    c = res["config"]
    ax.set_title(f"llmc train step, L={c['n_layer']} C={c['n_embd']} B={c['B']} T={c['T']}")
    fig.tight_layout()
    _save(fig, path)


@quiet
def plot_overlap(res: dict, path: str) -> None:
    """Per backend: GB/s against batch size (each line at its fastest block size) and against block size (at the
    largest batch); a colour per mode and stream count, solid for pinned host memory, dashed for pageable."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmc_cli.bench.overlap import best
    rs, c = res["results"], res["config"]
    labels = list(dict.fromkeys(r["backend"] for r in rs))
    lines = list(dict.fromkeys((r["mode"], r["streams"]) for r in rs))
    top = max(c["batches"])
    fig, axes = plt.subplots(len(labels), 2, figsize=(12, 4.2 * len(labels)), squeeze=False)
    for row, label in zip(axes, labels):
        for i, (mode, s) in enumerate(lines):
            name = "sync" if mode == "sync" else f"chunked x{s}"
            for host in c["host_memory"]:
                where = dict(backend=label, mode=mode, streams=s, host_memory=host)
                style = dict(color=f"C{i % 10}", ls="-" if host == "pinned" else "--", marker="o", ms=3,
                             label=f"{name}, {host}")
                pts = [(B, best(rs, B=B, **where)) for B in c["batches"]]
                pts = [(B, r["gb_s"]) for B, r in pts if r is not None]
                if pts:
                    row[0].plot(*zip(*pts), **style)
                pts = [(b, best(rs, B=top, block=b, **where)) for b in c["blocks"]]
                pts = [(b, r["gb_s"]) for b, r in pts if r is not None]
                if pts:
                    row[1].plot(*zip(*pts), **style)
        row[0].set_title(f"{label}: GB/s against batch size (fastest block each)")
        row[0].set_xlabel(f"batch size B (rows = B x {c['T']}, {c['C']} floats each)")
        row[1].set_title(f"{label}: GB/s against block size, B={top}")
        row[1].set_xlabel("threads per block")
        for ax, ticks in zip(row, (c["batches"], c["blocks"])):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_ylabel("GB/s (inp in + out, mean, rstd out)")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"llmc bench overlap: float32 layernorm forward with its copies (median of {c['repeat']})")
    fig.tight_layout()
    _save(fig, path)


PANELS = [  # (title, y-axis label, [(record key, label suffix, line style)], log-scale y)
    ("loss", "cross-entropy (nats/token)", [("loss", "train", "-"), ("val_loss", "val", "--")], False),
    ("learning rate", "learning rate", [("lr", "", "-")], False),
    ("grad norm", "global L2 norm (before clipping)", [("norm", "", "-")], True),
    ("throughput", "tokens / s", [("tok_per_s", "", "-")], False),
    ("HellaSwag", "acc_norm (fraction)", [("hellaswag_acc_norm", "", "-o")], False),
]


def default_png(runs: list[str]) -> Path:
    """Where `llmc plot` writes without --out: into the run (beside its log) for one run, else plot.png here."""
    if len(runs) == 1:
        p = Path(runs[0])
        return (p if p.is_dir() else p.parent) / "plot.png"
    return Path("plot.png")


def run_labels(runs: list[str]) -> list[str]:
    """Short legend names: each run directory's name (a log file's own name when it is not log.jsonl), the
    path only where two names would be the same."""
    def short(r: str) -> str:
        p = Path(r)
        if p.is_dir():
            return p.resolve().name
        return p.parent.resolve().name if p.name == "log.jsonl" else p.stem
    names = [short(r) for r in runs]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


class PlotError(ValueError):
    pass


def resolve_log(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        for name in ("log.jsonl", "train.jsonl"):
            if (p / name).is_file():
                return p / name
        found = sorted(f for f in p.glob("*.jsonl") if f.is_file())  # (a FIFO would block the read)
        if len(found) == 1:
            return found[0]
        raise PlotError(f"{p}: no log.jsonl in this run directory (write one with `llmc train --log`)")
    if p.exists() and not p.is_file():
        raise PlotError(f"{p}: not a regular file (a log `llmc train --log` writes)")
    if not p.is_file():
        raise PlotError(f"{p}: no such log file or run directory")
    return p


def number(v) -> float | None:
    """A log field as a finite float, else None: a damaged or hand-edited log may hold strings, lists, bools,
    NaN or integers past float's range where a number belongs, and a plot skips them as it skips a missing one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def read_log(path: str | Path) -> list[dict]:
    """The step records of a log: dicts whose `step` is a finite number."""
    p = resolve_log(path)
    recs = []
    from llmc_cli.formats.runlog import LINE_MAX_BYTES, log_lines
    with open(p, "rb") as f:
        for i, line in enumerate(log_lines(f), 1):  # (never a line of gigabytes held whole: a sparse file)
            if len(line) > LINE_MAX_BYTES:
                raise PlotError(f"{p}:{i}: a line of more than {LINE_MAX_BYTES // 2**20} MiB, not a record of the "
                                "log `llmc train --log` writes")
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except (ValueError, RecursionError):  # (bytes that are not UTF-8 are a ValueError; "[[[..." recurses)
                raise PlotError(f"{p}:{i}: not a JSON line (expected the log `llmc train --log` writes)") from None
            if isinstance(r, dict) and number(r.get("step")) is not None:
                recs.append(r)
    if not recs:
        raise PlotError(f"{p}: no step records")
    return recs


def tokens_per_step(recs: list[dict]) -> float | None:
    """Tokens one optimizer step takes, from the first record that tells (tokens_per_step, else tok_per_s x ms);
    a count that is not positive or overflows (a damaged log: 1e200 tok/s for 1e200 ms) tells nothing."""
    for r in recs:
        if (tps := number(r.get("tokens_per_step"))) is not None and tps > 0:
            return tps
        if (rate := number(r.get("tok_per_s"))) is not None and (ms := number(r.get("ms"))) is not None:
            tps = rate * ms / 1e3
            if math.isfinite(tps) and tps >= 0.5:  # (round() of an infinity raises; of less than 0.5 is no tokens)
                return round(tps)
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
    """The (x, y) points of `key`: records without a number there are skipped; a token count past float's range
    stays in as an infinity, for check_range to name rather than a line quietly losing its end."""
    xs, ys = [], []
    for r in recs:
        v, step = number(r.get(key)), number(r["step"])
        if v is None or step is None:
            continue
        if x != "tokens":
            at = step
        elif "tokens" in r:
            at = number(r.get("tokens"))
        else:
            at = step * tps
        if at is None:
            continue
        xs.append(at)
        ys.append(v)
    return xs, ys


# matplotlib computes its limits, margins and ticks in floats, and near float's largest value (1.8e308) they
# overflow: `arange: cannot compute length` for losses of +-1e308, an OverflowError in a log axis's tick labels
# once it spans some 500 decades. Values are held to bounds it draws (|v| <= 1e300 on a linear axis, at most
# 1e200 on a log one); a log axis leaves out values at or below 1e-200 as it must zero and negatives.
LINEAR_LIMIT = 1e300
LOG_LIMIT = 1e200
LOG_FLOOR = 1e-200


def check_range(path: str | Path, field: str, values: list[float], log: bool = False) -> None:
    """A PlotError naming the log and the field when `values` go past what matplotlib can draw (see LINEAR_LIMIT)."""
    if log:
        if any(not v <= LOG_LIMIT for v in values):
            raise PlotError(f"{path}: {field} has values out of the plottable range (expected at most {LOG_LIMIT:g} "
                            "on its log axis)")
    elif any(not abs(v) <= LINEAR_LIMIT for v in values):
        raise PlotError(f"{path}: {field} has values out of the plottable range (expected |{field}| <= "
                        f"{LINEAR_LIMIT:g})")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png_target(path: str | Path, option: str = "--out") -> None:
    """A picture may replace only a PNG: anything else already at `path` is the user's and stays. Checked before
    anything runs, so a name that could never be written is refused before a whole benchmark or plot, not after."""
    path = Path(path)
    # a name past NAME_MAX (255 bytes on Linux, macOS and Windows file systems) fails only when it is created, and
    # even the checks below would stop on it (ENAMETOOLONG), so it goes first
    long = next((part for part in path.parts if len(os.fsencode(part)) > 255), None)
    if long is not None:
        raise PlotError(f"{option} {path}: a file or folder name of {len(os.fsencode(long))} bytes; at most 255 "
                        "expected")
    if path.is_symlink() and not path.exists():  # (the rename would replace the link itself)
        raise PlotError(f"{option} {path}: a symbolic link to nothing (or to itself); give a new path; nothing was "
                        "changed")
    check_outside_checkpoints(path, option, PlotError)
    if path.exists():
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
    # the bytes are always a PNG: under a .svg or .pdf name they would be a file no viewer opens as what it claims
    # (checked after the above, so that a file of the user's there is named as theirs first)
    if path.suffix and path.suffix.lower() != ".png":
        raise PlotError(f"{option} {path}: expected a .png file name")
    if not path.exists():
        # its folder is made when the picture is written: a file where a folder of it belongs would fail only then
        # (after a whole benchmark), so it is refused now
        if (folder := non_folder_above(path.absolute())) is not None:
            raise PlotError(f"{option} {path}: {folder} is not a directory; give a path in a directory; nothing was "
                            "changed")


def save_png(fig, path: str | Path, dpi: int, option: str = "--out") -> Path:
    """`fig` as a PNG at `path`, written under a temporary name and renamed (see check_png_target)."""
    check_png_target(path, option)
    path = Path(path)
    try:
        with atomic_file(path, through_links=True) as tmp:  # (checked a PNG above)
            fig.savefig(tmp, dpi=dpi, format="png")
    except OSError as e:
        raise PlotError(f"{option} {path}: cannot write it ({e.strerror or e})") from None
    return path


PLOTTED = ", ".join(dict.fromkeys(k for _, _, keys, _ in PANELS for k, _, _ in keys))


def plot_runs(runs: list[str], out: str | Path, x: str = "step", smooth: float = 0.0) -> Path:
    """The PANELS of each run's log (those with a point to draw) into one PNG at `out`; any log that cannot be
    drawn is a PlotError naming it before a figure is made, so nothing is written."""
    check_png_target(out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # (checked here, before a log is read; drawn with in _draw_runs)
    except ImportError:
        raise PlotError("matplotlib is not installed (pip install 'llmc[plot]' or pip install matplotlib)") from None
    logs = [(label, resolve_log(r)) for label, r in zip(run_labels([str(r) for r in runs]), runs)]
    # every line of every panel, gathered and checked first: {panel index: [(log index, key, style, label, xs, ys)]}
    lines: dict[int, list] = {}
    for i, (name, path) in enumerate(logs):
        recs = read_log(path)
        found = [(p, key, suffix, style) for p, (_, _, keys, _) in enumerate(PANELS) for key, suffix, style in keys
                 if any(number(r.get(key)) is not None for r in recs)]
        if not found:  # (an LLMC_STEP_PHASES file, say: step records of llmc's, but no curve of training in them)
            raise PlotError(f"{path}: no plottable series (expected step records with {PLOTTED})")
        tps = tokens_per_step(recs) if x == "tokens" else None
        if x == "tokens" and tps is None and any("tokens" not in r for r in recs):
            raise PlotError(f"{path}: the log has no tok_per_s and ms (or tokens_per_step) that count the tokens of "
                            "a step; plot against step")
        drawn, placed = 0, 0
        for p, key, suffix, style in found:
            xs, ys = series(recs, key, x, tps)
            placed += len(xs)
            check_range(path, "tokens" if x == "tokens" else "step", xs)
            logy = PANELS[p][3]
            check_range(path, key, ys, log=logy)
            if key in ("loss", "norm", "tok_per_s"):
                ys = ema(ys, smooth)
            if logy:  # (zero, negatives and values too small to place have no point on a log axis)
                kept = [(a, v) for a, v in zip(xs, ys) if v > LOG_FLOOR]
                xs, ys = [a for a, _ in kept], [v for _, v in kept]
            if len(xs) == 1 and "o" not in style:  # (a line through one point draws nothing: a lone val record)
                style += "o"
            if xs:
                lines.setdefault(p, []).append((i, key, style, name + (f" {suffix}" if suffix else ""), xs, ys))
                drawn += 1
        fields = ", ".join(k for _, k, _, _ in found)
        if not placed:  # (--x tokens where the records' own tokens are damaged)
            raise PlotError(f"{path}: no plottable series (no record with {fields} has a number in tokens)")
        if not drawn:  # (only values a log axis cannot place: a grad norm of 0 throughout)
            raise PlotError(f"{path}: no plottable series (its {fields} values are all zero, negative or at most "
                            f"{LOG_FLOOR:g}, which a log axis cannot place)")
    return _draw_runs(lines, len(logs) > 1, x, out)


def short_count(v: float, _pos=None) -> str:
    """An axis tick as people read counts: 400k, 1.5M, 2B (matplotlib's default reads 400000 or 1e6)."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.4g}{suffix}"
    return f"{v:.4g}"


@quiet
def _draw_runs(lines: dict[int, list], several: bool, x: str, out: str | Path) -> Path:
    """The panels plot_runs gathered, drawn and written (see quiet for the warnings)."""
    import matplotlib.pyplot as plt
    panels = sorted(lines)
    ncol = 2 if len(panels) > 1 else 1
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.6 * nrow), squeeze=False)
    try:
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, p in zip(axes.flat, panels):
            title, ylabel, keys, logy = PANELS[p]
            for i, key, style, label, xs, ys in lines[p]:
                ax.plot(xs, ys, style, color=colors[i % len(colors)], label=label, lw=1.2, ms=3)
            ax.set_title(title)
            ax.set_xlabel("tokens seen" if x == "tokens" else "optimizer step")
            ax.xaxis.set_major_formatter(short_count)
            ax.set_ylabel(ylabel)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if several or len(keys) > 1:
                ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.tight_layout()
        return save_png(fig, out, dpi=110)
    except PlotError:
        raise
    except (ValueError, OverflowError) as e:  # (values inside the bounds above that matplotlib still fails on)
        raise PlotError(f"{out}: matplotlib cannot draw these logs' values ({e}); nothing was written") from None
    finally:
        plt.close(fig)
