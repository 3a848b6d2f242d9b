"""A Hugging Face tokenizer.json read as Llama 3's tokenizer: what llmc does not use of it (merges, special tokens,
split pattern) is still checked against what llmc builds instead, so a file that transformers would tokenize
otherwise is refused in one line naming it, never read as something else; and a copy of it made under the name
tokenizer.model (convert, train --init) holds Meta's tiktoken format, not the JSON."""

from __future__ import annotations

import base64
import copy
import json

import pytest

import llmc_cli.data.tokenizer as tk
from llmc_cli.data.tokenizer import (LLAMA3_PAT_STR, LLAMA3_SPECIALS, TokenizerError, gpt2_ranks, load_tokenizer,
                                     ranks_file_bytes)
from llmc_cli.formats.hf_tokenizer import write_tiktoken_tokenizer

N = 1000  # GPT-2's first ranks stand in for Meta's 128,000


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokjson")
    ranks = {t: r for t, r in gpt2_ranks().items() if r < N}
    specials = {t: N + i for i, t in enumerate(LLAMA3_SPECIALS)}
    write_tiktoken_tokenizer(d, ranks, LLAMA3_PAT_STR, specials, "<|begin_of_text|>", "<|end_of_text|>", 128)
    return json.loads((d / "tokenizer.json").read_text()), ranks


def _last(j):
    return list(j["model"]["vocab"])[-1]


BAD = {  # name: (change to a good file, what the one line says)
    "not_json": (b"{not json", "not JSON"),
    "empty": (b"", "not JSON"),
    "a_list": (b"[1, 2]", "no 'model' object"),
    "wordpiece": (lambda j: j["model"].update(type="WordPiece"), "model type 'WordPiece', expected 'BPE'"),
    "vocab_list": (lambda j: j["model"].update(vocab=list(j["model"]["vocab"].items())), "model.vocab is list"),
    "string_id": (lambda j: j["model"]["vocab"].update({_last(j): str(N - 1)}), "expected an integer id"),
    "float_id": (lambda j: j["model"]["vocab"].update({_last(j): N - 0.5}), "expected an integer id"),
    "bool_id": (lambda j: j["model"]["vocab"].update({"!": False}), "expected an integer id"),
    "negative_id": (lambda j: j["model"]["vocab"].update({_last(j): -1}), "not byte-level BPE ranks 0..999"),
    "huge_id": (lambda j: j["model"]["vocab"].update({_last(j): 10**30}), "not byte-level BPE ranks 0..999"),
    "empty_token": (lambda j: j["model"]["vocab"].update({"": N}), "model.vocab token '' is not byte-level BPE"),
    "merges_missing": (lambda j: j["model"].pop("merges"), "model.merges is NoneType, expected a list"),
    "merges_garbage": (lambda j: j["model"].update(merges=[1]), "model.merges[0] is 1"),
    "merges_three": (lambda j: j["model"]["merges"].append(["a", "b", "c"]), "expected 'a b' or"),
    "merges_unknown": (lambda j: j["model"]["merges"].append("zzq qqz"), "'zzq qqz' names a token not in model.vocab"),
    "added_missing": (lambda j: j.pop("added_tokens"), "added_tokens is not a list"),
    "added_empty": (lambda j: j.update(added_tokens=[]), "added token <|begin_of_text|> is missing, expected id 1000"),
    "added_other": (lambda j: j.update(added_tokens=[{"id": N, "content": "<s>"}, {"id": N + 1, "content": "</s>"}]),
                    "<|begin_of_text|> is missing"),
    "added_shifted": (lambda j: [a.update(id=a["id"] + 1) for a in j["added_tokens"]], "has id 1256, expected one of"),
    "special_in_vocab": (lambda j: j["model"]["vocab"].update({"<|begin_of_text|>": N}), "(and not in model.vocab)"),
    "other_regex": (lambda j: j["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+|\S+"),
                    "pre_tokenizer splits with ['\\\\s+|\\\\S+'], expected Llama 3's split pattern"),
    "no_pre_tokenizer": (lambda j: j.update(pre_tokenizer=None), "pre_tokenizer splits with no regex"),
    "gpt2_byte_level": (lambda j: j.update(pre_tokenizer={"type": "ByteLevel", "use_regex": True}),
                        "pre_tokenizer splits with [\"'s|'t|'re"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tokenizer_json_is_one_line_naming_it(good, tmp_path, monkeypatch, name):
    change, expect = BAD[name]
    f = tmp_path / "tokenizer.json"
    if isinstance(change, bytes):
        f.write_bytes(change)
    else:
        j = copy.deepcopy(good[0])
        change(j)
        f.write_text(json.dumps(j))
    monkeypatch.setattr(tk, "_CACHE", {})
    with pytest.raises(TokenizerError) as e:
        load_tokenizer("llama3", f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and expect in msg and "\n" not in msg, msg


def test_good_tokenizer_json_in_both_merge_spellings(good, tmp_path, monkeypatch):
    """transformers writes merges as "a b" strings or (newer) ["a", "b"] pairs: both read, to the same ranks."""
    ranks = good[1]
    for spelling in ("string", "pair"):
        j = copy.deepcopy(good[0])
        if spelling == "pair":
            j["model"]["merges"] = [m.split(" ") for m in j["model"]["merges"]]
        f = tmp_path / spelling / "tokenizer.json"
        f.parent.mkdir()
        f.write_text(json.dumps(j))
        monkeypatch.setattr(tk, "_CACHE", {})
        tok = load_tokenizer("llama3", f)
        assert tok.vocab_size == N + 256 and tok.doc_prefix == [N] and tok.eot == N + 1
        assert tk.llama3_ranks(f) == ranks
        # its copy under the name tokenizer.model is Meta's format, the same ranks
        copy_ = tmp_path / spelling / "tokenizer.model"
        copy_.write_bytes(ranks_file_bytes(f))
        assert tk.llama3_ranks(copy_) == ranks
        assert base64.b64decode(copy_.read_text().split()[0]) == min(ranks, key=ranks.get)
