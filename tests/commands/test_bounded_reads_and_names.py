"""Files that may be huge or FIFOs read in bounded pieces, and names shown as they are, across the commands.

* a file under a log's or a manifest's name that is gigabytes (sparse) is refused by reading a bounded prefix,
  never read whole: `train --log`, `plot`, `tokenize`'s manifest, a later rank's `--init-file`;
* a FIFO where `OUT/config.toml` or the `--init-file` belongs is refused by its kind, never opened (a hang);
* a log whose torn last line is JSON nested past Python's stack resumes (the line dropped), not a traceback;
* `--resume` with `--log` given as a symbolic link trims the log the link names and keeps the link;
* names on the progress and summary lines (tokenize, train's data line, plot, convert) are text, not rich markup,
  and a newline or an escape sequence in them is shown escaped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import pytest
from llmc_test_support import TINY, fifo, one_line_error, phrase_tokens, run

from llmc_cli.formats.shards import write_shard

HUGE = 1 << 30  # a sparse GiB: read whole, it costs a GiB of memory (or more)
BOUND = 200 << 20  # what a bounded read may cost, imports and all


@pytest.fixture(scope="module")
def data(shards):
    """(conftest's tiny shards, under the name these tests use)"""
    return shards


def sparse(path, size: int = HUGE):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def peak_of(fn):
    """(fn's result, the peak of Python's allocations while it ran)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def tree(d) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size if p.is_file() and not p.is_symlink() else os.readlink(p)
                                    if p.is_symlink() else None) for p in sorted(d.rglob("*"))}


# ---- b: whole-file reads of files no header bounds ------------------------------------------------------------
def test_train_log_that_is_a_huge_sparse_file_is_refused_without_reading_it(data, tmp_path):
    log = sparse(tmp_path / "big.jsonl")
    r, peak = peak_of(lambda: run(*TINY, "--steps", 1, "--data", data / "tiny_train_000001.bin", "--log", log,
                                  ok=False))
    one_line_error(r, "--log", "big.jsonl", "not an llmc log")
    assert peak < BOUND, f"{peak / 2**20:.0f} MiB allocated to refuse it"
    assert log.stat().st_size == HUGE


def test_plot_of_a_huge_one_line_file_is_one_line_without_reading_it(tmp_path):
    log = sparse(tmp_path / "big.jsonl")
    r, peak = peak_of(lambda: run("plot", log, "--out", tmp_path / "p.png", ok=False))
    one_line_error(r, "big.jsonl:1")
    assert peak < BOUND, f"{peak / 2**20:.0f} MiB allocated to refuse it"
    assert not (tmp_path / "p.png").exists()


def test_tokenize_manifest_that_is_a_huge_sparse_file_is_refused_without_reading_it(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, a tiny corpus\n")
    out = tmp_path / "out"
    out.mkdir()
    from llmc_cli.tokenizing.pipeline import MANIFEST_MAX_BYTES
    size = MANIFEST_MAX_BYTES + (1 << 20)
    sparse(out / "a_manifest.json", size)
    r, peak = peak_of(lambda: run("tokenize", "text", tmp_path / "a.txt", "--out-dir", out, "--workers", 1,
                                  ok=False))
    one_line_error(r, "a_manifest.json", "not an llmc tokenize manifest")
    assert peak < BOUND, f"{peak / 2**20:.0f} MiB allocated to refuse it"
    assert tree(out) == {"a_manifest.json": size}


def test_init_file_of_a_later_rank_huge_or_a_fifo(tmp_path):
    from llmc_cli.kernels import CommError
    from llmc_cli.parallel.rendezvous import share_file
    big = sparse(tmp_path / "id", 256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(CommError, match="did not write"):
            share_file(None, 1, str(big), timeout=0.3)
        assert tracemalloc.get_traced_memory()[1] < 32 << 20  # a few bytes read a time, not the whole file
    finally:
        tracemalloc.stop()
    # (opened, a FIFO would wait for a writer; the helper lets such a read go)
    with fifo(tmp_path / "fifo") as f, pytest.raises(CommError, match="a FIFO"):
        share_file(None, 1, str(f), timeout=5)


# ---- c: inputs that may be FIFOs ------------------------------------------------------------------------------
def test_config_toml_fifo_in_out_is_refused_not_a_hang(data, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    os.mkfifo(out / "config.toml")
    try:
        p = subprocess.run([sys.executable, "-m", "llmc_cli", *map(str, TINY), "--steps", "1", "--data",
                            str(data / "tiny_train_000001.bin"), "--out", str(out)], check=False,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("llmc train waited on a FIFO at OUT/config.toml")
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.strip().startswith("error: --out:") and "config.toml" in p.stderr
    assert "\n" not in p.stderr.strip() and "Traceback" not in p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["config.toml"]


# ---- a, d: the run log on resume ------------------------------------------------------------------------------
@pytest.fixture
def run_with_log(data, tmp_path):
    """A run of 2 steps (checkpoints at 1 and 2) and its log, the run rewound to step 1 (as if killed)."""
    real = tmp_path / "real.jsonl"
    log = tmp_path / "log.jsonl"
    log.symlink_to(real.name)
    rd = tmp_path / "r"
    run(*TINY, "--steps", 2, "--checkpoint-every", 1, "--data", data / "tiny_train_000001.bin", "--out", rd,
        "--log", log)
    return rd, log, real


def test_resume_with_a_deeply_nested_torn_last_log_line(run_with_log, data):
    rd, log, real = run_with_log
    with open(real, "a") as f:
        f.write("[" * 100_000)  # a torn last line (allowed) that json cannot read within Python's stack
    r = run(*TINY, "--steps", 3, "--data", data / "tiny_train_000001.bin", "--out", rd, "--log", log, "--resume",
            ok=False)
    assert r.exit_code == 0, r.output
    assert [line[:9] for line in real.read_text().splitlines()] == ['{"step": '] * 3


def test_resume_keeps_a_log_given_as_a_symbolic_link(run_with_log, data):
    rd, log, real = run_with_log
    run(*TINY, "--steps", 3, "--data", data / "tiny_train_000001.bin", "--out", rd, "--log", log, "--resume")
    assert log.is_symlink() and os.readlink(log) == real.name  # the user's link, not replaced by a file
    assert len(real.read_text().splitlines()) == 3  # the log it names trimmed and appended to


# ---- e: names on the progress and summary lines ---------------------------------------------------------------
def test_tokenize_progress_and_summary_show_a_name_as_it_is(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, a tiny corpus\n")
    for name, shown in (("a[red]b", "a[red]b"), ("a\nb\x1b[31m", "a\\nb\\x1b[31m")):
        out = tmp_path / f"out{len(shown)}"
        r = run("tokenize", "text", tmp_path / "a.txt", "--name", name, "--out-dir", out, "--workers", 1)
        assert f"tokenize {shown} " in r.output, r.output  # the progress line (rich would eat '[red]' as markup)
        assert f"{shown}: 2 shards" in r.output, r.output  # the summary line, one line
        assert "\x1b" not in r.output


def test_train_data_line_plot_and_convert_lines_escape_names(data, tmp_path):
    d = tmp_path / "d\x1b[31m\rx"
    d.mkdir()
    write_shard(d / "tiny_train_000001.bin", phrase_tokens(60))
    rd = tmp_path / "r"
    r = run(*TINY, "--steps", 1, "--data", d, "--out", rd, "--log", tmp_path / "log.jsonl")
    assert "d\\x1b[31m\\rx/tiny_train_000001.bin)" in r.output, r.output  # (train's lines keep a sample's newlines)
    assert "\x1b" not in r.output and "\r" not in r.output, r.output
    png = tmp_path / "p\n[bold]q.png"
    r = run("plot", tmp_path / "log.jsonl", "--out", png)
    assert r.output.strip().endswith("wrote " + str(tmp_path / "p\\n[bold]q.png")), r.output
    dst = tmp_path / "m\x1b.bin"
    r = run("convert", rd, dst)
    assert "m\\x1b.bin" in r.output and "\x1b" not in r.output, r.output


def test_bench_plot_line_escapes_its_path(tmp_path):
    png = tmp_path / "k\x1b[31m\n.png"
    r = run("bench", "kernels", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "--vocab-size", "256",
            "-b", "1", "-t", "8", "--repeat", "1", "--warmup", "0", "--only", "matmul", "--plot", png)
    assert "plot: " + str(tmp_path / "k\\x1b[31m\\n.png") in r.stderr, r.stderr
    assert "\x1b" not in r.stderr and png.is_file()


def test_tokenize_hellaswag_and_tokenizer_bin_lines_escape_their_paths(tmp_path):
    import json
    src = tmp_path / "h.jsonl"
    src.write_text(json.dumps({"ctx": "A man", "endings": [" a", " b", " c", " d"], "label": 1}) + "\n")
    out = tmp_path / "o\x1b[2J\n"
    r = run("tokenize", "hellaswag", "--local", src, "--out-dir", out)
    assert r.output.strip().endswith("-> " + str(tmp_path / "o\\x1b[2J\\n" / "hellaswag_val.bin")), r.output
    r = run("tokenize", "tokenizer-bin", tmp_path / "t\x1b[2J\n.bin")
    assert r.output.strip().endswith("-> " + str(tmp_path / "t\\x1b[2J\\n.bin")), r.output
