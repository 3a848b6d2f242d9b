"""The byte-level tokenizer (`--tokenizer bytes`): ids are UTF-8 bytes plus end-of-text 256; byte shards name it in
their header (magic 20240520 version 2), a model trained on them takes 257 ids and names it in its model file, and
every command finds it from the shards or the checkpoint alone: train, sample, eval, convert."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.data.tokenizer import ByteTokenizer, load_tokenizer, read_tokenizer_bin, write_tokenizer_bin
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.llmc_bin import read_model_header, read_model_tokenizer, write_model
from llmc_cli.formats.shards import (HEADER_BYTES, SHARD_VOCAB, data_vocab_size, read_shard, read_shard_header,
                                     write_shard)
from llmc_cli.formats.sources import tokenizer_for, tokenizer_name_for
from llmc_cli.models import gpt2
from llmc_cli.models.families import family_for
from llmc_cli.tokenizing.pipeline import run_pipeline
from llmc_cli.tokenizing.sources import files_source

TEXTS = ["", "hello", "héllo wörld ✓", "a<|endoftext|>b", "\x00\n\t\x7f", "日本語 🎭"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    tok = load_tokenizer("bytes")
    ordinary = tok.encode_ordinary(text)
    assert ordinary == list(text.encode("utf-8")) and max(ordinary, default=0) < 256
    assert tok.decode(ordinary) == text
    assert tok.encode_ordinary_array(text).tolist() == ordinary
    assert tok.encode_document(text) == [256] + ordinary
    assert tok.decode(tok.encode(text)) == text  # (the end-of-text text becomes 256 and decodes back)


def test_specials_and_vocabulary():
    tok = load_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eot, tok.doc_prefix) == ("bytes", 257, 256, [256])
    assert tok.encode("a<|endoftext|>b") == [97, 256, 98]
    assert tok.encode("a<|endoftext|>b", allowed_special=set()) == list(b"a<|endoftext|>b")
    assert [tok.token_bytes(i) for i in (0, 65, 255, 256)] == [b"\x00", b"A", b"\xff", b"<|endoftext|>"]
    with pytest.raises(DataError, match="out of range"):
        tok.token_bytes(257)
    assert pickle.loads(pickle.dumps(tok)).encode("x") == [120]  # (worker processes get it pickled)
    assert tok.vocabulary_sha256 == ByteTokenizer().vocabulary_sha256
    with pytest.raises(DataError, match="no ranks file"):
        load_tokenizer("bytes", "some.tiktoken")


def test_llm_c_tokenizer_file(tmp_path):
    table = read_tokenizer_bin(write_tokenizer_bin(load_tokenizer("bytes"), tmp_path / "bytes_tokenizer.bin"))
    assert (table.vocab_size, table.eot) == (257, 256)
    assert table.decode([104, 105, 256]) == "hi<|endoftext|>"


def test_shard_header_names_the_tokenizer(tmp_path):
    path = write_shard(tmp_path / "x_val_000000.bin", np.array([256, 104, 105], np.int64), "bytes")
    header = np.fromfile(path, "<i4", count=256)
    assert header[:3].tolist() == [20240520, 2, 3]
    assert header[4:12].tobytes().rstrip(b"\0") == b"bytes"
    info = read_shard_header(path)
    assert (info.tokenizer, info.dtype, info.num_tokens) == ("bytes", np.dtype("<u2"), 3)
    assert read_shard(path).tolist() == [256, 104, 105]
    assert SHARD_VOCAB["bytes"] == 257
    # another name in a version 2 header is refused, naming it (llm.c's version 1 stays GPT-2's)
    raw = bytearray(path.read_bytes())
    raw[16:48] = b"klingon".ljust(32, b"\0")
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="names tokenizer 'klingon'"):
        read_shard_header(tmp_path / "bad.bin")
    (tmp_path / "short.bin").write_bytes(bytes(raw[:100]))
    with pytest.raises(DataError, match="truncated shard"):
        read_shard_header(tmp_path / "short.bin")
    assert len(raw) == HEADER_BYTES + 6


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    """Shards of a small text tokenized with the bytes tokenizer through the pipeline, as `llmc tokenize` does."""
    d = tmp_path_factory.mktemp("bytes")
    texts = []
    for i in range(4):
        f = d / "in" / f"doc{i}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(("To be, or not to be, that is the question. " * 40) + f"Act {i}.\n")
        texts.append(f)
    out = d / "data"
    summary = run_pipeline(files_source("play", texts), load_tokenizer("bytes"), out, 1 << 20)
    assert [s["split"] for s in summary.shards] == ["val", "train"]
    return out


def test_the_pipeline_writes_byte_shards(byte_data):
    train = read_shard(next(byte_data.glob("*_train_*.bin")))
    assert read_shard_header(next(byte_data.glob("*_train_*.bin"))).tokenizer == "bytes"
    assert train.max() == 256 and bytes(train[train < 256][:9].astype(np.uint8)) in b"To be, or not to be"
    assert data_vocab_size(str(byte_data)) == 257


def test_data_vocab_size_is_the_byte_shards_alone(tmp_path, byte_data):
    write_shard(tmp_path / "g_train_000001.bin", [1, 2, 3], "gpt2")
    assert data_vocab_size(str(tmp_path)) is None  # (a GPT-2 preset keeps its 50257)
    assert data_vocab_size(str(tmp_path / "missing")) is None  # (the loader names what is wrong)
    assert data_vocab_size("") is None
    assert data_vocab_size(str(byte_data / "*train*.bin")) == 257


def test_model_file_names_the_tokenizer(tmp_path):
    cfg = gpt2.GPT2Config(block_size=16, vocab_size=257, n_layer=1, n_head=2, n_embd=16)
    params = gpt2.init_parameters(cfg, 0)
    write_model(tmp_path / "b.bin", cfg, params, tokenizer="bytes")
    write_model(tmp_path / "g.bin", cfg, params)
    header = np.fromfile(tmp_path / "b.bin", "<i4", count=256)
    assert header[:8].tolist() == np.fromfile(tmp_path / "g.bin", "<i4", count=8).tolist()  # llm.c's fields
    assert not np.fromfile(tmp_path / "g.bin", "<i4", count=256)[8:].any()  # GPT-2's: llm.c's header as it is
    assert read_model_header(tmp_path / "b.bin")[0] == cfg
    assert read_model_tokenizer(tmp_path / "b.bin") == "bytes" and read_model_tokenizer(tmp_path / "g.bin") == "gpt2"
    assert tokenizer_name_for(tmp_path / "b.bin") == "bytes" and tokenizer_for(tmp_path / "g.bin") == ("gpt2", None)


def test_preset():
    fam = family_for("bytes-d4")
    cfg = fam.preset("bytes-d4")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size) == (4, 4, 128, 64)
    assert fam.preset("bytes-d4", block_size=256).block_size == 256
    assert gpt2.preset("d6").block_size == 1024  # (the others keep GPT-2's context)


@pytest.fixture(scope="module")
def byte_run(byte_data, tmp_path_factory):
    """`llmc train` on the byte shards, the vocabulary unsaid: the model takes the shards' 257 ids."""
    out = tmp_path_factory.mktemp("run") / "run"
    r = run("train", "--backend", "cpu", "--model", "bytes-d4", "--n-layer", 1, "-b", 2, "-t", 16, "--steps", 3,
            "--data", byte_data, "--val-every", 3, "--val-batches", 2, "--sample-every", 3, "--sample-tokens", 8,
            "--out", out)
    assert "V=257" in r.output
    return out


def test_train_records_the_tokenizer(byte_run):
    model_file = ckpt.resolve_checkpoint(byte_run)
    assert read_model_tokenizer(model_file) == "bytes"
    assert json.loads((model_file.parent / "state.json").read_text())["tokenizer"] == "bytes"
    assert tokenizer_for(byte_run) == ("bytes", None)
    assert read_model_header(model_file)[0].vocab_size == 257


def test_resume_reads_the_recorded_tokenizer(byte_run, byte_data):
    run("train", "--out", byte_run, "--resume", "--steps", 4)
    assert ckpt.resolve_checkpoint(byte_run).parent.name == "step_00000004"


def test_sample_decodes_bytes(byte_run):
    r = run("sample", "--backend", "cpu", "--checkpoint", byte_run, "--prompt", "To be", "--max-new-tokens", 12,
            "--seed", 1)
    assert r.output.startswith("To be")


def test_eval_reads_byte_shards_and_refuses_others(byte_run, byte_data, tmp_path):
    out = json.loads(run("eval", "--backend", "cpu", "--checkpoint", byte_run, "--data", byte_data, "-b", 2,
                         "-t", 16, "--batches", 2, "--json").stdout)
    assert 0 < out["loss"] < 10
    write_shard(tmp_path / "g_val_000000.bin", np.arange(200), "gpt2")
    r = run("eval", "--backend", "cpu", "--checkpoint", byte_run, "--data", tmp_path, "-b", 2, "-t", 16, ok=False)
    one_line_error(r, "gpt2", "bytes")


def test_convert_keeps_the_tokenizer_or_refuses(byte_run, tmp_path):
    run("convert", byte_run, tmp_path / "m.bin")
    assert read_model_tokenizer(tmp_path / "m.bin") == "bytes"
    run("convert", byte_run, tmp_path / "again", "--to", "run")
    assert tokenizer_for(tmp_path / "again") == ("bytes", None)
    r = run("convert", byte_run, tmp_path / "hf", ok=False)
    one_line_error(r, "Hugging Face", "bytes")
    assert not (tmp_path / "hf").exists()


def test_tokenize_cli_takes_bytes(tmp_path):
    (tmp_path / "t.txt").write_text("Now is the winter of our discontent\n" * 50)
    r = run("tokenize", "text", tmp_path / "t.txt", "--tokenizer", "bytes", "--out-dir", tmp_path / "d",
            "--workers", 1)
    assert "1 val, 1 train" in r.output
    assert read_shard_header(next((tmp_path / "d").glob("*_val_*.bin"))).tokenizer == "bytes"


def test_hellaswag_has_no_byte_eval_file(tmp_path):
    r = run("tokenize", "hellaswag", "--tokenizer", "bytes", "--out-dir", tmp_path / "hs", ok=False)
    one_line_error(r, "bytes")
    assert not (tmp_path / "hs").exists()  # (refused before the download)
