"""llm.c's model .bin: a header of 256 int32 (magic 20240326; version 3 = float32 params, 5 = bfloat16; then
maxT, V, L, NH, C, Vp) followed by GPT-2's parameters in llm.c's order. Files written here load in llm.c's
train_gpt2.c / train_gpt2.cu and the other way round. A model of another tokenizer than GPT-2's (the byte-level
one) names it in header[8:16] (ASCII, NUL-padded to 32 bytes), which llm.c does not read; all zero is GPT-2's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes
from llmc_cli.formats.safetensors import bf16_bits_to_float32, float32_to_bf16_bits
from llmc_cli.models.gpt2 import GPT2Config, num_parameters

MODEL_MAGIC = 20240326
VERSION_FP32 = 3
VERSION_BF16 = 5
HEADER_INTS = 256
TOKENIZER_INTS = slice(8, 16)  # the tokenizer's name; zeros (every llm.c file) mean GPT-2's


# ---- llm.c model .bin -----------------------------------------------------------------------------------------
def model_header(cfg: GPT2Config, version: int, tokenizer: str = "gpt2") -> np.ndarray:
    h = np.zeros(HEADER_INTS, dtype=np.int32)
    h[:8] = [MODEL_MAGIC, version, cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
             cfg.padded_vocab_size]
    if tokenizer != "gpt2":
        h[TOKENIZER_INTS] = np.frombuffer(tokenizer.encode("ascii").ljust(32, b"\0"), dtype=np.int32)
    return h


def write_model(path: str | Path, cfg: GPT2Config, params: np.ndarray, bf16: bool = False,
                tokenizer: str = "gpt2") -> None:
    """Writes float32 `params` as llm.c's version 3 file, or rounded to bfloat16 as version 5."""
    if params.size != num_parameters(cfg):
        raise ValueError(f"{path}: {params.size} parameters do not fit the config ({num_parameters(cfg)})")
    header = model_header(cfg, VERSION_BF16 if bf16 else VERSION_FP32, tokenizer)
    body = float32_to_bf16_bits(params) if bf16 else np.ascontiguousarray(params, dtype=np.float32)
    atomic_write_bytes(path, [header.tobytes(), body.tobytes()])


def read_model_header(path: str | Path) -> tuple[GPT2Config, int]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such model file")
    raw = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if raw.size < HEADER_INTS:
        raise CheckpointError(f"{path}: truncated header ({raw.size * 4} bytes, expected {HEADER_INTS * 4})")
    if raw[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {raw[0]} (expected {MODEL_MAGIC}, an llm.c GPT-2 model file)")
    version = int(raw[1])
    if version not in (VERSION_FP32, VERSION_BF16):
        raise CheckpointError(f"{path}: unsupported version {version} (expected {VERSION_FP32} float32 or "
                              f"{VERSION_BF16} bfloat16)")
    cfg = GPT2Config(block_size=int(raw[2]), vocab_size=int(raw[3]), n_layer=int(raw[4]), n_head=int(raw[5]),
                     n_embd=int(raw[6]))
    try:
        cfg.validate()
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if int(raw[7]) != cfg.padded_vocab_size:
        raise CheckpointError(f"{path}: padded vocab {raw[7]} (expected {cfg.padded_vocab_size} for vocab "
                              f"{cfg.vocab_size})")
    return cfg, version


def read_model_tokenizer(path: str | Path) -> str:
    """The tokenizer an llm.c model file names in header[8:16] ("gpt2" where it names none, as llm.c's files)."""
    raw = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    name = raw[TOKENIZER_INTS].tobytes().rstrip(b"\0") if raw.size == HEADER_INTS else b""
    return name.decode("ascii", "backslashreplace") or "gpt2"


def read_model(path: str | Path) -> tuple[GPT2Config, np.ndarray, int]:
    """(config, float32 parameters, version) from an llm.c model file."""
    cfg, version = read_model_header(path)
    n = num_parameters(cfg)
    itemsize = 2 if version == VERSION_BF16 else 4
    expected = HEADER_INTS * 4 + n * itemsize
    size = os.path.getsize(path)
    if size != expected:
        raise CheckpointError(f"{path}: {size} bytes, expected {expected} for this config "
                              f"({'truncated' if size < expected else 'trailing data'})")
    body = np.fromfile(path, dtype=np.uint16 if itemsize == 2 else np.float32, offset=HEADER_INTS * 4, count=n)
    params = bf16_bits_to_float32(body) if itemsize == 2 else body
    return cfg, params, version
