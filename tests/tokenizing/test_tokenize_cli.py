"""`llmc tokenize`: every source format -> shards checked byte for byte against a direct tiktoken encoding."""
from __future__ import annotations

import importlib.util
import io
import json
import random
import re
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
from click.testing import CliRunner

from llmc_cli.formats.shards import write_shard
from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.tokenizing import downloads, pipeline, sources
from llmc_cli.commands.tokenize import tokenize

EOT = 50256


@pytest.fixture(scope="module")
def enc():
    """tiktoken's gpt2 encoding, built here straight from the ranks file (no llmc code involved)."""
    from llmc_cli.data.home import packages_dir  # where install.sh puts openai-whisper (not site-packages)
    spec = importlib.util.find_spec("whisper")
    ranks = (Path(spec.submodule_search_locations[0]) if spec else packages_dir() / "whisper") / "assets" / "gpt2.tiktoken"
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(ranks)),
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def stream(enc, docs) -> list[int]:
    out = []
    for d in docs:
        out.append(EOT)
        out += enc.encode_ordinary(d)
    return out


def shard_bytes(tokens) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


def expected_layout(tokens, val, shard_size):
    """[(split, tokens)] for the first `val` tokens as val and the rest in shards of shard_size."""
    out = [("val", tokens[:val])]
    rest = tokens[val:]
    for i in range(0, len(rest), shard_size):
        out.append(("train", rest[i:i + shard_size]))
    return out


def check_dir(out: Path, name: str, layout):
    files = sorted(p.name for p in out.glob("*.bin"))
    want = [f"{name}_{split}_{k:06d}.bin" for k, (split, _) in enumerate(layout)]
    assert files == sorted(want)
    for fname, (_, toks) in zip(want, layout):
        assert (out / fname).read_bytes() == shard_bytes(toks), fname


def run(args, cwd=None, ok=True):
    r = CliRunner().invoke(tokenize, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert r.exit_code == 0, r.output
    return r


DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "All:\nSpeak, speak.\n",
    "naïve café — 日本語 😀 <|endoftext|> is just text here",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20,
    "x",
]


def test_text_txt_files(tmp_path, enc):
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(DOCS):
        (src / f"doc{i}.txt").write_text(d, encoding="utf-8")
    out = tmp_path / "out"
    r = run(["text", src, "--out-dir", out, "--shard-size", "100", "--val-tokens", "30", "--workers", "1"])
    toks = stream(enc, DOCS)
    layout = expected_layout(toks, 30, 100)
    check_dir(out, "src", layout)
    assert f"{len(layout)} shards (1 val, {len(layout) - 1} train), {len(toks):,} tokens (30 val)" in r.output


def test_text_small_corpus_val_fraction(tmp_path, enc):
    f = tmp_path / "book.txt"
    f.write_text(DOCS[3], encoding="utf-8")
    out = tmp_path / "o"
    run(["text", f, "--out-dir", out, "--workers", "1"])  # default 100M shard: small corpus -> 10% val
    toks = stream(enc, [DOCS[3]])
    val = -(-len(toks) // 10)
    check_dir(out, "book", expected_layout(toks, val, 10**8))


def test_text_jsonl_parquet_json_and_workers(tmp_path, enc):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "mix"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:3])),
                               encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS[3:], "n": [1, 2]}), d / "b.parquet")
    (d / "c.json").write_text(json.dumps([{"text": "json doc one"}, "json doc two"]), encoding="utf-8")
    all_docs = DOCS + ["json doc one", "json doc two"]
    toks = stream(enc, all_docs)
    layout = expected_layout(toks, 50, 64)
    for w in ("1", "2"):  # parallel workers give the same bytes
        out = tmp_path / f"out{w}"
        run(["text", d, "--name", "mix", "--out-dir", out, "--shard-size", "64", "--val-tokens", "50", "--workers", w])
        check_dir(out, "mix", layout)


def test_fineweb_like_parquet(tmp_path, enc):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "sample" / "10BT"
    d.mkdir(parents=True)
    docs = [f"Document {i}: " + "web text about things. " * (i % 7 + 1) for i in range(40)]
    pq.write_table(pa.table({"text": docs[:25], "id": [str(i) for i in range(25)]}), d / "000_00000.parquet")
    pq.write_table(pa.table({"text": docs[25:], "id": [str(i) for i in range(25, 40)]}), d / "001_00000.parquet")
    out = tmp_path / "fw"
    run(["fineweb", "--edu", "--local", tmp_path / "sample", "--out-dir", out, "--shard-size", "200", "--workers", "2"])
    toks = stream(enc, docs)
    check_dir(out, "edu_fineweb", expected_layout(toks, 200, 200))  # first shard is val, like llm.c


def test_tinystories_like_json(tmp_path, enc):
    d = tmp_path / "TinyStories_all_data"
    d.mkdir()
    files = []
    for k in range(3):
        stories = [{"story": f"  Once upon a time {k}-{i}, a little cat sat. The end.\n", "instruction": {}}
                   for i in range(6)]
        (d / f"data{k:02d}.json").write_text(json.dumps(stories), encoding="utf-8")
        files.append([s["story"] for s in stories])
    out = tmp_path / "ts"
    run(["tinystories", "--local", d, "--out-dir", out, "--shard-size", "80", "--workers", "1"])

    def prepared(stories, i):  # llm.c's tinystories.py: shuffle with Random(1337 + index in split), strip
        s = list(stories)
        random.Random(1337 + i).shuffle(s)
        return [x.strip() for x in s]

    val = stream(enc, prepared(files[0], 0))
    train = stream(enc, prepared(files[1], 0) + prepared(files[2], 1))
    layout = [("val", val[i:i + 80]) for i in range(0, len(val), 80)]
    layout += [("train", train[i:i + 80]) for i in range(0, len(train), 80)]
    check_dir(out, "tinystories", layout)


def test_tinyshakespeare_local_matches_llmc_recipe(tmp_path, enc):
    text = "First Citizen:\nBefore we proceed.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved.\n"
    f = tmp_path / "input.txt"
    f.write_text(text * 5, encoding="utf-8")
    out = tmp_path / "tsh"
    run(["tinyshakespeare", "--local", f, "--out-dir", out, "--val-tokens", "40", "--workers", "1"])
    # llm.c: encode("<|endoftext|>" + text.replace("\n\n", "\n\n<|endoftext|>")), first N tokens val
    t = "<|endoftext|>" + (text * 5).replace("\n\n", "\n\n<|endoftext|>")
    toks = enc.encode(t, allowed_special={"<|endoftext|>"})
    check_dir(out, "tinyshakespeare", expected_layout(toks, 40, 10**8))


def test_hellaswag_eval_file(tmp_path, enc):
    exs = [{"ind": 24, "ctx": "A man is sitting on a roof. he", "label": 3,
            "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                        "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
           {"ind": 92, "ctx": "Then, the man writes over the snow.", "label": 0,
            "endings": ["a", "b c", "déjà vu", "the end"]}]
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in exs), encoding="utf-8")
    out = tmp_path / "hs"
    r = run(["hellaswag", "--local", src, "--out-dir", out])
    assert "2 examples" in r.output
    stream_, longest = [], 0
    for i, e in enumerate(exs):
        body = [i, e["label"], 4]
        ctx = enc.encode(e["ctx"])
        body += [len(ctx), *ctx]
        for end in e["endings"]:
            et = enc.encode(" " + end)
            body += [len(et), *et]
        nbytes = 2 * (len(body) + 2)
        longest = max(longest, nbytes)
        stream_ += [65535, nbytes, *body]
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240522, 1, 2, longest]
    assert (out / "hellaswag_val.bin").read_bytes() == header.tobytes() + np.asarray(stream_, "<u2").tobytes()


HS_EXS = [{"ind": 24, "ctx": "A man is sitting on a roof. he", "label": 3,
           "endings": ["is using wrap.", "is ripping level tiles off.", "is holding a cube.", "starts pulling."]},
          {"ind": 92, "ctx": "Then, the man writes over the snow.", "label": 0,
           "endings": ["a", "b c", "déjà vu", "the end"]}]


def write_byte_ranks(path):
    """A Llama-3-style tiktoken ranks file of the 256 single bytes (Meta's tokenizer.model layout): each byte's
    id is its value and <|begin_of_text|> is 256, so the expected ids are spelled out without any tokenizer."""
    import base64
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return path


def test_hellaswag_llama3_eval_file(tmp_path):
    """--tokenizer llama3: llmc's version 2 file (uint32 ids, "llama3" in the header) beside llm.c's GPT-2 one;
    each context after <|begin_of_text|>, each ending with its leading space; offline from a local jsonl."""
    ranks = write_byte_ranks(tmp_path / "tokenizer.model")
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in HS_EXS), encoding="utf-8")
    out = tmp_path / "hs"
    run(["hellaswag", "--local", src, "--out-dir", out])  # GPT-2's first: the Llama file must not replace it
    gpt2_bytes = (out / "hellaswag_val.bin").read_bytes()
    r = run(["hellaswag", "--local", src, "--out-dir", out, "--tokenizer", "llama3", "--tokenizer-path", ranks])
    assert "2 examples" in r.output and "llama3 tokens" in r.output
    stream_, longest = [], 0
    for i, e in enumerate(HS_EXS):
        ctx = [256, *e["ctx"].encode()]
        body = [i, e["label"], 4, len(ctx), *ctx]
        for end in e["endings"]:
            et = list((" " + end).encode())
            body += [len(et), *et]
        nbytes = 4 * (len(body) + 2)
        longest = max(longest, nbytes)
        stream_ += [2**32 - 1, nbytes, *body]
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240522, 2, 2, longest]
    head = bytearray(header.tobytes())
    head[16:22] = b"llama3"
    assert (out / "hellaswag_val_llama3.bin").read_bytes() == bytes(head) + np.asarray(stream_, "<u4").tobytes()
    assert (out / "hellaswag_val.bin").read_bytes() == gpt2_bytes
    # the model's own tokenizer, from a checkpoint: a Llama run keeps tokenizer.model beside its steps
    from llmc_cli.formats.sources import export_run
    from llmc_cli.models.llama3 import PRESETS, init_parameters
    cfg = PRESETS["llama3-tiny"]
    run_dir = export_run(tmp_path / "run", cfg, init_parameters(cfg, 0), tokenizer="llama3", tokenizer_file=ranks)
    run(["hellaswag", "--local", src, "--out-dir", tmp_path / "hs2", "--checkpoint", run_dir])
    assert (tmp_path / "hs2" / "hellaswag_val_llama3.bin").read_bytes() == \
        (out / "hellaswag_val_llama3.bin").read_bytes()
    # a Llama trained on GPT-2 shards gets llm.c's GPT-2 file
    gpt2_run = export_run(tmp_path / "run_gpt2", cfg, init_parameters(cfg, 0), tokenizer="gpt2")
    run(["hellaswag", "--local", src, "--out-dir", tmp_path / "hs3", "--checkpoint", gpt2_run])
    assert (tmp_path / "hs3" / "hellaswag_val.bin").read_bytes() == gpt2_bytes


@pytest.mark.parametrize("args, msg", [
    (["--tokenizer", "llama3"], "the llama3 tokenizer needs its tiktoken-format ranks file"),
    (["--checkpoint", "{tmp}/run", "--tokenizer", "gpt2"], "give --checkpoint or --tokenizer/--tokenizer-path"),
    (["--checkpoint", "{tmp}/run"], "--checkpoint: {tmp}/run: a Llama 3 model needs its tokenizer"),
    (["--checkpoint", "{tmp}/nothing"], "--checkpoint: "),
])
def test_hellaswag_tokenizer_errors_are_one_line(tmp_path, args, msg):
    from llmc_cli.formats.sources import export_run
    from llmc_cli.models.llama3 import PRESETS, init_parameters
    export_run(tmp_path / "run", PRESETS["llama3-tiny"], init_parameters(PRESETS["llama3-tiny"], 0),
               tokenizer="llama3")  # no tokenizer.model anywhere
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text(json.dumps(HS_EXS[0]) + "\n", encoding="utf-8")
    r = run(["hellaswag", "--local", src, "--out-dir", tmp_path / "hs", *[a.format(tmp=tmp_path) for a in args]],
            ok=False)
    line = r.output.strip()
    assert r.exit_code == 2 and line.startswith("error:") and "\n" not in line, line
    assert msg.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "hs").exists()


def test_shakespeare_offline_corpus(tmp_path, enc, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default output: datasets/shakespeare/ under the CWD
    r = run(["shakespeare", "--shard-size", "500K", "--workers", "2"])
    out = tmp_path / "datasets" / "shakespeare"
    files = sources.shakespeare_files()
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    toks = stream(enc, [f.read_text(encoding="utf-8") for f in files])
    layout = expected_layout(toks, 500_000, 500_000)  # > 2 shards of tokens: the first shard is val
    check_dir(out, "shakespeare", layout)
    assert f"{len(toks):,} tokens" in r.output


def test_resume_after_interruption(tmp_path, enc, monkeypatch):
    src = tmp_path / "c.txt"
    docs = [f"paragraph {i} " + "words " * (i % 13) for i in range(60)]
    src.write_text("\n".join(docs))
    d = tmp_path / "d"
    for i, t in enumerate(docs):
        (tmp_path / "d").mkdir(exist_ok=True)
        (d / f"{i:03d}.txt").write_text(t)
    args = ["text", d, "--name", "c", "--out-dir", tmp_path / "out", "--shard-size", "37", "--val-tokens", "20",
            "--workers", "1"]
    real = pipeline.write_shard
    calls = {"n": 0}

    def dying(*a, **kw):
        if calls["n"] == 4:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "write_shard", dying)
    r = run(args, ok=False)
    assert r.exit_code == 130 and "resume" in r.output
    assert len(list((tmp_path / "out").glob("*.bin"))) == 4
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*.bin")}
    monkeypatch.setattr(pipeline, "write_shard", real)
    r = run(args)
    assert "4 kept from an earlier run" in r.output
    layout = expected_layout(stream(enc, docs), 20, 37)
    check_dir(tmp_path / "out", "c", layout)
    assert all((tmp_path / "out" / n).stat().st_mtime_ns == m for n, m in first.items())  # not rewritten
    r = run(args)
    assert "already complete" in r.output
    # other settings on the same directory: refused unless --force
    r = run(args[:-4] + ["--shard-size", "50", "--workers", "1"], ok=False)
    assert r.exit_code != 0 and "--force" in r.output and "shard_size" in r.output
    run(args[:-4] + ["--shard-size", "50", "--workers", "1", "--val-tokens", "20", "--force"])
    check_dir(tmp_path / "out", "c", expected_layout(stream(enc, docs), 20, 50))


def test_existing_shards_without_manifest_are_not_clobbered(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    write_shard(out / "x_train_000001.bin", [1, 2, 3])  # an llm.c shard of an earlier run (a user's file: see below)
    f = tmp_path / "x.txt"
    f.write_text("hello there")
    r = run(["text", f, "--out-dir", out, "--workers", "1"], ok=False)
    assert r.exit_code != 0 and "--force" in r.output
    run(["text", f, "--out-dir", out, "--workers", "1", "--force"])
    assert sorted(p.name for p in out.glob("*.bin")) == ["x_train_000001.bin", "x_val_000000.bin"]


def test_a_killed_runs_temporaries_go_with_the_next_run(tmp_path):
    """A tokenize run killed mid-write (SIGKILL) leaves `.x_train_000001.bin.<pid>.tmp`; the next run into the same
    directory removes the corpus' temporaries whose process is gone, and leaves a live process's, another corpus',
    and anything not of that form."""
    import os
    out = tmp_path / "o"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    kept = [f".x_train_000001.bin.{os.getppid()}.tmp", f".y_train_000000.bin.{dead.pid}.tmp", ".x_notes.tmp",
            f".x_val_000000.bin.{dead.pid}.tmp.mine", f"x_train_000009.bin.{dead.pid}.tmp"]
    gone = [f".x_train_000001.bin.{dead.pid}.tmp", f".x_manifest.json.{dead.pid}.tmp"]
    for name in kept + gone:
        (out / name).write_bytes(b"half")
    f = tmp_path / "x.txt"
    f.write_text("hello there")
    run(["text", f, "--out-dir", out, "--workers", "1"])
    left = {p.name for p in out.iterdir()}
    assert set(kept) <= left and not set(gone) & left, sorted(left)


def test_one_writer_of_a_corpus_in_a_directory(tmp_path):
    """A second `tokenize` of the same corpus into a directory another is writing is refused before it writes
    (the two would interleave shards and manifest); another corpus into the same directory runs; a run that fails
    before its first shard leaves no folder it made, however deep."""
    import os

    from llmc_cli.formats.files import DirectoryLock
    out = tmp_path / "o"
    (tmp_path / "x.txt").write_text("hello there")
    (tmp_path / "y.txt").write_text("general kenobi")
    with DirectoryLock(out, ".x.lock", "--out-dir", "the output directory"):  # (as a running tokenize of x holds it)
        r = run(["text", tmp_path / "x.txt", "--out-dir", out, "--workers", "1"], ok=False)
        assert r.exit_code == 2 and f"is in use by another llmc process (pid {os.getpid()})" in r.output, r.output
        assert sorted(p.name for p in out.iterdir()) == [".x.lock"]
        run(["text", tmp_path / "y.txt", "--out-dir", out, "--workers", "1"])
    assert sorted(p.name for p in out.iterdir()) == ["y_manifest.json", "y_train_000001.bin", "y_val_000000.bin"]
    run(["text", tmp_path / "x.txt", "--out-dir", out, "--workers", "1"])
    (tmp_path / "empty.jsonl").write_text("")
    r = run(["text", tmp_path / "empty.jsonl", "--out-dir", tmp_path / "a" / "b" / "c", "--workers", "1"], ok=False)
    assert r.exit_code == 2 and not (tmp_path / "a").exists()


@pytest.mark.parametrize("args, msg", [
    (["text", "{tmp}/missing.txt"], "does not exist"),
    (["text", "{tmp}/a.csv"], "unsupported input type"),
    (["text", "{tmp}/bad.jsonl"], "bad.jsonl:2: no string field 'text'"),
    (["text", "{tmp}/num.jsonl"], "num.jsonl:1: field 'text' is int, expected a string"),
    (["text", "{tmp}/empty.jsonl"], "empty: the input holds no documents, no shards written"),
    (["text", "{tmp}/a.txt", "--shard-size", "ten"], "is not a token count"),
    (["hellaswag", "--local", "{tmp}/bad.jsonl", "--out-dir", "{tmp}/h"], "bad.jsonl:1: not a HellaSwag example"),
])
def test_bad_inputs(tmp_path, args, msg, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out-dir is datasets/<name>/ under the CWD
    (tmp_path / "a.csv").write_text("a,b\n")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (tmp_path / "num.jsonl").write_text('{"text": 7}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    r = run([a.format(tmp=tmp_path) for a in args], ok=False)
    assert r.exit_code == 2, r.output
    assert msg in r.output
    assert "Traceback" not in r.output
    if "does not exist" not in msg and "token count" not in msg:  # llmc's own errors (not click's usage errors)
        line = r.output.strip()
        assert line.startswith("error:") and "\n" not in line, line
    assert not (tmp_path / "datasets").exists() and not (tmp_path / "h").exists()  # nothing written


def test_offline_downloads_fail_fast_with_one_line(tmp_path, monkeypatch):
    def no_network(*a, **kw):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    for args in (["tinyshakespeare"], ["tinystories"], ["hellaswag"]):
        r = run(args + ["--out-dir", tmp_path / args[0]], ok=False)
        assert r.exit_code == 2
        line = r.output.strip()
        assert "\n" not in line and "cannot reach" in line and "--local PATH" in line, line
    # fineweb streams through Hugging Face datasets: not installed -> one clear line, nothing written
    monkeypatch.setitem(sys.modules, "datasets", None)
    r = run(["fineweb", "--out-dir", tmp_path / "fw", "--workers", "1"], ok=False)
    line = r.output.strip()
    assert r.exit_code == 2 and "\n" not in line and "pip install 'llmc[hf]'" in line and "--local" in line, line
    # installed but the hub is unreachable -> the same, naming the host, before anything is written
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, **kw: pytest.fail("load_dataset must not be reached offline")
    monkeypatch.setitem(sys.modules, "datasets", fake)
    r = run(["fineweb", "--edu", "--out-dir", tmp_path / "fw", "--workers", "1"], ok=False)
    line = r.output.strip()
    assert r.exit_code == 2 and "\n" not in line, line
    assert "cannot reach huggingface.co" in line and "--local PATH" in line, line
    assert not (tmp_path / "fw").exists() and not list(tmp_path.iterdir())


def test_fineweb_streams_through_hf_datasets(tmp_path, enc, monkeypatch):
    """Without --local: rows come from `datasets.load_dataset(..., streaming=True)` (a stand-in here: the
    real package needs the hub), tokenized like any other source."""
    docs = [f"Row {i}: " + "streamed web text. " * (i % 5 + 1) for i in range(30)]
    calls = []

    def load_dataset(repo, name=None, split=None, streaming=False):
        calls.append((repo, name, split, streaming))
        return iter({"text": d, "id": str(i)} for i, d in enumerate(docs))  # an IterableDataset iterates rows

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(downloads, "_probe", lambda url, timeout=5.0: None)
    out = tmp_path / "fw"
    run(["fineweb", "--version", "100B", "--out-dir", out, "--shard-size", "100", "--workers", "2"])
    assert calls == [("HuggingFaceFW/fineweb", "sample-100BT", "train", True)]
    check_dir(out, "fineweb", expected_layout(stream(enc, docs), 100, 100))


def test_llama3_vocabulary_writes_uint32_shards(tmp_path):
    """--tokenizer llama3 --tokenizer-path: llm.c's Llama 3 shard format (magic 20240801, version 7, uint32),
    every document after <|begin_of_text|>, ids checked against a direct tiktoken encoding."""
    import base64

    ranks = tmp_path / "toy.tiktoken"  # byte-level toy ranks in tiktoken's file format (Meta's is not shipped)
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    docs = ["hello llama\n", "déjà vu <|begin_of_text|> stays text", "x" * 50]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "l3"
    run(["text", src, "--out-dir", out, "--tokenizer", "llama3", "--tokenizer-path", ranks, "--shard-size", "40",
         "--val-tokens", "10", "--workers", "2"])
    direct = tiktoken.Encoding("toy", pat_str=load_tokenizer("llama3", ranks).enc._pat_str,
                               mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(ranks)), special_tokens={})
    toks = []
    for d in docs:
        toks += [256] + direct.encode_ordinary(d)  # <|begin_of_text|> = first id after the 256 ranks
    layout = expected_layout(toks, 10, 40)
    want = [f"d_{split}_{k:06d}.bin" for k, (split, _) in enumerate(layout)]
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(want)
    for fname, (_, t) in zip(want, layout):
        header = np.zeros(256, dtype="<i4")
        header[:3] = [20240801, 7, len(t)]
        assert (out / fname).read_bytes() == header.tobytes() + np.asarray(t, dtype="<u4").tobytes(), fname


def test_help_shows_examples_and_defaults():
    r = run(["--help"])
    assert "llmc tokenize shakespeare" in r.output
    r = run(["fineweb", "--help"])
    assert "Example" in r.output and "[default: 100M]" in r.output and "10B|100B" in r.output


def test_tokenizer_bin_command(tmp_path):
    out = tmp_path / "gpt2_tokenizer.bin"
    r = run(["tokenizer-bin", out])
    assert "50,257 tokens" in r.output
    assert list(np.frombuffer(out.read_bytes()[:16], "<i4")) == [20240328, 2, 50257, 50256]


def test_tokenizer_bin_takes_out_dir_as_its_siblings_do(tmp_path):
    r = run(["tokenizer-bin", "--out-dir", tmp_path / "d"])
    assert r.exit_code == 0 and (tmp_path / "d" / "gpt2_tokenizer.bin").is_file(), r.output
    r = run(["tokenizer-bin", tmp_path / "x.bin", "--out-dir", tmp_path / "d"], ok=False)
    assert r.exit_code == 2 and "give one of them" in r.output and not (tmp_path / "x.bin").exists(), r.output


def test_console_script_has_the_group():
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "tokenize", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "shakespeare" in r.stdout


def test_never_replaces_a_file_that_is_not_its_own(tmp_path, monkeypatch):
    """--force discards llmc's shards, never a user's file that happens to carry a shard's, a manifest's, an
    eval file's or a tokenizer file's name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world. " * 200)
    (tmp_path / "h.jsonl").write_text('{"ctx": "a b", "endings": ["c", "d", "e", "f"], "label": 0}\n')
    precious = b"precious, not a shard"
    for name in ("x_val_000000.bin", "x_train_000001.bin", "x_manifest.json"):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_bytes(precious)
        r = run(["text", tmp_path / "a.txt", "--name", "x", "--out-dir", d, "--force"], ok=False)
        assert r.exit_code == 2 and "llmc will not replace it" in r.output, r.output
        assert (d / name).read_bytes() == precious and sorted(p.name for p in d.iterdir()) == [name]
    (tmp_path / "hs").mkdir()
    (tmp_path / "hs" / "hellaswag_val.bin").write_bytes(precious)
    (tmp_path / "tok.bin").write_bytes(precious)
    for args, victim in ((["hellaswag", "--local", tmp_path / "h.jsonl", "--out-dir", tmp_path / "hs"],
                          tmp_path / "hs" / "hellaswag_val.bin"),
                         (["tokenizer-bin", tmp_path / "tok.bin"], tmp_path / "tok.bin")):
        r = run(args, ok=False)
        assert r.exit_code == 2 and "is not an llm.c" in r.output and "Traceback" not in r.output, r.output
        assert victim.read_bytes() == precious
        victim.unlink()
        run(args)  # its own file it writes, and writes again
        run(args)
    d = tmp_path / "ok"
    run(["text", tmp_path / "a.txt", "--name", "x", "--out-dir", d])
    run(["text", tmp_path / "a.txt", "--name", "x", "--out-dir", d, "--force"])  # llmc's own shards: replaced


def test_disk_full_is_one_line(tmp_path, monkeypatch):
    import errno
    import os

    from llmc_cli.formats import shards

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(shards, "atomic_write_bytes", full)
    (tmp_path / "a.txt").write_text("hello world. " * 200)
    r = run(["text", tmp_path / "a.txt", "--name", "x", "--out-dir", tmp_path / "o"], ok=False)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert line.startswith("error: ") and "No space left on device" in line and str(tmp_path / "o") in line, line


def test_empty_or_blank_text_is_no_document(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n\t\n")
    r = run(["text", tmp_path / "empty.txt", tmp_path / "blank.txt", "--name", "e", "--out-dir", tmp_path / "o"],
            ok=False)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "holds no documents" in line and not (tmp_path / "o").exists(), r.output


def test_val_tokens_help_states_one_default():
    from click.testing import CliRunner

    from llmc_cli.commands import main
    for corpus, want, unwanted in (("tinyshakespeare", "[default: 32768]", "--val-fraction"),
                                   ("text", "--val-fraction", "[default: None]")):
        out = " ".join(CliRunner().invoke(main, ["tokenize", corpus, "--help"]).output.split())
        part = out[out.index("--val-tokens TOKENS"):]
        ends = [i for i in (part.find(" --val-fraction FLOAT"), part.find("--help"), len(part)) if i > 0]
        part = part[:min(ends)]
        assert want in part and unwanted not in part and part.count("[default") <= 1, part


def test_the_progress_fits_80_columns(tmp_path):
    """On an 80-column terminal, and into a pipe (its last frame), the bar fits, no column cut short."""
    from rich.console import Console

    from llmc_cli.commands.tokenize import _progress
    for terminal in (True, False):
        console = Console(file=io.StringIO(), width=80, force_terminal=terminal)
        with _progress(console) as p:
            task = p.add_task("tokenize shakespeare", total=5_057_240, tokens=0, tok_s=0.0, shard=0)
            p.update(task, completed=5_057_240, tokens=5_057_240, shard=2)
        text = console.file.getvalue()
        lines = [ln for ln in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n").split("\n") if ln]
        assert lines, text
        assert all(len(ln) <= 80 and "…" not in ln for ln in lines), lines  # (no column cut short)
