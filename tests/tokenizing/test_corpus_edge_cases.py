"""`llmc tokenize` on corpora at the edges of what it reads: a run of a million
blank characters (tiktoken's pattern overflows its stack), a dataset named with glob characters, an input directory
with a folder that cannot be listed, an input or a tokenizer changed under a resume, byte offsets of bad UTF-8 in
JSON Lines, a lone carriage return inside a JSON line, suffixes in capitals, gzipped parquet, two parquet columns of
one name, names at the file system's 255-byte limit, and output inside a checkpoint folder."""
from __future__ import annotations

import glob
import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc_cli.commands.tokenize import tokenize
from llmc_cli.data.tokenizer import WHITESPACE_RUN_MAX, load_tokenizer
from llmc_cli.formats.files import atomic_write_bytes
from llmc_cli.formats.shards import read_shard


def run(*args):
    return CliRunner().invoke(tokenize, [str(a) for a in args])


def one_line_error(r, *needles) -> str:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    line = r.output.strip().splitlines()[-1] if r.output.strip() else ""
    assert r.exit_code == 2 and line.startswith("error:"), r.output
    assert "Traceback" not in r.output, r.output
    for n in needles:
        assert str(n) in line, line
    return line


def tokens_of(out: Path, name: str) -> np.ndarray:
    shards = sorted(out.glob(f"{glob.escape(name)}_*.bin"), key=lambda p: p.stem[-6:])  # (val 0, train 1, ...)
    return np.concatenate([read_shard(p) for p in shards])


@pytest.mark.parametrize("blank", [" ", "\n", " \n\t\u3000"])
def test_a_million_blank_characters_encode_and_decode_back(blank):
    tok = load_tokenizer("gpt2")
    text = "title\n" + blank * (1_100_000 // len(blank)) + "body\n"
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert list(tok.encode_ordinary_array(text)) == ids == tok.encode(text)
    normal = "Hello  world\n\n  again " * 20_000  # (long, without a long blank run: exactly tiktoken's ids)
    assert tok.encode_ordinary(normal) == tok.enc.encode_ordinary(normal)
    assert WHITESPACE_RUN_MAX < 1_000_000


def test_a_file_of_blank_lines_tokenizes(tmp_path):
    f = tmp_path / "blank.txt"
    f.write_text("title\n" + "\n" * 1_100_000 + "body\n")
    r = run("text", f, "--out-dir", tmp_path / "o", "--workers", 1)
    assert r.exit_code == 0, r.output
    ids = tokens_of(tmp_path / "o", "blank")
    tok = load_tokenizer("gpt2")
    assert tok.decode([i for i in ids if i != tok.eot]) == f.read_text()


def test_a_name_with_glob_characters_finds_its_own_shards(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(" ".join(["alpha", "beta", "gamma"] * 3000))
    small = tmp_path / "a.txt"
    small.write_text("hello world")
    out = tmp_path / "gl"
    assert run("text", big, "--name", "[x]", "--shard-size", 1000, "--out-dir", out, "--workers", 1).exit_code == 0
    assert len(list(out.glob("*.bin"))) > 3
    r = run("text", small, "--name", "[x]", "--shard-size", 1000, "--out-dir", out, "--workers", 1, "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.glob("*.bin")) == ["[x]_train_000001.bin", "[x]_val_000000.bin"]
    (out / "[x]_manifest.json").unlink()  # shards without a manifest: refused as for any other name
    one_line_error(run("text", big, "--name", "[x]", "--out-dir", out, "--workers", 1), "without a manifest")


def _unprivileged() -> list[str] | None:
    """A prefix that runs a command without the power to read what its mode forbids (root's), or None."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search"
    probe = subprocess.run(["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "true"], capture_output=True)
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"] if probe.returncode == 0 else None


def test_an_input_folder_that_cannot_be_listed_is_named(tmp_path):
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("running as root without setpriv: every folder can be listed")
    corp = tmp_path / "corp"
    (corp / "sub").mkdir(parents=True)
    (corp / "good.txt").write_text("good")
    (corp / "sub" / "h.txt").write_text("hidden")
    (corp / "sub").chmod(0)
    try:
        r = subprocess.run([*prefix, sys.executable, "-m", "llmc_cli", "tokenize", "text", str(corp), "--out-dir",
                            str(tmp_path / "o"), "--workers", "1"], capture_output=True, text=True, timeout=120)
    finally:
        (corp / "sub").chmod(0o755)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "sub: cannot list this input directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.bin"))


def test_a_resume_after_an_input_was_edited_to_the_same_size_is_refused(tmp_path):
    f = tmp_path / "e.txt"
    f.write_text("hello world")
    out = tmp_path / "o"
    assert run("text", f, "--out-dir", out, "--workers", 1).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    f.write_text("HELLO world")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # (a coarse clock may not have moved)
    one_line_error(run("text", f, "--out-dir", out, "--workers", 1), "source differ", "--force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_resume_under_another_vocabulary_of_the_same_size_is_refused(tmp_path):
    from test_tokenize_cli import write_byte_ranks
    r1 = tmp_path / "r1" / "tokenizer.model"
    r1.parent.mkdir()
    write_byte_ranks(r1)
    lines = r1.read_bytes().splitlines()
    (a, ra), (b, rb) = lines[104].split(), lines[119].split()  # two bytes' ids swapped: same size, other ids
    lines[104], lines[119] = a + b" " + rb, b + b" " + ra
    r2 = tmp_path / "r2" / "tokenizer.model"
    r2.parent.mkdir()
    r2.write_bytes(b"\n".join(lines) + b"\n")
    f = tmp_path / "t.txt"
    f.write_text("hello world")
    out = tmp_path / "o"
    common = ["text", f, "--out-dir", out, "--workers", 1, "--tokenizer", "llama3"]
    assert run(*common, "--tokenizer-path", r1).exit_code == 0
    one_line_error(run(*common, "--tokenizer-path", r2), "vocabulary_sha256")


def test_bad_utf8_in_json_lines_is_named_at_its_line_and_byte(tmp_path):
    f = tmp_path / "bad.jsonl"
    good = b'{"text": "hello world"}\n'
    f.write_bytes(good * 5000 + b'{"text": "\xc3\x28"}\n')
    one_line_error(run("text", f, "--out-dir", tmp_path / "o"), "bad.jsonl:5001: not UTF-8 text",
                   f"at byte {len(good) * 5000 + 10})")
    g = tmp_path / "bad.jsonl.gz"
    g.write_bytes(gzip.compress(f.read_bytes()))
    one_line_error(run("text", g, "--out-dir", tmp_path / "o"), "bad.jsonl.gz:5001",
                   f"at byte {len(good) * 5000 + 10} of its decompressed text")


def test_a_lone_carriage_return_inside_a_json_line_is_json_whitespace(tmp_path):
    f = tmp_path / "cr.jsonl"
    f.write_bytes(b'{"text": "a b",\r"x": 1}\n{"text": "c"}\r\n')
    r = run("text", f, "--out-dir", tmp_path / "o", "--workers", 1)
    assert r.exit_code == 0, r.output
    tok = load_tokenizer("gpt2")
    assert list(tokens_of(tmp_path / "o", "cr")) == tok.encode_document("a b") + tok.encode_document("c")


def test_suffixes_in_capitals_and_gzipped_parquet(tmp_path):
    u = tmp_path / "u.txt.GZ"
    u.write_bytes(gzip.compress(b"hello there\r\nx"))
    r = run("text", u, "--out-dir", tmp_path / "o", "--workers", 1, "--name", "u")
    assert r.exit_code == 0, r.output
    tok = load_tokenizer("gpt2")
    assert list(tokens_of(tmp_path / "o", "u")) == tok.encode_document("hello there\nx")  # (universal newlines)
    pz = tmp_path / "p.parquet.gz"
    pz.write_bytes(gzip.compress(b"PAR1"))
    one_line_error(run("text", pz, "--out-dir", tmp_path / "o2"), "p.parquet.gz: a gzipped parquet file")


def test_two_parquet_columns_of_the_text_fields_name(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    t = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])],
                             schema=pa.schema([("text", pa.string()), ("text", pa.string())]))
    f = tmp_path / "dup.parquet"
    pq.write_table(t, f)
    one_line_error(run("text", f, "--out-dir", tmp_path / "o"), "2 columns are named 'text'")


def test_names_at_the_255_byte_limit(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("hello world")
    assert run("text", a, "--name", "n" * 238, "--out-dir", tmp_path / "o", "--workers", 1).exit_code == 0
    one_line_error(run("text", a, "--name", "n" * 239, "--out-dir", tmp_path / "o2"), "--name: 239 bytes")
    long = tmp_path / ("f" * 250)  # a legal name whose temporary sibling would not be
    atomic_write_bytes(long, b"x")
    atomic_write_bytes(long, b"y")
    assert long.read_bytes() == b"y"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # (no temporary left beside it)


def test_a_link_to_a_file_is_written_through(tmp_path):
    target = tmp_path / "shared" / "tok.bin"
    target.parent.mkdir()
    link = tmp_path / "latest.bin"
    assert run("tokenizer-bin", target).exit_code == 0
    first = target.read_bytes()
    link.symlink_to(target)
    assert run("tokenizer-bin", link).exit_code == 0
    assert link.is_symlink() and target.read_bytes() == first
    assert sorted(os.listdir(target.parent)) == ["tok.bin"]


def test_nothing_is_written_into_a_checkpoint_folder(tmp_path):
    run_dir = tmp_path / "run"
    step = run_dir / "step_00000001"
    step.mkdir(parents=True)
    (run_dir / "latest").write_text("step_00000001\n")
    a = tmp_path / "a.txt"
    a.write_text("hello world")
    one_line_error(run("text", a, "--out-dir", step / "data"), "--out-dir", "is inside the checkpoint")
    one_line_error(run("tokenizer-bin", step / "tok.bin"), "OUT", "is inside the checkpoint")
    (tmp_path / "via").symlink_to(step)
    one_line_error(run("text", a, "--out-dir", tmp_path / "via" / "x"), "is inside the checkpoint")
    assert sorted(os.listdir(step)) == []


def test_an_empty_out_and_an_input_it_may_not_read_are_named(tmp_path):
    one_line_error(run("tokenizer-bin", ""), "OUT .: expected a file name")
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("running as root without setpriv: every file can be read")
    d = tmp_path / "np"
    d.mkdir()
    (d / "a.txt").write_text("x")
    d.chmod(0)
    try:
        r = subprocess.run([*prefix, sys.executable, "-m", "llmc_cli", "tokenize", "text", str(d / "a.txt"),
                            "--out-dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    finally:
        d.chmod(0o755)
    assert r.returncode == 2 and "a.txt': Permission denied" in r.stderr and "does not exist" not in r.stderr, r.stderr
