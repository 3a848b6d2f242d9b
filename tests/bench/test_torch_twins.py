"""The PyTorch twins `llmc bench train --compare torch` times (llmc_cli/bench/torch_gpt2.py, torch_llama3.py):
the same model as llmc's from the same flat parameters (loss, every gradient)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from llmc_test_support import make_backend

torch = pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli.bench.torch_gpt2 import build_torch_gpt2  # noqa: E402
from llmc_cli.bench.torch_llama3 import build_torch_llama3  # noqa: E402
from llmc_cli.models import gpt2, llama3  # noqa: E402
from llmc_cli.models.llama3 import Llama3, Llama3Config, parameter_shapes  # noqa: E402
from torch_llama3 import forward as oracle_forward  # noqa: E402

# GQA (4 query heads on 2 kv heads), Llama 3.1 rope scaling that moves some frequencies (original context 16)
TINY = Llama3Config(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                    ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=8.0, rope_original_context=16)
B, T = 2, 12


def _perturbed(cfg, seed):
    """llmc's init plus noise: norms away from 1 and larger weights, so every path carries signal."""
    flat = llama3.init_parameters(cfg, seed)
    flat += np.random.default_rng(seed + 1).normal(0, 0.05, flat.shape).astype(np.float32)
    return flat


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _twin_grads(model, cfg) -> dict[str, np.ndarray]:
    """The twin's gradients gathered back into llmc's tensors (per-layer ones stacked over layers)."""
    g = {n: p.grad.detach().double().numpy() for n, p in model.named_parameters()}
    per_layer = {"attn_norm": "attn_norm", "wqkv": "wqkv.weight", "wo": "wo.weight", "ffn_norm": "ffn_norm",
                 "w13": "w13.weight", "w2": "w2.weight"}
    out = {"wte": g["wte.weight"], "norm": g["norm"]}
    if not cfg.tie_embeddings:
        out["lm_head"] = g["lm_head.weight"]
    for ours, theirs in per_layer.items():
        out[ours] = np.stack([g[f"blocks.{l}.{theirs}"] for l in range(cfg.n_layer)])
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "repeat_kv"])
def test_llama_twin_matches_llmc_cpu_and_the_oracle(tied, gqa):
    cfg = replace(TINY, tie_embeddings=tied)
    flat = _perturbed(cfg, 3)
    x, y = _batch(cfg)
    # llmc's cpu backend (float32)
    cpu = make_backend("cpu")
    m = Llama3(cfg, cpu, B, T)
    m.load_parameters(flat)
    m.zero_grad()
    m.forward(x, y, dloss=1.0 / (B * T))
    m.backward()
    ours_loss = m.mean_loss()
    ours_grads = llama3.split_flat(cpu.download(m.grads.buf), parameter_shapes(cfg))
    # the twin, float32 as the bench runs it
    model = build_torch_llama3(cfg, flat, T, gqa=gqa)
    assert model.attention == ("SDPA enable_gqa" if gqa else "SDPA, kv heads repeated")
    loss = model(torch.tensor(x).long(), torch.tensor(y).long())
    loss.backward()
    assert abs(loss.item() - ours_loss) < 2e-6 * ours_loss
    theirs = _twin_grads(model, cfg)
    assert set(theirs) == set(ours_grads)
    for name, g in ours_grads.items():
        assert _rel(theirs[name], g) < 1e-4, name
    # the oracle (float64, explicit attention, complex rotary) against the twin in float64
    model64 = build_torch_llama3(cfg, flat, T, gqa=gqa).double()
    loss64 = model64(torch.tensor(x).long(), torch.tensor(y).long())
    _, loss_ref = oracle_forward(torch.tensor(flat, dtype=torch.float64), cfg, torch.tensor(x).long(),
                                 torch.tensor(y).long())
    assert abs(loss64.item() - loss_ref.item()) < 1e-12 * loss_ref.item()


def test_twins_decay_llmcs_tensors():
    """AdamW decays the tensors llmc decays (its DECAYED set: the matrices), none of the norms or biases."""
    g_cfg = gpt2.preset("d2", n_embd=32, vocab_size=64, block_size=16)
    twins = (build_torch_gpt2(g_cfg, gpt2.init_parameters(g_cfg, 0), gpt2.parameter_shapes(g_cfg)),
             build_torch_llama3(TINY, llama3.init_parameters(TINY, 0), T))
    for model in twins:
        params = dict(model.named_parameters())
        assert model.decayed and model.decayed == {n for n, p in params.items() if p.dim() >= 2}
    assert {"norm", "blocks.0.attn_norm"} <= set(params) - model.decayed
