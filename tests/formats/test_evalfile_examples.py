"""An eval file's examples must be scorable: a label naming one of the completions (any other was counted wrong
without a word) and a non-empty context and completions (an empty completion has no loss and always won). Both
the writer and the reader refuse them in one line naming the file and the example."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.formats.evalfile import HEADER_BYTES, read_evalfile, write_evalfile
from llmc_cli.formats.files import DataError

EX = {"label": 1, "ctx_tokens": [5, 6, 7], "ending_tokens": [[1], [2, 3], [4], [8, 9]]}


def _one_line(e, *needles):
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("tok", ["gpt2", "llama3"])
@pytest.mark.parametrize("change, expect", [
    ({"label": 4}, "example 1 has label 4, expected 0..3"),
    ({"label": -1}, "example 1 has label -1, expected 0..3"),
    ({"ctx_tokens": []}, "example 1 has an empty context or completion"),
    ({"ending_tokens": [[1], [], [4], [8]]}, "example 1 has an empty context or completion"),
])
def test_unscorable_examples_are_refused(tmp_path, tok, change, expect):
    good = write_evalfile(tmp_path / "good.bin", [EX, EX], tokenizer=tok)
    with pytest.raises(DataError) as e:
        write_evalfile(tmp_path / "bad.bin", [EX, {**EX, **change}], tokenizer=tok)
    _one_line(e, str(tmp_path / "bad.bin"), expect)
    assert not (tmp_path / "bad.bin").exists()
    # the same example written by another program: the reader refuses it too
    width = 2 if tok == "gpt2" else 4
    dt = np.dtype(f"<u{width}")
    s = np.frombuffer(good.read_bytes()[HEADER_BYTES:], dtype=dt).copy()
    half = len(s) // 2  # the second example's stream, written again by hand with the change
    ex = {**EX, **change}
    second = [dt.type(-1 % 2 ** (8 * width)), 0, 1, ex["label"] % 2 ** (8 * width), 4]
    for toks in [ex["ctx_tokens"], *ex["ending_tokens"]]:
        second += [len(toks), *toks]
    second[1] = len(second) * width
    raw = s[:half].tobytes() + np.asarray(second, dtype=dt).tobytes()
    (tmp_path / "bad.bin").write_bytes(good.read_bytes()[:HEADER_BYTES] + raw)
    with pytest.raises(DataError) as e:
        read_evalfile(tmp_path / "bad.bin")
    _one_line(e, str(tmp_path / "bad.bin"), "example 1 has")
    assert len(read_evalfile(good)) == 2
