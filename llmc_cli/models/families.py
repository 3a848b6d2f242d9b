"""The model families the engine trains, GPT-2 and Llama 3, each one `Family` value (family.py), and the lookups:
`family_for(--model name)`, `family_of(config)`. A new family is a new value here, not a new branch elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc_cli.formats import hf_gpt2, hf_llama3, llama_file, llmc_bin
from llmc_cli.kernels import BFLOAT16, FP8
from llmc_cli.models import gpt2, llama3
from llmc_cli.models.family import Family, HFMapping, ModelFile


def _write_gpt2(path: str | Path, cfg, params: np.ndarray, bf16: bool = False, tokenizer: str = "gpt2") -> None:
    llmc_bin.write_model(path, cfg, params, bf16=bf16, tokenizer=tokenizer)  # (GPT-2's: llm.c's header as it is)


def _read_gpt2(path: str | Path):
    cfg, params, _ = llmc_bin.read_model(path)
    return cfg, params


def _save_gpt2_hf(out_dir, cfg, params, bf16=False, tokenizer="gpt2", tokenizer_file=None) -> Path:
    return hf_gpt2.export_hf(out_dir, cfg, params, bf16=bf16)


GPT2 = Family(
    name="gpt2", label="GPT-2", tokenizer="gpt2", config_class=gpt2.GPT2Config, model_class=gpt2.GPT2, preset_names=tuple(gpt2.PRESETS),
    preset=gpt2.preset, parameter_shapes=gpt2.parameter_shapes, num_parameters=gpt2.num_parameters,
    init_parameters=gpt2.init_parameters, activation_bytes=gpt2.activation_bytes, kv_heads=lambda c: c.n_head,
    model_file=ModelFile("model.bin", lambda bf16: f"llm.c model file (version {5 if bf16 else 3})", _write_gpt2, _read_gpt2, lambda p: llmc_bin.read_model_header(p)[0]),
    hf=HFMapping("gpt2", hf_gpt2.read_hf_config, hf_gpt2.import_hf, _save_gpt2_hf),
)
LLAMA3 = Family(
    name="llama3", label="Llama 3", tokenizer="llama3", config_class=llama3.Llama3Config, model_class=llama3.Llama3,
    preset_names=tuple(llama3.PRESETS) + tuple(llama3.ALIASES), preset=llama3.preset,
    parameter_shapes=llama3.parameter_shapes, num_parameters=llama3.num_parameters,
    init_parameters=llama3.init_parameters, activation_bytes=llama3.activation_bytes, kv_heads=lambda c: c.n_kv_head,
    model_file=ModelFile("model.safetensors", lambda bf16: "llmc Llama model file", llama_file.write_llama_model, llama_file.read_llama_model,
                         lambda p: llama_file.read_llama_header(p)[0]),
    hf=HFMapping("llama", hf_llama3.read_hf_config, hf_llama3.import_hf, hf_llama3.export_hf),
)
FAMILIES: dict[str, Family] = {f.name: f for f in (GPT2, LLAMA3)}


def family_for(model: str) -> Family:
    """The family of a --model preset name (d12 -> gpt2, llama3.2-1b -> llama3)."""
    for f in FAMILIES.values():
        if model in f.preset_names:
            return f
    names = ", ".join(n for f in FAMILIES.values() for n in f.preset_names)
    raise ValueError(f"unknown model '{model}' (presets: {names})")


def family_of(cfg) -> Family:
    """The family a config belongs to (its class names it)."""
    try:
        return FAMILIES[cfg.family]
    except (AttributeError, KeyError):
        raise TypeError(f"no model family for {type(cfg).__name__}") from None


def family_of_hf(model_type: str) -> Family | None:
    """The family a Hugging Face config.json's model_type is, or None."""
    return next((f for f in FAMILIES.values() if f.hf.model_type == model_type), None)


def memory_plan(cfg, B: int, T: int, dtype: str, training: bool = True, recompute: str = "none",
                world_size: int = 1, zero: int = 0, overlap: bool = False) -> dict[str, int]:
    """Bytes the engine will allocate on one rank, by component, without allocating anything (for --dry-run). With
    ZeRO (`zero` >= 1) over `world_size` ranks a rank holds its shard of the optimizer state: n // W elements plus
    the tail of fewer than W that every rank keeps (parallel.zero.ShardedAdamW); with ZeRO-2 its gradients are such
    a shard, one layer's slot and the unstacked tensors (models.base.LayerSlotGrads). ZeRO-1 with `overlap` counts
    the inbox a communicator that copies the pieces to their owners takes (world_size - 1 chunks; the cuda plugin's
    on two GPUs with peer access, or more with `--backend-opt p2p=on`: an upper bound elsewhere)."""
    fam = family_of(cfg)
    half = dtype in (BFLOAT16, FP8)  # fp8 keeps every buffer in bf16 (only the matmuls' operands are cast)
    act_bytes = 2 if half else 4
    n = fam.num_parameters(cfg)
    plan = {"parameters": n * act_bytes}
    if training:
        held = n if zero < 1 or world_size <= 1 else n // world_size + n % world_size
        if zero >= 2:  # the shard, one layer's slot, and the tensors stacked over nothing (LayerSlotGrads)
            stacked = fam.model_class.stacked_tensors(cfg)
            shapes = fam.parameter_shapes(cfg)
            slot = sum(int(np.prod(s[1:])) for name, s in shapes if name in stacked)
            others = sum(int(np.prod(s)) for name, s in shapes if name not in stacked)
            shard = n // world_size + n % world_size
            plan[f"gradients (ZeRO-2 shard 1/{world_size}, one layer, embeddings)"] = (shard + slot + others) * act_bytes
        else:
            plan["gradients"] = n * act_bytes
            if zero == 1 and overlap and world_size > 1:
                inbox = (world_size - 1) * (n // world_size) * act_bytes
                plan["gradient inbox (--overlap; cuda: 2 GPUs, or p2p=on)"] = inbox
        key = "optimizer (m, v" + (", fp32 master)" if half else ")")
        if held < n:
            key += f", ZeRO-{zero} shard 1/{world_size}"
        plan[key] = held * 4 * (3 if half else 2)
    plan["activations"] = fam.activation_bytes(cfg, B, T, training, act_bytes, recompute)
    if dtype == FP8:
        plan["FP8 casts"] = fp8_cast_bytes(fam, cfg, B * T, training)
    return plan


def fp8_cast_bytes(fam: Family, cfg, N: int, training: bool) -> int:
    """The one scratch buffer FP8 matmuls cast their operands into (one byte an element), sized by the layer
    matmul that needs most (the classifier stays bf16 unless an option of the backend says otherwise, which this
    does not count). Forward: the input (N,C) and the weight (OC,C). Backward: the gradient transposed (N*OC),
    beside the gradient and the transposed weight, which the transposed input (N*C) then overwrites (the CUDA
    backend's _fp8_arena)."""
    mats = [s[1:] for _, s in fam.parameter_shapes(cfg) if len(s) == 3]  # per-layer (OC, C) weights
    need = [N * c + oc * c for oc, c in mats]
    if training:
        need += [N * oc + max(N * oc + oc * c, N * c) for oc, c in mats]
    return max(need)


def flops_per_token(cfg, T: int) -> int:
    """llm.c's estimate of a training step's FLOPs per token: 6 per parameter plus attention's 6*L*C*T (causal)."""
    return 6 * family_of(cfg).num_parameters(cfg) + 6 * cfg.n_layer * cfg.n_embd * T
