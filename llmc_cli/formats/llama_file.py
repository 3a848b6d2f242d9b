"""llmc's Llama model file (model.safetensors in a run directory; llm.c's format has no Llama layout): llmc's
own tensor names and stacked per-layer shapes, with the family, config and tokenizer in the file's metadata,
so the file alone rebuilds the model."""

from __future__ import annotations

import json
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError
from llmc_cli.formats.safetensors import (
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from llmc_cli.models import llama3 as llama3_spec
from llmc_cli.models.base import split_flat
from llmc_cli.models.llama3 import Llama3Config

# ---- llmc's Llama model file (model.safetensors in a run directory) ------------------------------------------
LLMC_FORMAT = "llmc"
TOKENIZERS = ("gpt2", "llama3")  # what a model file may record (the names load_tokenizer knows)


def write_llama_model(path: str | Path, cfg: Llama3Config, params: np.ndarray, bf16: bool = False,
                      tokenizer: str = "gpt2") -> None:
    """Parameters under llmc's names (wte, wqkv, ...; per-layer tensors stacked), config in the metadata."""
    n = llama3_spec.num_parameters(cfg)
    if params.size != n:
        raise ValueError(f"{path}: {params.size} parameters do not fit the config ({n})")
    meta = {"format": LLMC_FORMAT, "family": "llama3", "config": json.dumps(asdict(cfg)), "tokenizer": tokenizer}
    write_safetensors(path, split_flat(np.asarray(params, np.float32), llama3_spec.parameter_shapes(cfg)),
                      "BF16" if bf16 else "F32", meta)


def read_llama_header(path: str | Path) -> tuple[Llama3Config, dict]:
    """(config, metadata) of an llmc Llama model file, without reading the parameters."""
    header, _ = read_safetensors_header(path)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != LLMC_FORMAT:
        raise CheckpointError(f"{path}: not an llmc model file (no llmc metadata); for Hugging Face weights give "
                              f"the directory holding config.json")
    if meta.get("family") != "llama3":
        raise CheckpointError(f"{path}: model family {meta.get('family')!r} (expected 'llama3')")
    try:
        fields = json.loads(meta["config"])
        known = {f.name for f in dataclass_fields(Llama3Config)}
        if not isinstance(fields, dict) or set(fields) - known:
            raise ValueError(f"unknown fields {sorted(set(fields) - known) if isinstance(fields, dict) else fields}")
        cfg = Llama3Config(**fields)
        cfg.validate()
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: bad Llama config in the metadata ({type(e).__name__}: {e})") from None
    if meta.get("tokenizer", "gpt2") not in TOKENIZERS:  # (taken for GPT-2's, it would score ids of another)
        raise CheckpointError(f"{path}: tokenizer {meta.get('tokenizer')!r:.80} in the metadata (expected "
                              f"{' or '.join(map(repr, TOKENIZERS))})")
    return cfg, meta


def read_llama_model(path: str | Path) -> tuple[Llama3Config, np.ndarray]:
    cfg, _ = read_llama_header(path)
    # the tensors' names and shapes, from the header, match the config before anything is read or allocated: a
    # config in the metadata far larger than the file (a damaged one) is refused, not allocated
    header, _ = read_safetensors_header(path)
    shapes = llama3_spec.parameter_shapes(cfg)
    for name, shape in shapes:
        info = header.get(name)
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: tensor {name} is missing" if info is None else
                                  f"{path}: tensor {name} has no dtype/shape/data_offsets entry")
        if info.get("shape") != list(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {info.get('shape')!r:.80}, the config says "
                                  f"{tuple(shape)}")
    extra = sorted(set(header) - {"__metadata__"} - {name for name, _ in shapes})
    if extra:  # llmc writes exactly the config's tensors; another (an untied lm_head, say) would be ignored silently
        raise CheckpointError(f"{path}: tensor {extra[0]} is not one of a Llama of this config"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
    tensors = read_safetensors(path)
    flat = np.empty(llama3_spec.num_parameters(cfg), np.float32)
    for name, view in split_flat(flat, llama3_spec.parameter_shapes(cfg)).items():
        a = tensors.get(name)
        if a is None:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        if a.shape != view.shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {a.shape}, the config says {view.shape}")
        view[...] = a
    return cfg, flat
