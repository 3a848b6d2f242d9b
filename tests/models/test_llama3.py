"""Llama 3 on every installed backend against a PyTorch reference: logits, loss, every gradient, 10 steps."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli.models import llama3  # noqa: E402
from llmc_cli.models.llama3 import Llama3, Llama3Config, init_parameters, num_parameters, parameter_shapes  # noqa: E402
from llmc_cli.optim import AdamW, AdamWConfig  # noqa: E402
from torch_llama3 import forward as torch_forward  # noqa: E402
from llmc_test_support import dtype_tol as tol  # noqa: E402
from llmc_test_support import rel_err as rel  # noqa: E402

# GQA (4 query heads on 2 kv heads), rope scaling on, a hidden size from the multiple_of rule
TINY = Llama3Config(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                    ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=8.0, rope_original_context=16)


def perturbed(cfg, seed):
    flat = init_parameters(cfg, seed)
    flat += np.random.default_rng(seed + 1).normal(0, 0.05, flat.shape).astype(np.float32)
    return flat


@pytest.mark.parametrize("tied", [False, True])
def test_forward_backward_match_torch(backend, tied):
    cfg = Llama3Config(**{**TINY.__dict__, "tie_embeddings": tied})
    B, T = 2, 9
    flat = perturbed(cfg, 3)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    m = Llama3(cfg, backend, B, T)
    m.load_parameters(flat)
    ref = torch.tensor(flat, dtype=torch.float64, requires_grad=True)
    logits_ref, loss_ref = torch_forward(ref, cfg, torch.tensor(x).long(), torch.tensor(y).long())
    loss_ref.backward()
    m.forward(x)
    assert rel(backend.download(m.acts["logits"]), logits_ref.detach().numpy()) < tol(backend, 1e-5, 2e-2)
    m.zero_grad()
    m.forward(x, y, dloss=1.0 / (B * T))
    assert abs(m.mean_loss() - loss_ref.item()) < tol(backend, 1e-5, 2e-2) * loss_ref.item()
    m.backward()
    g, gref, off = backend.download(m.grads.buf).astype(np.float64), ref.grad.numpy(), 0
    for name, shape in parameter_shapes(cfg):
        n = int(np.prod(shape))
        assert rel(g[off:off + n], gref[off:off + n]) < tol(backend, 1e-4, 5e-2), name
        off += n


def test_ten_steps_match_torch(backend):
    cfg, B, T = TINY, 2, 8
    flat = perturbed(cfg, 5)
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)) for _ in range(3)]
    ocfg = AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    m = Llama3(cfg, backend, B, T)
    m.load_parameters(flat)
    opt = AdamW(backend, m.params, m.grads, m.tensor_names(), ocfg)
    opt.sync_master_from_params()
    ours = []
    for s in range(10):
        x, y = batches[s % 3]
        m.zero_grad()
        m.forward(x, y, dloss=1.0 / (B * T))
        m.backward()
        ours.append(m.mean_loss())
        opt.step(ocfg.lr, opt.grad_norm(), seed=s)
    # reference: torch AdamW over the same flat vector, decay only on matrices
    w = torch.tensor(flat, dtype=torch.float64)
    mask = torch.cat([torch.full((int(np.prod(s)),), n in llama3.DECAYED, dtype=torch.bool)
                      for n, s in parameter_shapes(cfg)])
    pd, pp = torch.nn.Parameter(w[mask].clone()), torch.nn.Parameter(w[~mask].clone())
    opt_t = torch.optim.AdamW([{"params": [pd], "weight_decay": 0.1}, {"params": [pp], "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ref = []
    for s in range(10):
        x, y = batches[s % 3]
        full = torch.empty_like(w)
        full[mask], full[~mask] = pd, pp
        _, loss = torch_forward(full, cfg, torch.tensor(x).long(), torch.tensor(y).long())
        opt_t.zero_grad()
        loss.backward()
        norm = math.sqrt(float(pd.grad.pow(2).sum() + pp.grad.pow(2).sum()))
        if norm > 1.0:
            pd.grad.mul_(1.0 / norm)
            pp.grad.mul_(1.0 / norm)
        opt_t.step()
        ref.append(float(loss.detach()))
    np.testing.assert_allclose(ours, ref, rtol=tol(backend, 1e-4, 2e-2))


def test_real_preset_shapes():
    """Parameter counts of Meta's released models (tied heads for 3.2 1B/3B, untied for 3.1 8B)."""
    assert llama3.preset("llama3.2-1b").hidden_dim == 8192
    assert llama3.preset("llama3.2-3b").hidden_dim == 8192
    assert llama3.preset("llama3.1-8b").hidden_dim == 14336
    assert num_parameters(llama3.preset("llama3.2-1b")) == 1235814400
    assert num_parameters(llama3.preset("llama3.2-3b")) == 3212749824
    assert num_parameters(llama3.preset("llama3.1-8b")) == 8030261248
    with pytest.raises(ValueError, match="unknown model"):
        llama3.preset("llama3-70b")


def test_rope_scaling_matches_llama31_reference():
    """Meta's apply_scaling, written out literally, against the vectorised version."""
    cfg = llama3.preset("llama3.1-8b")
    hd = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2)[: hd // 2] / hd)
    expect = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            expect.append(f)
        elif wavelen > 8192 / 1:
            expect.append(f / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            expect.append((1 - smooth) * f / 8 + smooth * f)
    np.testing.assert_allclose(llama3.rope_frequencies(cfg), expect, rtol=1e-12)
