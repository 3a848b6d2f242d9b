"""What `llmc train` leaves on a terminal or a pipe fits its width: at 80 columns every line, start to end, fits (a
step line of ~123 characters wrapped to two rows, the live bar cut its count and times to "100/3..." and "0:00:...");
the bar and the step lines show the one ETA; a wider console shows more; bench/train_median.py still reads the
step lines."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmc_test_support import TINY, run
from rich.console import Console

import llmc_cli.commands.progress as progress
import llmc_cli.commands.train as train_cmd
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.models.gpt2 import GPT2Config, init_parameters

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


@pytest.fixture
def workdir(shards, tmp_path, monkeypatch):
    """A working directory with the shards in data/, so that the paths the lines show are short, as a user's are."""
    shutil.copytree(shards, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def screen(monkeypatch, width: int, terminal: bool) -> io.StringIO:
    """What train prints, into a console of `width` columns (a terminal's or a pipe's)."""
    out = io.StringIO()
    con = Console(file=out, width=width, force_terminal=terminal, highlight=False, soft_wrap=True)
    for module in (progress, train_cmd):
        monkeypatch.setattr(module, "console", con)
    return out


def rows(text: str) -> list[str]:
    """The rows a terminal shows: escape sequences out, split at newlines and carriage returns."""
    return [r for r in re.split(r"[\r\n]", ANSI.sub("", text)) if r.strip()]


def train(*extra):
    return run(*TINY, "--data", "data", "--val-every", 2, "--val-batches", 2, *extra)


@pytest.mark.parametrize("terminal", [False, True])
def test_every_line_fits_80_columns(workdir, monkeypatch, terminal):
    out = screen(monkeypatch, 80, terminal)
    train("--steps", 4, "--out", "run", "--sample-every", 2, "--sample-tokens", 4)
    train("--steps", 6, "--out", "run", "--resume")
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)
    write_model(workdir / "init.bin", cfg, init_parameters(cfg, 4))
    run("train", "--backend", "cpu", "--init", "init.bin", "-b", 2, "-t", 32, "--steps", 2, "--data", "data",
        "--val-every", 0, "--sample-every", 0, "--no-prefetch")
    shown = rows(out.getvalue())
    for said in ("options from run:", "resumed from run at step 4", "init: init.bin (GPT-2", "no --out:",
                 "data: train 1 shard(s)", "memory:", "memory at the end:", "data: waited for", "checkpoint: run",
                 "step     6/6 | loss ", "read inside the steps"):
        assert any(said in r for r in shown), (said, shown)
    sample = False
    for r in shown:  # (a sample's text is the model's own: its rows are what the model wrote)
        sample = r.startswith("sample at step") or (sample and r != "---")
        assert sample or (len(r) <= 80 and "…" not in r), r
    if terminal:
        assert any(r.startswith("train ") and "━" in r for r in shown), shown  # the live bar was there


def test_the_bar_shows_the_step_lines_eta(workdir, monkeypatch):
    out = screen(monkeypatch, 80, True)
    update = progress.StepLines._update_bar

    def drawn(self, *a):  # every update drawn (rich draws ten times a second: a tiny step is faster)
        update(self, *a)
        self.bar.refresh()
    monkeypatch.setattr(progress.StepLines, "_update_bar", drawn)
    train("--steps", 6)
    shown = rows(out.getvalue())
    lines = {m[1]: m[2] for m in (re.match(r"step +(\d+)/6 \|.* ETA (\S+)", r) for r in shown) if m}
    bars = {m[1]: m[2] for m in (re.search(r"(\d+)/6 .*ETA (\S+)$", r) for r in shown if r.startswith("train "))
            if m}
    assert len(lines) == 6 and bars, shown
    assert all(lines[step] == eta for step, eta in bars.items()), (lines, bars)


def test_a_wider_console_shows_more_and_the_bench_reads_both(workdir, monkeypatch, tmp_path):
    logs = {}
    for width in (80, 200):
        out = screen(monkeypatch, width, False)
        train("--steps", 5)
        logs[width] = [r for r in rows(out.getvalue()) if r.startswith("step ") and "|" in r]
        assert len(logs[width]) == 5 and all(len(r) <= width for r in logs[width]), logs[width]
        (tmp_path / f"w{width}.log").write_text("\n".join(logs[width]) + "\n")
        r = subprocess.run([sys.executable, REPO / "bench" / "train_median.py", tmp_path / f"w{width}.log", "--skip",
                            "0"], capture_output=True, text=True, check=True)
        assert ": 5 steps after step 0: median " in r.stdout, r.stdout
    for extra in ("| norm ", "| lr ", " tokens |", " elapsed |"):
        assert extra in logs[200][0] and extra not in logs[80][0], (extra, logs)


def test_wrapped_breaks_lines_of_facts_between_items(monkeypatch):
    monkeypatch.setattr(progress, "console", Console(file=io.StringIO(), width=40))
    text = progress.wrapped("memory: activations 27.9 MiB, grads 3.2 MiB, optimizer 6.5 MiB; total 40.8 MiB")
    assert text == "memory: activations 27.9 MiB, grads 3.2\n  MiB, optimizer 6.5 MiB; total 40.8 MiB"
    assert progress.wrapped("data: a\nb; c") == "data: a\\nb; c"  # (a name's newline shown, not obeyed)
    long = "/" + "x" * 50
    assert progress.wrapped(f"options {long}") == f"options\n  {long}"  # a path kept whole
    note = "step 12: update skipped (loss z-score 9.1 > --skip-loss-z 6); 1 bad step(s) in a row"
    assert progress.wrapped(note, between_words=False) == note.replace("; ", ";\n  ")  # (what `say` prints)
    assert progress.wrapped(f"checkpoint: {long}", between_words=False) == f"checkpoint: {long}"
    text = progress.wrapped_items("options from run:", ["--batch-size 12", "--model bytes-d4", "--lr 0.001"])
    assert text == "options from run: --batch-size 12\n  --model bytes-d4 --lr 0.001"
