"""Token shards (llm.c's format) and the training / validation data loaders.

Shard file = 256 little-endian int32 header, then the tokens:

    header[0] magic     20240520 (GPT-2 vocabulary, uint16 tokens)  | 20240801 (Llama 3, uint32 tokens)
    header[1] version   1                                           | 7
    header[2] number of tokens that follow (< 2**31); header[3:] zero

byte for byte what llm.c's ``dev/data/data_common.py write_datafile`` writes ("gpt-2" / "llama-3"),
so the magic/version pair also records which vocabulary the shard was tokenized with.

``DataLoader`` follows llm.c's ``llmc/dataloader.h``: the sorted glob of shards, every batch is
``B*T+1`` contiguous tokens (inputs = first B*T, targets = the same shifted by one), rank r of W reads
the r-th ``B*T`` slice of each ``W*B*T`` window, a shard serves ``(ntok-1) // (W*B*T)`` samples and then
the loader moves to the next shard, wrapping around (epoch += 1) after the last. With ``shuffle`` the
shard order and the sample order inside each shard are permuted per epoch, from the seed only (every
rank draws the same permutation, so ranks keep reading disjoint slices of the same windows).
``state()`` / ``load_state()`` save and restore the exact position.
"""
from __future__ import annotations

import glob as _glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

__all__ = [
    "DataError", "ShardInfo", "SHARD_FORMATS", "HEADER_INTS", "HEADER_BYTES", "shard_format",
    "write_shard", "read_shard_header", "read_shard", "atomic_write_bytes", "fsync_dir", "resolve_shards",
    "DataLoader", "ValLoader", "EVAL_MAGIC", "write_evalfile", "read_evalfile",
]

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1


class DataError(ValueError):
    """Bad or missing data (shards, tokenizer files, source corpora). The message is one line and
    names the file and what was expected."""


@dataclass(frozen=True)
class _Format:
    tokenizer: str
    magic: int
    version: int
    dtype: np.dtype


SHARD_FORMATS = {
    "gpt2": _Format("gpt2", 20240520, 1, np.dtype("<u2")),
    "llama3": _Format("llama3", 20240801, 7, np.dtype("<u4")),
}
_BY_MAGIC = {(f.magic, f.version): f for f in SHARD_FORMATS.values()}
_KNOWN = ", ".join(f"magic {f.magic} version {f.version} ({f.tokenizer}, {f.dtype.itemsize * 8}-bit tokens)"
                   for f in SHARD_FORMATS.values())


def shard_format(tokenizer: str = "gpt2") -> _Format:
    """The on-disk format for shards of a tokenizer's ids ("gpt2" -> uint16, "llama3" -> uint32)."""
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
    tokenizer: str  # which vocabulary the format stands for ("gpt2" or "llama3")

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_tokens * self.dtype.itemsize


# ----------------------------------------------------------------------------------------------
# writing


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Sequence[bytes]) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory, fsync, os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:  # never created (on a read-only file system unlink says so rather than ENOENT)
            pass
        if isinstance(e, OSError) and e.errno is not None:  # name the file being written, not its temporary name
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def replace_dir(tmp: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put the finished directory `tmp` in `dst`'s place: a `dst` already there is moved aside first and dropped
    only after the new one stands, so at every moment one complete version exists under `dst` or beside it."""
    tmp, dst = Path(tmp), Path(dst)
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def check_replaceable(path: str | os.PathLike, magics: Sequence[int], what: str) -> None:
    """llmc writes over a file only when it is one of its own kind (its int32 magic number is one of `magics`);
    anything else at `path` is the user's and is refused before a byte is written."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    try:
        head = np.fromfile(path, dtype="<i4", count=1) if path.is_file() else np.zeros(0, "<i4")
    except OSError:
        head = np.zeros(0, "<i4")
    if head.size < 1 or int(head[0]) not in magics:
        raise DataError(f"{path}: exists and is not an llm.c {what}, so llmc will not replace it; move it or "
                        "choose another path")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so the names created or renamed in it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"data shard {path} not found") from None
    except IsADirectoryError:
        raise DataError(f"data shard {path} is a directory, expected a .bin file") from None
    if len(raw) < 12:
        raise DataError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4", count=len(raw) // 4)
    magic, version, ntok = int(header[0]), int(header[1]), int(header[2])
    if magic not in {f.magic for f in SHARD_FORMATS.values()}:
        hint = " (this is an llm.c tokenizer file)" if magic == 20240328 else (
            " (this is an llm.c eval file, e.g. HellaSwag)" if magic == 20240522 else (
                " (this is an llm.c model checkpoint)" if magic == 20240326 else ""))
        raise DataError(f"{path}: bad magic {magic}, expected a token shard ({_KNOWN}){hint}")
    fmt = _BY_MAGIC.get((magic, version))
    if fmt is None:
        raise DataError(f"{path}: unsupported shard version {version} for magic {magic}; "
                        f"this llmc reads {_KNOWN}")
    if len(raw) < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
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


def read_shard(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """The tokens of a shard (validated header) as a read-only memory map (or an in-memory copy)."""
    info = read_shard_header(path)
    if info.num_tokens == 0:
        return np.zeros(0, dtype=info.dtype)
    arr = np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,))
    return arr if mmap else np.array(arr)


_GLOB_CHARS = set("*?[")


def resolve_shards(pattern: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Glob pattern (or list of patterns / paths) -> sorted, de-duplicated shard paths."""
    pats = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    if not pats:
        raise DataError("no data shards given")
    files: list[str] = []
    for p in pats:
        p = os.fspath(p)
        if _GLOB_CHARS & set(p):
            hits = sorted(h for h in _glob.glob(p) if os.path.isfile(h))
            if not hits:
                raise DataError(f"no data shards match the pattern {p!r}")
            files += hits
        elif os.path.isdir(p):
            hits = sorted(_glob.glob(os.path.join(p, "*.bin")))
            if not hits:
                raise DataError(f"no .bin shards in directory {p}")
            files += hits
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise DataError(f"data shard {p} not found")
    seen: set[str] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


# ----------------------------------------------------------------------------------------------
# loaders


class DataLoader:
    """Distributed, optionally shuffled loader over token shards (llm.c's semantics).

    ``next_batch()`` -> ``(inputs, targets)``, each a fresh ``(B, T)`` int32 array.
    ``vocab_size``: when given, every shard is checked (once, when first opened; or all at once with
    :meth:`check_vocab`) to hold only ids ``< vocab_size``, else :class:`DataError` naming the shard.
    """

    STATE_VERSION = 1

    def __init__(self, pattern, B: int, T: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 42, vocab_size: int | None = None):
        if B < 1 or T < 1:
            raise DataError(f"batch shape must be positive, got B={B} T={T}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
        self.B, self.T = int(B), int(T)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.vocab_size = vocab_size
        self.pattern = pattern
        self.files = resolve_shards(pattern)
        self.infos = [read_shard_header(f) for f in self.files]
        need = self.world_size * self.B * self.T + 1
        for info in self.infos:
            if info.num_tokens < need:
                raise DataError(
                    f"{info.path}: {info.num_tokens:,} tokens is too few for one batch of "
                    f"world_size*B*T+1 = {self.world_size}*{self.B}*{self.T}+1 = {need:,} tokens")
        self.tokenizers = sorted({i.tokenizer for i in self.infos})
        self.num_tokens = sum(i.num_tokens for i in self.infos)
        self._window = self.world_size * self.B * self.T
        self._checked: set[int] = set()
        self._mm: np.ndarray | None = None
        self._mm_file = -1
        self._perm_key = None
        self._perm = None
        self.reset()

    # -- geometry
    @property
    def num_shards(self) -> int:
        return len(self.files)

    def shard_samples(self, file_index: int) -> int:
        """Batches (windows of world_size*B*T) a shard serves: llm.c's (ntok-1) // (W*B*T)."""
        return (self.infos[file_index].num_tokens - 1) // self._window

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.shard_samples(i) for i in range(self.num_shards))

    @property
    def tokenizer(self) -> str:
        """The vocabulary the shards' format records ("gpt2" / "llama3"; "mixed" if they differ)."""
        return self.tokenizers[0] if len(self.tokenizers) == 1 else "mixed"

    # -- permutations (pure functions of seed, epoch, position: nothing to save but the position)
    def _shard_order(self, epoch: int) -> np.ndarray:
        n = self.num_shards
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(n)

    def _sample_order(self, epoch: int, shard_pos: int, file_index: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        key = (epoch, shard_pos, file_index)
        if self._perm_key != key:  # cached: --overfit-batch resets every step
            n = self.shard_samples(file_index)
            self._perm = np.random.default_rng([self.seed, epoch, 1 + shard_pos]).permutation(n)
            self._perm_key = key
        return self._perm

    # -- position
    def reset(self) -> None:
        """Back to the first batch of epoch 0."""
        self._set_position(0, 0, 0)

    def _set_position(self, epoch: int, shard_pos: int, sample: int) -> None:
        self.epoch, self.shard_pos, self.sample = epoch, shard_pos, sample
        self._order = self._shard_order(epoch)
        self._file = int(self._order[shard_pos])
        self._samples = self._sample_order(epoch, shard_pos, self._file)
        self._open(self._file)

    def _open(self, file_index: int) -> None:
        if self._mm_file != file_index:
            self._mm = None  # drop the previous map first
            self._mm = read_shard(self.files[file_index])
            self._mm_file = file_index
        if self.vocab_size is not None and file_index not in self._checked:
            self._check_shard(file_index, self._mm)

    def _check_shard(self, file_index: int, tokens: np.ndarray) -> None:
        hi = int(tokens.max()) if tokens.size else -1
        if hi >= self.vocab_size:
            where = int(np.argmax(tokens >= self.vocab_size))
            raise DataError(
                f"{self.files[file_index]}: token id {int(tokens[where])} at position {where:,} is >= "
                f"the model's vocab size {self.vocab_size:,} (shard format: "
                f"{self.infos[file_index].tokenizer}; tokenized with a different vocabulary?)")
        self._checked.add(file_index)

    def check_vocab(self, vocab_size: int | None = None) -> None:
        """Check every shard now for ids >= vocab_size (default: the loader's vocab_size)."""
        if vocab_size is not None:
            if vocab_size != self.vocab_size:
                self._checked.clear()
            self.vocab_size = vocab_size
        if self.vocab_size is None:
            raise DataError("check_vocab needs a vocab_size")
        for i, f in enumerate(self.files):
            if i not in self._checked:
                self._check_shard(i, read_shard(f))

    def _advance_shard(self) -> None:
        if self.shard_pos + 1 >= self.num_shards:
            self._set_position(self.epoch + 1, 0, 0)
        else:
            self._set_position(self.epoch, self.shard_pos + 1, 0)

    def _read(self, idx: int):
        off = idx * self._window + self.rank * self.B * self.T
        buf = np.asarray(self._mm[off: off + self.B * self.T + 1], dtype=np.int32)
        x = buf[:-1].reshape(self.B, self.T)
        y = buf[1:].reshape(self.B, self.T)
        return x, y  # two views of one fresh buffer; callers own them

    def next_batch(self):
        """The next (inputs, targets) pair, moving to the next shard / epoch when one is used up."""
        if self.sample >= self.shard_samples(self._file):
            self._advance_shard()
        idx = self.sample if self._samples is None else int(self._samples[self.sample])
        self.sample += 1
        return self._read(idx)

    def __iter__(self) -> Iterator:
        while True:
            yield self.next_batch()

    # -- resumability
    def state(self) -> dict:
        """The exact position as a small JSON-able dict (goes into checkpoints)."""
        return {
            "version": self.STATE_VERSION, "epoch": self.epoch, "shard": self.shard_pos,
            "sample": self.sample, "shard_file": os.path.basename(self.files[self._file]),
            "num_shards": self.num_shards, "B": self.B, "T": self.T, "world_size": self.world_size,
            "shuffle": self.shuffle, "seed": self.seed,
        }

    def load_state(self, state: dict) -> None:
        """Continue exactly where :meth:`state` was taken (same shards, B, T, world size, shuffling)."""
        if int(state.get("version", -1)) != self.STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')!r} is not {self.STATE_VERSION}")
        now = {"num_shards": self.num_shards, "B": self.B, "T": self.T, "world_size": self.world_size,
               "shuffle": self.shuffle}
        if self.shuffle:
            now["seed"] = self.seed
        diff = [f"{k} {state.get(k)!r} -> {v!r}" for k, v in now.items() if state.get(k) != v]
        if diff:
            raise DataError("cannot resume the data position, the data setup changed: " + ", ".join(diff))
        epoch, shard, sample = int(state["epoch"]), int(state["shard"]), int(state["sample"])
        if not 0 <= shard < self.num_shards:
            raise DataError(f"data loader state: shard {shard} out of range 0..{self.num_shards - 1}")
        self._set_position(epoch, shard, sample)
        if os.path.basename(self.files[self._file]) != state.get("shard_file", os.path.basename(self.files[self._file])):
            raise DataError(f"cannot resume the data position: shard {shard} is now "
                            f"{self.files[self._file]}, was {state['shard_file']}")
        if not 0 <= sample <= self.shard_samples(self._file):
            raise DataError(f"data loader state: sample {sample} out of range for {self.files[self._file]}")


class ValLoader(DataLoader):
    """Validation / eval batches: in order from the start of the first shard, one pass, no shuffling."""

    def __init__(self, pattern, B: int, T: int, rank: int = 0, world_size: int = 1,
                 vocab_size: int | None = None):
        super().__init__(pattern, B, T, rank=rank, world_size=world_size, shuffle=False,
                         vocab_size=vocab_size)

    @property
    def num_batches(self) -> int:
        return self.batches_per_epoch

    def batches(self, n: int | None = None) -> Iterator:
        """Yield the first ``n`` batches (all of them if None or larger) from the start."""
        total = self.num_batches if n is None or n <= 0 else min(int(n), self.num_batches)
        self.reset()
        for _ in range(total):
            yield self.next_batch()

    def __iter__(self) -> Iterator:
        return self.batches()


# ----------------------------------------------------------------------------------------------
# multiple-choice eval files (HellaSwag), llm.c's dev/data/data_common.py write_evalfile layout:
# 256 int32 header (magic 20240522, version 1, number of examples, longest example in bytes), then per
# example a stream of uint16: 65535, example bytes, example index, label, number of completions,
# context length + context tokens, then per completion its length + tokens.

EVAL_MAGIC = 20240522
EVAL_VERSION = 1


def write_evalfile(path: str | os.PathLike, examples: Sequence[dict]) -> Path:
    """``examples``: dicts with ``label`` (int), ``ctx_tokens`` (ids) and ``ending_tokens`` (list of 4
    id lists), in order. Written atomically, byte for byte as llm.c writes them."""
    path = Path(path)
    check_replaceable(path, [EVAL_MAGIC], "eval file")
    if not 0 < len(examples) < 2**16:
        raise DataError(f"{path}: an eval file holds 1..65535 examples, got {len(examples)}")
    stream: list[int] = []
    longest = 0
    for idx, ex in enumerate(examples):
        endings = ex["ending_tokens"]
        if len(endings) != 4:
            raise DataError(f"{path}: example {idx} has {len(endings)} completions, llm.c expects 4")
        ex_stream = [2**16 - 1, 0, idx, int(ex["label"]), len(endings)]
        for toks in [ex["ctx_tokens"], *endings]:
            if any(not 0 <= int(t) < 2**16 - 1 for t in toks):
                raise DataError(f"{path}: example {idx} has a token id outside 0..65534 (GPT-2 vocabulary only)")
            ex_stream.append(len(toks))
            ex_stream.extend(int(t) for t in toks)
        nbytes = 2 * len(ex_stream)
        if nbytes >= 2**16:
            raise DataError(f"{path}: example {idx} is {nbytes} bytes, the format allows < 65536")
        ex_stream[1] = nbytes
        longest = max(longest, nbytes)
        stream.extend(ex_stream)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[3] = EVAL_MAGIC, EVAL_VERSION, len(examples), longest
    atomic_write_bytes(path, [header.tobytes(), np.asarray(stream, dtype="<u2").tobytes()])
    return path


def read_evalfile(path: str | os.PathLike) -> list[dict]:
    """Read an llm.c eval file back into the dicts :func:`write_evalfile` takes (plus ``index``)."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"eval file {path} not found") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise DataError(f"{path}: cannot read the eval file ({e.strerror or e})") from None
    if len(data) < HEADER_BYTES:
        raise DataError(f"{path}: truncated eval file, {len(data)} bytes is shorter than the header")
    header = np.frombuffer(data, dtype="<i4", count=HEADER_INTS)
    if header[0] != EVAL_MAGIC:
        raise DataError(f"{path}: bad magic {int(header[0])}, expected {EVAL_MAGIC} (an llm.c eval file)")
    if header[1] != EVAL_VERSION:
        raise DataError(f"{path}: unsupported eval file version {int(header[1])}, expected {EVAL_VERSION}")
    if (len(data) - HEADER_BYTES) % 2:
        raise DataError(f"{path}: odd number of bytes after the header")
    s = np.frombuffer(data, dtype="<u2", offset=HEADER_BYTES)
    out, pos = [], 0
    for i in range(int(header[2])):
        if pos + 5 > len(s) or s[pos] != 2**16 - 1:
            raise DataError(f"{path}: example {i} does not start with the 65535 delimiter (corrupt or truncated)")
        nbytes, index, label, ncomp = (int(v) for v in s[pos + 1: pos + 5])
        end = pos + nbytes // 2
        if end > len(s):
            raise DataError(f"{path}: truncated in example {i}")
        p = pos + 5
        parts = []
        for _ in range(1 + ncomp):
            if p >= end or p + 1 + int(s[p]) > end:
                raise DataError(f"{path}: example {i}'s token lists overrun its length field {nbytes} (corrupt)")
            n = int(s[p])
            parts.append([int(t) for t in s[p + 1: p + 1 + n]])
            p += 1 + n
        if p != end:
            raise DataError(f"{path}: example {i} length field {nbytes} does not match its contents")
        out.append({"index": index, "label": label, "ctx_tokens": parts[0], "ending_tokens": parts[1:]})
        pos = end
    if pos != len(s):
        raise DataError(f"{path}: {2 * (len(s) - pos)} trailing bytes after {int(header[2])} examples")
    return out
