"""Tables of benchmark results (rich renderables; the command prints them)."""

from __future__ import annotations

import math

from rich.markup import escape
from rich.table import Table

from llmc_cli.bench.overlap import best

# ---------------------------------------------------------------------------------------------------------------
# presenting

def _fmt_ms(ms: float) -> str:
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _fmt_rate(r: dict) -> str:
    if r.get("tflop_s") is not None:
        v = r["tflop_s"]
        return f"{v * 1e6:.0f} MF/s" if v < 1e-4 else f"{v * 1e3:.1f} GF/s" if v < 1 else f"{v:.2f} TF/s"
    v = r.get("gb_s")
    return "-" if v is None else f"{v * 1e3:.0f} MB/s" if v < 0.1 else f"{v:.1f} GB/s"


def _fmt_err(r: dict) -> str:
    e = r["max_rel_err"]
    if e is None:
        return "n/a"
    s = "0" if e == 0 else "inf" if math.isinf(e) else f"{e:.1e}"
    return f"[bold red]{s} MISMATCH[/]" if r["ok"] is False else f"[green]{s}[/]"


def kernels_table(res: dict):
    """Kernels as rows, backends as columns; each cell: median ms [min-max], then the rate and the error."""
    c = res["config"]
    labels = list(dict.fromkeys(r["backend"] for r in res["results"]))
    table = Table(title=f"llmc bench kernels: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} "
                        f"Vp={c['padded_vocab_size']}, B={c['B']} T={c['T']}",
                  caption=f"ms: median of {c['repeat']} calls \\[min-max] after {c['warmup']} warm-up; "
                          "rate: GB/s, or GF/s / TF/s (10^9 / 10^12 FLOP/s) for matmuls and attention, at the "
                          "median; err: max|got-ref| / max|ref| against the reference backend on the same inputs",
                  show_lines=True)
    table.add_column("kernel", no_wrap=True)
    for l in labels:
        table.add_column(l, justify="right", no_wrap=True)
    rows: dict[str, dict[str, dict]] = {}
    for r in res["results"]:
        rows.setdefault(r["kernel"], {})[r["backend"]] = r
    for kernel, per in rows.items():
        cells = [kernel]
        for l in labels:
            r = per.get(l)
            cells.append("-" if r is None else
                         f"{_fmt_ms(r['median_ms'])} ms [dim]\\[{_fmt_ms(r['min_ms'])}-{_fmt_ms(r['max_ms'])}][/]\n"
                         f"{_fmt_rate(r)}  err {_fmt_err(r)}")
        table.add_row(*cells)
    return table


def variants_table(res: dict):
    """One row per variant of each kernel on each backend, the default first: median ms [min-max], the default's
    median over its (above 1: faster), the rate and the error; the fastest within the tolerance is marked."""
    c = res["config"]
    table = Table(title=f"llmc bench kernels --variants: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} "
                        f"Vp={c['padded_vocab_size']}, B={c['B']} T={c['T']}",
                  caption=f"ms: median of {c['repeat']} calls \\[min-max] after {c['warmup']} warm-up; vs default: "
                          "the default's median / the variant's (above 1: faster); *: the fastest whose error is "
                          "within the tolerance; err: max|got-ref| / max|ref| against the reference backend")
    for col, just in (("kernel", "left"), ("backend", "left"), ("variant", "left"), ("ms \\[min-max]", "right"),
                      ("vs default", "right"), ("rate", "right"), ("err", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in res["results"]:
        base = r["median_ms"]
        for i, v in enumerate([dict(r, variant="default")] + r.get("variants", [])):
            first = (r["kernel"], r["backend"]) if i == 0 else ("", "")
            mark = "[bold green]*[/] " if r.get("variants") and v["variant"] == r.get("fastest") else ""
            if "skipped" in v:
                table.add_row(*first, v["variant"], "-", "-", "-", f"[dim]n/a: {v['skipped']}[/]")
                continue
            ratio = base / v["median_ms"] if v["median_ms"] > 0 else math.inf
            table.add_row(*first, mark + v["variant"],
                          f"{_fmt_ms(v['median_ms'])} [dim]\\[{_fmt_ms(v['min_ms'])}-{_fmt_ms(v['max_ms'])}][/]",
                          "-" if i == 0 else f"{ratio:.2f}x", _fmt_rate(v), _fmt_err(v))
        table.add_section()
    return table


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def train_table(res: dict):
    c = res["config"]
    table = Table(title=f"llmc bench train: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} "
                        f"({c['num_parameters']:,} params), B={c['B']} T={c['T']}",
                  caption=f"median of {c['steps']} steps \\[min-max] after {c['warmup']} warm-up; each step "
                          "includes the data loader, forward, backward, grad norm and AdamW; data waits: batches "
                          "not ready when a step asked (all of them with --no-prefetch); RSS peak is the "
                          "process's, cumulative over the runs before it")
    for col, just in (("backend", "left"), ("dtype", "left"), ("ms/step \\[min-max]", "right"),
                      ("tok/s", "right"), ("TFLOP/s", "right"), ("MFU", "right"), ("loss 1st -> last", "right"),
                      ("data waits", "right"), ("alloc MiB", "right"), ("device used MiB", "right"),
                      ("RSS peak MiB", "right")):
        table.add_column(col, justify=just, no_wrap=col != "backend")
    for r in res["results"]:
        name = r["name"] + (f"\n[dim]{r['optimizer']}[/]" if r.get("optimizer") else "")  # torch's AdamW flavour
        table.add_row(name, r.get("dtype", "-"),
                      f"{_fmt_ms(r['median_ms'])} [dim]\\[{_fmt_ms(r['min_ms'])}-{_fmt_ms(r['max_ms'])}][/]",
                      f"{r['tok_s']:,.0f}", f"{r['tflop_s']:.3f}",
                      "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                      f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
                      f"{r['data_waits']}/{r['data_batches']}" if "data_waits" in r else "-",
                      _mib(r.get("allocated_bytes")), _mib(r.get("device_used_bytes")),
                      _mib(r.get("host_rss_peak_bytes")))
    return table


def decode_table(res: dict):
    """Backends as rows: prefill, tokens/s inside the window and past it, and their ratio (or why it did not
    run)."""
    c = res["config"]
    table = Table(title=f"llmc bench decode: L={c['n_layer']} NH={c['n_head']} C={c['n_embd']} V={c['vocab_size']}, "
                        f"B={c['B']}, window {c['window']}, prompt {c['prompt_len']}",
                  caption="tok/s: new tokens per second over all B sequences, greedy, host round trip included; "
                          "past: the next tokens after the window is full (cache slides, or refills from its "
                          "newest half for learned absolute positions)")
    for col in ("backend", "dtype", "prefill ms", "in window tok/s", "past window tok/s", "past / in", "refills"):
        table.add_column(col, justify="left" if col in ("backend", "dtype") else "right")
    for r in res["results"]:
        if "skipped" in r:
            table.add_row(escape(r["backend"]), "-", "-", "-", "-", "-", f"[dim]{escape(r['skipped'])}[/]")
            continue
        if "failed" in r:
            table.add_row(escape(r["backend"]), "-", "-", "-", "-", "-", f"[bold red]failed: {escape(r['failed'])}[/]")
            continue
        ratio = r["past_over_window"]
        table.add_row(r["backend"], r["dtype"], f"{r['prefill_s'] * 1e3:.1f}",
                      "-" if r["window_tok_s"] is None else f"{r['window_tok_s']:.1f}", f"{r['past_tok_s']:.1f}",
                      "-" if ratio is None else f"{ratio:.2f}", str(r["refills"]))
    return table


def overlap_table(res: dict):
    """Rows: backend, host memory, mode (and streams); columns: batch sizes; each cell the fastest block's median
    ms, GB/s and that block size."""

    c = res["config"]
    rs = res["results"]
    table = Table(title=f"llmc bench overlap: layernorm forward with its copies, float32, T={c['T']} C={c['C']}",
                  caption=f"ms: median of {c['repeat']} calls after {c['warmup']} warm-up, from the first copy in "
                          "to the last copy out; GB/s: (inp in + out, mean, rstd out) bytes / ms; b: the fastest "
                          f"block size of {', '.join(map(str, c['blocks']))}; every cell checked against numpy",
                  show_lines=True)
    for col in ("backend", "host memory", "mode"):
        table.add_column(col, no_wrap=True)
    for B in c["batches"]:
        table.add_column(f"B={B}", justify="right", no_wrap=True)
    for label, host, mode, s in dict.fromkeys((r["backend"], r["host_memory"], r["mode"], r["streams"]) for r in rs):
        cells = []
        for B in c["batches"]:
            r = best(rs, backend=label, host_memory=host, mode=mode, streams=s, B=B)
            bad = "" if r is None or r["ok"] else "\n[bold red]MISMATCH[/]"
            cells.append("-" if r is None else
                         f"{_fmt_ms(r['median_ms'])} ms\n{_fmt_rate(r)} [dim]b{r['block']}[/]{bad}")
        table.add_row(label, host, "sync" if mode == "sync" else f"chunked x{s}", *cells)
    return table


def overlap_lines(res: dict) -> list[str]:
    """At the largest batch, per backend and host memory: the fastest chunked case against the fastest sync one;
    and pinned against pageable where both ran."""
    lines = []
    top = max(res["config"]["batches"])
    summary = [r for r in res["summary"] if r["B"] == top]
    for r in summary:
        if r["speedup"] is not None:
            lines.append(f"{r['backend']} {r['host_memory']} B={top}: chunked x{r['chunked_streams']} "
                         f"{r['chunked_ms']:.2f} ms ({r['chunked_gb_s']:.1f} GB/s) against sync {r['sync_ms']:.2f} ms "
                         f"({r['sync_gb_s']:.1f} GB/s): {r['speedup']:.2f}x")
    def fast(r: dict) -> float:
        return min(v for v in (r["sync_ms"], r["chunked_ms"]) if v is not None)
    by = {(r["backend"], r["host_memory"]): r for r in summary}
    for label in dict.fromkeys(r["backend"] for r in summary):
        pin, page = by.get((label, "pinned")), by.get((label, "pageable"))
        if pin and page:
            lines.append(f"{label} B={top}: pinned {fast(pin):.2f} ms, pageable {fast(page):.2f} ms (the fastest "
                         f"case of each): {fast(page) / fast(pin):.2f}x")
    return lines


def failure_lines(failed: list[dict]) -> list[str]:
    """One line per backend that failed (its label, the cases it failed on, the first error), for the report:
    a backend that raises on every kernel is one line, not one per kernel."""
    by: dict[str, list[dict]] = {}
    for f in failed:
        by.setdefault(f["backend"], []).append(f)
    lines = []
    for label, fs in by.items():
        kernels = [f["kernel"] for f in fs if f.get("kernel")]
        where = ""
        if kernels:
            more = f" and {len(kernels) - 4} more" if len(kernels) > 4 else ""
            where = f" on {', '.join(kernels[:4])}{more}"
        lines.append(f"failed: {label}{where}: {fs[0]['error']}")
    return lines
