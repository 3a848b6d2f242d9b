"""Tokenizers: GPT-2 BPE (and Llama 3) through tiktoken, built offline; llm.c's tokenizer .bin.

Nothing here touches the network. The GPT-2 ranks file comes from the installed ``openai-whisper``
distribution (``whisper/assets/gpt2.tiktoken``, the same merges tiktoken's own ``gpt2`` encoding
downloads); it is located on disk without importing ``whisper`` (whose ``__init__`` imports torch).

    tok = load_tokenizer("gpt2")            # or load_tokenizer("gpt2", "path/to/gpt2.tiktoken")
    tok.encode("Hello world")               # [15496, 995]
    tok.decode([15496, 995])                # 'Hello world'
    write_tokenizer_bin(tok, "gpt2_tokenizer.bin")   # llm.c's decoder file (magic 20240328, v2)

A Llama 3 tokenizer (tiktoken-format ``tokenizer.model`` from Meta, 128,000 ranks + 256 specials) is
``load_tokenizer("llama3", path)``; it needs a path because the ranks are not shipped in any package.
``load_tokenizer("bytes")`` is the byte-level one (ids 0..255 are UTF-8 bytes, 256 is end-of-text).
New tokenizers register a builder in ``TOKENIZERS``.
"""
from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import struct
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from llmc_cli.data.home import install_hint, packages_dir
from llmc_cli.formats.files import (DataError, atomic_write_bytes, check_replaceable, read_at_most,
                                    special_file)
from llmc_cli.formats.hf_tokenizer import bytes_to_unicode
from llmc_cli.naming import arg

__all__ = [
    "Tokenizer", "ByteTokenizer", "TokenTable", "TokenizerError", "TOKENIZERS", "load_tokenizer", "gpt2_ranks_path",
    "write_tokenizer_bin", "read_tokenizer_bin", "ranks_file_bytes", "TOKENIZER_MAGIC", "TOKENIZER_VERSION",
]

TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
HEADER_INTS = 256

# GPT-2's split pattern, as in the original release; tiktoken's gpt2 encoding uses an equivalent,
# faster spelling (tiktoken_ext.openai_public.r50k_pat_str), preferred when importable.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _gpt2_pat() -> str:
    try:
        from tiktoken_ext.openai_public import r50k_pat_str  # (tiktoken's own spelling, where installed)
        return r50k_pat_str
    except Exception:  # pragma: no cover - older / trimmed tiktoken
        return GPT2_PAT_STR
GPT2_EOT = "<|endoftext|>"

LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
# the specials at the same ids in every Llama 3.x tokenizer.json (3.1 renamed some reserved ones): llmc's bos and eos
# (required), and the chat headers and <|eot_id|> (checked where present)
LLAMA3_FIXED_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>")


class TokenizerError(DataError):
    """A tokenizer file is missing, unreadable or not in the expected format."""


# tiktoken's split pattern backtracks through a run of whitespace (`\s+(?!\S)`) one stack frame a character: a run
# of about a million (blank lines, padding) panics in Rust with a stack overflow. Runs longer than this are cut
# into pieces of this length, each encoded alone: the ids still decode to the text, and text without such a run
# (every real document) is encoded exactly as tiktoken would.
WHITESPACE_RUN_MAX = 1 << 17
_LONG_WHITESPACE = re.compile(r"(?<!\s)\s{%d,}" % WHITESPACE_RUN_MAX)  # (linear: a run is scanned from its start)


def _pieces(text: str) -> list[str]:
    """`text`, cut inside every whitespace run longer than WHITESPACE_RUN_MAX (see there)."""
    if len(text) <= WHITESPACE_RUN_MAX:
        return [text]
    cuts = [j for m in _LONG_WHITESPACE.finditer(text)
            for j in range(m.start() + WHITESPACE_RUN_MAX, m.end(), WHITESPACE_RUN_MAX)]
    if not cuts:
        return [text]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# ----------------------------------------------------------------------------------------------
# the encoder


class Tokenizer:
    """A BPE tokenizer (tiktoken underneath) with the small interface the engine uses.

    Attributes: ``name`` ("gpt2", "llama3"), ``vocab_size`` (number of token ids, specials included;
    50257 for GPT-2), ``eot`` (end-of-text id), ``doc_prefix`` (ids put before every document in a
    shard: GPT-2 ``[eot]`` like llm.c, Llama 3 ``[<|begin_of_text|>]``), ``path`` (the ranks file).
    """

    def __init__(self, name: str, encoding, eot: int, doc_prefix: Sequence[int], path: str | None):
        self.name = name
        self.enc = encoding
        self.eot = int(eot)
        self.doc_prefix = [int(t) for t in doc_prefix]
        self.path = path
        self.vocab_size = int(encoding.n_vocab)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eot={self.eot})"

    @functools.cached_property
    def vocabulary_sha256(self) -> str:
        """A digest of every id's bytes: two ranks files of one size that give a token different ids (a resume of
        shards under another tokenizer.model) differ here, where name and vocab_size agree."""
        h = hashlib.sha256()
        for i in range(self.vocab_size):
            b = self.enc.decode_single_token_bytes(i)
            h.update(len(b).to_bytes(4, "little") + b)
        return h.hexdigest()

    def __getstate__(self):  # picklable for worker processes: rebuilt from (name, path)
        return {"name": self.name, "path": self.path}

    def __setstate__(self, state):
        other = load_tokenizer(state["name"], state["path"])
        self.__dict__.update(other.__dict__)

    # -- encoding
    def encode(self, text: str, allowed_special="all") -> list[int]:
        """Text -> ids (prompts). Special-token text such as ``<|endoftext|>`` becomes its id; restrict
        that with ``allowed_special`` (a set of specials, as in tiktoken). Documents for shards use
        :meth:`encode_ordinary`, where special-token text is just text."""
        return [i for piece in _pieces(text)
                for i in self.enc.encode(piece, allowed_special=allowed_special, disallowed_special=())]

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, special-token text encoded as plain text (what documents in shards use)."""
        return [i for piece in _pieces(text) for i in self.enc.encode_ordinary(piece)]

    def encode_ordinary_array(self, text: str) -> np.ndarray:
        """encode_ordinary's ids as a uint32 array: 4 bytes a token where a list of Python ints takes over 30 (one
        62 MB text file, 19.4M tokens: a peak of 974 MB tokenized to a list, 341 MB to an array)."""
        to_numpy = getattr(self.enc, "encode_to_numpy", None)  # (tiktoken 0.8 and later)
        if to_numpy is None:
            return np.asarray(self.encode_ordinary(text), dtype=np.uint32)
        parts = [to_numpy(piece, allowed_special=set(), disallowed_special=())  # (no special: all of it is text)
                 for piece in _pieces(text)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts).astype(np.uint32, copy=False)

    def encode_document(self, text: str) -> list[int]:
        """A document as it goes into a shard: ``doc_prefix`` then its ordinary encoding."""
        return self.doc_prefix + self.encode_ordinary(text)

    # -- decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def token_bytes(self, i: int) -> bytes:
        return self.enc.decode_single_token_bytes(int(i))


class ByteTokenizer:
    """The byte-level tokenizer: a text's UTF-8 bytes are its ids (0..255), end-of-text is 256. No ranks file, no
    merges: a vocabulary of 257 keeps a small model's embedding and classifier small, where GPT-2's 50,257 rows
    would be most of its parameters. Documents start with end-of-text, as GPT-2's do in llm.c's shards."""

    name = "bytes"
    vocab_size = 257
    eot = 256
    path = None
    EOT_TEXT = GPT2_EOT

    def __init__(self):
        self.doc_prefix = [self.eot]

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eot={self.eot})"

    @functools.cached_property
    def vocabulary_sha256(self) -> str:
        h = hashlib.sha256()
        for i in range(self.vocab_size):
            b = self.token_bytes(i)
            h.update(len(b).to_bytes(4, "little") + b)
        return h.hexdigest()

    def encode(self, text: str, allowed_special="all") -> list[int]:
        """Text -> ids (prompts): ``<|endoftext|>`` becomes 256 unless ``allowed_special`` leaves it out."""
        if allowed_special != "all" and self.EOT_TEXT not in allowed_special:
            return self.encode_ordinary(text)
        out: list[int] = []
        for k, part in enumerate(text.split(self.EOT_TEXT)):
            out += ([self.eot] if k else []) + self.encode_ordinary(part)
        return out

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_ordinary_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def encode_document(self, text: str) -> list[int]:
        return self.doc_prefix + self.encode_ordinary(text)

    def token_bytes(self, i: int) -> bytes:
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise TokenizerError(f"token id {i} out of range for a vocabulary of {self.vocab_size}")
        return self.EOT_TEXT.encode() if i == self.eot else bytes((i,))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)


class TokenTable:
    """Decode-only tokenizer read from llm.c's tokenizer .bin (what ``llmc sample`` needs)."""

    def __init__(self, tokens: list[bytes], eot: int, path: str | None = None, name: str = "bin"):
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.eot = int(eot)
        self.path = path
        self.name = name

    def __repr__(self) -> str:
        return f"TokenTable(vocab_size={self.vocab_size}, eot={self.eot}, path={self.path!r})"

    def token_bytes(self, i: int) -> bytes:
        return self.tokens[int(i)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} out of range for a vocabulary of {self.vocab_size}")
            out.append(self.tokens[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        return self.decode_bytes(ids).decode("utf-8", errors=errors)


# ----------------------------------------------------------------------------------------------
# builders


def gpt2_ranks_path() -> Path:
    """Path of ``whisper/assets/gpt2.tiktoken`` in openai-whisper (llmc's data home, or installed), without
    importing it."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("whisper")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "assets" / "gpt2.tiktoken" for p in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files("openai-whisper") or []:
            if str(f).replace("\\", "/").endswith("whisper/assets/gpt2.tiktoken"):
                candidates.append(Path(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    ours = packages_dir() / "whisper" / "assets" / "gpt2.tiktoken"  # where install.sh puts it (needs a home)
    if ours.is_file():
        return ours
    raise TokenizerError(
        "GPT-2 ranks file whisper/assets/gpt2.tiktoken not found: install it with "
        f"`{install_hint('openai-whisper==20250625')}` (or pass the path of a gpt2.tiktoken file)")


# the sha256 of GPT-2's ranks file (openai-whisper's assets/gpt2.tiktoken, tiktoken's gpt2 merges): a damaged
# or altered file would tokenize differently without any other sign
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


TOKENIZER_FILE_MAX_BYTES = 64 * 2**20  # Llama 3's tokenizer.model is 2.2 MB, its tokenizer.json 9 MB, GPT-2's 1.6 MB


def _read_capped(p: Path, what: str) -> bytes:
    """The whole of a tokenizer file, which is megabytes: a FIFO (waits forever), a device (/dev/zero never ends) or a
    file over TOKENIZER_FILE_MAX_BYTES (a stray or sparse huge file) is a TokenizerError naming it, before any of it is
    held in memory. OSError where it cannot be read."""
    if kind := special_file(p):
        raise TokenizerError(f"{p}: is {kind}, not {what}")
    raw = read_at_most(p, TOKENIZER_FILE_MAX_BYTES)
    if raw is None:
        raise TokenizerError(f"{p}: larger than {TOKENIZER_FILE_MAX_BYTES // 2**20} MiB, not {what} (those are a "
                             f"few MB)")
    return raw


def _load_ranks(path: str | os.PathLike, what: str, sha256: str | None = None) -> dict[bytes, int]:
    """A tiktoken ranks file ('base64-token rank' per line), read here and checked line by line: never
    through tiktoken's loader, whose cache is shared and keyed by the file's path rather than its content."""
    p = Path(path)
    try:
        raw = _read_capped(p, f"a {what} ranks file")
    except FileNotFoundError:
        raise TokenizerError(f"{what} ranks file {p} not found") from None
    except OSError as e:
        raise TokenizerError(f"{p}: cannot read the {what} ranks file ({e.strerror or e})") from None
    if p.suffix == ".json":  # a Hugging Face tokenizer.json: the byte-level BPE vocabulary, ids as ranks
        return _ranks_from_tokenizer_json(p, raw, what)
    if sha256 is not None and (found := hashlib.sha256(raw).hexdigest()) != sha256:
        raise TokenizerError(f"{p}: not the {what} ranks file (sha256 {found}, expected {sha256}); reinstall it "
                             "(`pip install --no-deps --force-reinstall openai-whisper`)")
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{p}:{n}: expected 'base64-token rank', got {line[:60]!r} (not a tiktoken "
                                 f"ranks file)") from None
        if tok in ranks:
            raise TokenizerError(f"{p}:{n}: token {tok!r} appears twice")
        ranks[tok] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{p}: the ranks are not 0..{len(ranks) - 1} each once (not a tiktoken ranks file)")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise TokenizerError(f"{p}: {len(ranks)} ranks without all 256 single bytes (not a byte-level BPE ranks file)")
    return ranks


def _ranks_from_tokenizer_json(p: Path, raw: bytes, what: str) -> dict[bytes, int]:
    """The ranks a byte-level BPE tokenizer.json holds (Hugging Face's Llama 3 directories): its model's vocabulary,
    each token's printable characters mapped back to bytes, the id as the rank (tiktoken's convention); the added
    special tokens are not ranks. Everything llmc does not read but the file states is checked against what llmc
    builds instead (the merges, the special tokens' ids, the split pattern), so a file that tokenizes otherwise in
    transformers is refused rather than read differently."""
    try:
        doc = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise TokenizerError(f"{p}: not JSON ({type(e).__name__}: {e}); expected a Hugging Face "
                             f"tokenizer.json") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        raise TokenizerError(f"{p}: no 'model' object; expected a Hugging Face tokenizer.json")
    if model.get("type") != "BPE":
        raise TokenizerError(f"{p}: model type {model.get('type')!r}, expected 'BPE' (a byte-level BPE tokenizer.json)")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise TokenizerError(f"{p}: model.vocab is {type(vocab).__name__}, expected an object of token: id")
    ranks = _json_vocab_ranks(p, vocab, what)
    _check_json_merges(p, model.get("merges"), vocab)
    _check_json_specials(p, doc.get("added_tokens"), vocab, len(ranks), what)
    patterns = _split_patterns(doc.get("pre_tokenizer"))
    if patterns != [LLAMA3_PAT_STR]:
        raise TokenizerError(f"{p}: pre_tokenizer splits with {patterns or 'no regex'}, expected {what}'s split "
                             f"pattern alone (llmc tokenizes with it)")
    return ranks


def _json_vocab_ranks(p: Path, vocab: dict, what: str) -> dict[bytes, int]:
    """model.vocab's tokens as bytes -> id: byte-level BPE ranks 0..n-1 holding every single byte."""
    decode = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for tok, i in vocab.items():
        if type(i) is not int:
            raise TokenizerError(f"{p}: model.vocab[{tok!r}] is {i!r}, expected an integer id")
        bad = next((c for c in tok if c not in decode), None) if tok else ""
        if bad is not None:
            raise TokenizerError(f"{p}: model.vocab token {tok!r} is not byte-level BPE (expected 1 or more of the "
                                 f"256 byte characters{f', found {bad!r}' if bad else ''})")
        ranks[bytes(decode[c] for c in tok)] = i
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)) or any(bytes([b]) not in ranks for b in range(256)):
        raise TokenizerError(f"{p}: the {what} vocabulary is not byte-level BPE ranks 0..{n - 1}")
    return ranks


def _check_json_merges(p: Path, merges, vocab: dict) -> None:
    if not isinstance(merges, list):
        raise TokenizerError(f"{p}: model.merges is {type(merges).__name__}, expected a list of merges")
    for k, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise TokenizerError(f"{p}: model.merges[{k}] is {m!r}, expected 'a b' or [\"a\", \"b\"]")
        if not all(s in vocab for s in (*pair, pair[0] + pair[1])):
            raise TokenizerError(f"{p}: model.merges[{k}] {m!r} names a token not in model.vocab")


def _check_json_specials(p: Path, added, vocab: dict, n: int, what: str) -> None:
    """added_tokens: Llama 3's specials, after the n ranks, the fixed ones at their ids."""
    if not isinstance(added, list) or not all(isinstance(a, dict) and isinstance(a.get("content"), str)
                                              and type(a.get("id")) is int for a in added):
        raise TokenizerError(f"{p}: added_tokens is not a list of {{\"id\": int, \"content\": str}}, expected "
                             f"{what}'s special tokens")
    ids = {a["content"]: a["id"] for a in added}
    for a in added:
        if a["content"] in vocab or not n <= a["id"] < n + len(LLAMA3_SPECIALS):
            raise TokenizerError(f"{p}: added token {a['content']!r} has id {a['id']}, expected one of "
                                 f"{n}..{n + len(LLAMA3_SPECIALS) - 1} after the vocabulary (and not in model.vocab)")
    for tok in LLAMA3_FIXED_SPECIALS:
        want = n + LLAMA3_SPECIALS.index(tok)
        if ids.get(tok, None if tok in LLAMA3_SPECIALS[:2] else want) != want:
            found = "is missing" if tok not in ids else f"has id {ids[tok]}"
            raise TokenizerError(f"{p}: added token {tok} {found}, expected id {want} "
                                 f"({what}'s special tokens follow the vocabulary's {n} ranks)")


def _split_patterns(pre) -> list[str]:
    """The regexes a tokenizer.json's pre_tokenizer splits with (Split, Sequence of them; ByteLevel with use_regex
    splits with GPT-2's)."""
    if isinstance(pre, list):
        return [r for x in pre for r in _split_patterns(x)]
    if not isinstance(pre, dict):
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        return _split_patterns(pre.get("pretokenizers"))
    if kind == "Split":
        pat = pre.get("pattern")
        return [str(pat.get("Regex", pat.get("String"))) if isinstance(pat, dict) else repr(pat)]
    if kind == "ByteLevel" and pre.get("use_regex", True):
        return [GPT2_PAT_STR]
    if kind is not None and kind != "ByteLevel":
        return [f"<{kind}>"]
    return []


def llama3_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Llama 3's BPE ranks from Meta's tiktoken-format tokenizer.model (token bytes -> rank = id)."""
    return _load_ranks(path, "Llama 3")


def ranks_file_bytes(path: str | os.PathLike) -> bytes:
    """What a copy of the Llama 3 tokenizer at `path` holds under the name tokenizer.model (Meta's tiktoken format,
    which every reader of that name expects): the file itself, or the ranks of a Hugging Face tokenizer.json written
    out in that format (never its JSON under the other name). OSError where the file cannot be read."""
    p = Path(path)
    if p.suffix != ".json":
        return _read_capped(p, "a Llama 3 ranks file")
    ranks = llama3_ranks(p)
    return "".join(f"{base64.b64encode(t).decode()} {r}\n"
                   for t, r in sorted(ranks.items(), key=lambda kv: kv[1])).encode()


def gpt2_ranks(path: str | os.PathLike | None = None) -> dict[bytes, int]:
    """GPT-2's BPE ranks (token bytes -> rank = id), checked against their known sha256."""
    return _load_ranks(Path(path) if path else gpt2_ranks_path(), "GPT-2", GPT2_RANKS_SHA256)


def _build_gpt2(path: str | None) -> Tokenizer:
    import tiktoken  # (its Rust extension loads only where a BPE tokenizer is built: bytes needs none)

    p = Path(path) if path else gpt2_ranks_path()
    ranks = _load_ranks(p, "GPT-2", GPT2_RANKS_SHA256)
    if len(ranks) != 50256:
        raise TokenizerError(f"{p}: expected 50,256 GPT-2 BPE ranks, found {len(ranks):,}")
    enc = tiktoken.Encoding(name="gpt2", pat_str=_gpt2_pat(), mergeable_ranks=ranks,
                            special_tokens={GPT2_EOT: 50256}, explicit_n_vocab=50257)
    return Tokenizer("gpt2", enc, eot=50256, doc_prefix=[50256], path=str(p))


def _build_llama3(path: str | None) -> Tokenizer:
    import tiktoken  # (as in _build_gpt2)

    if not path:
        raise TokenizerError(
            "the llama3 tokenizer needs its tiktoken-format ranks file (Meta's tokenizer.model): "
            f"pass {arg('tokenizer_path')} PATH")
    ranks = _load_ranks(path, "Llama 3")
    n = len(ranks)
    specials = {tok: n + i for i, tok in enumerate(LLAMA3_SPECIALS)}
    enc = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PAT_STR, mergeable_ranks=ranks,
                            special_tokens=specials)
    return Tokenizer("llama3", enc, eot=specials["<|end_of_text|>"],
                     doc_prefix=[specials["<|begin_of_text|>"]], path=str(path))


def _build_bytes(path: str | None) -> ByteTokenizer:
    if path:
        raise TokenizerError(f"the bytes tokenizer has no ranks file; leave out {arg('tokenizer_path')} ({path})")
    return ByteTokenizer()


TOKENIZERS: dict[str, Callable[[str | None], Tokenizer | ByteTokenizer]] = {
    "gpt2": _build_gpt2,
    "llama3": _build_llama3,
    "bytes": _build_bytes,
}
_CACHE: dict[tuple[str, str | None], Tokenizer] = {}


def load_tokenizer(name: str = "gpt2", path: str | os.PathLike | None = None) -> Tokenizer:
    """Build (once per process) the tokenizer ``name`` from its ranks file (``path`` or the default)."""
    key = (name, str(path) if path else None)
    if key not in _CACHE:
        if name not in TOKENIZERS:
            raise TokenizerError(f"unknown tokenizer {name!r}; known: {', '.join(sorted(TOKENIZERS))}")
        _CACHE[key] = TOKENIZERS[name](key[1])
    return _CACHE[key]


# ----------------------------------------------------------------------------------------------
# llm.c tokenizer .bin: 256 int32 header (magic 20240328, version 2, vocab_size, eot), then per token
# one uint8 length and that many bytes (llm.c's train_gpt2.py write_tokenizer / llmc/tokenizer.h)


def write_tokenizer_bin(tok, path: str | os.PathLike) -> Path:
    """Write llm.c's tokenizer file for ``tok`` (anything with vocab_size, eot, token_bytes)."""
    path = Path(path)
    check_replaceable(path, [TOKENIZER_MAGIC], "tokenizer file")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[3] = TOKENIZER_MAGIC, TOKENIZER_VERSION, tok.vocab_size, tok.eot
    parts = [header.tobytes()]
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if not 0 < len(b) < 256:
            raise TokenizerError(f"token {i} is {len(b)} bytes long; llm.c's format holds 1..255")
        parts.append(struct.pack("<B", len(b)))
        parts.append(b)
    atomic_write_bytes(path, b"".join(parts), through_links=True)  # (checked a tokenizer file above)
    return path


def read_tokenizer_bin(path: str | os.PathLike) -> TokenTable:
    """Read llm.c's tokenizer file (versions 1 and 2) into a decode-only :class:`TokenTable`."""
    path = Path(path)
    try:
        data = _read_capped(path, "an llm.c tokenizer file")
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} not found") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read the tokenizer file ({e.strerror or e})") from None
    if len(data) < HEADER_INTS * 4:
        raise TokenizerError(f"{path}: truncated tokenizer file ({len(data)} bytes, header alone is 1024)")
    header = np.frombuffer(data, dtype="<i4", count=HEADER_INTS)
    if header[0] != TOKENIZER_MAGIC:
        raise TokenizerError(f"{path}: bad magic {int(header[0])}, expected {TOKENIZER_MAGIC} "
                             "(an llm.c tokenizer .bin)")
    version, n = int(header[1]), int(header[2])
    if version == 1:
        eot = 50256  # version 1 predates the eot field; llm.c assumes GPT-2
    elif version == 2:
        eot = int(header[3])
    else:
        raise TokenizerError(f"{path}: unsupported tokenizer version {version} (expected 1 or 2)")
    tokens: list[bytes] = []
    off = HEADER_INTS * 4
    for i in range(n):
        if off >= len(data):
            raise TokenizerError(f"{path}: truncated after {i} of {n} tokens")
        ln = data[off]
        if ln == 0 or off + 1 + ln > len(data):
            raise TokenizerError(f"{path}: token {i} has bad length {ln} or is cut off")
        tokens.append(data[off + 1: off + 1 + ln])
        off += 1 + ln
    if off != len(data):
        raise TokenizerError(f"{path}: {len(data) - off} trailing bytes after {n} tokens")
    return TokenTable(tokens, eot, str(path))
