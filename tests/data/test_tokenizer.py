"""GPT-2 tokenizer (tiktoken, offline ranks from openai-whisper) and llm.c's tokenizer .bin."""
from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest

from llmc_cli.data import tokenizer as tk
from llmc_cli.formats.files import DataError
from llmc_cli.data.tokenizer import TokenizerError, gpt2_ranks_path, load_tokenizer, read_tokenizer_bin, write_tokenizer_bin


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_identity(gpt2):
    assert gpt2.name == "gpt2"
    assert gpt2.vocab_size == 50257
    assert gpt2.eot == 50256
    assert gpt2.doc_prefix == [50256]
    assert gpt2_ranks_path().name == "gpt2.tiktoken"
    assert load_tokenizer("gpt2") is gpt2  # built once per process


@pytest.mark.parametrize("text, ids", [
    ("Hello world", [15496, 995]),
    ("The quick brown fox", [464, 2068, 7586, 21831]),
    (" the", [262]),
    ("\n", [198]),
    ("<|endoftext|>", [50256]),
])
def test_known_ids(gpt2, text, ids):
    # ids of tiktoken's own "gpt2" encoding (and of GPT-2's encoder.json)
    assert gpt2.encode(text) == ids
    assert gpt2.decode(ids) == text


def test_special_tokens(gpt2):
    # ordinary encoding treats the special token's text as text, like tiktoken's encode_ordinary
    assert gpt2.encode_ordinary("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert gpt2.encode_document("Hello world") == [50256, 15496, 995]


@pytest.mark.parametrize("text", [
    "", "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n",
    "naïve café — 日本語 😀 \t tabs  and   spaces\r\n", "1234567890 3.14159 x=y+z; {'a': [1,2]}",
])
def test_round_trip(gpt2, text):
    ids = gpt2.encode_ordinary(text)
    assert gpt2.decode(ids) == text
    assert gpt2.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < 50257 for i in ids)


def test_partial_utf8_decodes_with_replacement(gpt2):
    ids = gpt2.encode_ordinary("😀")
    assert len(ids) > 1
    assert gpt2.decode(ids[:1]).endswith("\ufffd")


def test_pickles_for_worker_processes(gpt2):
    again = pickle.loads(pickle.dumps(gpt2))
    assert again.encode("Hello world") == [15496, 995]


def test_llmc_tokenizer_bin_round_trip(gpt2, tmp_path):
    path = write_tokenizer_bin(gpt2, tmp_path / "gpt2_tokenizer.bin")
    data = path.read_bytes()
    header = np.frombuffer(data[:1024], dtype="<i4")
    assert list(header[:4]) == [20240328, 2, 50257, 50256]
    assert not header[4:].any()
    # then one length byte + the bytes of every token, in id order
    assert data[1024:1024 + 2] == bytes([1, ord("!")])  # token 0 is "!"
    expected_len = 1024 + sum(1 + len(gpt2.token_bytes(i)) for i in range(50257))
    assert len(data) == expected_len
    table = read_tokenizer_bin(path)
    assert table.vocab_size == 50257 and table.eot == 50256
    assert table.token_bytes(198) == b"\n"
    assert table.token_bytes(50256) == b"<|endoftext|>"
    ids = gpt2.encode("Hello world, it's 2024!")
    assert table.decode(ids) == "Hello world, it's 2024!"
    with pytest.raises(TokenizerError, match="out of range"):
        table.decode([50257])


def test_tokenizer_bin_version1_and_errors(tmp_path):
    p = tmp_path / "v1.bin"
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240328, 1, 2]
    p.write_bytes(header.tobytes() + b"\x01a\x02bc")
    t = read_tokenizer_bin(p)
    assert t.tokens == [b"a", b"bc"] and t.eot == 50256
    bad = tmp_path / "bad.bin"
    header[0] = 20240520
    bad.write_bytes(header.tobytes())
    with pytest.raises(TokenizerError, match=r"bad\.bin: bad magic 20240520, expected 20240328"):
        read_tokenizer_bin(bad)
    cut = tmp_path / "cut.bin"
    header[0] = 20240328
    cut.write_bytes(header.tobytes() + b"\x01a\x05b")
    with pytest.raises(TokenizerError, match="cut.bin: token 1"):
        read_tokenizer_bin(cut)
    with pytest.raises(TokenizerError, match="not found"):
        read_tokenizer_bin(tmp_path / "nope.bin")
    assert issubclass(TokenizerError, DataError) and issubclass(DataError, ValueError)


def test_missing_ranks_file_says_how_to_install(monkeypatch, tmp_path):
    import importlib.metadata
    import importlib.util

    monkeypatch.setenv("LLMC_DATA_HOME", str(tmp_path))  # an empty data home: nothing installed there either
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    with pytest.raises(TokenizerError, match=r"bash install.sh, or pip install --no-deps --upgrade --target \S+ "
                                             r"openai-whisper"):
        gpt2_ranks_path()


def test_bad_paths_and_names(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer("gpt2", tmp_path / "missing.tiktoken")
    junk = tmp_path / "junk.tiktoken"
    junk.write_text("not base64 at all !!\n")
    with pytest.raises(TokenizerError, match="junk.tiktoken"):
        load_tokenizer("gpt2", junk)
    with pytest.raises(TokenizerError, match="unknown tokenizer 'gpt5'"):
        load_tokenizer("gpt5")
    with pytest.raises(TokenizerError, match="pass tokenizer_path PATH"):
        load_tokenizer("llama3")


def test_llama3_style_tokenizer_from_a_ranks_file(tmp_path):
    # a byte-level toy vocabulary in tiktoken's file format stands in for Meta's tokenizer.model
    ranks = tmp_path / "toy.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    tok = load_tokenizer("llama3", ranks)
    assert tok.name == "llama3"
    assert tok.vocab_size == 256 + 256
    assert tok.doc_prefix == [256]  # <|begin_of_text|>
    assert tok.eot == 257           # <|end_of_text|>
    assert tok.encode("hi") == [ord("h"), ord("i")]
    assert tok.encode("<|begin_of_text|>hi") == [256, ord("h"), ord("i")]
    assert tok.decode(tok.encode_ordinary("héllo\n")) == "héllo\n"
    assert "llama3" in tk.TOKENIZERS


def test_fallback_split_pattern_is_equivalent(gpt2):
    import tiktoken

    alt = tiktoken.Encoding("gpt2-alt", pat_str=tk.GPT2_PAT_STR, mergeable_ranks=gpt2.enc._mergeable_ranks,
                            special_tokens={"<|endoftext|>": 50256})
    text = ("I'm sure they'll say: \"it's 1,234.5 naïve\tcafés!!\"\n\n  \n   x  y\r\n日本語 😀 "
            "don't DON'T we've you'd  \t\n") * 3
    assert alt.encode_ordinary(text) == gpt2.encode_ordinary(text)


def test_gpt2_ranks_are_checked_by_content_and_never_go_through_a_shared_cache(tmp_path, monkeypatch):
    good = gpt2_ranks_path().read_bytes()
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(good.replace(b"IQ== 0", b"Ig== 0", 1))  # one rank's token changed, still well-formed
    with pytest.raises(TokenizerError, match=r"gpt2.tiktoken: not the GPT-2 ranks file \(sha256 [0-9a-f]{64}, "
                                             f"expected {tk.GPT2_RANKS_SHA256}"):
        load_tokenizer("gpt2", damaged)
    # a planted entry in tiktoken's cache (keyed by a hash of the path) changes nothing: the file is read here
    import hashlib
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(cache))
    copy = tmp_path / "copy.tiktoken"
    copy.write_bytes(good)
    (cache / hashlib.sha1(str(copy).encode()).hexdigest()).write_bytes(damaged.read_bytes())
    monkeypatch.setattr(tk, "_CACHE", {})
    assert load_tokenizer("gpt2", copy).encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("content, expect", [
    (b"", "without all 256 single bytes"),
    (b"SGVsbG8= 0\n", "1 ranks without all 256 single bytes"),
    (b"\x00\xff garbage\n", "1: expected 'base64-token rank'"),
    (b"SGVsbG8=\n", "1: expected 'base64-token rank'"),
    (b"SGVsbG8= x\n", "1: expected 'base64-token rank'"),
    (b"SGVsbG8= 0\nSGVsbG8= 1\n", "2: token b'Hello' appears twice"),
    (b"".join(base64.b64encode(bytes([i])) + b" %d\n" % (i * 2) for i in range(256)), "are not 0..255 each once"),
])
def test_bad_llama3_ranks_files_are_one_line(tmp_path, content, expect):
    f = tmp_path / "tokenizer.model"
    f.write_bytes(content)
    with pytest.raises(TokenizerError, match=None) as e:
        load_tokenizer("llama3", f)
    msg = str(e.value)
    assert expect in msg and "\n" not in msg and str(f) in msg, msg
