"""GPT-2 in a Hugging Face directory: config.json (GPT2LMHeadModel) and model.safetensors under transformers'
names.

transformers' GPT-2 uses Conv1D layers, whose weights are (in_features, out_features): the transpose of llm.c's
(OC, C). wte is stored with the real vocabulary (llm.c pads it to a multiple of 128 with zero rows) and the
language-model head is tied to it, so no lm_head.weight is written (one that is present is ignored on import).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes
from llmc_cli.formats.hf import (
    GPT2_HF_KEYS,
    check_layer_count,
    hf_field_names,
    read_config_json,
    read_hf_tensors,
    write_hf_weights,
)
from llmc_cli.models.base import split_flat
from llmc_cli.models.gpt2 import GPT2Config, parameter_shapes


# ---- GPT-2 <-> transformers' names ----------------------------------------------------------------------------
def _layer_map(l: int) -> list[tuple[str, str, bool]]:
    """(llm.c tensor, HF name, transposed) for layer l."""
    h = f"transformer.h.{l}."
    return [("ln1w", h + "ln_1.weight", False), ("ln1b", h + "ln_1.bias", False),
            ("qkvw", h + "attn.c_attn.weight", True), ("qkvb", h + "attn.c_attn.bias", False),
            ("attprojw", h + "attn.c_proj.weight", True), ("attprojb", h + "attn.c_proj.bias", False),
            ("ln2w", h + "ln_2.weight", False), ("ln2b", h + "ln_2.bias", False),
            ("fcw", h + "mlp.c_fc.weight", True), ("fcb", h + "mlp.c_fc.bias", False),
            ("fcprojw", h + "mlp.c_proj.weight", True), ("fcprojb", h + "mlp.c_proj.bias", False)]


def to_hf_tensors(cfg: GPT2Config, params: np.ndarray) -> dict[str, np.ndarray]:
    p = split_flat(np.asarray(params, dtype=np.float32), parameter_shapes(cfg))
    t = {"transformer.wte.weight": p["wte"][:cfg.vocab_size], "transformer.wpe.weight": p["wpe"]}
    for l in range(cfg.n_layer):
        for ours, theirs, tr in _layer_map(l):
            t[theirs] = p[ours][l].T if tr else p[ours][l]
    t["transformer.ln_f.weight"], t["transformer.ln_f.bias"] = p["lnfw"], p["lnfb"]
    return t


def hf_config(cfg: GPT2Config, dtype: str = "float32") -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256, "use_cache": True,
        "torch_dtype": dtype,
    }


def export_hf(out_dir: str | Path, cfg: GPT2Config, params: np.ndarray, bf16: bool = False) -> Path:
    """Writes config.json + model.safetensors (F32, or BF16) into `out_dir` (created)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, to_hf_tensors(cfg, params), bf16)
    conf = json.dumps(hf_config(cfg, "bfloat16" if bf16 else "float32"), indent=2) + "\n"
    atomic_write_bytes(out / "config.json", [conf.encode()])
    _write_tokenizer(out, cfg)
    return out


def _write_tokenizer(out: Path, cfg: GPT2Config) -> None:
    """GPT-2's tokenizer beside the weights (vocab.json, merges.txt, ...), so transformers' AutoTokenizer and
    pipeline work offline on the directory; a model with another vocabulary gets none (it has no GPT-2 ids)."""
    from llmc_cli.data.tokenizer import GPT2_EOT, TokenizerError, gpt2_ranks
    from llmc_cli.formats.hf_tokenizer import write_gpt2_tokenizer
    if cfg.vocab_size != 50257:
        return
    try:
        ranks = gpt2_ranks()
    except TokenizerError as e:
        raise CheckpointError(f"{out}: cannot write GPT-2's tokenizer files ({e})") from None
    write_gpt2_tokenizer(out, ranks, GPT2_EOT, len(ranks), cfg.block_size)



LAYERNORM_EPS = 1e-5  # llm.c's, fixed in every backend's layernorm (config.json may say otherwise)


def read_hf_config(path: str | Path) -> GPT2Config:
    path = Path(path)
    c = read_config_json(path)
    if c.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}: config.json is for model_type {c.get('model_type')!r}, not a GPT-2 (gpt2)")
    try:
        cfg = GPT2Config(block_size=c["n_positions"], vocab_size=c["vocab_size"], n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"])
        cfg.validate()  # the fields' JSON types too: "12" or true is not a layer count
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json: bad GPT-2 config (no field {e})") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: bad GPT-2 config ({hf_field_names(e, GPT2_HF_KEYS)})") from None
    inner = c.get("n_inner")
    if inner not in (None, 4 * cfg.n_embd):
        raise CheckpointError(f"{path}: n_inner {inner} is not 4*n_embd, which llm.c's GPT-2 requires")
    # what llm.c's GPT-2 does not compute (transformers' defaults are llm.c's): such a config is another model
    for key, ours in (("tie_word_embeddings", True), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False)):
        if key in c and c[key] is not ours:
            raise CheckpointError(f"{path}/config.json: {key} {json.dumps(c[key])[:80]} is not supported (llm.c's "
                                  f"GPT-2 has {key} {json.dumps(ours)})")
    eps = c.get("layer_norm_epsilon", LAYERNORM_EPS)
    if type(eps) not in (int, float) or not abs(eps - LAYERNORM_EPS) <= 1e-3 * LAYERNORM_EPS:  # (NaN too)
        raise CheckpointError(f"{path}/config.json: layer_norm_epsilon {eps!r:.80} is not {LAYERNORM_EPS}, which "
                              "llm.c's layernorm kernels use")
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise CheckpointError(f"{path}: activation {act!r}; llmc's GPT-2 uses the tanh GELU (gelu_new)")
    return cfg


def import_hf(path: str | Path) -> tuple[GPT2Config, np.ndarray]:
    """(config, float32 parameters in llm.c's layout) from a Hugging Face GPT-2 directory."""
    path = Path(path)
    cfg = read_hf_config(path)
    tensors = {name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name: a
               for name, a in read_hf_tensors(path).items()}

    def get(name: str, shape: tuple) -> np.ndarray:
        a = tensors.get(name)
        if a is None:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        if a.shape != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {a.shape}, config says {shape}")
        return a

    # every tensor is found and its shape checked before the parameters are allocated: a config.json describing
    # a model far larger than its weights is refused here, not allocated
    check_layer_count(path, tensors, r"transformer\.h\.(\d+)\.", "n_layer", cfg.n_layer)
    C, V = cfg.n_embd, cfg.vocab_size
    wte, wpe = get("transformer.wte.weight", (V, C)), get("transformer.wpe.weight", (cfg.block_size, C))
    shapes = dict(parameter_shapes(cfg))
    layers = [[(ours, get(theirs, shapes[ours][1:][::-1]).T if tr else get(theirs, shapes[ours][1:]))
               for ours, theirs, tr in _layer_map(l)] for l in range(cfg.n_layer)]
    lnfw, lnfb = get("transformer.ln_f.weight", (C,)), get("transformer.ln_f.bias", (C,))
    p = {n: np.zeros(s, np.float32) for n, s in parameter_shapes(cfg)}
    p["wte"][:V], p["wpe"][...], p["lnfw"][...], p["lnfb"][...] = wte, wpe, lnfw, lnfb
    for l, layer in enumerate(layers):
        for ours, a in layer:
            p[ours][l] = a
    return cfg, np.concatenate([p[n].reshape(-1) for n, _ in parameter_shapes(cfg)])
