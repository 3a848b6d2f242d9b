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


def one_step(cfg, backend, B, T, flat, batches, **plan):
    """Losses of every micro-step and the accumulated gradient (float64) of a model planned with `plan`."""
    m = Llama3(cfg, backend, B, T, **plan)
    m.load_parameters(flat)
    m.zero_grad()
    losses = []
    for x, y in batches:
        m.forward(x, y, dloss=1.0 / (len(batches) * B * T))
        m.backward()
        losses.append(backend.download(m.acts["losses"]))
    return m, losses, backend.download(m.grads.buf).astype(np.float64)


def llama_batches(cfg, B, T, seeds):
    out = []
    for s in seeds:
        rng = np.random.default_rng(s)
        out.append((rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                    rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)))
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("recompute", ["gelu", "layernorm", "gelu+layernorm"])
def test_recompute_matches_keeping_activations(backend, recompute, tied):
    """Recomputing the SwiGLU output ("gelu") and/or the RMSNorm outputs ("layernorm") in backward gives
    bit-identical losses and gradients: the same kernels run again on the same inputs (every kernel is
    deterministic), also with gradient accumulation over two micro-steps. The recomputed buffers are one for all
    layers, ln2 and lnf living in ln1's memory."""
    cfg = Llama3Config(**{**TINY.__dict__, "tie_embeddings": tied})
    B, T = 2, 9
    flat = perturbed(cfg, 13)
    batches = llama_batches(cfg, B, T, (4, 5))
    _, l0, g0 = one_step(cfg, backend, B, T, flat, batches)
    m, l1, g1 = one_step(cfg, backend, B, T, flat, batches, recompute=recompute)
    for a, b in zip(l1, l0):
        assert np.array_equal(a, b)
    assert np.array_equal(g1, g0)
    kept = (cfg.n_layer, B, T)  # one per layer, or one (B, T, ...) buffer for all
    assert (m.acts["hs"].shape[:3] == kept) == ("gelu" not in recompute)
    assert (m.acts["ln1"].shape[:3] == kept) == ("layernorm" not in recompute)
    if "layernorm" in recompute:  # one buffer for every rmsnorm output
        backend.fill(m.acts["ln1"], 0.0)
        backend.fill(m.acts["lnf"], 2.0)
        assert backend.download(m.acts["ln2"]).reshape(-1)[0] == 2.0
    with pytest.raises(ValueError, match="^recompute must be one of"):
        Llama3(cfg, backend, B, T, recompute="swiglu")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunks", [2, 5, 18])
def test_chunked_classifier_matches_whole_batch(backend, chunks, tied):
    """The training classifier run in chunks of the B*T rows (lm-head product, fused classifier, lm-head backward
    per chunk; 5 chunks of 18 rows: 4, 4, 4, 4, 2) gives the losses and gradients of the whole-batch one, with
    gradient accumulation over two micro-steps, under recompute, and for an evaluation forward (targets, no
    dloss). Not bit-identical: a BLAS product rounds differently for a different row count (numpy's matmul of
    9 rows is not bit-for-bit its 18-row product's first rows), and the head's gradient sums the chunks in another
    order; every row's loss still agrees to float32 rounding."""
    cfg = Llama3Config(**{**TINY.__dict__, "tie_embeddings": tied})
    B, T = 2, 9
    flat = perturbed(cfg, 17)
    batches = llama_batches(cfg, B, T, (6, 7))
    _, l1, g1 = one_step(cfg, backend, B, T, flat, batches, classifier_chunks=1)
    for recompute in ("none", "gelu+layernorm"):
        m, ln, gn = one_step(cfg, backend, B, T, flat, batches, classifier_chunks=chunks, recompute=recompute)
        assert m.chunks == chunks and m.acts["logits"].shape == (-(-B * T // chunks), cfg.vocab_size)
        for a, b in zip(ln, l1):
            np.testing.assert_allclose(a, b, rtol=tol(backend, 1e-6, 1e-2), atol=tol(backend, 1e-6, 1e-2))
        assert rel(gn, g1) < tol(backend, 1e-6, 1e-2)
        m.forward(*batches[0])  # an evaluation forward on the chunked plan
        np.testing.assert_allclose(backend.download(m.acts["losses"]), l1[0], rtol=tol(backend, 1e-6, 1e-2),
                                   atol=tol(backend, 1e-6, 1e-2))
        with pytest.raises(ValueError, match="chunks"):
            m.forward(batches[0][0])  # the whole logits are not there to keep
    with pytest.raises(ValueError, match="between 1 and B\\*T"):
        Llama3(cfg, backend, B, T, classifier_chunks=B * T + 1)
    with pytest.raises(ValueError, match="inference"):
        Llama3(cfg, backend, B, T, training=False, classifier_chunks=2)


def test_classifier_chunk_plan():
    """Llama 3.1 8B at B=1, T=8192 in bf16: the 2.1 GB logits of its one sequence become 7 chunks of 1171 rows
    (the least memory with every chunk at least 256 MiB), and the recompute options take exactly the kept
    activations they name out of the --dry-run plan."""
    from llmc_cli.models.base import CLASSIFIER_CHUNK_BYTES, CLASSIFIER_CHUNK_MIN_BYTES
    from llmc_cli.models.families import memory_plan
    cfg = llama3.preset("llama3.1-8b")
    V, C, H, L = cfg.vocab_size, cfg.n_embd, cfg.hidden_dim, cfg.n_layer
    n = llama3.auto_classifier_chunks(cfg, 1, 8192, True, 2)
    rows = -(-8192 // n)
    assert (n, rows) == (7, 1171)
    assert CLASSIFIER_CHUNK_MIN_BYTES <= rows * V * 2 <= CLASSIFIER_CHUNK_BYTES
    assert llama3.auto_classifier_chunks(cfg, 1, 8192, False, 2) == 1
    assert llama3.auto_classifier_chunks(llama3.preset("llama3-tiny"), 4, 64, True, 4) == 1  # 4 MiB: whole
    assert llama3.auto_classifier_chunks(cfg, 8, 8192, True, 2) == 62  # 8 sequences: 62 chunks of 1057 rows
    act = {r: memory_plan(cfg, 1, 8192, "bfloat16", recompute=r)["activations"]
           for r in ("none", "gelu", "layernorm", "gelu+layernorm")}
    BT = 8192
    assert act["none"] - act["gelu"] == (L - 1) * BT * H * 2                      # hs: one buffer instead of L
    assert act["none"] - act["layernorm"] == (2 * L - 1) * BT * C * 2 + BT * C * 2  # ln1, ln2 (+ lnf) in one
    assert act["none"] - act["gelu+layernorm"] == (act["none"] - act["gelu"]) + (act["none"] - act["layernorm"])
    whole = llama3.activation_bytes(cfg, 1, 8192, False, 2)  # the inference plan keeps the whole logits
    assert whole >= BT * V * 2


def test_dry_run_plan_matches_allocation(backend, monkeypatch):
    """memory_plan (what --dry-run prints) is what Llama3 allocates: every recompute option, a training plan with
    its classifier chunks (budgets shrunk so a tiny model chunks: 3 chunks of 6 rows) and an inference plan."""
    from llmc_cli.models import base
    from llmc_cli.models.families import memory_plan
    cfg, B, T = TINY, 2, 9
    row = cfg.vocab_size * (4 if backend.dtype == "float32" else 2)
    for budget in (None, 6 * row):
        if budget:
            monkeypatch.setattr(base, "CLASSIFIER_CHUNK_BYTES", budget)
            monkeypatch.setattr(base, "CLASSIFIER_CHUNK_MIN_BYTES", budget)
        for recompute, training in (("none", True), ("gelu", True), ("layernorm", True),
                                    ("gelu+layernorm", True), ("none", False)):
            before = backend.memory_report().by_tag.get("activations", 0)
            m = Llama3(cfg, backend, B, T, training=training, recompute=recompute)
            after = backend.memory_report().by_tag.get("activations", 0)
            plan = memory_plan(cfg, B, T, backend.dtype, training=training, recompute=recompute)
            assert after - before == plan["activations"], (budget, recompute, training)
            assert m.chunks == (3 if budget and training else 1)
            del m
