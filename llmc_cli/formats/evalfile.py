"""Multiple-choice eval files (HellaSwag): llm.c's layout for GPT-2 ids, and llmc's wider one for Llama 3 ids.

    header: 256 little-endian int32
      [0] magic    20240522
      [1] version  1: llm.c's (dev/data/data_common.py write_evalfile), GPT-2 ids, uint16 stream
                   2: llmc's, uint32 stream, the tokenizer named in [4:12]
      [2] number of examples, [3] the longest example in bytes
      [4:12] (version 2 only) the tokenizer's name, ASCII, NUL-padded to 32 bytes ("llama3")
    then per example a stream of tokens of the version's width: the delimiter (all ones: 65535 / 2**32-1), the
    example's bytes, its index, label, number of completions, context length + context tokens, then per
    completion its length + tokens.

Version 1 is written byte for byte as llm.c writes it, so llm.c reads llmc's GPT-2 files and llmc reads llm.c's.
It has no room for the tokenizer (the format knows only GPT-2) nor for Llama 3's ids (up to 128,255), so those
go to version 2, which spells out the same fields in uint32 and says which vocabulary the ids belong to: a model
trained with another tokenizer is refused rather than scored on ids that mean other words to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from llmc_cli.formats.files import DataError, atomic_write_bytes, check_replaceable, special_file
from llmc_cli.formats.shards import HEADER_BYTES, HEADER_INTS

EVAL_MAGIC = 20240522
EVAL_VERSION = 1         # llm.c's, GPT-2 (kept as the name of llm.c's version)
NAME_INTS = slice(4, 12)  # version 2: where the tokenizer's name sits in the header
NAME_BYTES = 4 * (NAME_INTS.stop - NAME_INTS.start)


@dataclass(frozen=True)
class _Format:
    tokenizer: str
    version: int
    dtype: np.dtype

    @property
    def delimiter(self) -> int:
        return int(np.iinfo(self.dtype).max)


EVAL_FORMATS = {
    "gpt2": _Format("gpt2", 1, np.dtype("<u2")),
    "llama3": _Format("llama3", 2, np.dtype("<u4")),
}
_KNOWN = ", ".join(f"version {f.version} ({f.tokenizer}, {f.dtype.itemsize * 8}-bit tokens)"
                   for f in EVAL_FORMATS.values())


@dataclass(frozen=True)
class EvalFileInfo:
    path: str
    version: int
    tokenizer: str  # whose ids the file holds ("gpt2" for llm.c's version 1)
    num_examples: int
    longest: int    # bytes of the longest example


def eval_format(tokenizer: str = "gpt2") -> _Format:
    """The on-disk format of a tokenizer's eval files ("gpt2" -> llm.c's version 1, "llama3" -> version 2)."""
    try:
        return EVAL_FORMATS[tokenizer]
    except KeyError:
        raise DataError(f"no eval file format for tokenizer {tokenizer!r}; known: {', '.join(EVAL_FORMATS)}") from None


def write_evalfile(path: str | os.PathLike, examples: Sequence[dict], tokenizer: str = "gpt2") -> Path:
    """``examples``: dicts with ``label`` (int), ``ctx_tokens`` (ids) and ``ending_tokens`` (list of 4
    id lists), in order, tokenized with ``tokenizer``. Written atomically; GPT-2's byte for byte as llm.c
    writes them."""
    path = Path(path)
    fmt = eval_format(tokenizer)
    check_replaceable(path, [EVAL_MAGIC], "eval file")
    top = fmt.delimiter  # the delimiter's value is no id, and no count or length either
    most = min(top, 2**31 - 1)  # indices 0..n-1 stay below the delimiter; the header's count is an int32
    if not 0 < len(examples) <= most:
        raise DataError(f"{path}: an eval file holds 1..{most} examples, got {len(examples)}")
    stream: list[int] = []
    longest = 0
    for idx, ex in enumerate(examples):
        endings = ex["ending_tokens"]
        if len(endings) != 4:
            raise DataError(f"{path}: example {idx} has {len(endings)} completions, llm.c expects 4")
        _check_example(path, idx, int(ex["label"]), ex["ctx_tokens"], endings)
        ex_stream = [top, 0, idx, int(ex["label"]), len(endings)]
        for toks in [ex["ctx_tokens"], *endings]:
            if any(not 0 <= int(t) < top for t in toks):
                raise DataError(f"{path}: example {idx} has a token id outside 0..{top - 1} "
                                f"({fmt.tokenizer} eval file, {fmt.dtype.itemsize * 8}-bit tokens)")
            ex_stream.append(len(toks))
            ex_stream.extend(int(t) for t in toks)
        nbytes = fmt.dtype.itemsize * len(ex_stream)
        if nbytes >= min(top + 1, 2**31):
            raise DataError(f"{path}: example {idx} is {nbytes} bytes, the format allows < {min(top + 1, 2**31)}")
        ex_stream[1] = nbytes
        longest = max(longest, nbytes)
        stream.extend(ex_stream)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[3] = EVAL_MAGIC, fmt.version, len(examples), longest
    if fmt.version != 1:
        header[NAME_INTS] = np.frombuffer(fmt.tokenizer.encode("ascii").ljust(NAME_BYTES, b"\0"), dtype="<i4")
    atomic_write_bytes(path, [header.tobytes(), np.asarray(stream, dtype=fmt.dtype).tobytes()], through_links=True)
    return path


def _check_example(path, i: int, label: int, ctx: Sequence, endings: Sequence) -> None:
    """An example scores only with a context, non-empty completions (an empty one has no loss and always wins) and
    a label naming one of them (any other would count as wrong, silently)."""
    if not 0 <= label < len(endings):
        raise DataError(f"{path}: example {i} has label {label}, expected 0..{len(endings) - 1} (one of its "
                        f"{len(endings)} completions; corrupt?)")
    if not len(ctx) or not all(len(e) for e in endings):
        raise DataError(f"{path}: example {i} has an empty context or completion, expected 1 or more tokens each")


# ----------------------------------------------------------------------------------------------
# reading


def _header(path: str, data: bytes, size: int) -> tuple[EvalFileInfo, _Format]:
    """The checked header of an eval file whose first bytes are `data` (of `size` bytes in all)."""
    if len(data) < HEADER_BYTES:
        raise DataError(f"{path}: truncated eval file, {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(data, dtype="<i4", count=HEADER_INTS)
    magic, version, n, longest = (int(v) for v in header[:4])
    if magic != EVAL_MAGIC:
        raise DataError(f"{path}: bad magic {magic}, expected {EVAL_MAGIC} (an llm.c eval file: {_KNOWN})")
    if version == 1:
        fmt = EVAL_FORMATS["gpt2"]  # llm.c's format knows GPT-2 alone
    elif version == 2:
        name = header[NAME_INTS].tobytes().rstrip(b"\0")
        fmt = next((f for f in EVAL_FORMATS.values() if f.version == 2 and f.tokenizer.encode() == name), None)
        if fmt is None:
            shown = name.decode("ascii", "backslashreplace") if name else ""
            raise DataError(f"{path}: eval file version 2 names tokenizer {shown!r}, expected one of "
                            f"{', '.join(f.tokenizer for f in EVAL_FORMATS.values() if f.version == 2)} (corrupt?)")
    else:
        raise DataError(f"{path}: unsupported eval file version {version}; this llmc reads {_KNOWN}")
    if n < 0 or longest < 0:
        raise DataError(f"{path}: corrupt header, {n} examples of at most {longest} bytes")
    return EvalFileInfo(path, version, fmt.tokenizer, n, longest), fmt


def _read_bytes(path: str, count: int = -1) -> tuple[bytes, int]:
    if kind := special_file(path):  # (opening a FIFO waits for a writer forever)
        raise DataError(f"{path}: is {kind}, not an eval file")
    try:
        with open(path, "rb") as f:
            return f.read(count), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DataError(f"eval file {path} not found") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise DataError(f"{path}: cannot read the eval file ({e.strerror or e})") from None


def read_evalfile_header(path: str | os.PathLike) -> EvalFileInfo:
    """The header of an eval file (version, whose tokenizer's ids, examples), read alone; raises DataError."""
    path = str(path)
    data, size = _read_bytes(path, HEADER_BYTES)
    return _header(path, data, size)[0]


def _tokens(path: str) -> tuple[EvalFileInfo, _Format, np.ndarray, int]:
    """The header, the token stream after it and that stream's size in bytes. The stream is mapped, never read whole,
    and only as far as the header allows (its examples x its longest example: each example is held to that longest
    length when read), so a stray huge file under an eval file's name (or a sparse one) costs no memory and reads
    back as trailing bytes, one line naming the file."""
    if kind := special_file(path):  # (opening a FIFO waits for a writer forever)
        raise DataError(f"{path}: is {kind}, not an eval file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            info, fmt = _header(path, f.read(HEADER_BYTES), size)
            body, width = size - HEADER_BYTES, fmt.dtype.itemsize
            if body % width:
                raise DataError(f"{path}: {body} bytes after the header is not a whole number of "
                                f"{width * 8}-bit tokens (truncated or corrupt)")
            count = min(body, info.num_examples * info.longest) // width
            if not count:
                return info, fmt, np.zeros(0, fmt.dtype), body
            mapped = np.memmap(f, dtype=fmt.dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
            return info, fmt, mapped.view(np.ndarray), body  # (a memmap's own indexing costs ~3x a plain array's)
    except FileNotFoundError:
        raise DataError(f"eval file {path} not found") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise DataError(f"{path}: cannot read the eval file ({e.strerror or e})") from None


def read_evalfile(path: str | os.PathLike) -> list[dict]:
    """Read an eval file (either version) back into the dicts :func:`write_evalfile` takes (plus ``index``);
    which tokenizer made it is :func:`read_evalfile_header`'s ``tokenizer``."""
    path = str(path)
    info, fmt, s, body = _tokens(path)
    width = fmt.dtype.itemsize
    out, pos = [], 0
    for i in range(info.num_examples):
        if pos + 5 > len(s) or s[pos] != fmt.delimiter:
            raise DataError(f"{path}: example {i} does not start with the {fmt.delimiter} delimiter "
                            f"(corrupt or truncated)")
        nbytes, index, label, ncomp = (int(v) for v in s[pos + 1: pos + 5])
        if nbytes % width or nbytes > info.longest:
            raise DataError(f"{path}: example {i} length field {nbytes} is not a whole number of tokens of at most "
                            f"the header's longest example, {info.longest} bytes (corrupt)")
        end = pos + nbytes // width
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
        _check_example(path, i, label, parts[0], parts[1:])
        out.append({"index": index, "label": label, "ctx_tokens": parts[0], "ending_tokens": parts[1:]})
        pos = end
    if width * pos != body:  # (bytes past what the header allows are not even mapped)
        over = body > info.num_examples * info.longest
        raise DataError(f"{path}: {body - width * pos:,} trailing bytes after {info.num_examples} examples"
                        + (f" (more than its header allows, {info.num_examples} of at most {info.longest} bytes: "
                           "corrupt, or not an eval file)" if over else ""))
    return out
