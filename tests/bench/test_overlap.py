"""`llmc bench overlap`'s workflow (llmc_cli.bench.overlap) on a numpy backend announcing CAP_COPY_OVERLAP: the
case grid, bytes and GB/s, the check catching outputs that are unwritten, stale or wrong, the summary, the table
and the plot. The device backends' own overlap_layernorm is tested in backends/cuda/tests and backends/opencl/tests."""

from __future__ import annotations

import numpy as np
import pytest
from llmc_test_support import make_backend, overlap_backend

from llmc_cli import naming
from llmc_cli.bench import overlap as ov
from llmc_cli.bench.backends import BenchError
from llmc_cli.bench.report import overlap_lines, overlap_table
from llmc_cli.kernels import CAP_COPY_OVERLAP, OVERLAP_CHUNKED, OVERLAP_MODES, OVERLAP_SYNC, Backend

SMALL = dict(T=16, C=48, batches=(2, 4), streams=(1, 3), blocks=(32, 128), repeat=2, warmup=1)


def test_grid_runs_sync_once_per_block_and_chunked_per_stream_count():
    cases = ov.overlap_cases((8, 64), OVERLAP_MODES, (1, 2, 8), (32, 1024), ("pinned", "pageable"))
    assert len(cases) == 2 * 2 * (2 + 3 * 2)
    assert {c.streams for c in cases if c.mode == OVERLAP_SYNC} == {1}
    assert [c.host_memory for c in cases[:16]] == ["pinned"] * 16  # host memory outermost
    assert cases[0] == ov.OverlapCase(8, OVERLAP_SYNC, 1, 32, True) and cases[0].label == "sync"
    assert ov.OverlapCase(8, OVERLAP_CHUNKED, 8, 32, False).label == "chunked x8"
    # the default grid: 7 batches x 6 blocks x (sync + 5 stream counts) x 2 host memories
    assert len(ov.overlap_cases(ov.BATCHES, OVERLAP_MODES, ov.STREAMS, ov.BLOCKS, ov.HOST_MEMORY)) == 504


def test_the_grids_and_an_axis_given_in_place_of_the_grids():
    small = ov.grid_axes("small")
    assert len(ov.overlap_cases(**small)) == 8 and small["batches"] == (8, 16) and small["streams"] == (4,)
    assert len(ov.overlap_cases(**ov.grid_axes("full"))) == 504
    mixed = ov.grid_axes("full", batches=(64,), streams=(), blocks=None)
    assert mixed["batches"] == (64,) and mixed["streams"] == ov.STREAMS and mixed["blocks"] == ov.BLOCKS
    assert len(ov.overlap_cases(**mixed)) == 6 * 6 * 2
    assert ov.grid_line("small", small, 2, 1024, 768) == (
        "bench overlap: 16 case(s) on 2 backend(s) (grid small; --grid full runs 504 per backend)")
    assert ov.grid_line("full", mixed, 1, 1024, 768) == "bench overlap: 72 case(s) on 1 backend(s) (grid full)"
    with naming.flags(), pytest.raises(BenchError, match="--streams 16: more chunks than the 8 rows"):
        ov.grid_line("full", ov.grid_axes("full"), 1, 1, 768)
    assert ov.grid_help().startswith("small: 8 cases (-b 8 16, --streams 4, --block 256, --host-memory pinned")


def test_bytes_chunks_and_checked_rows():
    assert ov.bytes_moved(1024, 768) == 4 * 1024 * 768 * 2 + 8 * 1024
    bounds = ov.chunk_bounds(10, 3)
    assert bounds == [(0, 3), (3, 6), (6, 10)]
    rows = ov.check_rows(100_000, 7)
    edges = {r for a, b in ov.chunk_bounds(100_000, 7) for r in (a, b - 1)}
    assert edges <= set(rows) and rows[0] == 0 and rows[-1] == 99_999
    assert len(rows) <= ov.CHECK_ROWS + 14 and np.all(np.diff(rows) > 0)
    assert list(ov.check_rows(5, 2)) == [0, 1, 2, 3, 4]


def test_reference_stats_are_numpys_layernorm():
    x = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    mean, rstd = ov.reference_stats(x)
    assert np.allclose(mean, x.astype(np.float64).mean(1))
    assert np.allclose(rstd, 1 / np.sqrt(x.astype(np.float64).var(1) + 1e-5))


def test_a_correct_backend_passes_every_case_and_gb_s_is_bytes_over_the_median():
    be = overlap_backend(seconds=0.002)
    res = ov.run_overlap([("host", be)], **SMALL)
    rs = res["results"]
    assert len(rs) == 2 * 2 * (2 + 2 * 2) and res["mismatches"] == []
    for r in rs:
        assert r["ok"] and r["max_rel_err"] < 1e-5, r
        assert r["times_ms"] == [2.0, 2.0] and r["median_ms"] == 2.0
        assert r["bytes"] == ov.bytes_moved(r["B"] * 16, 48) and r["rows"] == r["B"] * 16
        assert r["gb_s"] == pytest.approx(r["bytes"] / 0.002 / 1e9)
    assert be.calls == len(rs) * 3  # warmup + repeat calls per case
    assert res["config"]["batches"] == [2, 4] and res["config"]["dtype"] == "float32"
    assert {(s["host_memory"], s["B"]) for s in res["summary"]} == {(h, B) for h in ov.HOST_MEMORY for B in (2, 4)}
    assert all(s["speedup"] == pytest.approx(1.0) for s in res["summary"])


def test_the_summary_and_lines_pick_the_fastest_cases():
    rec = dict(backend="x", host_memory="pinned", B=8, streams=1, block=32, ok=True)
    results = [dict(rec, mode="sync", median_ms=9.0, gb_s=1.0), dict(rec, mode="sync", block=64, median_ms=6.0, gb_s=2.0),
               dict(rec, mode="chunked", streams=8, median_ms=2.0, gb_s=6.0),
               dict(rec, mode="chunked", streams=2, median_ms=4.0, gb_s=3.0),
               dict(rec, host_memory="pageable", mode="sync", median_ms=12.0, gb_s=1.0),
               dict(rec, host_memory="pageable", mode="chunked", streams=8, median_ms=10.0, gb_s=1.2)]
    s = ov.summarize(results)
    assert s[0] == {"backend": "x", "host_memory": "pinned", "B": 8, "sync_ms": 6.0, "sync_gb_s": 2.0,
                    "sync_block": 64, "chunked_ms": 2.0, "chunked_gb_s": 6.0, "chunked_block": 32,
                    "chunked_streams": 8, "speedup": 3.0}
    lines = overlap_lines({"config": {"batches": [8]}, "summary": s})
    assert "chunked x8 2.00 ms" in lines[0] and "3.00x" in lines[0]
    assert lines[-1].startswith("x B=8: pinned 2.00 ms, pageable 10.00 ms") and lines[-1].endswith("5.00x")


@pytest.mark.parametrize("fault, failing", [
    ("no_out", {OVERLAP_SYNC, OVERLAP_CHUNKED}),     # out never copied back: the poisoned rows stay NaN
    ("stale", {OVERLAP_SYNC, OVERLAP_CHUNKED}),      # no kernel after the first call: the device's poison comes back
    ("rstd", {OVERLAP_SYNC, OVERLAP_CHUNKED}),       # a wrong statistic (read in full)
    ("last_chunk", {OVERLAP_CHUNKED}),               # a forgotten chunk: its edge rows are always read
])
def test_unwritten_stale_or_wrong_outputs_are_mismatches(fault, failing):
    res = ov.run_overlap([("bad", overlap_backend(fault))], **dict(SMALL, streams=(3,), repeat=1))
    bad = {(m["mode"], m["streams"]) for m in res["mismatches"]}
    assert {m for m, _ in bad} == failing, res["mismatches"]
    for r in res["results"]:
        assert r["ok"] == (r["mode"] not in failing)
        if not r["ok"]:
            assert r["max_rel_err"] > ov.TOLERANCE
    table = overlap_table(res)
    from rich.console import Console
    con = Console(width=200, record=True)
    con.print(table)
    assert "MISMATCH" in con.export_text()


@pytest.mark.parametrize("kw, needle", [
    (dict(batches=(0,)), "-b/--batch-size"),
    (dict(C=0), "-c/--channels"),
    (dict(blocks=(48,)), "--block 48"),
    (dict(blocks=(2048,)), "--block 2048"),
    (dict(streams=(0,)), "--streams 0"),
    (dict(streams=(65,)), "--streams 65"),
    (dict(modes=("async",)), "--mode async"),
    (dict(host_memory=("shared",)), "--host-memory shared"),
    (dict(batches=(1,), T=2, streams=(4,)), "more chunks than the 2 rows"),
    (dict(batches=(2**21,), T=1024), "more than the kernels index"),
    (dict(repeat=0), "--repeat"),
])
def test_bad_grids_are_one_line_before_any_memory_is_taken(kw, needle):
    be = overlap_backend()
    with naming.flags(), pytest.raises(BenchError) as e:  # (the flags; test_bench_naming: a Python caller's words)
        ov.run_overlap([("host", be)], **dict(SMALL, **kw))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert be.calls == 0 and be.memory_report().allocated == 0


def test_backends_without_the_capability_are_skipped_or_refused():
    cpu, host = make_backend("cpu"), overlap_backend()
    assert CAP_COPY_OVERLAP not in cpu.capabilities
    chosen, skipped = ov.overlap_backends([("cpu", cpu), ("host", host)], named=False)
    assert chosen == [("host", host)] and skipped[0][0] == "cpu" and "copy_overlap" in skipped[0][1]
    with naming.flags(), pytest.raises(BenchError, match="--backend cpu: no copy_overlap capability"):
        ov.overlap_backends([("cpu", cpu), ("host", host)], named=True)
    with pytest.raises(BenchError, match="no usable backend can overlap copies"):
        ov.overlap_backends([("cpu", cpu)], named=False)
    with pytest.raises(BenchError, match="cannot overlap copies"):
        ov.run_overlap([("cpu", cpu)], **SMALL)


def test_the_contracts_defaults():
    cpu = make_backend("cpu")
    a = Backend.host_alloc(cpu, (3, 4))
    assert a.shape == (3, 4) and a.dtype == np.float32
    with pytest.raises(NotImplementedError, match="copy_overlap"):
        Backend.host_alloc(cpu, (3, 4), pinned=True)
    with pytest.raises(NotImplementedError, match="copy_overlap"):
        Backend.overlap_layernorm(cpu, a, a[:, 0], a[:, 0], a, a, a[:, 0], a[:, 0], a, a[0], a[0],
                                  mode=OVERLAP_SYNC, streams=1, block=32)


def test_plot_draws_both_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from llmc_cli.charts import plot_overlap
    res = ov.run_overlap([("host", overlap_backend())], **dict(SMALL, repeat=1, warmup=0))
    out = tmp_path / "overlap.png"
    plot_overlap(res, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
