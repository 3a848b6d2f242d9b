"""A model ready for inference from any source: an llm.c .bin, llmc's Llama .safetensors, a run or step directory,
or a Hugging Face GPT-2 / Llama directory, planned once for batch (B, T) on a backend."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmc_cli.formats.sources import load_model_and_tokenizer_name
from llmc_cli.kernels import Backend
from llmc_cli.models.base import Model, backend_capabilities, check_backend, check_seq_len
from llmc_cli.models.families import family_of


def load_model(checkpoint: str | Path, backend: Backend, B: int = 1, T: int | None = None) -> Model:
    """The model at `checkpoint` on `backend`, planned for inference at (B, T) (T None = the model's block size,
    at most 1024), its `tokenizer` the one the checkpoint records. CheckpointError names an unreadable source;
    ValueError a B or T below 1, or a T longer than the block size."""
    for name, v in (("B", B), ("T", T)):  # (0 planned an empty model, which then failed far from here)
        if (v is not None or name == "B") and (isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                                               or v < 1):
            raise ValueError(f"load_model: {name} must be an integer >= 1 (got {v!r})")
    # numpy's integers as Python ints: np.uint8(255) or np.int16(2) overflowed the planning's arithmetic
    B, T = int(B), None if T is None else int(T)
    if not isinstance(checkpoint, (str, os.PathLike)) or str(checkpoint) == "":  # ('' is the working directory)
        raise ValueError(f"load_model: checkpoint must be a path (got {checkpoint!r:.80})")
    try:  # the backend first: its capabilities must be a set of names whose kernels it has (models.base)
        check_backend(backend, "load_model: backend")
        backend_capabilities(backend)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("load_model") else f"load_model: {e}") from None
    cfg, params, tokenizer = load_model_and_tokenizer_name(checkpoint)  # (one step of a live run: both its own)
    T = min(cfg.block_size, 1024) if T is None else T
    check_seq_len(T, cfg.block_size)
    model = family_of(cfg).model_class(cfg, backend, B, T, training=False)
    model.load_parameters(params)
    model.tokenizer = tokenizer  # evals refuse data of another vocabulary
    return model
