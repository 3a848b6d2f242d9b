"""``llmc bench``: every kernel of the interface and the whole training step, timed on every backend side by side.

llm.c's ``dev/cuda`` files time each kernel and check it against a CPU reference; here one command does that for
every installed backend on the shapes a GPT-2 really uses.

* ``kernels``: each kernel (forward and backward) on random inputs drawn from a fixed seed; the same inputs go to
  every backend and to the reference (the ``cpu`` backend, numpy float32). Timing is the median of ``repeat`` calls
  after ``warmup`` calls, each call measured with ``Backend.timer()`` (device events where the backend announces
  CAP_DEVICE_EVENTS, else the host clock around a synchronize). Throughput is GB/s for memory-bound kernels (bytes
  read + written, counted analytically per kernel: every input element read once, every output written once,
  accumulated outputs read and written) and TFLOP/s for matmuls and attention (useful FLOPs: 2*M*N*K per product,
  the causal half for attention). The error is ``max|got - ref| / max|ref|`` over each output, the worst output
  of the kernel; a backend whose error exceeds the tolerance of its dtype is flagged as a mismatch.
* ``train``: end-to-end training steps through the same ``Trainer`` that ``llmc train`` uses (data loader,
  forward, backward, global norm, AdamW), ms/step, tokens/s, MFU where the backend knows its peak FLOP/s
  (``Backend.peak_flops``), memory; optionally PyTorch on the same model, weights, data and optimizer.

The functions here take lists of ``(label, Backend)`` so tests (or other tools) can pass backends directly.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import click
from rich.markup import escape  # device names, reasons and paths are text, not markup
from rich.measure import Measurement

from llmc_cli.bench.backends import BenchError, choose_reference, resolve_backends
from llmc_cli.bench.decode import run_decode
from llmc_cli.bench.kernel_cases import run_kernels
from llmc_cli.bench.machine import describe_machine, machine_lines
from llmc_cli.bench.overlap import (
    GRIDS,
    HOST_MEMORY,
    MAX_STREAMS,
    grid_axes,
    grid_help,
    grid_line,
    overlap_backends,
    run_overlap,
)
from llmc_cli.bench.report import (
    decode_table,
    failure_lines,
    kernels_table,
    overlap_lines,
    overlap_table,
    train_table,
    variants_table,
)
from llmc_cli.bench.train_steps import run_train
from llmc_cli.charts import PlotError, check_png_target, plot_kernels, plot_overlap, plot_train, require_matplotlib
from llmc_cli.commands.console import (
    BACKEND_OPT_HELP,
    DTYPES,
    backend_options,
    console,
    err_console,
    fail,
    printable,
)
from llmc_cli.commands.options import COUNT, POSITIVE, SEED, Int, PowerOfTwo, Real, check_tokens
from llmc_cli.formats.files import DataError
from llmc_cli.kernels import OVERLAP_MODES
from llmc_cli.models.base import check_seq_len
from llmc_cli.models.families import family_for


def print_wide(console, renderable) -> None:
    """Print a table at its natural width when stdout is not a terminal (files, pipes), else at the terminal's."""
    if console.is_terminal:
        console.print(renderable)
        return
    need = Measurement.get(console, console.options.update(width=1000), renderable).maximum
    old = console.width
    console.width = max(old, min(need, 1000))
    try:
        console.print(renderable)
    finally:
        console.width = old


# ---------------------------------------------------------------------------------------------------------------
# the commands

def _check_plot(path: str | None) -> None:
    """--plot: matplotlib installed and a .png path that can be written, checked before anything runs."""
    if path is None:
        return
    if not path:  # (an empty --plot was taken as none: the run's picture silently not drawn)
        fail("--plot: an empty path; give a .png file name")
    try:
        require_matplotlib()
        check_png_target(path, "--plot")
    except (BenchError, PlotError) as e:
        fail(str(e))
    _check_writable_folder(path)


def _check_writable_folder(path: str) -> None:
    """The folder the picture goes into (or the nearest one that exists, where its folders will be made) takes a
    new file: a read-only or pseudo file system failed the command only after the whole benchmark, its results
    lost. Tried with a file that has no name (O_TMPFILE) or is removed at once."""
    target = Path(os.path.realpath(path))  # (an existing PNG through a link: written where the link points)
    folder = next((q for q in target.parents if q.is_dir()), None)
    if folder is None:
        return
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=f".{target.name}.probe-"):
            pass
    except OSError as e:
        fail(f"--plot {path}: cannot write in {folder} ({e.strerror or e}); nothing was run")


def _write_plot(draw, res: dict, path: str) -> None:
    try:
        draw(res, path)
    except BenchError as e:
        fail(str(e))
    err_console.print(printable(f"plot: {path}"), markup=False, soft_wrap=True)


def _model_options(f=None, *, batch: int = 4, seq: int = 64, seq_help: str = "Sequence length (tokens)."):
    """The model, backend and output options every bench command takes (`batch`, `seq`: -b and -t defaults)."""
    if f is None:
        return lambda g: _model_options(g, batch=batch, seq=seq, seq_help=seq_help)
    opts = [
        click.option("--backend", "backend_names", multiple=True,
                     help="Backend to benchmark (repeatable; default: every usable one, see `llmc backends`)."),
        click.option("--backend-opt", "backend_opt", multiple=True, metavar="KEY=VALUE",
                     help=BACKEND_OPT_HELP + " Each backend takes the ones it declares."),
        click.option("--dtype", "dtypes", type=click.Choice(["fp32", "bf16", "fp8", "auto"]), multiple=True,
                     default=("auto",), show_default=True,
                     help="Compute dtype for every backend; auto = each backend's default; fp8 = bf16 with FP8 "
                          "matmuls (cuda, compute capability 8.9+). Repeatable: each backend once per dtype, "
                          "e.g. --dtype bf16 --dtype fp8."),
        click.option("--model", default="d12", show_default=True,
                     help="Preset: GPT-2 d2, d6, d12 (124M), d24, d36, d48, or Llama 3 "
                          "(llama3-tiny, llama3.2-1b, ...: rmsnorm, RoPE, GQA attention, SwiGLU)."),
        click.option("--n-layer", type=POSITIVE, default=None, help="Override the preset's layer count."),
        click.option("--n-head", type=POSITIVE, default=None, help="Override the preset's head count."),
        click.option("--n-embd", type=POSITIVE, default=None, help="Override the preset's channels."),
        click.option("--vocab-size", type=POSITIVE, default=None, help="Vocabulary (tokens) [default: GPT-2's 50257, "
                     "or the Llama preset's]."),
        click.option("--block-size", type=POSITIVE, default=None, help="Max sequence length (tokens) [default: 1024 for "
                     "GPT-2, or the Llama preset's]."),
        click.option("-b", "--batch-size", type=POSITIVE, default=batch, show_default=True,
                     help="Batch size (sequences)."),
        click.option("-t", "--seq-len", type=POSITIVE, default=seq, show_default=True, help=seq_help),
        click.option("--seed", type=SEED, default=1337, show_default=True, help="Seed for inputs, weights, data."),
        click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout (no table)."),
        click.option("--plot", default=None, type=click.Path(dir_okay=False),
                     help="Also draw the comparison into this PNG (needs matplotlib)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _setup(o: dict):
    """Shared option checks: the model config and the backends (fails with one line)."""
    B, T = o["batch_size"], o["seq_len"]
    if B <= 0 or T <= 0:
        fail(f"-b/--batch-size and -t/--seq-len must be positive (got {B}, {T})")
    if (why := check_tokens(B, T)) is not None:
        fail(why)
    for prefix in o.get("only") or ():
        if not prefix.strip():
            fail("--only: an empty name matches every kernel; give the start of a kernel's name, e.g. --only matmul")
    # the preset's own vocabulary and context unless given (GPT-2's: 50257 and 1024)
    over = {k: o[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") if o[k]}
    try:
        cfg = family_for(o["model"]).preset(o["model"], **over)
        cfg.validate()
    except ValueError as e:
        fail(f"--model: {e}")
    try:
        check_seq_len(T, cfg.block_size, "-t")
    except ValueError as e:
        fail(str(e))
    _check_plot(o["plot"])
    try:
        dtypes = list(dict.fromkeys(o["dtypes"]))
        failed: list[tuple[str, str]] = []
        backends, skipped = resolve_backends(o["backend_names"], [DTYPES[d] for d in dtypes],
                                             options=backend_options(o["backend_opt"]),
                                             labels=dtypes if len(dtypes) > 1 else None, failed=failed)
    except BenchError as e:
        fail(str(e))
    # a backend whose plugin said it could run but which failed to start: a failure of this run (exit status 1,
    # after the others are measured), reported as the failures of their kernels are
    o["_failed"] = [{"backend": label, "kernel": None, "error": why} for label, why in failed]
    return cfg, B, T, backends, skipped


@contextmanager
def _progress(as_json: bool):
    """A spinner on a terminal (not with --json) for the duration: yields the `progress` callback a bench
    workflow takes (None when there is no spinner)."""
    status = err_console.status("") if (err_console.is_terminal and not as_json) else None
    if status is None:
        yield None
        return
    status.start()
    try:
        yield lambda s: status.update(f"bench: {s}")
    finally:
        status.stop()


def _report_header(console, res: dict, backends, skipped, as_json: bool) -> bool:
    """Adds the machine and the skipped backends to `res`; prints all of it as JSON (returns False) or prints the
    machine lines and skips for the table that follows (returns True)."""
    res["machine"] = describe_machine(backends)
    res["skipped"] = [{"backend": n, "reason": r} for n, r in skipped]
    if as_json:
        _emit_json(res)
        return False
    for line in machine_lines(res["machine"]):
        console.print(f"[dim]{escape(line)}[/]")
    for n, r in skipped:
        console.print(f"[dim]not benchmarked: {escape(n)} ({escape(r)})[/]")
    return True


def _failures(res: dict, o: dict) -> None:
    """Puts the backends that failed to start (from `_setup`) before those that failed while measured, in
    res["failed"]."""
    res["failed"] = list(o.get("_failed", [])) + list(res.get("failed", []))


def _report_failures(console, res: dict, as_json: bool) -> None:
    """A line per failed backend under the table (not with --json: the JSON holds them)."""
    if as_json or not res.get("failed"):
        return
    for line in failure_lines(res["failed"]):
        console.print(f"[bold red]{escape(line)}[/]")


def _fail_failures(res: dict, what: str) -> None:
    """Exit status 1 when a backend failed (as a mismatch does), with one line saying which."""
    if not res.get("failed"):
        return
    labels = list(dict.fromkeys(f["backend"] for f in res["failed"]))
    first = res["failed"][0]
    fail(f"{len(labels)} backend(s) failed {what}: {', '.join(labels)} (first: {first['backend']}"
         + (f" on {first['kernel']}" if first.get("kernel") else "") + f": {first['error']})", code=1)


def _emit_json(obj: dict) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    click.echo(json.dumps(clean(obj), indent=1))


@click.group(name="bench")
def bench() -> None:
    """Benchmark backends against each other: every kernel, whole training steps, decoding, or copies overlapped
    with kernels.

    \b
    Example:
      llmc bench kernels --model d2 -b 2 -t 32
      llmc bench train --model d6 -b 4 -t 64 --steps 10 --compare torch
      llmc bench decode --model d12 -t 1024
      llmc bench overlap --backend cuda -b 64 -b 512
    """


@bench.command()
@_model_options
@click.option("--repeat", type=POSITIVE, default=10, show_default=True, help="Timed calls per kernel (median taken).")
@click.option("--warmup", type=COUNT, default=2, show_default=True, help="Untimed calls per kernel first.")
@click.option("--tol", type=Real(0, min_open=True), default=None,
              help="Max relative error before a kernel is flagged [default: 1e-4 for fp32, 3e-2 for bf16, 0.1 for "
                   "fp8 matmuls].")
@click.option("--only", multiple=True, help="Only kernels whose name starts with this (repeatable), e.g. matmul.")
@click.option("--variants", is_flag=True,
              help="Also time and check every other implementation (algorithm, block size) each backend has of "
                   "each kernel, and mark the fastest within the tolerance (a table row per variant; in --json, "
                   "\"variants\" and \"fastest\" in each result).")
def kernels(**o) -> None:
    """Time every kernel of the interface on the model's real shapes and check it against the cpu backend.

    Every backend gets the same random inputs (fixed seed). Time is the median of --repeat calls after --warmup
    calls and after the backend settled its own tuning (Backend.settle), measured with the backend's timer (device
    events where it has them); rate is GB/s (bytes read + written, counted per kernel) or TFLOP/s (matmuls,
    attention); err is max|got - ref| / max|ref| against the numpy cpu backend on the same inputs. With
    --variants, each variant a backend has of a kernel gets the same inputs, check and timing. Exits with status 1
    when a kernel or a variant exceeds the tolerance (a mismatch), or when a backend fails to start or raises on a
    kernel (a line says which; the others are still measured).

    \b
    Example:
      llmc bench kernels --model d2 -b 2 -t 32
      llmc bench kernels --backend opencl --only matmul --repeat 20 --json > kernels.json
      llmc bench kernels --model d12 -b 4 -t 64 --plot kernels.png
      llmc bench kernels --backend cuda --dtype bf16 --variants --only layernorm --model d12 -b 8 -t 1024
    """
    cfg, B, T, backends, skipped = _setup(o)
    with _progress(o["as_json"]) as progress:
        try:
            chosen = choose_reference(backends)
            ref_name, ref = chosen if chosen is not None else (None, None)
            res = run_kernels(backends, cfg, B, T, repeat=o["repeat"], warmup=o["warmup"], seed=o["seed"],
                              reference=ref, tol=o["tol"], only=o["only"] or None, variants=o["variants"],
                              progress=progress)
        except BenchError as e:
            fail(str(e))
    _failures(res, o)
    res["config"]["reference_backend"] = ref_name
    if o["plot"]:  # before the report: a plot that cannot be written fails the command with no JSON printed
        _write_plot(plot_kernels, res, o["plot"])
    if _report_header(console, res, backends, skipped, o["as_json"]):
        if ref is None:
            console.print("[yellow]no reference backend (CAP_REFERENCE, the cpu one) usable: errors are not checked[/]")
        print_wide(console, variants_table(res) if o["variants"] else kernels_table(res))
    _report_failures(console, res, o["as_json"])
    if res["mismatches"]:
        bad = ", ".join(f"{m['kernel']} on {m['backend']}"
                        + (f" (variant {m['variant']})" if m.get("variant") else "")
                        + f" ({m['max_rel_err']:.1e} > {m['tol']:.0e})" for m in res["mismatches"])
        failed = list(dict.fromkeys(f["backend"] for f in res["failed"]))
        also = f"; {len(failed)} backend(s) failed: {', '.join(failed)}" if failed else ""
        fail(f"{len(res['mismatches'])} kernel(s) differ from the {ref_name} reference: {bad}{also}", code=1)
    _fail_failures(res, "on some kernels")


@bench.command()
@_model_options
@click.option("--steps", type=POSITIVE, default=10, show_default=True, help="Timed training steps (median taken).")
@click.option("--warmup", type=COUNT, default=2, show_default=True, help="Untimed training steps first.")
@click.option("--data", default=None, help="Glob of token shards [default: a temporary shard of random tokens].")
@click.option("--recompute", type=click.Choice(["none", "gelu", "layernorm", "gelu+layernorm"]), default="none",
              show_default=True, help="Activations llmc recomputes in backward instead of keeping (as `llmc train`).")
@click.option("--graphs/--no-graphs", default=True, show_default=True,
              help="Replay captured graphs of the micro-steps where the backend can (as `llmc train`).")
@click.option("--prefetch/--no-prefetch", default=True, show_default=True,
              help="Read batches ahead in a background thread and copy them to the device on a side stream where the "
                   "backend can (as `llmc train`); the results count the timed steps' batches that were not ready.")
@click.option("--compare", type=click.Choice(["torch", "torch-eager", "torch-compile"]), multiple=True,
              help="Also time PyTorch on the same model, weights, data and optimizer: torch = eager and "
                   "torch.compile (skipped with a note when torch is not installed). AdamW is fused on CUDA, "
                   "foreach on the CPU; the notes say which ran.")
@click.option("--torch-dtype", type=click.Choice(["fp32", "bf16", "auto"]), default="auto", show_default=True,
              help="PyTorch compute dtype (bf16 = autocast over float32 weights); auto = the backends' dtype "
                   "where they share one, else fp32.")
def train(**o) -> None:
    """Time whole training steps (data loader, forward, backward, clip, AdamW) on each backend.

    Reports ms/step (median and min-max over --steps after --warmup), tokens/s, achieved TFLOP/s (llm.c's
    6*params + 6*L*C*T per token), MFU where the backend reports its peak FLOP/s, the first and last loss
    (every backend starts from the same weights and data, so first losses agree), memory allocated through the
    backend, device memory in use, and the process's peak RSS (cumulative over the backends run so far). A backend
    that fails to start or raises while training is a line saying so, the others are still timed, and the exit
    status is 1.

    \b
    Example:
      llmc bench train --model d2 -b 4 -t 64 --steps 20
      llmc bench train --backend cpu --model d12 -b 4 -t 64 --compare torch --plot train.png
      llmc bench train --backend cuda --dtype bf16 --model llama3.2-1b -b 8 -t 2048 --compare torch
    """
    cfg, B, T, backends, skipped = _setup(o)
    compare = []
    for c in o["compare"]:
        compare += ["torch-eager", "torch-compile"] if c == "torch" else [c]
    with _progress(o["as_json"]) as progress:
        try:
            res = run_train(backends, cfg, B, T, steps=o["steps"], warmup=o["warmup"], seed=o["seed"],
                            data=o["data"], compare=list(dict.fromkeys(compare)), torch_dtype=DTYPES[o["torch_dtype"]],
                            recompute=o["recompute"], graphs=o["graphs"], prefetch=o["prefetch"],
                            progress=progress)
        except (BenchError, DataError, ValueError) as e:  # TrainError is a ValueError too
            fail(str(e))
    _failures(res, o)
    if o["plot"]:  # (before the report, as in `bench kernels`)
        _write_plot(plot_train, res, o["plot"])
    if _report_header(console, res, backends, skipped, o["as_json"]):
        console.print(f"[dim]data: {escape(str(res['config']['data']))}; "
                      f"{res['config']['flops_per_step'] / 1e9:.2f} GFLOP/step[/]")
        print_wide(console, train_table(res))
        for n in res["notes"]:
            console.print(f"[yellow]{escape(n)}[/]")
    _report_failures(console, res, o["as_json"])
    _fail_failures(res, "to train")


@bench.command()
@_model_options(batch=1, seq=1024, seq_help="The window: key/value cache positions per sequence (tokens).")
@click.option("--prompt-len", type=POSITIVE, default=16, show_default=True, help="Prompt tokens (one prefill).")
@click.option("--tokens", type=POSITIVE, default=None,
              help="New tokens timed inside the window and again past it [default: fill the window, then as many "
                   "as it holds].")
@click.option("--warmup", type=COUNT, default=3, show_default=True, help="Untimed tokens first.")
def decode(**o) -> None:
    """Time decoding over a key/value cache: tokens/s inside the window and past it, on each backend.

    The model (the preset's shape, seeded random weights) decodes greedily from a random prompt, one token at a time,
    with its host round trip (logits download, argmax) as `llmc sample` pays it. Past the window a rotary model's
    cache slides; GPT-2's (learned absolute positions) refills from its newest half every window/2 tokens. A
    backend that fails to start or raises while decoding gets a row saying so, the others still decode, and the
    exit status is 1.

    \b
    Example:
      llmc bench decode --model d12 -t 1024
      llmc bench decode --backend cuda --dtype bf16 --model llama3.2-1b -t 2048 --tokens 256 --json
    """
    if o["plot"] is not None:  # refused before the benchmark runs, not after it
        fail("--plot: `llmc bench decode` draws no plot; use --json")
    cfg, B, S, backends, skipped = _setup(o)
    with _progress(o["as_json"]) as progress:
        try:
            res = run_decode(backends, cfg, B, S, prompt_len=o["prompt_len"], tokens=o["tokens"],
                             warmup=o["warmup"], seed=o["seed"], progress=progress)
        except ValueError as e:
            fail(str(e))
    # a backend that failed to start gets its row too; either kind of failure is exit status 1
    res["results"] += [{"backend": f["backend"], "failed": f["error"]} for f in o["_failed"]]
    res["failed"] = [{"backend": r["backend"], "kernel": None, "error": r["failed"]}
                     for r in res["results"] if "failed" in r]
    if _report_header(console, res, backends, skipped, o["as_json"]):
        print_wide(console, decode_table(res))
    _fail_failures(res, "to decode")


@bench.command()
@click.option("--backend", "backend_names", multiple=True,
              help="Backend to benchmark (repeatable; default: every usable one that can overlap copies).")
@click.option("--backend-opt", "backend_opt", multiple=True, metavar="KEY=VALUE",
              help=BACKEND_OPT_HELP + " Each backend takes the ones it declares.")
@click.option("--grid", type=click.Choice(list(GRIDS)), default="small", show_default=True,
              help=f"The cases per backend: {grid_help()}; an axis's own option replaces the grid's.")
@click.option("-b", "--batch-size", "batches", type=POSITIVE, multiple=True,
              help="Batch size (sequences of -t rows; repeatable) [default: the --grid's].")
@click.option("-t", "--seq-len", type=POSITIVE, default=1024, show_default=True, help="Rows per sequence (tokens).")
@click.option("-c", "--channels", type=POSITIVE, default=768, show_default=True,
              help="Channels per row (floats; 768 is GPT-2 124M's width).")
@click.option("--mode", "modes", type=click.Choice(OVERLAP_MODES), multiple=True,
              help="sync: the fast kernel between one copy in and the copies out; chunked: the naive kernel over "
                   "--streams chunks, each on its own stream (repeatable) [default: both].")
@click.option("--streams", type=Int(1, MAX_STREAMS), multiple=True,
              help=f"Streams (chunks) of the chunked mode, 1..{MAX_STREAMS} (repeatable) [default: the --grid's].")
@click.option("--block", "blocks", type=PowerOfTwo(32, 1024), multiple=True,
              help="Threads per block (work-items per work-group), a power of two in 32..1024 (repeatable) "
                   "[default: the --grid's].")
@click.option("--host-memory", type=click.Choice(HOST_MEMORY), multiple=True,
              help="Host memory the copies read and write (repeatable) [default: both].")
@click.option("--repeat", type=POSITIVE, default=3, show_default=True, help="Timed calls per case (median taken).")
@click.option("--warmup", type=COUNT, default=1, show_default=True, help="Untimed calls per case first.")
@click.option("--seed", type=SEED, default=1337, show_default=True, help="Seed for the inputs, weight and bias.")
@click.option("--json", "as_json", is_flag=True, help="Print every case as JSON on stdout (no table).")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Also draw GB/s against batch size and block size into this PNG (needs matplotlib).")
def overlap(**o) -> None:
    """Time a float32 layernorm forward with its host<->device copies: synchronous copies, or chunks on streams.

    The rewrite diary's experiment. Each case copies inp (B*T rows of C floats) to the device, normalises it and
    copies out, mean and rstd back; time runs from the first copy in until the last copy out is in host memory
    (median of --repeat calls after --warmup). sync: the backend's fast layernorm (a warp per row) between one
    copy in and the copies out, in order on one stream. chunked: llm.c's naive kernel (a thread per row) over
    the rows in --streams chunks, each chunk's copy in, kernel and copies out on its own stream, so copies and
    kernels of different chunks overlap. pinned host memory is page-locked (the copy engines reach it directly);
    pageable is plain memory, which the driver stages with the host waiting. GB/s = (4*N*C in + 4*N*C + 8*N out)
    bytes / time. Every case is checked against a numpy layernorm (outputs NaN-poisoned before each call); exits
    with status 1 when one is off. Backends without the copy_overlap capability (cpu) are listed as skipped. The
    small default grid (8 cases) ends in under a minute on a 2-core CPU; --grid full (7 batches x 6 blocks x
    (sync + 5 stream counts) x 2 host memories: 504 cases of 4 calls) copies about 1.8 TB. How many cases a run
    has is printed (stderr) before it starts.

    \b
    Example:
      llmc bench overlap --backend cuda --grid full --host-memory pinned --block 256
      llmc bench overlap --backend cuda -b 64 -b 512 --streams 1 --streams 8 --json > overlap.json
      llmc bench overlap --backend cuda --block 32 --block 256 --block 1024 --plot overlap.png
    """
    _check_plot(o["plot"])
    try:
        failed: list[tuple[str, str]] = []
        backends, skipped = resolve_backends(o["backend_names"], None, options=backend_options(o["backend_opt"]),
                                             failed=failed)
        backends, more = overlap_backends(backends, named=bool(o["backend_names"]))
        axes = grid_axes(o["grid"], **{k: o[k] for k in ("batches", "modes", "streams", "blocks", "host_memory")})
        line = grid_line(o["grid"], axes, len(backends), o["seq_len"], o["channels"])
    except BenchError as e:
        fail(str(e))
    if not o["as_json"]:  # (with --json, stderr holds nothing but a failure's line)
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    with _progress(o["as_json"]) as progress:
        try:
            res = run_overlap(backends, T=o["seq_len"], C=o["channels"], **axes, repeat=o["repeat"],
                              warmup=o["warmup"], seed=o["seed"], progress=progress)
        except BenchError as e:
            fail(str(e))
    o["_failed"] = [{"backend": label, "kernel": None, "error": why} for label, why in failed]
    _failures(res, o)
    if not res["failed"]:  # (its JSON's keys stay the documented ones unless a backend failed)
        del res["failed"]
    if o["plot"]:  # (before the report, as in `bench kernels`)
        _write_plot(plot_overlap, res, o["plot"])
    if _report_header(console, res, backends, skipped + more, o["as_json"]):
        print_wide(console, overlap_table(res))
        for line in overlap_lines(res):
            console.print(line, markup=False)
    _report_failures(console, res, o["as_json"])
    if res["mismatches"]:
        bad = ", ".join(f"{m['backend']} B={m['B']} {m['mode']} x{m['streams']} block {m['block']} {m['host_memory']} "
                        f"({m['max_rel_err']:.1e})" for m in res["mismatches"][:5])
        more_bad = f" and {len(res['mismatches']) - 5} more" if len(res["mismatches"]) > 5 else ""
        fail(f"{len(res['mismatches'])} case(s) differ from the numpy layernorm: {bad}{more_bad}", code=1)
    _fail_failures(res, "to overlap copies")
