"""The named datasets' downloads and resumes, and the shard reader as `llmc train`
uses it (shards changing under a run, globs naming odd files)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from llmc_test_support import fifo, local_http_server
from llmc_test_support import run as llmc

from llmc_cli.data.loader import DataLoader
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import resolve_shards, write_shard
from llmc_cli.tokenizing import downloads
from llmc_cli.tokenizing.sources import extract_tinystories


def run(*args, ok: bool = True):
    """`llmc tokenize ARGS` in-process."""
    return llmc("tokenize", *args, ok=ok)


def one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _two_shards(d: Path, n: int = 3000) -> None:
    d.mkdir(exist_ok=True)
    for i in (1, 2):
        write_shard(d / f"x_train_{i:06d}.bin", np.arange(n) % 50000)


# ---------------------------------------------------------------------------------------------------------------
# shards changing under the loader


def test_a_shard_that_shrank_before_the_loader_reached_it_is_named(tmp_path):
    # (was: "cannot reshape array of size 7 into shape (2,32)", the batch count taken from the old size)
    _two_shards(tmp_path)
    loader = DataLoader(tmp_path, 2, 32, vocab_size=50257)
    loader.next_batch()
    write_shard(tmp_path / "x_train_000002.bin", np.arange(200) % 50000)
    with pytest.raises(DataError, match=r"x_train_000002.bin: changed since the data was opened \(3,000 gpt2 tokens "
                                        r"then, now 200 gpt2 tokens\)"):
        for _ in range(200):
            loader.next_batch()


def test_a_shard_cut_short_while_it_is_read_is_an_error_not_sigbus(tmp_path):
    # (was: the memory map of the file cut short killed the process with SIGBUS, nothing saved)
    code = f"""
import os, numpy as np
from llmc_cli.data.loader import DataLoader
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import write_shard
p = {str(tmp_path / 'x_train_000001.bin')!r}
write_shard(p, np.arange(50000) % 50000)
loader = DataLoader(p, 2, 32, vocab_size=50257)
loader.next_batch()
os.truncate(p, 2000)
try:
    for _ in range(100):
        loader.next_batch()
except DataError as e:
    print("DataError", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "DataError" in r.stdout and "x_train_000001.bin: cut short while it was read" in r.stdout, r.stdout


def test_a_shard_replaced_by_one_of_the_same_size_is_checked_again(tmp_path):
    # (was: check_vocab's verdict kept for the new file: ids past the vocabulary handed out as a batch)
    _two_shards(tmp_path)
    loader = DataLoader(tmp_path, 2, 32, vocab_size=50257)
    loader.check_vocab()
    loader.next_batch()
    bad = np.arange(3000) % 50000
    bad[100] = 60000
    write_shard(tmp_path / "x_train_000002.bin", bad)
    with pytest.raises(DataError, match=r"x_train_000002.bin: token id 60000 at position 100 is >= the model's vocab"):
        for _ in range(200):
            loader.next_batch()


def test_the_loader_reads_the_same_batches_as_before(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, 5000)
    write_shard(tmp_path / "x_train_000001.bin", toks)
    loader = DataLoader(tmp_path, 2, 32, vocab_size=50257, shuffle=True)
    x, y = loader.next_batch()
    i = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(toks, 64) == x.reshape(-1), axis=1))[0])
    assert i % 64 == 0 and (y.reshape(-1) == toks[i + 1:i + 65]).all() and x.dtype == np.int32


# ---------------------------------------------------------------------------------------------------------------
# globs


def test_a_glob_naming_a_fifo_or_a_dangling_link_refuses_it(tmp_path):
    # (was: left out of the data without a word, where a directory with them was refused)
    write_shard(tmp_path / "x_train_000001.bin", np.arange(3000) % 50000)
    (tmp_path / "x_train_000003.bin").symlink_to(tmp_path / "nowhere")
    (tmp_path / "x_train_000004.bin").mkdir()  # (a folder is passed over)
    pattern = str(tmp_path / "*.bin")
    assert resolve_shards(pattern) == [str(tmp_path / "x_train_000001.bin"), str(tmp_path / "x_train_000003.bin")]
    with pytest.raises(DataError, match="x_train_000003.bin not found"):
        DataLoader(pattern, 2, 32)
    (tmp_path / "x_train_000003.bin").unlink()
    with fifo(tmp_path / "x_train_000002.bin"):
        with pytest.raises(DataError, match="x_train_000002.bin is a FIFO"):
            DataLoader(pattern, 2, 32)


# ---------------------------------------------------------------------------------------------------------------
# downloads


_server = local_http_server


@pytest.mark.parametrize("answer,what", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n10\r\n0123", "IncompleteRead"),
    (b"garbage\r\n\r\n", "BadStatusLine"),
])
def test_a_download_that_is_no_whole_http_answer_is_one_line(tmp_path, monkeypatch, answer, what):
    # (was: an http.client traceback, IncompleteRead or BadStatusLine)
    monkeypatch.setitem(downloads.URLS, "tinyshakespeare", f"http://127.0.0.1:{_server(answer)}/input.txt")
    out = tmp_path / "out"
    one_line_error(run("tinyshakespeare", "--out-dir", out, "--workers", "1", ok=False),
                   "download of http://127.0.0.1", f"not a whole HTTP answer: {what}", "--local PATH")
    assert not [p for p in out.rglob("*") if p.is_file()]


def test_a_download_with_a_bad_content_length_is_read_to_its_end(tmp_path):
    # (was: ValueError: invalid literal for int())
    port = _server(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\nConnection: close\r\n\r\nFirst:\nhello\n")
    dest = downloads.download(f"http://127.0.0.1:{port}/input.txt", tmp_path / "input.txt")
    assert dest.read_bytes() == b"First:\nhello\n"


# ---------------------------------------------------------------------------------------------------------------
# manifests that lie


@pytest.fixture
def corpus(tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    words = ["alpha", "beta", "gamma", "delta"]
    rng = np.random.default_rng(0)
    for i in range(30):
        (inp / f"d{i:02d}.txt").write_text(" ".join(words[j] for j in rng.integers(0, 4, 200)))
    out = tmp_path / "out"
    run("text", inp, "--name", "c", "--out-dir", out, "--shard-size", "1000", "--workers", "1")
    return inp, out


def _lie(out: Path, keep: int, edit) -> None:
    m = json.loads((out / "c_manifest.json").read_text())
    m["complete"] = False
    m["shards"] = m["shards"][:keep]
    edit(m)
    for p in out.glob("c_*.bin"):
        if p.name not in {s["file"] for s in m["shards"]}:
            p.unlink()
    (out / "c_manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m["shards"][-1].update(next_doc=999), "says the next shard starts at token"),
    (lambda m: m["shards"][-1].update(next_offset=99999), "that document has"),
    (lambda m: m.update(shards=[m["shards"][0], m["shards"][0]]), "shards[1].file is 'c_val_000000.bin'"),
    (lambda m: m["shards"][1].update(split="val"), "shards[1].file is 'c_train_000001.bin'"),
])
def test_a_manifest_that_lies_about_its_shards_or_position_is_refused(corpus, edit, needle):
    # (was: exit 0 having dropped the rest of the corpus, or a document's tail, or with a shard counted twice)
    inp, out = corpus
    _lie(out, 3, edit)
    one_line_error(run("text", inp, "--name", "c", "--out-dir", out, "--shard-size", "1000", "--workers", "1",
                       ok=False), "c_manifest.json", needle, "--force")


def test_a_manifest_naming_a_foreign_file_as_a_shard_is_refused(corpus):
    inp, out = corpus

    def edit(m):
        (out / "c_train_000001.bin").rename(out / "other.bin")
        m["shards"][1]["file"] = "other.bin"
    _lie(out, 2, edit)
    one_line_error(run("text", inp, "--name", "c", "--out-dir", out, "--shard-size", "1000", "--workers", "1",
                       ok=False), "shards[1].file is 'other.bin', expected 'c_train_000001.bin'")


def test_an_honest_resume_still_resumes(corpus):
    inp, out = corpus
    whole = {p.name: p.read_bytes() for p in out.glob("c_*.bin")}
    _lie(out, 3, lambda m: None)
    r = run("text", inp, "--name", "c", "--out-dir", out, "--shard-size", "1000", "--workers", "1")
    assert "3 kept from an earlier run" in r.output
    assert {p.name: p.read_bytes() for p in out.glob("c_*.bin")} == whole


# ---------------------------------------------------------------------------------------------------------------
# HellaSwag and TinyStories


def test_hellaswag_lines_are_read_as_json_lines(tmp_path):
    # (was: a lone "\r", JSON's blank, split the line: "not valid JSON"; a .gz read as text)
    src = tmp_path / "hs.jsonl"
    src.write_bytes(b'{"ctx": "a b", "label": 0,\r "endings": ["x", "y", "z", "w"]}\n')
    r = run("hellaswag", "--local", src, "--out-dir", tmp_path / "o")
    assert "1 examples" in r.output
    gz = tmp_path / "hs.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    assert "1 examples" in run("hellaswag", "--local", gz, "--out-dir", tmp_path / "o2").output
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:30])
    one_line_error(run("hellaswag", "--local", cut, "--out-dir", tmp_path / "o3", ok=False),
                   "cut.jsonl.gz: truncated or corrupt gzip file")


def test_a_tinystories_archive_extracted_by_another_run_meanwhile_is_taken(tmp_path, monkeypatch):
    # (was: "error: ...: Directory not empty" when two runs extracted the same archive at once)
    archive = tmp_path / "ts.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for i in range(2):
            data = json.dumps([{"story": f"s{i}"}]).encode()
            info = tarfile.TarInfo(f"data{i:02d}.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    dest = tmp_path / "out" / "TinyStories_all_data"
    real = tarfile.TarFile.extractall

    def and_the_other_run(self, path, *a, **kw):
        real(self, path, *a, **kw)
        if not dest.exists():
            real(self, dest, *a, **kw)
    monkeypatch.setattr(tarfile.TarFile, "extractall", and_the_other_run)
    assert extract_tinystories(archive, dest) == dest
    assert sorted(os.listdir(dest)) == ["data00.json", "data01.json"]
    assert os.listdir(dest.parent) == ["TinyStories_all_data"]  # (this run's temporary gone)
