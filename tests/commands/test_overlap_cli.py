"""`llmc bench overlap` on the command line, with a numpy backend announcing CAP_COPY_OVERLAP injected as a plugin:
the table, --json, --plot, a wrong backend's exit status, and every bad option refused in one line."""

from __future__ import annotations

import json
import sys

import pytest
from llmc_test_support import one_line_error, overlap_backend, run

from llmc_cli import registry
from llmc_cli.kernels import BackendPlugin

SMALL = ["-t", "8", "-c", "32", "-b", "1", "-b", "2", "--streams", "1", "--streams", "2", "--block", "32",
         "--block", "64", "--repeat", "1", "--warmup", "0"]


class _Plugin(BackendPlugin):
    name = "hostoverlap"

    def __init__(self, fault=None):
        self.fault = fault

    def probe(self):
        return True, "numpy with CAP_COPY_OVERLAP (test)"

    def create(self, device=None, dtype=None, options=None):
        return overlap_backend(self.fault)


@pytest.fixture
def plugins(monkeypatch):
    """Only the cpu backend and the numpy overlap one (the others, where installed, would be timed too)."""
    cpu = [p for p in registry.discover() if p.name == "cpu"]

    def use(fault=None):
        fake = registry.PluginInfo("hostoverlap", _Plugin(fault), True, "test plugin", "test")
        monkeypatch.setattr(registry, "discover", lambda: cpu + [fake])
    use()
    return use


def test_table_lists_the_cases_and_the_skipped_cpu(plugins):
    r = run("bench", "overlap", *SMALL)
    assert "not benchmarked: cpu (no copy_overlap capability" in r.stdout
    for word in ("llmc bench overlap", "chunked x2", "sync", "pinned", "pageable", "B=2", "GB/s", "against sync"):
        assert word in r.stdout, word
    assert "MISMATCH" not in r.stdout


def test_json_holds_every_case(plugins):
    r = run("bench", "overlap", *SMALL, "--host-memory", "pinned", "--json")
    out = json.loads(r.stdout)
    assert set(out) == {"config", "results", "summary", "mismatches", "machine", "skipped"}
    assert len(out["results"]) == 2 * (2 + 2 * 2) and out["mismatches"] == []
    assert out["config"]["host_memory"] == ["pinned"] and out["config"]["blocks"] == [32, 64]
    assert out["skipped"][0]["backend"] == "cpu"
    r0 = out["results"][0]
    assert {"backend", "B", "T", "C", "rows", "mode", "streams", "block", "host_memory", "bytes", "times_ms",
            "median_ms", "gb_s", "max_rel_err", "ok"} <= set(r0)
    assert r0["gb_s"] == pytest.approx(r0["bytes"] / r0["median_ms"] / 1e6)


def test_plot_is_written(plugins, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "overlap.png"
    r = run("bench", "overlap", *SMALL, "--plot", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in r.stderr


def test_a_backend_that_writes_nothing_exits_1(plugins):
    plugins("no_out")
    r = run("bench", "overlap", *SMALL, "--json", ok=False)
    assert r.exit_code == 1 and len(json.loads(r.stdout)["mismatches"]) == 24
    err = r.stderr.strip()
    assert err.startswith("error: 24 case(s) differ from the numpy layernorm") and "and 19 more" in err
    assert "\n" not in err


@pytest.mark.parametrize("args, needles", [
    (["--streams", "0"], ["--streams", "1, 64", "got 0"]),
    (["--streams", "nan"], ["--streams", "integer"]),
    (["--block", "48"], ["--block", "power of two", "got 48"]),
    (["--block", "2048"], ["--block", "power of two", "got 2048"]),
    (["--block", "16"], ["--block", "got 16"]),
    (["-b", "-1"], ["--batch-size", ">= 1", "got -1"]),
    (["-b", "nan"], ["--batch-size", "integer"]),
    (["-t", "0"], ["--seq-len", "got 0"]),
    (["-c", "inf"], ["--channels", "integer"]),
    (["--repeat", "nan"], ["--repeat", "integer"]),
    (["--warmup", "-2"], ["--warmup", "got -2"]),
    (["--mode", "async"], ["--mode", "async"]),
    (["--host-memory", "shared"], ["--host-memory", "shared"]),
    (["-b", "1", "-t", "1", "--streams", "2"], ["--streams 2", "more chunks than the 1 rows"]),
    (["--backend", "cpu"], ["--backend cpu", "copy_overlap"]),
    (["--backend", "nope"], ["--backend nope", "not installed"]),
])
def test_bad_options_are_one_line(plugins, args, needles):
    r = run("bench", "overlap", "--repeat", "1", "-b", "1", "-t", "4", "-c", "8", *args, ok=False)
    one_line_error(r, *needles)


def test_plot_refuses_to_replace_a_file_that_is_not_a_png(plugins, tmp_path):
    pytest.importorskip("matplotlib")
    keep = tmp_path / "notes.png"
    keep.write_text("mine")
    one_line_error(run("bench", "overlap", *SMALL, "--plot", keep, ok=False), "--plot", "not a PNG")
    assert keep.read_text() == "mine"


def test_plot_without_matplotlib_is_one_line(plugins, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    one_line_error(run("bench", "overlap", *SMALL, "--plot", tmp_path / "x.png", ok=False), "needs matplotlib")
    assert not (tmp_path / "x.png").exists()


def test_help_shows_an_example():
    r = run("bench", "overlap", "--help")
    assert "Example:" in r.output and "llmc bench overlap --backend cuda" in r.output
    assert "full: 504 cases (-b 8 16 32 64 128 256 512," in " ".join(r.output.split())


def test_no_options_run_the_small_grid_and_say_so_first(plugins):
    quick = ["-t", "8", "-c", "32", "--repeat", "1", "--warmup", "0"]
    out = json.loads(run("bench", "overlap", *quick, "--json").stdout)
    assert len(out["results"]) == 8 and out["config"]["batches"] == [8, 16] and out["config"]["streams"] == [4]
    r = run("bench", "overlap", *quick)
    assert r.stderr.splitlines()[0] == ("bench overlap: 8 case(s) on 1 backend(s) (grid small; --grid full runs 504 "
                                        "per backend)")
    full = [*quick, "--grid", "full", "-b", "2", "--block", "32"]
    r = run("bench", "overlap", *full)
    assert r.stderr.splitlines()[0] == "bench overlap: 12 case(s) on 1 backend(s) (grid full)"
    assert len(json.loads(run("bench", "overlap", *full, "--json").stdout)["results"]) == 12  # 1 batch x 1 block
    # x (sync + 5 stream counts) x 2 host memories
