"""safetensors, read and written here without the `safetensors` package: 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}} (offsets relative to the end of the header, which is
space-padded to a multiple of 8), then the raw little-endian data. bfloat16 travels as its 16-bit words,
converted on the host (round to nearest even, as the GPUs do)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes


# ---- bfloat16 on the host (no dependency): round to nearest even, as the GPUs do -------------------------------
def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint32(0x7FC0), rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)




# ---- safetensors ----------------------------------------------------------------------------------------------
SAFETENSORS_HEADER_MAX = 100 * 2**20  # bytes: a larger header length is not a safetensors file's
ST_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                      metadata: dict[str, str] | None = None) -> None:
    """float32 arrays -> one safetensors file in `dtype` (F32, or BF16 rounded to nearest even), atomically."""
    if dtype not in ("F32", "BF16"):
        raise ValueError(f"safetensors dtype {dtype} (F32 or BF16)")
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, off = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        raw = (float32_to_bf16_bits(a).astype("<u2") if dtype == "BF16" else a.astype("<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    atomic_write_bytes(path, [np.uint64(len(h)).astype("<u8").tobytes(), h, *blobs])


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short for a safetensors file")
            n = int(np.frombuffer(head, "<u8")[0])
            if n > SAFETENSORS_HEADER_MAX:
                raise CheckpointError(f"{path}: header length {n} is implausible (not a safetensors file)")
            raw = f.read(n)
            if len(raw) < n:
                raise CheckpointError(f"{path}: header length {n} is past the end of the file ({8 + len(raw)} "
                                      "bytes; truncated, or not a safetensors file)")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:  # json keeps the last of two equal names: one tensor would silently be another
        raise CheckpointError(f"{path}: the header names {e.args[0]!r} twice (a damaged safetensors file)") from None
    except (ValueError, RecursionError):  # (RecursionError: JSON nested past Python's stack)
        raise CheckpointError(f"{path}: the header is not JSON (not a safetensors file)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is JSON but not an object of tensors (not a safetensors file)")
    return header, 8 + n


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _tensor_entries(path: Path, header: dict, start: int, size: int) -> dict[str, tuple[np.dtype, int, int, tuple]]:
    """name -> (dtype, begin, end, shape) of every tensor in the header, each checked against the file's size, and
    no two sharing bytes (the format forbids it; a damaged header would otherwise read one tensor as another)."""
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: tensor {name} has no dtype/shape/data_offsets entry")
        dt = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.get('dtype')} "
                                  f"(supported: {', '.join(ST_DTYPES)})")
        offs, shape = info.get("data_offsets"), info.get("shape")
        if not (isinstance(offs, list) and len(offs) == 2 and isinstance(shape, list)
                and all(type(v) is int and v >= 0 for v in offs + shape) and offs[0] <= offs[1]):
            raise CheckpointError(f"{path}: tensor {name} has a bad shape {shape!r} or data_offsets "
                                  f"{offs!r} (non-negative integers expected)")
        if len(shape) > 32 or int(np.prod([d for d in shape if d], dtype=object)) * dt.itemsize >= 2**62:
            # (numpy cannot make such an array even with no data, a dimension of 0: no tensor of a model is one)
            raise CheckpointError(f"{path}: tensor {name} has a shape no array can have ({len(shape)} dimensions, "
                                  f"{str(shape)[:80]})")
        b, e = offs
        if start + e > size or e - b != int(np.prod(shape, dtype=object)) * dt.itemsize:
            raise CheckpointError(f"{path}: tensor {name} data out of bounds or of the wrong size")
        entries[name] = (dt, b, e, tuple(shape))
    spans = sorted((b, e, name) for name, (_, b, e, _) in entries.items() if e > b)
    for (_, e0, first), (b1, _, second) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {first} and {second} overlap in the data (a damaged "
                                  "safetensors file)")
    return entries


def read_safetensors(path: str | Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
    """name -> float32 array (F32, BF16, F16), for every tensor or only those in `names`."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    size = path.stat().st_size
    out = {}
    entries = _tensor_entries(path, header, start, size)
    with open(path, "rb") as f:
        for name, (dt, b, e, shape) in entries.items():
            if names is not None and name not in names:
                continue
            f.seek(start + b)
            a = np.frombuffer(f.read(e - b), dtype=dt).reshape(shape)
            out[name] = bf16_bits_to_float32(a) if header[name]["dtype"] == "BF16" else a.astype(np.float32)
    return out
