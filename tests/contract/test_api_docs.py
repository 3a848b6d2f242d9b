"""docs/api.md's examples run as written, in order, in a folder where `llmc tokenize shakespeare` has run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_documented_examples_run(tmp_path, monkeypatch, capsys):
    from llmc_cli.formats.files import DataError
    from llmc_cli.tokenizing.sources import shakespeare_files
    try:
        shakespeare_files()
    except DataError as e:
        pytest.skip(str(e))
    monkeypatch.chdir(tmp_path)
    from llmc_test_support import run
    run("tokenize", "shakespeare")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3
    env: dict = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), env)
    out = capsys.readouterr().out
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out
    assert out.count("ROMEO:") >= 1 and re.search(r"val loss \d+\.\d+", out), out
    assert (tmp_path / "checkpoints" / "api" / "latest").is_file()


def test_the_readme_and_api_examples_write_different_run_directories():
    """Run one after the other in one folder, the second must not find the first's run (and refuse it)."""
    readme = DOC.parents[1] / "README.md"
    outs = [set(re.findall(r'out="([^"]+)"', "".join(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))))
            for p in (readme, DOC)]
    assert all(outs) and not outs[0] & outs[1], outs
