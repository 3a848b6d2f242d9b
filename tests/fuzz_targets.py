"""The binary formats' readers as fuzz targets, shared by tests/formats/test_fuzz.py (bounded) and
bench/fuzz_readers.py (minutes). Each target: a valid seed file, the reader, and the clean error class the
reader may raise; every other exception is a finding."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from hypothesis import strategies as st

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.llmc_bin import read_model
from llmc_cli.formats.llmc_bin import VERSION_FP32
from llmc_cli.formats.llmc_bin import model_header
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import read_shard
from llmc_cli.data.loader import DataLoader
from llmc_cli.formats.evalfile import read_evalfile, write_evalfile
from llmc_cli.models.gpt2 import GPT2Config, init_parameters
from llmc_cli.data.tokenizer import TokenizerError, read_tokenizer_bin

HEADER = 256 * 4


@dataclass
class Target:
    seed: Callable[[Path], bytes]           # a valid file's bytes
    read: Callable[[Path], object]          # the reader under test
    clean: tuple[type[BaseException], ...]  # what it may raise
    suffix: str = ".bin"
    header_ints: int = 8                    # int32 header fields worth overwriting (0 = no int32 header)


# ---- seeds ---------------------------------------------------------------------------------------------------
def _model_seed(_: Path) -> bytes:
    cfg = GPT2Config(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=4)
    h = model_header(cfg, VERSION_FP32)
    return h.tobytes() + init_parameters(cfg, 0).astype(np.float32).tobytes()


def _shard_seed(_: Path) -> bytes:
    h = np.zeros(256, "<i4")
    h[:3] = [20240520, 1, 200]
    return h.tobytes() + (np.arange(200) % 50257).astype("<u2").tobytes()


def _byte_shard_seed(_: Path) -> bytes:
    h = np.zeros(256, "<i4")
    h[:3] = [20240520, 2, 200]
    h[4:12] = np.frombuffer(b"bytes".ljust(32, b"\0"), "<i4")
    return h.tobytes() + (np.arange(200) % 257).astype("<u2").tobytes()


def _tokenizer_seed(_: Path) -> bytes:
    toks = [bytes([i]) for i in range(40)] + [b"<|endoftext|>"]
    h = np.zeros(256, "<i4")
    h[:4] = [20240328, 2, len(toks), len(toks) - 1]
    return h.tobytes() + b"".join(bytes([len(t)]) + t for t in toks)


def _eval_seed(d: Path) -> bytes:
    p = d / "seed_eval.bin"
    write_evalfile(p, [{"label": i % 4, "ctx_tokens": [1, 2, 3 + i], "ending_tokens": [[4], [5, 6], [7], [8, 9, i]]}
                       for i in range(3)])
    return p.read_bytes()


def _eval_llama3_seed(d: Path) -> bytes:
    """llmc's version 2 (uint32 ids, the tokenizer named in the header)."""
    p = d / "seed_eval_llama3.bin"
    write_evalfile(p, [{"label": i % 4, "ctx_tokens": [128000, 2, 3 + i], "ending_tokens": [[4], [70000, 6], [7],
                                                                                            [8, 9, 128255]]}
                       for i in range(3)], tokenizer="llama3")
    return p.read_bytes()


def _state_seed(_: Path) -> bytes:
    state = {"version": 1, "step": 3, "dataloader": {"version": 1, "epoch": 0, "shard": 0, "sample": 3},
             "rng": np.random.default_rng(1).bit_generator.state, "args": {"batch_size": 2, "seq_len": 4},
             "config": {"n_layer": 1}}
    return json.dumps(state, indent=1).encode()


_OPT_N = 16


def _opt_seed(_: Path) -> bytes:
    f = io.BytesIO()
    np.savez(f, m=np.ones(_OPT_N, np.float32), v=np.full(_OPT_N, 2, np.float32))
    return f.getvalue()


def _safetensors_seed(d: Path) -> bytes:
    from llmc_cli.formats import hf
    p = d / "seed.safetensors"
    hf.write_safetensors(p, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)})
    return p.read_bytes()


# ---- readers -------------------------------------------------------------------------------------------------
def _read_shard(p: Path):
    read_shard(p, mmap=False)
    loader = DataLoader(str(p), 1, 4, vocab_size=50257)  # header, size and vocabulary checks of the loader
    for _ in range(3):
        loader.next_batch()


def _read_safetensors(p: Path):
    from llmc_cli.formats import hf
    hf.read_safetensors(p)


def _ranks_seed(_: Path) -> bytes:
    import base64
    toks = [bytes([i]) for i in range(256)] + [b"ab", b"abc"]
    return b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(toks))


def _read_llama_ranks(p: Path):
    from llmc_cli.data import tokenizer as tk
    tk._CACHE.clear()
    tk.load_tokenizer("llama3", p).encode("abc abd")


def _hf_config_seed(d: Path) -> bytes:
    from llmc_cli.formats import hf_gpt2
    out = d / "seed_hf"
    hf_gpt2.export_hf(out, GPT2Config(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=4),
                 init_parameters(GPT2Config(block_size=8, vocab_size=11, n_layer=1, n_head=1, n_embd=4), 0))
    return (out / "config.json").read_bytes()


def _read_hf_config(p: Path):
    """config.json as a Hugging Face GPT-2 or Llama directory holds it (read by model type)."""
    from llmc_cli.formats import sources
    d = p.parent / f"{p.stem}_dir"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(p.read_bytes())
    sources.load_config_any(d)


TARGETS: dict[str, Target] = {
    "model_bin": Target(_model_seed, read_model, (ckpt.CheckpointError,)),
    "shard": Target(_shard_seed, _read_shard, (DataError,)),
    "shard_bytes": Target(_byte_shard_seed, _read_shard, (DataError,), header_ints=12),
    "tokenizer_bin": Target(_tokenizer_seed, read_tokenizer_bin, (TokenizerError,)),
    "eval_file": Target(_eval_seed, read_evalfile, (DataError,)),
    "eval_file_llama3": Target(_eval_llama3_seed, read_evalfile, (DataError,), header_ints=12),
    "run_state_json": Target(_state_seed, ckpt.read_run_state, (ckpt.CheckpointError,), ".json", 0),
    "llama3_ranks": Target(_ranks_seed, _read_llama_ranks, (TokenizerError,), ".model", 0),
    "hf_config_json": Target(_hf_config_seed, _read_hf_config, (ckpt.CheckpointError,), ".json", 0),
    "optimizer_npz": Target(_opt_seed, lambda p: ckpt.read_optimizer_state(p, _OPT_N), (ckpt.CheckpointError,),
                            ".npz", 0),
}
try:
    import llmc_cli.formats.hf  # noqa: F401  (only whether it imports: safetensors reading needs it)
    TARGETS["safetensors"] = Target(_safetensors_seed, _read_safetensors, (ckpt.CheckpointError,), ".safetensors", 0)
except ImportError:
    pass


# ---- inputs --------------------------------------------------------------------------------------------------
INTERESTING = [0, 1, -1, 2, 3, 5, 7, 255, 256, 1024, 65535, 65536, 2**31 - 1, -2**31, 20240326, 20240520,
               20240801, 20240328, 20240522]


def mutated_bytes(seed: bytes, header_ints: int = 8):
    """Random bytes, or the seed with some of: int32 header fields overwritten, bytes flipped, a cut,
    garbage appended."""
    n = len(seed)
    field = st.tuples(st.integers(0, max(header_ints - 1, 0)),
                      st.one_of(st.sampled_from(INTERESTING), st.integers(-2**31, 2**31 - 1)))
    edits = st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)), max_size=8)

    @st.composite
    def mutate(draw):
        b = bytearray(seed)
        if header_ints and draw(st.booleans()):
            for i, v in draw(st.lists(field, min_size=1, max_size=3)):
                b[4 * i: 4 * i + 4] = int(v).to_bytes(4, "little", signed=True)
        for pos, val in draw(edits):
            if pos < len(b):
                b[pos] = val
        cut = draw(st.one_of(st.none(), st.integers(0, n)))
        if cut is not None:
            del b[cut:]
        b += draw(st.binary(max_size=16))
        return bytes(b)

    return st.one_of(st.binary(max_size=2048), mutate(), mutate())


def check_target(target: Target, d: Path, data: bytes) -> None:
    p = d / ("input" + target.suffix)
    p.write_bytes(data)
    try:
        target.read(p)
    except target.clean as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"error message must be one non-empty line: {msg!r}"
    finally:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
