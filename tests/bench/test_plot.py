"""`llmc plot`: run logs (JSON lines from `llmc train --log`) -> one PNG, several runs overlaid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc_cli import charts

from llmc_test_support import run

pytest.importorskip("matplotlib")




def write_log(path, steps=30, seed=0, hellaswag=True):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for s in range(steps + 1):
            if s % 10 == 0:
                rec = {"step": s, "val_loss": 6 - s / 10}
                if hellaswag:
                    rec |= {"hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.25 + s / 1000, "hellaswag_examples": 10}
                f.write(json.dumps(rec) + "\n")
            if s < steps:
                f.write(json.dumps({"step": s + 1, "loss": 6 - s / 8 + rng.normal(0, 0.1), "norm": 1 + rng.random(),
                                    "lr": 3e-4 * min(1, (s + 1) / 5), "ms": 100.0, "tok_per_s": 2560.0}) + "\n")


def is_png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_runs_overlaid(tmp_path):
    (tmp_path / "run1").mkdir()
    write_log(tmp_path / "run1" / "log.jsonl")
    write_log(tmp_path / "b.jsonl", seed=1, hellaswag=False)
    out = tmp_path / "curves.png"
    r = run("plot", tmp_path / "run1", tmp_path / "b.jsonl", "--out", out, "--smooth", 0.8)
    assert is_png(out) and "wrote" in r.output
    out2 = tmp_path / "sub" / "tokens.png"
    run("plot", tmp_path / "b.jsonl", "--x", "tokens", "--out", out2)
    assert is_png(out2)


def test_tokens_per_step_and_ema():
    recs = [{"step": 1, "loss": 1.0, "ms": 100.0, "tok_per_s": 2560.0}]
    assert charts.tokens_per_step(recs) == 256
    assert charts.ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected
    assert charts.ema([0.0, 1.0], 0.0) == [0.0, 1.0]


@pytest.mark.parametrize("case", ["missing", "no_log_dir", "not_json", "smooth"])
def test_bad_input_one_line_error(tmp_path, case):
    args = ["plot", tmp_path / "x.jsonl", "--out", tmp_path / "p.png"]
    if case == "no_log_dir":
        (tmp_path / "run").mkdir()
        args[1] = tmp_path / "run"
    elif case == "not_json":
        (tmp_path / "x.jsonl").write_text("step 1 loss 3\n")
    elif case == "smooth":
        write_log(tmp_path / "x.jsonl")
        args += ["--smooth", 1.5]
    r = run(*args, ok=False)
    msg = r.output.strip()
    assert r.exit_code == 2 and msg.startswith("error:") and "\n" not in msg, msg
    assert not (tmp_path / "p.png").exists()


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    write_log(tmp_path / "x.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = run("plot", tmp_path / "x.jsonl", "--out", tmp_path / "p.png", ok=False)
    assert r.exit_code == 2 and "matplotlib" in r.output and "\n" not in r.output.strip()


def test_default_output_goes_into_the_run_and_legends_are_short(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from llmc_cli.charts import default_png, run_labels
    a, b = tmp_path / "runs" / "a", tmp_path / "other" / "a"
    for d in (a, b):
        d.mkdir(parents=True)
        write_log(d / "log.jsonl")
    monkeypatch.chdir(tmp_path)
    r = run("plot", a)
    assert (a / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists(), r.output
    assert default_png([str(a), str(b)]) == Path("plot.png")
    assert run_labels([str(a), str(tmp_path / "x.jsonl")]) == ["a", "x"]
    assert run_labels([str(a), str(b / "log.jsonl")]) == [str(a), str(b / "log.jsonl")]  # same name: the paths
