"""Hugging Face Llama checkpoints: import a sharded directory written here in transformers' exact layout, check
llmc's logits against a transformers-style PyTorch forward over the HF tensors, and export back bit-exactly."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli.formats import checkpoint as ckpt  # noqa: E402
from llmc_cli.models.llama3 import Llama3  # noqa: E402
from llmc_cli.formats.hf_llama3 import export_hf, import_hf
from llmc_cli.formats.hf import read_hf_tensors  # noqa: E402
from llmc_test_support import LLAMA_HF_CONFIG as CONFIG  # noqa: E402
from llmc_test_support import hf_tensors, write_hf_dir, write_st  # noqa: E402,F401

def hf_reference_logits(t, c, idx, cfg):
    """transformers' LlamaForCausalLM formulation: rotate_half on permuted q/k, repeat_kv, float64."""
    T = {n: torch.tensor(a, dtype=torch.float64) for n, a in t.items()}
    B, S = idx.shape
    NH, NKV, C = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    hd = C // NH
    from llmc_cli.models.llama3 import rope_frequencies
    inv = torch.tensor(rope_frequencies(cfg))  # Llama 3.1 scaling, checked against Meta's loop elsewhere
    ang = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rot_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([-x2, x1], dim=-1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w

    x = T["model.embed_tokens.weight"][torch.tensor(idx).long()]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms(x, T[p + "input_layernorm.weight"])
        q = (h @ T[p + "self_attn.q_proj.weight"].T).view(B, S, NH, hd).transpose(1, 2)
        k = (h @ T[p + "self_attn.k_proj.weight"].T).view(B, S, NKV, hd).transpose(1, 2)
        v = (h @ T[p + "self_attn.v_proj.weight"].T).view(B, S, NKV, hd).transpose(1, 2)
        q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
        k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, S, C) @ T[p + "self_attn.o_proj.weight"].T
        h = rms(x, T[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(h @ T[p + "mlp.gate_proj.weight"].T) * (h @ T[p + "mlp.up_proj.weight"].T)
        x = x + g @ T[p + "mlp.down_proj.weight"].T
    return (rms(x, T["model.norm.weight"]) @ T["lm_head.weight"].T).numpy()


def test_import_matches_transformers_layout_and_export_round_trips(tmp_path, cpu):
    rng = np.random.default_rng(0)
    t = hf_tensors(CONFIG, rng)
    write_hf_dir(tmp_path / "hf", t)
    cfg, params = import_hf(tmp_path / "hf")
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.hidden_dim, cfg.rope_scaling) == (2, 4, 2, 176, 8.0)
    idx = rng.integers(0, CONFIG["vocab_size"], (2, 11)).astype(np.int32)
    m = Llama3(cfg, cpu, 2, 11, training=False)
    m.load_parameters(params)
    m.forward(idx)
    ref = hf_reference_logits(t, CONFIG, idx, cfg)
    got = cpu.download(m.acts["logits"])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    # export (sharded, as the source was) and read back: the same tensors bit for bit
    export_hf(tmp_path / "out", cfg, params, max_shard_bytes=60_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    back = read_hf_tensors(tmp_path / "out")
    assert set(back) == set(t) and all(np.array_equal(back[n], t[n]) for n in t)
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_key_value_heads", "rope_scaling", "tie_word_embeddings"):
        assert conf[key] == CONFIG[key], key


def test_bad_hf_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ckpt.CheckpointError, match="not a Llama"):
        import_hf(tmp_path / "a")
    t = hf_tensors(CONFIG, np.random.default_rng(1))
    del t["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(CONFIG))
    write_st(tmp_path / "b" / "model.safetensors", t)
    with pytest.raises(ckpt.CheckpointError, match="up_proj.weight is missing"):
        import_hf(tmp_path / "b")
