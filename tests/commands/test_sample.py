"""`llmc sample`'s --prompt: the command line's bytes read as UTF-8 whatever the locale decoded them as (LC_ALL=C
with Python's UTF-8 mode off decodes a UTF-8 prompt into lone surrogates), and a prompt that is not UTF-8 refused
in one line that says what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from llmc_test_support import TINY, run, two_shard_dir

from llmc_cli.commands.sample import prompt_text


@pytest.mark.parametrize("given, want", [
    ("ROMEO:", "ROMEO:"),
    ("héllo wörld", "héllo wörld"),
    ("h\udcc3\udca9llo", "héllo"),  # UTF-8 bytes an ASCII locale kept as surrogates
    ("\udce2\udc82\udcac 5", "€ 5"),
    ("a\udcff", ValueError("not UTF-8 text (byte 0xff)")),
    ("é\udcc3", ValueError("not UTF-8 text (byte 0xc3)")),  # half a character
    ("\ud800", ValueError("not UTF-8 text ('\\ud800')")),  # a surrogate no byte stands for (the API's text)
    ("\udcff\ud800", ValueError("not UTF-8 text (byte 0xff)")),
])
def test_prompt_text(given, want):
    if isinstance(want, ValueError):
        with pytest.raises(ValueError) as e:
            prompt_text(given)
        assert str(e.value) == str(want)
    else:
        assert prompt_text(given) == want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    run(*TINY, "--data", two_shard_dir(tmp), "--steps", 1, "--out", tmp / "run")
    return tmp / "run"


def _sample(checkpoint, prompt: bytes, **env):
    argv = [sys.executable, "-m", "llmc_cli", "sample", "--checkpoint", str(checkpoint), "--backend", "cpu",
            "--max-new-tokens", "1", "--prompt"]
    return subprocess.run([os.fsencode(a) for a in argv] + [prompt], capture_output=True,
                          env={**os.environ, **env}, timeout=120)


def test_a_utf8_prompt_under_the_c_locale_is_text(checkpoint):
    p = _sample(checkpoint, "héllo €".encode(), LC_ALL="C", PYTHONUTF8="0")
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    assert p.stdout.startswith("héllo €".encode())


def test_a_prompt_that_is_not_utf8_says_to_use_a_utf8_locale(checkpoint):
    p = _sample(checkpoint, b"a\xff", LC_ALL="C", PYTHONUTF8="0")
    assert p.returncode == 2 and p.stderr.decode().strip() == (
        "error: --prompt: not UTF-8 text (byte 0xff); give UTF-8 (a UTF-8 locale, e.g. LC_ALL=C.UTF-8), or the text "
        "in a UTF-8 file with --prompt-file"), p.stderr
