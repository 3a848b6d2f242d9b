"""A model family as one value: what the engine needs to know of GPT-2 or Llama 3 to build, plan, train, decode,
save and convert one, so no module switches on a config's type. The values themselves are in families.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

Config = Any  # a family's config dataclass (GPT2Config, Llama3Config)


@dataclass(frozen=True)
class ModelFile:
    """How a run directory's step folder keeps the model (llm.c's .bin for GPT-2; llmc's .safetensors for Llama)."""

    name: str                                                   # model.bin | model.safetensors
    label: Callable[[bool], str]                                # (bf16) -> what the file is, for messages
    write: Callable[..., None]                                  # (path, cfg, params, bf16=False, tokenizer="gpt2")
    read: Callable[[str | Path], tuple[Config, np.ndarray]]    # float32 parameters
    read_config: Callable[[str | Path], Config]


@dataclass(frozen=True)
class HFMapping:
    """The family in a Hugging Face directory: config.json's model_type and the tensor names both ways."""

    model_type: str                                             # gpt2 | llama
    read_config: Callable[[str | Path], Config]
    load: Callable[[str | Path], tuple[Config, np.ndarray]]
    save: Callable[..., Path]   # (out_dir, cfg, params, bf16=False, tokenizer="gpt2", tokenizer_file=None)


@dataclass(frozen=True)
class Family:
    name: str                                                   # a config's `family` names it
    label: str                                                  # for people: GPT-2, Llama 3
    tokenizer: str                                              # its own tokenizer (what pretrained weights use)
    config_class: type
    model_class: type       # planned once for (B, T): forward/backward, and decode_* over the same layer loop
    preset_names: tuple[str, ...]                               # what --model accepts (aliases included)
    preset: Callable[..., Config]                               # (name, **overrides)
    parameter_shapes: Callable[[Config], list[tuple[str, tuple[int, ...]]]]
    num_parameters: Callable[[Config], int]
    init_parameters: Callable[[Config, int], np.ndarray]        # (cfg, seed), on the host: identical everywhere
    activation_bytes: Callable[..., int]   # (cfg, B, T, training, act_bytes, recompute): the activation plan
    kv_heads: Callable[[Config], int]      # attention's key/value heads (GPT-2: one per query head)
    model_file: ModelFile
    hf: HFMapping

    def presets(self) -> list[str]:
        return list(self.preset_names)
