"""A byte-level BPE tokenizer (GPT-2's) in the files Hugging Face's tokenizers read: vocab.json (the tokens, each
byte shown through GPT-2's printable byte alphabet) and merges.txt (the merge pairs in rank order), with
tokenizer_config.json, special_tokens_map.json and generation_config.json, so `AutoTokenizer` and `pipeline`
work offline on an exported directory. The merges are recovered from the ranks: a token's pair is what BPE,
allowed only merges of lower rank, leaves of it (the two parts tiktoken itself would have joined last)."""

from __future__ import annotations

import json
from pathlib import Path

from llmc_cli.formats.files import atomic_write_bytes

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (so a token is a plain string in vocab.json)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """BPE on `token`'s bytes with only the merges ranked below the token's own: the last two parts."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[str]]:
    enc = bytes_to_unicode()
    show = lambda b: "".join(enc[x] for x in b)  # noqa: E731
    vocab = {show(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = _split(ranks, tok)
        if len(parts) != 2:
            raise ValueError(f"token {tok!r} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append(f"{show(parts[0])} {show(parts[1])}")
    return vocab, merges


def write_gpt2_tokenizer(out: Path, ranks: dict[bytes, int], eot: str, eot_id: int, max_length: int) -> None:
    """GPT-2's tokenizer files into the Hugging Face directory `out`."""
    vocab, merges = vocab_and_merges(ranks)
    vocab[eot] = eot_id
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length,
                                             "bos_token": eot, "eos_token": eot, "unk_token": eot,
                                             "add_prefix_space": False}, indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": eot, "eos_token": eot, "unk_token": eot}, indent=2),
        "generation_config.json": json.dumps({"bos_token_id": eot_id, "eos_token_id": eot_id,
                                              "pad_token_id": eot_id}, indent=2),
    }
    for name, text in files.items():
        atomic_write_bytes(out / name, [text.encode()])


def write_tiktoken_tokenizer(out: Path, ranks: dict[bytes, int], pat_str: str, specials: dict[str, int],
                             bos: str, eos: str, max_length: int) -> None:
    """A tiktoken-style byte-level BPE (Llama 3's: its split pattern, its special tokens) as the `tokenizer.json`
    transformers' fast tokenizer reads, with tokenizer_config.json, special_tokens_map.json and
    generation_config.json. `ignore_merges` keeps tiktoken's rule that a piece found whole in the vocabulary is
    one token."""
    vocab, merges = vocab_and_merges(ranks)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for t, i in sorted(specials.items(), key=lambda kv: kv[1])]
    bos_id, eos_id = specials[bos], specials[eos]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    files = {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                                             "eos_token": eos, "model_max_length": max_length,
                                             "clean_up_tokenization_spaces": False}, indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": bos, "eos_token": eos}, indent=2),
        "generation_config.json": json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id,
                                              "pad_token_id": eos_id}, indent=2),
    }
    for name, text in files.items():
        atomic_write_bytes(out / name, [text.encode()])
