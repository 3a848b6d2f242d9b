"""Token shards, llm.c's format: 256 little-endian int32 header, then the tokens.

    header[0] magic     20240520 (GPT-2 vocabulary, uint16 tokens)  | 20240801 (Llama 3, uint32 tokens)
    header[1] version   1                                           | 7
    header[2] number of tokens that follow (< 2**31); header[3:] zero

byte for byte what llm.c's ``dev/data/data_common.py write_datafile`` writes ("gpt-2" / "llama-3"),
so the magic/version pair also records which vocabulary the shard was tokenized with.

llmc's own version 2 of magic 20240520 holds uint16 ids of the tokenizer named in header[4:12] (ASCII,
NUL-padded to 32 bytes, as in llmc's eval files): "bytes", the byte-level vocabulary (256 bytes + end-of-text).
llm.c's readers refuse it (they know version 1 alone), which is right: its ids are not GPT-2's.
"""

from __future__ import annotations

import glob as _glob
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from llmc_cli.formats.files import DataError, atomic_write_bytes, check_replaceable, special_file

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1
NAMED_VERSION = 2  # magic 20240520's version whose header names its tokenizer
NAME_INTS = slice(4, 12)
NAME_BYTES = 32


@dataclass(frozen=True)
class _Format:
    tokenizer: str
    magic: int
    version: int
    dtype: np.dtype
    vocab_size: int  # the ids the tokenizer gives (specials included): a model needs at least this many rows


SHARD_FORMATS = {
    "gpt2": _Format("gpt2", 20240520, 1, np.dtype("<u2"), 50257),
    "llama3": _Format("llama3", 20240801, 7, np.dtype("<u4"), 128256),
    "bytes": _Format("bytes", 20240520, NAMED_VERSION, np.dtype("<u2"), 257),
}
SHARD_VOCAB = {f.tokenizer: f.vocab_size for f in SHARD_FORMATS.values()}
_BY_MAGIC = {(f.magic, f.version): f for f in SHARD_FORMATS.values() if f.version != NAMED_VERSION}
_NAMED = {f.tokenizer.encode(): f for f in SHARD_FORMATS.values() if f.version == NAMED_VERSION}
_KNOWN = ", ".join(f"magic {f.magic} version {f.version} ({f.tokenizer}, {f.dtype.itemsize * 8}-bit tokens)"
                   for f in SHARD_FORMATS.values())


def shard_format(tokenizer: str = "gpt2") -> _Format:
    """The on-disk format for shards of a tokenizer's ids ("gpt2", "bytes" -> uint16, "llama3" -> uint32)."""
    try:
        return SHARD_FORMATS[tokenizer]
    except KeyError:
        raise DataError(f"no shard format for tokenizer {tokenizer!r}; known: {', '.join(SHARD_FORMATS)}") from None


@dataclass(frozen=True)
class ShardInfo:
    path: str
    magic: int
    version: int
    num_tokens: int
    dtype: np.dtype
    tokenizer: str  # which vocabulary the format stands for ("gpt2", "llama3" or "bytes")

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_tokens * self.dtype.itemsize


def _shard_bytes(tokens, fmt: _Format, name: str) -> list:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and arr.dtype != fmt.dtype:
        if arr.dtype.kind not in "iu":
            raise DataError(f"{name}: tokens must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        limit = int(np.iinfo(fmt.dtype).max) + 1
        if lo < 0 or hi >= limit:
            bad = hi if hi >= limit else lo
            raise DataError(f"{name}: token id {bad} does not fit the {fmt.tokenizer} shard format "
                            f"({fmt.dtype.itemsize * 8}-bit tokens, ids 0..{limit - 1})")
    if arr.size > MAX_TOKENS:
        raise DataError(f"{name}: {arr.size:,} tokens is too many for one shard (max {MAX_TOKENS:,})")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = fmt.magic, fmt.version, arr.size
    if fmt.version == NAMED_VERSION:
        header[NAME_INTS] = np.frombuffer(fmt.tokenizer.encode("ascii").ljust(NAME_BYTES, b"\0"), dtype="<i4")
    return [header.tobytes(), np.ascontiguousarray(arr, dtype=fmt.dtype).tobytes()]


def write_shard(path: str | os.PathLike, tokens, tokenizer: str = "gpt2") -> Path:
    """Write one shard atomically. ``tokens``: a sequence / array of ids. Returns the path."""
    path = Path(path)
    check_replaceable(path, [f.magic for f in SHARD_FORMATS.values()], "token shard")
    atomic_write_bytes(path, _shard_bytes(tokens, shard_format(tokenizer), str(path)))
    return path


# ----------------------------------------------------------------------------------------------
# reading


def read_shard_header(path: str | os.PathLike) -> ShardInfo:
    """Read and validate a shard's header against its size; raises :class:`DataError`."""
    path = str(path)
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(st.st_mode):  # opening a FIFO waits for a writer forever; a device never ends
            raise DataError(f"data shard {path} is {special_file(path)}, expected a .bin file")
        size = st.st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"data shard {path} not found") from None
    except IsADirectoryError:
        raise DataError(f"data shard {path} is a directory, expected a .bin file") from None
    except OSError as e:  # no permission, an I/O error: the shard's name, not a traceback
        raise DataError(f"data shard {path}: cannot read it ({e.strerror or e})") from None
    if len(raw) < 12:
        raise DataError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4", count=len(raw) // 4)
    magic, version, ntok = int(header[0]), int(header[1]), int(header[2])
    if magic not in {f.magic for f in SHARD_FORMATS.values()}:
        hint = " (this is an llm.c tokenizer file)" if magic == 20240328 else (
            " (this is an llm.c eval file, e.g. HellaSwag)" if magic == 20240522 else (
                " (this is an llm.c model checkpoint)" if magic == 20240326 else ""))
        raise DataError(f"{path}: bad magic {magic}, expected a token shard ({_KNOWN}){hint}")
    named = (magic, version) == (20240520, NAMED_VERSION)
    if not named and (magic, version) not in _BY_MAGIC:
        raise DataError(f"{path}: unsupported shard version {version} for magic {magic}; "
                        f"this llmc reads {_KNOWN}")
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    fmt = _named_format(path, header) if named else _BY_MAGIC[(magic, version)]
    if ntok < 0:
        raise DataError(f"{path}: corrupt header, negative token count {ntok}")
    expected = HEADER_BYTES + ntok * fmt.dtype.itemsize
    if size < expected:
        raise DataError(f"{path}: truncated shard, header says {ntok:,} tokens ({expected:,} bytes) "
                        f"but the file has {size:,} bytes")
    if size > expected:
        raise DataError(f"{path}: header says {ntok:,} tokens ({expected:,} bytes) but the file has "
                        f"{size:,} bytes ({size - expected:,} extra)")
    return ShardInfo(path, magic, version, ntok, fmt.dtype, fmt.tokenizer)


def _named_format(path: str, header: np.ndarray) -> _Format:
    """The format a version 2 header names in header[4:12]."""
    name = header[NAME_INTS].tobytes().rstrip(b"\0")
    fmt = _NAMED.get(name)
    if fmt is None:
        shown = name.decode("ascii", "backslashreplace")
        raise DataError(f"{path}: shard version {NAMED_VERSION} names tokenizer {shown!r}, expected one of "
                        f"{', '.join(f.decode() for f in _NAMED)} (corrupt?)")
    return fmt


def data_vocab_size(data) -> int | None:
    """The vocabulary a model trained on `data` takes when none is given: byte-level shards' 257 (a preset's own,
    GPT-2's 50,257 rows, would leave 99.5% of the embedding unused); None for other shards, whose model keeps its
    preset's vocabulary, and for data that does not resolve (the loader names what is wrong with it)."""
    try:
        first = resolve_shards(data, "train" if isinstance(data, (str, os.PathLike)) and os.path.isdir(data)
                               else None)[0]
        tokenizer = read_shard_header(first).tokenizer
    except (DataError, TypeError, ValueError):
        return None
    return SHARD_VOCAB[tokenizer] if tokenizer == "bytes" else None


def read_shard(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """The tokens of a shard (validated header) as a read-only memory map (or an in-memory copy)."""
    info = read_shard_header(path)
    if info.num_tokens == 0:
        return np.zeros(0, dtype=info.dtype)
    arr = np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,))
    return arr if mmap else np.array(arr)


_GLOB_CHARS = set("*?[")


SPLITS = ("train", "val")


def split_of(path: str | os.PathLike) -> str | None:
    """"train" or "val" by llm.c's shard naming (NAME_train_000001.bin, NAME_val_000000.bin), else None."""
    words = re.split(r"[_.\-]", Path(path).stem.lower())
    found = [s for s in SPLITS if s in words]
    return found[0] if len(found) == 1 else None


def resolve_shards(pattern: str | os.PathLike | Sequence[str | os.PathLike], split: str | None = None) -> list[str]:
    """Glob pattern (or list of patterns / paths) -> sorted, de-duplicated shard paths. A directory gives its
    `split` shards ("train" or "val", by llm.c's naming; None: every .bin in it), never the other split's."""
    pats = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    if not pats:
        raise DataError("no data shards given")
    files: list[str] = []
    for p in pats:
        p = os.fspath(p)
        if os.path.isdir(p):  # (an existing path is itself, '[' or '*' in its name included; else a pattern)
            hits = sorted(_glob.glob(os.path.join(_glob.escape(p), "*.bin")))
            if not hits:
                raise DataError(f"no .bin shards in directory {p}")
            if split is not None:
                mine = [h for h in hits if split_of(h) == split]
                if not mine:
                    names = ", ".join(Path(h).name for h in hits[:4]) + (", ..." if len(hits) > 4 else "")
                    raise DataError(f"{p}: no {split} shards (llm.c names them NAME_{split}_NNNNNN.bin; the "
                                    f"directory holds {names}); give a glob such as '{p}/*.bin' to use them all")
                hits = mine
            files += hits
        elif os.path.exists(p):  # (a FIFO or device too: read_shard_header says what it is)
            files.append(p)
        elif _GLOB_CHARS & set(p):
            # (folders are passed over; anything else the pattern names is a shard: a FIFO, a device or a dangling
            # link among them is refused when read, as in a directory, rather than left out of the data unsaid)
            hits = sorted(h for h in _glob.glob(p) if not os.path.isdir(h))
            if not hits:
                raise DataError(f"no data shards match the pattern {p!r}")
            files += hits
        else:
            raise DataError(f"data shard {p} not found")
    seen: set[str] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def has_split(directory: str | os.PathLike, split: str) -> bool:
    """Whether `directory` holds shards of `split` by llm.c's naming."""
    return os.path.isdir(directory) and any(split_of(h) == split
                                            for h in _glob.glob(os.path.join(_glob.escape(os.fspath(directory)),
                                                                             "*.bin")))


def tokenize_manifests(shards: Sequence[str | os.PathLike]) -> list[Path]:
    """The tokenize manifests (`*_manifest.json`) in the folders of `shards`, each folder once, sorted."""
    folders = dict.fromkeys(Path(s).parent for s in shards)
    return [m for folder in folders for m in sorted(folder.glob("*_manifest.json"))]


def check_tokenize_complete(shards: Sequence[str | os.PathLike]) -> None:
    """Shards beside a tokenize manifest (`*_manifest.json`) that says its run did not finish are refused: the
    corpus is cut short (the tokenize run was stopped or failed), and `llmc tokenize` run again completes it."""
    for m in tokenize_manifests(shards):
        try:
            complete = json.loads(m.read_bytes()).get("complete", True)
        except (OSError, ValueError, AttributeError):
            continue  # (not a tokenize manifest this reads: its shards speak for themselves)
        if complete is False:
            raise DataError(f"{m}: its tokenize run did not finish, so the shards beside it are incomplete; "
                            "run the same `llmc tokenize` again to complete them")
