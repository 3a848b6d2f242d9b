"""`llmc tokenize` on inputs that are wrong in ways a corpus really is: a lone surrogate in JSON, nesting past the
parser's depth, a parquet column of other types or a damaged page, a cut-off gzip or tar archive, byte-order marks,
FIFOs and devices where files belong, HellaSwag fields of the wrong type, a download cut short. Each is one line
naming the input (exit 2, no traceback, nothing written), or, where the input is fine (a UTF-8 BOM, a label
written as a string), the same tokens as the clean input."""
from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from llmc_test_support import fifo

from llmc_cli.commands.tokenize import tokenize
from llmc_cli.formats.files import DataError
from llmc_cli.tokenizing import downloads


def run(*args):
    return CliRunner().invoke(tokenize, [str(a) for a in args])


def one_line_error(r, *needles) -> str:
    """The result failed as llmc fails on bad input: exit 2, one `error:` line holding every needle."""
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    line = r.output.strip()
    assert r.exit_code == 2 and line.startswith("error:") and "\n" not in line, r.output
    for n in needles:
        assert str(n) in line, line
    return line


def tokens(out: Path) -> list[int]:
    return [int(t) for p in sorted(out.glob("*.bin")) for t in np.fromfile(p, dtype="<u2")[512:]]




def _parquet(path: Path, column) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": column}), path)


def _damaged_parquet(path: Path) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    rows = ["".join(rng.choice("abcdefgh ") for _ in range(200)) for _ in range(300)]
    pq.write_table(pa.table({"text": rows}), path, compression="snappy", use_dictionary=False)
    b = bytearray(path.read_bytes())
    for i in range(200, 5000):  # the data pages (the footer, at the end, still reads)
        b[i] = (b[i] * 7 + 3) % 256
    path.write_bytes(bytes(b))


CASES = {
    "surrogate.jsonl": (lambda p: p.write_text('{"text": "ok"}\n{"text": "a\\ud800b"}\n'),
                        ["surrogate.jsonl:2", "lone surrogate"]),
    "deep.json": (lambda p: p.write_text("[" * 100_000), ["deep.json", "nested too deeply"]),
    "deep.jsonl": (lambda p: p.write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n"), ["deep.jsonl:2", "nested"]),
    "array.jsonl": (lambda p: p.write_text('[{"text": "a"}, {"text": "b"}]\n'),
                    ["array.jsonl:1", "a JSON array", "belongs in a .json file"]),
    "pretty.jsonl": (lambda p: p.write_text('[\n  {"text": "a"}\n]\n'), ["pretty.jsonl:1", "belongs in a .json file"]),
    "ints.parquet": (lambda p: _parquet(p, list(range(5))), ["ints.parquet", "'text' holds int64, expected strings"]),
    "bytes.parquet": (lambda p: _parquet(p, [b"a", b"b"]), ["bytes.parquet", "holds binary, expected strings"]),
    "lists.parquet": (lambda p: _parquet(p, [["a"], ["b"]]), ["lists.parquet", "expected strings"]),
    "damaged.parquet": (_damaged_parquet, ["damaged.parquet", "corrupt parquet data"]),
    "cut.jsonl.gz": (lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 500)[:-30]),
                     ["cut.jsonl.gz", "truncated or corrupt gzip"]),
    "plain.txt.gz": (lambda p: p.write_bytes(b"not gzip at all"), ["plain.txt.gz", "truncated or corrupt gzip"]),
    "utf16.txt": (lambda p: p.write_bytes("hello".encode("utf-16")), ["utf16.txt", "UTF-16", "convert it to UTF-8"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_file_is_one_line_naming_it(tmp_path, name):
    make, needles = CASES[name]
    make(tmp_path / name)
    out = tmp_path / "out"
    r = run("text", tmp_path / name, "--out-dir", out, "--workers", "1")
    line = one_line_error(r, *needles)
    assert str(out) not in line  # the input is named, not the output directory
    assert not out.exists()


def test_byte_order_mark_is_no_text(tmp_path):
    clean, bom = tmp_path / "clean", tmp_path / "bom"
    for d, head in ((clean, b""), (bom, b"\xef\xbb\xbf")):
        d.mkdir()
        (d / "a.txt").write_bytes(head + "caf\u00e9 au lait\n".encode())
        (d / "b.jsonl").write_bytes(head + b'{"text": "first line"}\n{"text": "second"}\n')
        assert run("text", d, "--name", "x", "--out-dir", d / "out", "--workers", "1").exit_code == 0
    assert tokens(bom / "out") == tokens(clean / "out")


@pytest.mark.parametrize("args", [
    ["text", "{fifo}"],
    ["text", "{ok}", "--tokenizer-path", "{fifo}"],
    ["text", "{ok}", "--tokenizer", "llama3", "--tokenizer-path", "/dev/null"],
    ["tinyshakespeare", "--local", "/dev/zero"],
    ["tinystories", "--local", "{fifo}"],
    ["hellaswag", "--local", "/dev/zero"],
    ["fineweb", "--local", "{fifo}"],
])
def test_fifos_and_devices_are_refused_without_waiting(tmp_path, args):
    """Inputs that workers split, seek or resume need a file; a device never ends."""
    (tmp_path / "ok.txt").write_text("hello world")
    with fifo(tmp_path / "in.txt") as f:
        r = run(*[a.format(fifo=f, ok=tmp_path / "ok.txt") for a in args], "--out-dir", tmp_path / "out")
    one_line_error(r, "a FIFO" if "{fifo}" in args else "a device")
    assert not (tmp_path / "out").exists()


HS = {"ctx": "A man sits", "endings": ["down.", "up.", "still.", "away."], "label": 0}


@pytest.mark.parametrize("line, needles", [
    ({**HS, "label": 1.7}, ["h.jsonl:2", "label 1.7 is not an integer"]),
    ({**HS, "label": True}, ["h.jsonl:2", "label True"]),
    ({**HS, "endings": "abcd"}, ["h.jsonl:2", "endings must be a list of strings"]),
    ({**HS, "endings": ["a", "b", "c"]}, ["h.jsonl:2", "3 endings, expected 4"]),
    ({**HS, "label": 4}, ["h.jsonl:2", "label 4, expected 0..3"]),
    ({**HS, "ctx": "a\ud800"}, ["h.jsonl:2", "lone surrogate"]),
    ("[" * 100_000, ["h.jsonl:2", "nested too deeply"]),
    (b"\xff\xfe", ["h.jsonl", "not UTF-8 text"]),
], ids=["label-float", "label-bool", "endings-string", "three-endings", "label-4", "surrogate", "deep", "not-utf8"])
def test_hellaswag_examples_are_read_strictly(tmp_path, line, needles):
    src = tmp_path / "h.jsonl"
    first = json.dumps(HS).encode() + b"\n"
    src.write_bytes(first + (line if isinstance(line, bytes) else
                             (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n")
    r = run("hellaswag", "--local", src, "--out-dir", tmp_path / "out")
    one_line_error(r, *needles)
    assert not (tmp_path / "out").exists()


def test_hellaswag_label_as_a_string_and_an_empty_file(tmp_path):
    src = tmp_path / "h.jsonl"
    src.write_text(json.dumps({**HS, "label": "2"}) + "\n")  # Hugging Face's copy writes labels so
    r = run("hellaswag", "--local", src, "--out-dir", tmp_path / "out")
    assert r.exit_code == 0, r.output
    from llmc_cli.formats.evalfile import read_evalfile
    assert read_evalfile(tmp_path / "out" / "hellaswag_val.bin")[0]["label"] == 2
    src.write_text("\n")
    one_line_error(run("hellaswag", "--local", src, "--out-dir", tmp_path / "o2"), f"{src}: holds no HellaSwag")


def _tinystories_archive(path: Path, n: int = 3) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for i in range(n):
            data = json.dumps([{"story": f"Story {i}.{j}: " + "words " * 40} for j in range(40)]).encode()
            info = tarfile.TarInfo(f"data{i:02d}.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_a_cut_off_tinystories_archive_is_never_taken_for_the_corpus(tmp_path):
    whole, cut = tmp_path / "whole.tar.gz", tmp_path / "cut.tar.gz"
    _tinystories_archive(whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 3 // 4])
    out = tmp_path / "out"
    one_line_error(run("tinystories", "--local", cut, "--out-dir", out, "--workers", "1"),
                   "cut.tar.gz", "not a complete, readable tar archive")
    assert not out.exists()  # no half of the files, which the next run would have tokenized as the corpus
    out.mkdir()
    one_line_error(run("tinystories", "--local", cut, "--out-dir", out, "--workers", "1"), "cut.tar.gz")
    assert list(out.iterdir()) == []
    r = run("tinystories", "--local", whole, "--out-dir", out, "--workers", "1")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (out / "TinyStories_all_data").iterdir()) == [f"data{i:02d}.json" for i in range(3)]


def test_a_download_cut_short_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    class Cut(io.BytesIO):
        headers = {"Content-Length": "1000"}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(downloads, "_probe", lambda url, timeout=5.0: None)
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=30: Cut(b"x" * 400))
    dest = tmp_path / "dl" / "input.txt"
    with pytest.raises(DataError, match="ended after 400 of 1,000 bytes"):
        downloads.download("https://example.invalid/input.txt", dest)
    assert not (tmp_path / "dl").exists()  # neither the file nor its temporary, nor the folder made for them


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ""])
def test_a_name_is_a_name_not_a_path(tmp_path, name):
    (tmp_path / "a.txt").write_text("hello world")
    out = tmp_path / "out"
    one_line_error(run("text", tmp_path / "a.txt", "--name", name, "--out-dir", out), "--name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_workers_are_bounded(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    # (llama3 without its ranks file fails before any worker starts, should the count get through: never 2**31 forks)
    r = run("text", tmp_path / "a.txt", "--workers", str(2**31 - 1), "--tokenizer", "llama3", "--out-dir", tmp_path / "out")
    assert r.exit_code == 2 and "'--workers': must be in [1, " in r.output, r.output  # (click's usage error)
    assert "tokenizer" not in r.output.lower() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("opt, value", [("--shard-size", "3B"), ("--val-tokens", "2147483648")])
def test_token_counts_fit_a_shard_header(tmp_path, opt, value):
    """A shard counts its tokens in an int32: a larger one used to be buffered whole and refused only when written."""
    (tmp_path / "a.txt").write_text("hello world")
    r = run("text", tmp_path / "a.txt", opt, value, "--out-dir", tmp_path / "out", "--workers", "1")
    assert r.exit_code == 2 and "must be at most 2,147,483,647 tokens" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_a_file_named_twice_is_tokenized_once(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("alpha beta gamma")
    (d / "b.txt").write_text("delta epsilon")
    (tmp_path / "link.txt").symlink_to(d / "a.txt")
    once, twice = tmp_path / "once", tmp_path / "twice"
    assert run("text", d, "--name", "x", "--out-dir", once, "--workers", "1").exit_code == 0
    r = run("text", d, d / "a.txt", tmp_path / "link.txt", "--name", "x", "--out-dir", twice, "--workers", "1")
    assert r.exit_code == 0, r.output
    assert tokens(twice) == tokens(once)  # (not a.txt's tokens three times over)


def test_the_output_directory_inside_the_input_directory_resumes(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("hello world, " * 50)
    assert run("text", d, "--out-dir", d, "--workers", "1").exit_code == 0
    r = run("text", d, "--out-dir", d, "--workers", "1")  # its manifest (a .json) is not an input of the rerun
    assert r.exit_code == 0 and "already complete" in r.output, r.output


def _shards_only(m):
    m["shards"] = "x"


def _shard_int(m):
    m["shards"] = [1]


def _no_file(m):
    del m["shards"][0]["file"]


def _file_outside(m):
    m["shards"][0]["file"] = "../a.txt"


def _negative_offset(m):
    m["shards"][0]["next_offset"] = -3


def _next_doc_text(m):
    m["shards"][0]["next_doc"] = "x"


def _val_size_text(m):
    m["val_size"] = "x"


@pytest.mark.parametrize("damage, field", [
    (_shards_only, "'shards' is str"), (_shard_int, "shards[0] is int"), (_no_file, "shards[0].file is None"),
    (_file_outside, "shards[0].file is '../a.txt'"), (_negative_offset, "shards[0].next_offset is -3"),
    (_next_doc_text, "shards[0].next_doc is 'x'"), (_val_size_text, "val_size is 'x'"),
])
def test_a_damaged_manifest_is_one_line_and_force_redoes_it(tmp_path, damage, field):
    """A resume from a manifest edited by hand: a traceback (a missing key, a string where a count belongs), or
    shards resumed from a position that is none (a negative offset kept 4 of 10 tokens, exit 0)."""
    (tmp_path / "a.txt").write_text("hello world, this is a test.\n")
    out = tmp_path / "out"
    assert run("text", tmp_path / "a.txt", "--out-dir", out, "--workers", "1", "--shard-size", "5").exit_code == 0
    want = tokens(out)
    manifest = out / "a_manifest.json"
    m = json.loads(manifest.read_text())
    m["complete"] = False  # (an interrupted run: the next one resumes from the manifest)
    m["shards"] = m["shards"][:1]
    for p in sorted(out.glob("a_train_*.bin")):
        p.unlink()
    damage(m)
    manifest.write_text(json.dumps(m))
    one_line_error(run("text", tmp_path / "a.txt", "--out-dir", out, "--workers", "1", "--shard-size", "5"),
                   str(manifest), field, "--force")
    r = run("text", tmp_path / "a.txt", "--out-dir", out, "--workers", "1", "--shard-size", "5", "--force")
    assert r.exit_code == 0, r.output
    assert tokens(out) == want


def test_stderr_holds_the_error_line_alone(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "tokenize", "text", str(tmp_path / "latin1.txt"),
                        "--out-dir", str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'latin1.txt'}: not UTF-8 text (unexpected end of " \
                                             "data at byte 3)\n", repr(r.stderr)


@pytest.mark.parametrize("what", ["hellaswag", "tinyshakespeare"])
def test_local_files_read_once_may_come_through_a_pipe(tmp_path, what):
    """`--local <(curl ...)` or `cat f | llmc tokenize ... --local /dev/stdin`: read from start to end once, so a pipe
    is as good as the file."""
    src = tmp_path / "src"
    src.write_text(json.dumps(HS) + "\n" if what == "hellaswag" else "First Citizen:\nBefore we proceed any further.\n" * 50)
    extra = [] if what == "hellaswag" else ["--val-tokens", "40", "--workers", "1"]
    script = (f"cat {src} | {sys.executable} -m llmc_cli tokenize {what} --local /dev/stdin --out-dir {tmp_path / 'out'} "
              + " ".join(extra))
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "out").glob("*.bin"))
