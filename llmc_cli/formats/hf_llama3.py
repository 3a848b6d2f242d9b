"""Hugging Face interop for Llama 3: a directory with config.json (LlamaForCausalLM) and safetensors weights under
transformers' names, single-file or sharded with model.safetensors.index.json, read and written without torch
(the directory and file handling is hf.py's, shared with GPT-2).

transformers' Llama applies rotary embeddings to the two halves of each head (rotate_half) where Meta's code,
and llmc's rope kernels, rotate adjacent pairs; Meta's conversion script therefore permutes the rows of q_proj
and k_proj. Import undoes that permutation, export applies it, so a round trip is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes
from llmc_cli.formats.hf import (
    LLMC_TOKENIZER_KEY,
    TOKENIZER_FILE,
    check_layer_count,
    hf_field_names,
    read_config_json,
    read_hf_tensors,
    write_hf_weights,
)
from llmc_cli.models.base import split_flat
from llmc_cli.models.llama3 import Llama3Config, num_parameters, parameter_shapes


def hf_config(cfg: Llama3Config, dtype: str = "float32", tokenizer: str = "llama3") -> dict:
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling, "low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_context}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "bos_token_id": 128000, "eos_token_id": 128001,
    } | ({LLMC_TOKENIZER_KEY: "gpt2", "bos_token_id": 50256, "eos_token_id": 50256} if tokenizer == "gpt2" else {})


HF_KEYS = {"block_size": "max_position_embeddings", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
           "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size", "norm_eps": "rms_norm_eps",
           "rope_scaling": "rope_scaling.factor", "rope_low_freq_factor": "rope_scaling.low_freq_factor",
           "rope_high_freq_factor": "rope_scaling.high_freq_factor", "tie_embeddings": "tie_word_embeddings",
           "rope_original_context": "rope_scaling.original_max_position_embeddings"}


def read_hf_config(path: str | Path) -> Llama3Config:
    path = Path(path)
    c = read_config_json(path)
    if c.get("model_type") != "llama":
        raise CheckpointError(f"{path}: config.json is for model_type {c.get('model_type')!r}, not a Llama "
                                   f"(llama)")
    # what llmc's Llama does not compute: a config asking for it is another model, not one to load without it
    for key, ours in (("hidden_act", ("silu", "swish")), ("attention_bias", (False,)), ("mlp_bias", (False,))):
        if key in c and not any(c[key] is v if isinstance(v, bool) else c[key] == v for v in ours):
            raise CheckpointError(f"{path}/config.json: {key} {json.dumps(c[key])[:80]} is not supported (llmc's "
                                  f"Llama has {key} {json.dumps(ours[0])})")
    scaling = c.get("rope_scaling") or None
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"{path}/config.json: rope_scaling must be an object or null (got {scaling!r:.80})")
    if scaling is not None and (kind := scaling.get("rope_type", scaling.get("type"))) != "llama3":
        raise CheckpointError(f"{path}/config.json: rope_scaling.rope_type {kind!r:.80} is not supported (only "
                              "llama3 scaling is)")
    if c.get(LLMC_TOKENIZER_KEY, "llama3") not in ("gpt2", "llama3"):  # (else read as Llama 3's without a word)
        raise CheckpointError(f"{path}/config.json: {LLMC_TOKENIZER_KEY} {c[LLMC_TOKENIZER_KEY]!r:.80} is not a "
                              "tokenizer llmc knows ('gpt2' or 'llama3')")
    try:
        C, NH = c["hidden_size"], c["num_attention_heads"]
        cfg = Llama3Config(  # the values as JSON typed them: validate() refuses "16", true or 1.5 for a count
            block_size=c.get("max_position_embeddings", 8192), vocab_size=c["vocab_size"],
            n_layer=c["num_hidden_layers"], n_head=NH, n_kv_head=c.get("num_key_value_heads", NH),
            n_embd=C, norm_eps=c.get("rms_norm_eps", 1e-5), rope_theta=c.get("rope_theta", 10000.0),
            rope_scaling=None if scaling is None else scaling["factor"],
            rope_low_freq_factor=(scaling or {}).get("low_freq_factor", 1.0),
            rope_high_freq_factor=(scaling or {}).get("high_freq_factor", 4.0),
            rope_original_context=(scaling or {}).get("original_max_position_embeddings", 8192),
            tie_embeddings=c.get("tie_word_embeddings", False),
            intermediate_size=c["intermediate_size"])
        cfg.validate()
        if c.get("head_dim", cfg.head_dim) != cfg.head_dim:
            raise ValueError("head_dim must be hidden_size / num_attention_heads")
    except KeyError as e:
        raise CheckpointError(f"{path}/config.json: bad Llama config (no field {e})") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: bad Llama config ({hf_field_names(e, HF_KEYS)})") from None
    return cfg


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Meta (adjacent pairs) -> transformers (halves) row order of a q or k projection."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def to_hf_tensors(cfg: Llama3Config, params: np.ndarray) -> dict[str, np.ndarray]:
    p = split_flat(np.asarray(params, dtype=np.float32), parameter_shapes(cfg))
    NH, NKV, hd, H = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.hidden_dim
    t = {"model.embed_tokens.weight": p["wte"]}
    for l in range(cfg.n_layer):
        pre = f"model.layers.{l}."
        q, k, v = np.split(p["wqkv"][l], [NH * hd, (NH + NKV) * hd])
        t[pre + "input_layernorm.weight"] = p["attn_norm"][l]
        t[pre + "self_attn.q_proj.weight"] = _permute(q, NH)
        t[pre + "self_attn.k_proj.weight"] = _permute(k, NKV)
        t[pre + "self_attn.v_proj.weight"] = v
        t[pre + "self_attn.o_proj.weight"] = p["wo"][l]
        t[pre + "post_attention_layernorm.weight"] = p["ffn_norm"][l]
        t[pre + "mlp.gate_proj.weight"] = p["w13"][l][:H]
        t[pre + "mlp.up_proj.weight"] = p["w13"][l][H:]
        t[pre + "mlp.down_proj.weight"] = p["w2"][l]
    t["model.norm.weight"] = p["norm"]
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = p["lm_head"]
    return t


def tokenizer_model_bytes(tokenizer_file: str | Path) -> bytes:
    """The bytes a copy of a Llama 3 tokenizer gets under the name tokenizer.model (Meta's tiktoken format): a
    Hugging Face tokenizer.json's ranks converted, never its JSON (which no reader of that name would take)."""
    from llmc_cli.data.tokenizer import TokenizerError, ranks_file_bytes
    try:
        return ranks_file_bytes(tokenizer_file)
    except TokenizerError as e:
        raise CheckpointError(f"cannot copy the tokenizer ({e})") from None


def export_hf(out_dir: str | Path, cfg: Llama3Config, params: np.ndarray, bf16: bool = False,
              max_shard_bytes: int = 5 * 2**30, tokenizer: str = "llama3",
              tokenizer_file: str | Path | None = None) -> Path:
    """Writes config.json and the weights, split into shards of at most `max_shard_bytes` with an index file
    when they do not fit one (transformers' naming: model-00001-of-00003.safetensors). `tokenizer` "gpt2" (a
    model llmc trained from scratch on GPT-2 shards) is recorded in config.json; a Llama 3 `tokenizer_file`
    is copied in as tokenizer.model."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, to_hf_tensors(cfg, params), bf16, max_shard_bytes)
    if tokenizer_file is not None and Path(tokenizer_file).resolve() != (out / TOKENIZER_FILE).resolve():
        atomic_write_bytes(out / TOKENIZER_FILE, [tokenizer_model_bytes(tokenizer_file)])
    conf = json.dumps(hf_config(cfg, "bfloat16" if bf16 else "float32", tokenizer), indent=2) + "\n"
    atomic_write_bytes(out / "config.json", [conf.encode()])
    _write_tokenizer(out, cfg, tokenizer, out / TOKENIZER_FILE)
    return out


def _write_tokenizer(out: Path, cfg: Llama3Config, tokenizer: str, ranks_file: Path) -> None:
    """The files transformers' tokenizers read, beside the weights: Llama 3's as tokenizer.json (from its
    tokenizer.model, when it is there), GPT-2's as vocab.json / merges.txt for a Llama llmc trained on GPT-2
    shards. Nothing when the tokenizer is not at hand (the directory still loads as a model)."""
    from llmc_cli.data.tokenizer import GPT2_EOT, LLAMA3_PAT_STR, LLAMA3_SPECIALS, TokenizerError, gpt2_ranks, llama3_ranks
    from llmc_cli.formats.hf_tokenizer import write_gpt2_tokenizer, write_tiktoken_tokenizer
    try:
        if tokenizer == "gpt2" and cfg.vocab_size == 50257:
            write_gpt2_tokenizer(out, gpt2_ranks(), GPT2_EOT, 50256, cfg.block_size)
        elif tokenizer == "llama3" and ranks_file.is_file():
            ranks = llama3_ranks(ranks_file)
            specials = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIALS)}
            write_tiktoken_tokenizer(out, ranks, LLAMA3_PAT_STR, specials, "<|begin_of_text|>", "<|end_of_text|>",
                                     cfg.block_size)
    except TokenizerError as e:
        raise CheckpointError(f"{out}: cannot write the tokenizer files ({e})") from None


def import_hf(path: str | Path) -> tuple[Llama3Config, np.ndarray]:
    """(config, float32 parameters in llmc's Llama layout) from a Hugging Face Llama directory."""
    path = Path(path)
    cfg = read_hf_config(path)
    t = read_hf_tensors(path)
    NH, NKV, hd, H, C, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.hidden_dim, cfg.n_embd, cfg.vocab_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in t:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        if tuple(t[name].shape) != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(t[name].shape)}, "
                                       f"expected {shape}")
        return t[name]

    # every tensor is found and its shape checked before the parameters are allocated: a config.json describing
    # a model far larger than its weights is refused here, not allocated
    check_layer_count(path, t, r"model\.layers\.(\d+)\.", "num_hidden_layers", cfg.n_layer)
    wte = get("model.embed_tokens.weight", (V, C))
    layer_shapes = (("input_layernorm.weight", (C,)), ("self_attn.q_proj.weight", (NH * hd, C)),
                    ("self_attn.k_proj.weight", (NKV * hd, C)), ("self_attn.v_proj.weight", (NKV * hd, C)),
                    ("self_attn.o_proj.weight", (C, NH * hd)), ("post_attention_layernorm.weight", (C,)),
                    ("mlp.gate_proj.weight", (H, C)), ("mlp.up_proj.weight", (H, C)), ("mlp.down_proj.weight", (C, H)))
    layers = [[get(f"model.layers.{l}.{name}", shape) for name, shape in layer_shapes] for l in range(cfg.n_layer)]
    norm = get("model.norm.weight", (C,))
    head = None if cfg.tie_embeddings else get("lm_head.weight", (V, C))
    params = np.empty(num_parameters(cfg), dtype=np.float32)
    p = split_flat(params, parameter_shapes(cfg))
    p["wte"][...] = wte
    for l, (attn_norm, q, k, v, o, ffn_norm, gate, up, down) in enumerate(layers):
        p["attn_norm"][l] = attn_norm
        p["wqkv"][l] = np.concatenate([_unpermute(q, NH), _unpermute(k, NKV), v])
        p["wo"][l] = o
        p["ffn_norm"][l] = ffn_norm
        p["w13"][l] = np.concatenate([gate, up])
        p["w2"][l] = down
    p["norm"][...] = norm
    if head is not None:
        p["lm_head"][...] = head
    return cfg, params
