"""The rewrite diary's copy/compute overlap experiment (`llmc bench overlap`): a float32 layernorm forward timed
*with* its host<->device copies, on every backend that can overlap them (CAP_COPY_OVERLAP).

Each case copies inp (N,C) in, normalises it, and copies out (N,C), mean and rstd (N,) back, N = B*T rows:

* sync: the backend's fast layernorm between one copy in and the copies out, all in order on one queue;
* chunked S: llm.c's naive kernel (one thread per row) over the rows in S chunks, each chunk's copy in, kernel
  and copies out on its own queue, so that one chunk's copies run while another's kernel does;

for every batch size, block size (threads per block) and host memory (pinned: page-locked, which the device's
copy engines reach directly; pageable: plain numpy memory, which the driver stages piece by piece while the
host waits). Bytes moved = 4*N*C in + 4*N*C + 8*N out; GB/s = bytes / the median time of `repeat` calls after
`warmup` calls. Time is the backend's: from the first copy in until the last copy out is in host memory.

Memory is planned once, for the largest batch: device buffers through `Backend.alloc`, host arrays through
`Backend.host_alloc`; a smaller batch uses the first rows of them (views), and so the same inputs. Before every
call the device outputs are filled with NaN, and so are the host outputs the check reads: mean and rstd in full,
out on CHECK_ROWS rows spread over the batch plus the first and last row of every chunk (reading all of out after
every call would cost the host more time than the case itself). The check compares them with a float64 numpy
layernorm of the same float32 inputs; a case that writes nothing, or the wrong thing, is a mismatch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from llmc_cli.bench.backends import BenchError, failure_line
from llmc_cli.kernels import (
    CAP_COPY_OVERLAP,
    FLOAT32,
    OVERLAP_CHUNKED,
    OVERLAP_MODES,
    OVERLAP_SYNC,
    Backend,
)
from llmc_cli.naming import arg, arg_both

BATCHES = (8, 16, 32, 64, 128, 256, 512)  # the diary's batch sizes, at T=1024, C=768 (GPT-2 124M's width)
STREAMS = (1, 2, 4, 8, 16)
BLOCKS = (32, 64, 128, 256, 512, 1024)
MAX_STREAMS = 64
HOST_MEMORY = ("pinned", "pageable")
# the axes `--grid` names, which an axis's own option replaces. small: sync against 4 streams at two batch sizes in
# both host memories, 8 cases that end in seconds on a GPU and in under a minute on a 2-core CPU's OpenCL; full: the
# diary's sweep, 504 cases copying about 1.8 TB (minutes even on an H200)
GRIDS = {
    "small": {"batches": (8, 16), "modes": OVERLAP_MODES, "streams": (4,), "blocks": (256,),
              "host_memory": HOST_MEMORY},
    "full": {"batches": BATCHES, "modes": OVERLAP_MODES, "streams": STREAMS, "blocks": BLOCKS,
             "host_memory": HOST_MEMORY},
}
TOLERANCE = 1e-4  # max|got - ref| / max|ref|, float32 against float64
CHECK_ROWS = 4096  # rows of out read back after every call (mean and rstd are read in full)
EPS = 1e-5


@dataclass(frozen=True)
class OverlapCase:
    B: int
    mode: str       # OVERLAP_SYNC or OVERLAP_CHUNKED
    streams: int    # 1 for sync
    block: int
    pinned: bool

    @property
    def host_memory(self) -> str:
        return "pinned" if self.pinned else "pageable"

    @property
    def label(self) -> str:
        return "sync" if self.mode == OVERLAP_SYNC else f"chunked x{self.streams}"


def overlap_cases(batches: Sequence[int], modes: Sequence[str], streams: Sequence[int], blocks: Sequence[int],
                  host_memory: Sequence[str]) -> list[OverlapCase]:
    """The grid, host memory outermost (each kind's arrays are filled once), then batch, mode, streams, block;
    sync runs once per block whatever `streams` holds."""
    cases = []
    for host in dict.fromkeys(host_memory):
        for B in dict.fromkeys(batches):
            for mode in dict.fromkeys(modes):
                for s in ((1,) if mode == OVERLAP_SYNC else dict.fromkeys(streams)):
                    cases += [OverlapCase(B, mode, s, blk, host == "pinned") for blk in dict.fromkeys(blocks)]
    return cases


def grid_axes(grid: str, **given: Sequence) -> dict:
    """The axes of the named grid (GRIDS) as run_overlap takes them, each axis `given` non-empty in its place."""
    return {axis: tuple(given.get(axis) or values) for axis, values in GRIDS[grid].items()}


def grid_line(grid: str, axes: dict, backends: int, T: int, C: int) -> str:
    """What a run is about to do, said before it starts: its cases, and the grid they come from (a BenchError for
    a grid run_overlap refuses, so that its one line is all a bad grid prints)."""
    check_grid(axes["batches"], T, C, axes["modes"], axes["streams"], axes["blocks"], axes["host_memory"])
    n = len(overlap_cases(**axes)) * backends
    more = f"; --grid full runs {len(overlap_cases(**GRIDS['full']))} per backend" if grid != "full" else ""
    return f"bench overlap: {n} case(s) on {backends} backend(s) (grid {grid}{more})"


def grid_help() -> str:
    """Each grid's cases and axes, for --help: `small: 8 cases (-b 8 16, --streams 4, ...)`."""
    def axes(g: dict) -> str:
        return (f"-b {' '.join(map(str, g['batches']))}, --streams {' '.join(map(str, g['streams']))}, --block "
                f"{' '.join(map(str, g['blocks']))}, --host-memory {' '.join(g['host_memory'])}")
    return "; ".join(f"{name}: {len(overlap_cases(**g))} cases ({axes(g)})" for name, g in GRIDS.items())


def bytes_moved(N: int, C: int) -> int:
    """Host<->device bytes of one case: inp in, out + mean + rstd out, float32."""
    return 4 * N * C + 4 * N * C + 8 * N


def chunk_bounds(N: int, chunks: int) -> list[tuple[int, int]]:
    """Chunk i's rows [i*N//chunks, (i+1)*N//chunks), as the contract's OVERLAP_CHUNKED splits them."""
    return [(i * N // chunks, (i + 1) * N // chunks) for i in range(chunks)]


def check_rows(N: int, chunks: int) -> np.ndarray:
    """Rows of out the check reads: CHECK_ROWS spread evenly over N, and every chunk's first and last row."""
    spread = np.linspace(0, N - 1, min(N, CHECK_ROWS)).astype(np.int64)
    edges = [r for a, b in chunk_bounds(N, chunks) for r in (a, b - 1)]
    return np.unique(np.concatenate([spread, np.asarray(edges, np.int64)]))


def check_grid(batches: Sequence[int], T: int, C: int, modes: Sequence[str], streams: Sequence[int],
               blocks: Sequence[int], host_memory: Sequence[str]) -> None:
    """BenchError (one line, naming the option) for a grid the backends must not be asked to run."""
    if not batches or min(batches) < 1 or T < 1 or C < 1:
        raise BenchError(f"{arg_both('batches', cli='batch_size')}, {arg_both('T', cli='seq_len')} and "
                         f"{arg_both('C', cli='channels')} must be >= 1 (got {list(batches)}, {T}, {C})")
    if bad := [m for m in modes if m not in OVERLAP_MODES]:
        raise BenchError(f"{arg('modes', cli='mode')} {bad[0]}: expected one of {', '.join(OVERLAP_MODES)}")
    if bad := [h for h in host_memory if h not in HOST_MEMORY]:
        raise BenchError(f"{arg('host_memory')} {bad[0]}: expected one of {', '.join(HOST_MEMORY)}")
    if bad := [b for b in blocks if not (32 <= b <= 1024 and b & (b - 1) == 0)]:
        raise BenchError(f"{arg('blocks', cli='block')} {bad[0]}: expected a power of two in 32..1024 (threads per "
                         "block)")
    if bad := [s for s in streams if not 1 <= s <= MAX_STREAMS]:
        raise BenchError(f"{arg('streams')} {bad[0]}: expected 1..{MAX_STREAMS}")
    if max(batches) * T >= 2**31:
        raise BenchError(f"{_rows(max(batches), T)}: {max(batches) * T:,} rows, more than the kernels index "
                         "(2**31 - 1)")
    if OVERLAP_CHUNKED in modes and max(streams) > min(batches) * T:
        raise BenchError(f"{arg('streams')} {max(streams)}: more chunks than the {min(batches) * T} rows of "
                         f"{_rows(min(batches), T)}")


def _rows(B: int, T: int) -> str:
    """One batch size of `batches` and T as a caller gave them (`-b 8 -t 1024` on the command line)."""
    return f"{arg('batches', cli='batch_size')} {B} {arg('T', T, cli='seq_len')}"


def reference_stats(inp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mean and rstd (N,) of every row in float64, a slab of rows at a time (inp may be gigabytes)."""
    N = inp.shape[0]
    mean, rstd = np.empty(N), np.empty(N)
    step = max(1, (1 << 24) // inp.shape[1])
    for a in range(0, N, step):
        x = inp[a:a + step].astype(np.float64)
        m = x.mean(axis=1)
        mean[a:a + step] = m
        rstd[a:a + step] = 1.0 / np.sqrt(((x - m[:, None]) ** 2).mean(axis=1) + EPS)
    return mean, rstd


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


class _Plan:
    """One backend's buffers, planned once for the largest batch, and the reference statistics of its input."""

    def __init__(self, backend: Backend, N: int, C: int, inp: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                 ref_mean: np.ndarray, ref_rstd: np.ndarray, host_memory: Sequence[str]):
        self.backend, self.C = backend, C
        self.inp_src, self.weight, self.bias = inp, weight.astype(np.float64), bias.astype(np.float64)
        self.ref_mean, self.ref_rstd = ref_mean, ref_rstd
        # device (N,C) inp and out, (N,) mean and rstd, (C,) weight and bias, float32 whatever the backend's dtype
        self.d_inp = backend.alloc((N, C), FLOAT32, tag="overlap")
        self.d_out = backend.alloc((N, C), FLOAT32, tag="overlap")
        self.d_mean = backend.alloc((N,), FLOAT32, tag="overlap")
        self.d_rstd = backend.alloc((N,), FLOAT32, tag="overlap")
        self.d_weight = backend.alloc((C,), FLOAT32, tag="overlap")
        self.d_bias = backend.alloc((C,), FLOAT32, tag="overlap")
        backend.upload(self.d_weight, weight)
        backend.upload(self.d_bias, bias)
        # host inp, out (N,C) and mean, rstd (N,) of each kind asked for; the input copied in once
        self.host = {}
        for kind in host_memory:
            pinned = kind == "pinned"
            h = [backend.host_alloc((N, C), pinned=pinned), backend.host_alloc((N, C), pinned=pinned),
                 backend.host_alloc((N,), pinned=pinned), backend.host_alloc((N,), pinned=pinned)]
            np.copyto(h[0], inp)
            self.host[kind] = h
        backend.synchronize()

    def run(self, case: OverlapCase, N: int) -> tuple[float, float]:
        """One call of the case on the first N rows: (seconds, max relative error of out, mean and rstd)."""
        be, C = self.backend, self.C
        inp, out, mean, rstd = (a[:N] for a in self.host[case.host_memory])
        views = [be.view(d, 0, shape) for d, shape in ((self.d_out, (N, C)), (self.d_mean, (N,)),
                                                        (self.d_rstd, (N,)), (self.d_inp, (N, C)))]
        rows = check_rows(N, case.streams if case.mode == OVERLAP_CHUNKED else 1)
        for v in views[:3]:
            be.fill(v, float("nan"))
        out[rows] = np.nan
        mean[:] = np.nan
        rstd[:] = np.nan
        seconds = be.overlap_layernorm(out, mean, rstd, inp, *views, self.d_weight, self.d_bias, mode=case.mode,
                                       streams=case.streams, block=case.block)
        m, r = self.ref_mean[rows], self.ref_rstd[rows]
        ref_out = (self.inp_src[rows].astype(np.float64) - m[:, None]) * r[:, None] * self.weight + self.bias
        err = max(_rel(out[rows], ref_out), _rel(mean, self.ref_mean[:N]), _rel(rstd, self.ref_rstd[:N]))
        return float(seconds), err


def run_overlap(backends: Sequence[tuple[str, Backend]], T: int = 1024, C: int = 768,
                batches: Sequence[int] = BATCHES, modes: Sequence[str] = OVERLAP_MODES,
                streams: Sequence[int] = STREAMS, blocks: Sequence[int] = BLOCKS,
                host_memory: Sequence[str] = HOST_MEMORY, repeat: int = 3, warmup: int = 1, seed: int = 1337,
                progress: Callable[[str], None] | None = None) -> dict:
    """Every case on every backend (each must announce CAP_COPY_OVERLAP): {"config", "results", "summary",
    "mismatches"}. One record per case: its grid point, bytes, times (ms), median, GB/s at the median, error."""
    check_grid(batches, T, C, modes, streams, blocks, host_memory)
    if repeat < 1 or warmup < 0:
        raise BenchError(f"{arg('repeat')} must be >= 1 and {arg('warmup')} >= 0 (got {repeat}, {warmup})")
    for label, be in backends:
        if CAP_COPY_OVERLAP not in be.capabilities:
            raise BenchError(f"backend {label} cannot overlap copies (capability {CAP_COPY_OVERLAP!r})")
    cases = overlap_cases(batches, modes, streams, blocks, host_memory)
    N = max(batches) * T
    rng = np.random.default_rng(seed)
    inp = rng.standard_normal((N, C), dtype=np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(C)).astype(np.float32)
    ref_mean, ref_rstd = reference_stats(inp)
    results, failed = [], []
    for label, be in backends:
        try:
            results += _run_backend(label, be, cases, T, C, N, batches, host_memory, inp, weight, bias, ref_mean,
                                    ref_rstd, repeat, warmup, progress)
        except BenchError:
            raise
        except Exception as e:  # noqa: BLE001  (one backend's failure is its line; the others still run)
            failed.append({"backend": label, "kernel": None, "error": failure_line(e)})
    config = {"T": T, "C": C, "batches": list(dict.fromkeys(batches)), "modes": list(dict.fromkeys(modes)),
              "streams": list(dict.fromkeys(streams)), "blocks": list(dict.fromkeys(blocks)),
              "host_memory": list(dict.fromkeys(host_memory)), "repeat": repeat, "warmup": warmup, "seed": seed,
              "dtype": FLOAT32, "tol": TOLERANCE, "check_rows": CHECK_ROWS}
    mismatches = [{k: r[k] for k in ("backend", "B", "mode", "streams", "block", "host_memory", "max_rel_err")}
                  for r in results if not r["ok"]]
    return {"config": config, "results": results, "summary": summarize(results), "mismatches": mismatches,
            "failed": failed}


def _run_backend(label: str, be: Backend, cases: list, T: int, C: int, N: int, batches: Sequence[int],
                 host_memory: Sequence[str], inp: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                 ref_mean: np.ndarray, ref_rstd: np.ndarray, repeat: int, warmup: int,
                 progress: Callable[[str], None] | None) -> list[dict]:
    """Every case on one backend: its records (BenchError when it runs out of memory for the grid)."""
    results = []
    if progress:
        progress(f"{label}: planning {N:,} rows x {C} in {', '.join(dict.fromkeys(host_memory))} host memory")
    try:
        plan = _Plan(be, N, C, inp, weight, bias, ref_mean, ref_rstd, list(dict.fromkeys(host_memory)))
    except Exception as e:
        if be.is_out_of_memory(e):
            raise BenchError(f"{label}: out of memory for {_rows(max(batches), T)} {arg('C', C, cli='channels')} "
                             f"({4 * N * C / 2**30:.1f} GiB per array, two on the device and two per kind of "
                             f"host memory); lower {arg('batches', cli='batch_size')}") from None
        raise
    for i, case in enumerate(cases):
        n = case.B * T
        if progress:
            progress(f"{label}: case {i + 1}/{len(cases)}: B={case.B} {case.label} block {case.block} "
                     f"{case.host_memory}")
        times, err = [], 0.0
        for k in range(warmup + repeat):
            s, e = plan.run(case, n)
            err = max(err, e)
            if k >= warmup:
                times.append(s * 1e3)
        med = statistics.median(times)
        nbytes = bytes_moved(n, C)
        results.append({"backend": label, "B": case.B, "T": T, "C": C, "rows": n, "mode": case.mode,
                        "streams": case.streams, "block": case.block, "host_memory": case.host_memory,
                        "bytes": nbytes, "times_ms": times, "median_ms": med, "min_ms": min(times),
                        "max_ms": max(times), "gb_s": nbytes / (med / 1e3) / 1e9, "max_rel_err": err,
                        "ok": err <= TOLERANCE})
    del plan
    return results


def overlap_backends(backends: Sequence[tuple[str, Backend]],
                     named: bool) -> tuple[list[tuple[str, Backend]], list[tuple[str, str]]]:
    """(those that announce CAP_COPY_OVERLAP, [(label, why not)] for the others). A backend the user named that
    lacks it, or none left at all, is a BenchError."""
    chosen, skipped = [], []
    for label, be in backends:
        if CAP_COPY_OVERLAP in be.capabilities:
            chosen.append((label, be))
            continue
        why = f"no {CAP_COPY_OVERLAP} capability: no host<->device copies to overlap"
        if named:
            raise BenchError(f"{arg('backends', cli='backend')} {label}: {why}")
        skipped.append((label, why))
    if not chosen:
        raise BenchError(f"no usable backend can overlap copies (capability {CAP_COPY_OVERLAP}; see `llmc backends`)")
    return chosen, skipped


def best(results: Sequence[dict], **where) -> dict | None:
    """The fastest record (lowest median) among those matching every `key=value` of `where`."""
    rs = [r for r in results if all(r[k] == v for k, v in where.items())]
    return min(rs, key=lambda r: r["median_ms"]) if rs else None


def summarize(results: Sequence[dict]) -> list[dict]:
    """Per backend, host memory and batch: the fastest sync case against the fastest chunked one (any block,
    any number of streams), and the speedup of chunked over sync."""
    out = []
    keys = dict.fromkeys((r["backend"], r["host_memory"], r["B"]) for r in results)
    for label, host, B in keys:
        s = best(results, backend=label, host_memory=host, B=B, mode=OVERLAP_SYNC)
        c = best(results, backend=label, host_memory=host, B=B, mode=OVERLAP_CHUNKED)
        rec = {"backend": label, "host_memory": host, "B": B}
        for name, r in (("sync", s), ("chunked", c)):
            rec[f"{name}_ms"] = None if r is None else r["median_ms"]
            rec[f"{name}_gb_s"] = None if r is None else r["gb_s"]
            rec[f"{name}_block"] = None if r is None else r["block"]
        rec["chunked_streams"] = None if c is None else c["streams"]
        rec["speedup"] = s["median_ms"] / c["median_ms"] if s and c else None
        out.append(rec)
    return out
