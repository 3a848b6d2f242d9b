"""`llmc tokenize` runs that would leave no train shard: a --val-tokens at least the whole corpus (wrote a lone val shard
and exited 0; `llmc train` then said "no train shards"), fineweb's default val split (one --shard-size) over a small
--local file, and a TinyStories train part without stories. And the hint of a TinyStories file without `story`
fields, which named --text-field, an option `llmc tokenize tinystories` does not have."""
from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from llmc_test_support import one_line_error

from llmc_cli.commands.tokenize import tokenize
from llmc_cli.formats.shards import read_shard_header


def run(*args):
    return CliRunner().invoke(tokenize, [str(a) for a in args])


def corpus(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world this is a tiny corpus\n")  # 9 GPT-2 tokens with its <|endoftext|>
    return f


def test_val_tokens_covering_the_corpus_is_one_line_and_writes_nothing(tmp_path):
    f, out = corpus(tmp_path), tmp_path / "o"
    for val in (9, 10, "1M"):  # the whole corpus, one more, far more
        line = one_line_error(run("text", f, "--name", "x", "--val-tokens", val, "--workers", 1, "--out-dir", out),
                              "x: the input holds 9 tokens", "--val-tokens below 9", "no shard written")
        assert "no train shard" in line
        assert not out.exists()  # nothing to resume from or trip over: the rerun below starts clean
    r = run("text", f, "--name", "x", "--val-tokens", 8, "--workers", 1, "--out-dir", out)
    assert r.exit_code == 0, r.output
    assert read_shard_header(out / "x_val_000000.bin").num_tokens == 8
    assert read_shard_header(out / "x_train_000001.bin").num_tokens == 1
    assert json.loads((out / "x_manifest.json").read_text())["complete"] is True


def test_fineweb_local_smaller_than_its_default_val_shard(tmp_path):
    """fineweb's val split defaults to one --shard-size (llm.c's layout): a small --local file was all val."""
    f = tmp_path / "sample.jsonl"
    f.write_text("".join(json.dumps({"text": f"document number {i} of a small sample"}) + "\n" for i in range(5)))
    out = tmp_path / "fw"
    one_line_error(run("fineweb", "--local", f, "--shard-size", "1K", "--workers", 1, "--out-dir", out),
                   "fineweb: the input holds", "--val-tokens below")
    assert not out.exists()
    r = run("fineweb", "--local", f, "--shard-size", "1K", "--val-tokens", 10, "--workers", 1, "--out-dir", out)
    assert r.exit_code == 0, r.output
    assert (out / "fineweb_train_000001.bin").is_file()


def _stories(d, files):
    d.mkdir(exist_ok=True)
    for k, stories in enumerate(files):
        (d / f"data{k:02d}.json").write_text(json.dumps(stories))
    return d


def test_tinystories_without_train_stories_is_an_error_not_a_val_only_dataset(tmp_path):
    val = [{"story": f"Once upon a time {i}, a cat sat."} for i in range(4)]
    d = _stories(tmp_path / "ts_data", [val, []])  # the train file holds no story
    out = tmp_path / "ts"
    line = one_line_error(run("tinystories", "--local", d, "--out-dir", out, "--workers", 1),
                          "no train shard", "tinystories_val_000000.bin", "--force")
    manifest = json.loads((out / "tinystories_manifest.json").read_text())
    assert manifest["complete"] is False, line  # a rerun is no "already complete" run of val alone
    one_line_error(run("tinystories", "--local", d, "--out-dir", out, "--workers", 1), "no train shard")
    _stories(d, [val, [{"story": "A dog ran."}]])
    r = run("tinystories", "--local", d, "--out-dir", out, "--workers", 1, "--force")
    assert r.exit_code == 0, r.output
    tokens = np.fromfile(out / "tinystories_train_000001.bin", dtype="<u2", offset=1024)
    assert len(tokens) > 1


def test_tinystories_hint_names_no_option_it_lacks(tmp_path):
    d = _stories(tmp_path / "ts_data", [[{"story": "A cat."}], [{"text": "no story field here"}]])
    line = one_line_error(run("tinystories", "--local", d, "--out-dir", tmp_path / "ts", "--workers", 1),
                          "data01.json[0]", "no string field 'story'", "TinyStories")
    assert "--text-field" not in line
    d2 = _stories(tmp_path / "ts_data2", [[{"story": "A cat."}], [{"story": 5}]])
    line = one_line_error(run("tinystories", "--local", d2, "--out-dir", tmp_path / "ts2", "--workers", 1),
                          "data01.json[0]", "field 'story' is int", "TinyStories")
    assert "--text-field" not in line
    # the commands that have the option still name it
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"body": "text"}) + "\n")
    one_line_error(run("text", f, "--out-dir", tmp_path / "t", "--workers", 1), "no string field 'text'",
                   "--text-field")
