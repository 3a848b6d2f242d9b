"""Multiple-choice eval files (HellaSwag), llm.c's dev/data/data_common.py write_evalfile layout:
256 int32 header (magic 20240522, version 1, number of examples, longest example in bytes), then per
example a stream of uint16: 65535, example bytes, example index, label, number of completions,
context length + context tokens, then per completion its length + tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from llmc_cli.formats.files import DataError, atomic_write_bytes, check_replaceable
from llmc_cli.formats.shards import HEADER_BYTES, HEADER_INTS

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
