"""`llmc plot` (and `llmc bench --plot`) on odd logs and odd output names, each case as found:

* a log whose step records hold none of the plotted fields ({"step": 1}, or the LLMC_STEP_PHASES file llmc itself
  writes) was a matplotlib traceback ("Number of rows must be a positive integer, not 0"); now one line naming it;
* tok_per_s x ms past float's range was an OverflowError from round(); losses or steps of +-1e308 and --x tokens
  with tokens_per_step 1e308 were "arange: cannot compute length" from matplotlib; now one line naming the log
  and the field, or (where the values can be drawn) a picture;
* NaN-only series, zero or negative grad norms on the log axis and the like printed matplotlib's UserWarnings;
* --out x.svg / x.pdf (and bench --plot x.svg) wrote PNG bytes under that name; a name over 255 bytes failed only
  when written.
Every failure: exit 2, one line starting "error:" that names the file or option, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from llmc_test_support import TINY, one_line_error, run

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def write(path, *records) -> str:
    """A log of `records`: dicts as JSON lines, strings as they are (JSON that json.dumps will not write)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def plot(*args):
    """`llmc plot ARGS` in-process, failing the test on any Python warning it raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run("plot", *args, ok=False)
    assert not caught, [str(w.message) for w in caught]
    return r


def refused(tmp_path, log, *needles, extra=()):
    out = tmp_path / "p.png"
    line = one_line_error(plot(log, "--out", out, *extra), *needles)
    assert not out.exists() and not list(tmp_path.glob("*.tmp*")), line
    return line


def drawn(tmp_path, log, extra=()):
    out = tmp_path / "drawn.png"
    r = plot(log, "--out", out, *extra)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == PNG and r.output.strip() == f"wrote {out}", r.output


# ---------------------------------------------------------------------------------------------------------------
# logs with nothing to draw

@pytest.mark.parametrize("records", [
    [{"step": 1}],
    [{"step": 1, "ms": 3.5, "device_ms": {"compute": 3.0}, "gap_ms": None}],  # an LLMC_STEP_PHASES line
    [{"step": 1, "loss": "2.5", "lr": [1e-3], "norm": True}],  # numbers that are not numbers
    [{"step": 1, "loss": "NaN"}, '{"step": 2, "loss": NaN, "norm": NaN, "lr": Infinity}'],
    ['{"step": 1, "loss": 1%s}' % ("0" * 400)],  # an integer past float's range: skipped like a missing one
], ids=["step_only", "phases", "strings", "nan_only", "huge_int"])
def test_no_plottable_series_is_one_line(tmp_path, records):
    log = write(tmp_path / "x.jsonl", *records)
    refused(tmp_path, log, log, "no plottable series", "loss")


def test_a_step_phases_file_llmc_wrote_is_not_a_training_log(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_STEP_PHASES", str(tmp_path / "ph" / "phases.jsonl"))
    run(*TINY, "--data", shards / "tiny_train_000001.bin", "--steps", 2)
    log = tmp_path / "ph" / "phases.jsonl" / "rank0.jsonl"
    assert json.loads(log.read_text().splitlines()[0])["step"] == 1
    monkeypatch.delenv("LLMC_STEP_PHASES")
    refused(tmp_path, log, log, "no plottable series")


def test_one_bad_log_among_good_ones_is_named(tmp_path):
    good = write(tmp_path / "good.jsonl", {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5})
    bad = write(tmp_path / "bad.jsonl", {"step": 1})
    out = tmp_path / "p.png"
    line = one_line_error(plot(good, bad, "--out", out), bad, "no plottable series")
    assert "good.jsonl" not in line and not out.exists()


@pytest.mark.parametrize("records", [
    ['{"step": true, "loss": 1}', '{"step": false, "loss": 2}'],  # bools are not steps
    ['{"step": 1%s, "loss": 1}' % ("0" * 400)],  # nor integers past float's range
])
def test_steps_that_are_not_numbers_are_no_step_records(tmp_path, records):
    log = write(tmp_path / "x.jsonl", *records)
    refused(tmp_path, log, log, "no step records")


def test_zero_grad_norms_only_cannot_go_on_the_log_axis(tmp_path):
    log = write(tmp_path / "x.jsonl", {"step": 1, "norm": 0.0}, {"step": 2, "norm": -1.0}, {"step": 3, "norm": 1e-320})
    refused(tmp_path, log, log, "no plottable series", "norm", "log axis")


def test_tokens_axis_without_a_token_count(tmp_path):
    # 1e200 tok/s for 1e200 ms: a count past float's range (it was an OverflowError from round())
    log = write(tmp_path / "x.jsonl", {"step": 1, "loss": 2.0, "tok_per_s": 1e200, "ms": 1e200})
    refused(tmp_path, log, log, "tok_per_s", extra=("--x", "tokens"))
    drawn(tmp_path, log)  # against step it is an ordinary loss
    log = write(tmp_path / "y.jsonl", {"step": 1, "loss": 2.0, "tokens": "many"}, {"step": 2, "loss": 1.0,
                                                                                    "tokens": "more"})
    refused(tmp_path, log, log, "no plottable series", "tokens", extra=("--x", "tokens"))


# ---------------------------------------------------------------------------------------------------------------
# values matplotlib cannot place

@pytest.mark.parametrize("records, x, field", [
    ([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1e308}, {"step": 3, "loss": -1e308}], "step", "loss"),
    ([{"step": -1e308, "loss": 1.0}, {"step": 1e308, "loss": 2.0}], "step", "step"),
    ([{"step": 1, "loss": 1.0, "tokens_per_step": 1e308}, {"step": 2, "loss": 2.0}], "tokens", "tokens"),
    ([{"step": 1, "loss": 1.0, "tokens_per_step": 1e300}, {"step": 2, "loss": 2.0}], "tokens", "tokens"),  # 2e300
    ([{"step": 1, "loss": 1.0, "tokens": 1e308}, {"step": 2, "loss": 2.0, "tokens": -1e308}], "tokens", "tokens"),
    ([{"step": 1, "norm": 1e250}, {"step": 2, "norm": 1.0}], "step", "norm"),  # a log axis's ticks overflow
    ([{"step": 1, "lr": 1e-3}, {"step": 2, "lr": 1.7e308}], "step", "lr"),
], ids=["loss", "step", "tokens_per_step", "tokens_product", "tokens_field", "norm_log", "lr"])
def test_values_out_of_the_plottable_range_are_one_line(tmp_path, records, x, field):
    log = write(tmp_path / "x.jsonl", *records)
    line = refused(tmp_path, log, log, f"{field} has values out of the plottable range", extra=("--x", x))
    assert "e+" in line  # the bound it expected


@pytest.mark.parametrize("records, extra", [
    # at the bounds: huge but drawable
    ([{"step": 1, "loss": 1e300}, {"step": 2, "loss": -1e300}, {"step": 1e300, "loss": 0.0},
      {"step": -1e300, "loss": 5e-324}], ()),
    ([{"step": 1, "norm": 1e200}, {"step": 2, "norm": 1.5e-200}, {"step": 3, "norm": 1.0}], ()),
    # non-positive and vanishing grad norms beside positive ones: left off the log axis, no warning
    ([{"step": 1, "loss": 1.0, "norm": 0.0}, {"step": 2, "loss": 1.0, "norm": -1.0},
      {"step": 3, "loss": 1.0, "norm": 1e-320}, {"step": 4, "loss": 1.0, "norm": 2.0}], ("--smooth", "0.9")),
    # grad norms all zero or negative beside a good loss: the norm panel is left out ("Data has no positive values")
    ([{"step": 1, "loss": 1.0, "norm": 0.0}, {"step": 2, "loss": 1.0, "norm": -1.0}], ()),
    # NaN-only fields beside a good one: their panel is left out ("No artists with labels found to put in legend")
    ([{"step": 1, "lr": 1e-3, "norm": "NaN"}, '{"step": 2, "lr": 2e-3, "loss": NaN, "val_loss": NaN}'], ()),
    # duplicate steps, steps going backwards, a single point, a lone val record
    ([{"step": 1, "loss": 3.0}, {"step": 1, "loss": 2.0}, {"step": 1, "loss": 1.0}], ()),
    ([{"step": 3, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 1, "loss": 3.0}], ()),
    ([{"step": 5, "loss": 3.0}], ()),
    ([{"step": 0, "val_loss": 5.0}], ()),
    ([{"step": 0, "hellaswag_acc_norm": 0.3}], ()),
    # steps further apart than float can tell, subnormal learning rates
    ([{"step": 1e17, "loss": 1.0}, {"step": 100000000000000016, "loss": 2.0}], ()),
    ([{"step": 1, "lr": 5e-324}, {"step": 2, "lr": 0.0}], ()),
    # negative steps against tokens
    ([{"step": -5, "loss": 1.0, "tok_per_s": 1000.0, "ms": 100.0}, {"step": 5, "loss": 2.0}], ("--x", "tokens")),
], ids=["linear_bounds", "log_bounds", "norm_nonpositive", "norm_zero", "nan_fields", "duplicate_steps", "backwards",
        "one_point", "val_only", "hellaswag_only", "close_huge_steps", "subnormal_lr", "negative_steps_tokens"])
def test_odd_but_drawable_logs_are_drawn_without_warnings(tmp_path, records, extra):
    drawn(tmp_path, write(tmp_path / "x.jsonl", *records), extra)


def test_stderr_holds_no_warnings(tmp_path):
    """The real stderr of the command (in-process checks see warnings, not what a user's terminal shows)."""
    log = write(tmp_path / "x.jsonl", {"step": 1, "loss": 2.0, "norm": 0.0}, {"step": 2, "loss": 1.0, "norm": -1.0},
                '{"step": 3, "loss": 1.0, "val_loss": NaN}')
    out = tmp_path / "p.png"
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # (shown once each, as a user would see them)
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "plot", log, "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert out.read_bytes()[:8] == PNG


# ---------------------------------------------------------------------------------------------------------------
# output names

@pytest.mark.parametrize("name", ["x.svg", "x.pdf", "x.jpg", "x.png.txt"])
def test_out_must_be_a_png_name(tmp_path, name):
    log = write(tmp_path / "x.jsonl", {"step": 1, "loss": 2.0})
    out = tmp_path / name
    line = one_line_error(plot(log, "--out", out), f"--out {out}: expected a .png file name")
    assert not out.exists(), line


@pytest.mark.parametrize("name", ["x.PNG", "x.Png", "curves"])
def test_png_names_in_any_case_and_names_without_a_suffix_are_written(tmp_path, name):
    log = write(tmp_path / "x.jsonl", {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0})
    out = tmp_path / name
    r = plot(log, "--out", out)
    assert r.exit_code == 0 and out.read_bytes()[:8] == PNG, r.output


def test_a_file_name_over_255_bytes_is_refused_up_front(tmp_path):
    log = write(tmp_path / "x.jsonl", {"step": 1, "loss": 2.0})
    out = tmp_path / ("a" * 252 + ".png")  # 256 bytes
    one_line_error(plot(log, "--out", out), "--out", "256 bytes", "at most 255")
    out = tmp_path / ("é" * 127 + ".png")  # 127 characters of 2 bytes each: 258 bytes
    one_line_error(plot(log, "--out", out), "--out", "258 bytes")
    assert os.listdir(tmp_path) == ["x.jsonl"]


@pytest.mark.parametrize("name, needle", [("k.svg", "expected a .png file name"), ("b" * 256 + ".png", "at most 255")],
                         ids=["svg", "long"])
def test_bench_plot_name_is_refused_before_the_benchmark(tmp_path, name, needle):
    out = tmp_path / name
    r = run("bench", "kernels", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "--vocab-size", "256",
            "-b", "1", "-t", "8", "--repeat", "1", "--warmup", "0", "--only", "matmul", "--plot", out, ok=False)
    one_line_error(r, "--plot", needle)
    assert "matmul" not in r.output and os.listdir(tmp_path) == []  # refused before any table
