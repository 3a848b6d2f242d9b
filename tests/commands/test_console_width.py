"""Output that is the result never depends on the terminal's width, and a standard error that cannot be written
never changes the exit code: `COLUMNS=0 llmc backends` printed nothing (exit 0), and `llmc sample ... 2>/dev/full`
on a bad --checkpoint ended in a traceback and exit 1 instead of the one-line error's 2."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console
from rich.table import Table

from llmc_cli.commands.console import PLAIN_WIDTH, console_size

LLMC = [sys.executable, "-m", "llmc_cli"]

# (COLUMNS, LINES, the size the consoles are made with: {} = rich's own reading, which is usable)
SIZES = [
    (None, None, {}),
    ("120", None, {}),
    ("20", "40", {}),
    ("0", None, {"width": PLAIN_WIDTH}),
    ("5", None, {"width": PLAIN_WIDTH}),
    ("abc", None, {"width": PLAIN_WIDTH}),
    ("-3", None, {"width": PLAIN_WIDTH}),
    ("", None, {"width": PLAIN_WIDTH}),
    ("99999999999", None, {"width": PLAIN_WIDTH}),
    ("80", "0", {"height": 25}),
    ("0", "x", {"width": PLAIN_WIDTH, "height": 25}),
]


@pytest.mark.parametrize("columns,lines,want", SIZES)
def test_an_unusable_width_falls_back_to_a_sane_one(monkeypatch, columns, lines, want):
    for var, value in (("COLUMNS", columns), ("LINES", lines)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert console_size() == want
    out = io.StringIO()
    table = Table("backend", "usable")
    table.add_row("cpu", "yes")
    Console(file=out, **console_size()).print(table)  # (the table a result is: every cell printed)
    assert "cpu" in out.getvalue() and "usable" in out.getvalue(), (columns, out.getvalue())


@pytest.mark.parametrize("columns", ["0", "garbage", "3"])
def test_backends_prints_its_table_at_any_columns(columns):
    r = subprocess.run([*LLMC, "backends"], capture_output=True, text=True, timeout=120,
                       env=os.environ | {"COLUMNS": columns})
    assert r.returncode == 0, r.stderr
    assert "cpu" in r.stdout and "backend" in r.stdout, r.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("args", [["sample", "--checkpoint", "/nonexistent/run"], ["backends", "--bogus"]])
def test_a_full_stderr_still_ends_with_the_documented_code(args):
    with open("/dev/full", "w") as full:
        r = subprocess.run([*LLMC, *args], stdout=subprocess.PIPE, stderr=full, timeout=120)
    assert r.returncode == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_success_whose_stderr_is_full_still_succeeds(gpt2_model):
    """sample's last line (tokens/s) goes to stderr: a full one is no failure of the sampling."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([*LLMC, "sample", "--backend", "cpu", "--checkpoint", str(gpt2_model), "--prompt", "Hi",
                            "--max-new-tokens", "2"], stdout=subprocess.PIPE, stderr=full, timeout=300, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Hi"), r.stdout
