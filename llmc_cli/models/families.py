"""The model families the engine trains, and what the engine needs to know of each: its config, presets,
parameter table, activation plan and model class. `family_for(name)` maps a --model name to its family."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from llmc_cli.models import gpt2, llama3
from llmc_cli.kernels import BFLOAT16


@dataclass(frozen=True)
class Family:
    name: str
    module: ModuleType   # gpt2 or llama3: preset, init_parameters, num_parameters, parameter_shapes, ...
    model_class: type
    config_class: type

    def preset(self, name: str, **overrides):
        return self.module.preset(name, **overrides)

    def presets(self) -> list[str]:
        return list(self.module.PRESETS) + list(getattr(self.module, "ALIASES", {}))


GPT2 = Family("gpt2", gpt2, gpt2.GPT2, gpt2.GPT2Config)
LLAMA3 = Family("llama3", llama3, llama3.Llama3, llama3.Llama3Config)
FAMILIES = (GPT2, LLAMA3)


def family_for(model: str) -> Family:
    """The family of a --model preset name (d12 -> gpt2, llama3.2-1b -> llama3)."""
    for f in FAMILIES:
        if model in f.presets():
            return f
    names = ", ".join(n for f in FAMILIES for n in f.presets())
    raise ValueError(f"unknown model '{model}' (presets: {names})")


def family_of_config(cfg) -> Family:
    for f in FAMILIES:
        if isinstance(cfg, f.config_class):
            return f
    raise TypeError(f"no model family for {type(cfg).__name__}")


def memory_plan(cfg, B: int, T: int, dtype: str, training: bool = True, recompute: str = "none") -> dict[str, int]:
    """Bytes the engine will allocate, by component, without allocating anything (for --dry-run)."""
    fam = family_of_config(cfg)
    act_bytes = 2 if dtype == BFLOAT16 else 4
    n = fam.module.num_parameters(cfg)
    plan = {"parameters": n * act_bytes}
    if training:
        plan["gradients"] = n * act_bytes
        plan["optimizer (m, v" + (", fp32 master)" if dtype == BFLOAT16 else ")")] = \
            n * 4 * (3 if dtype == BFLOAT16 else 2)
    acts = 0
    extra = {}
    if fam is GPT2:  # the same classifier chunking and placement as GPT2.__init__ plans
        extra = {"recompute": recompute,
                 "chunks": gpt2.auto_classifier_chunks(cfg, B, T, training, act_bytes, recompute)}
    aliased = getattr(fam.module, "in_logits", lambda *a, **k: {})(cfg, B, T, training, **extra)
    for name, shape, kind, per_layer in fam.module.activation_shapes(cfg, B, T, training, **extra):
        if name in aliased or (training and name in getattr(fam.module, "SCRATCH_PARTNER", {})):
            continue  # placed inside the logits buffer or in its partner's memory: none of its own
        elems = int(np.prod(shape)) * (cfg.n_layer if per_layer else 1)
        acts += elems * (act_bytes if kind == "act" else 4)
    plan["activations"] = acts
    return plan
