"""The whole GPT-2 engine against a PyTorch autograd reference: logits, loss, every gradient, 10 AdamW steps.
Run on every installed backend; the tolerances follow the backend's dtype."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters, num_parameters, parameter_shapes, preset  # noqa: E402
from llmc_cli.optim import AdamW, AdamWConfig, lr_at  # noqa: E402
from torch_gpt2 import forward as torch_forward  # noqa: E402
from torch_gpt2 import train_losses  # noqa: E402
from llmc_test_support import dtype_tol as tol  # noqa: E402
from llmc_test_support import rel_err as rel  # noqa: E402

TINY = GPT2Config(block_size=16, vocab_size=100, n_layer=2, n_head=4, n_embd=32)


def perturbed_init(cfg, seed):
    """GPT-2 init plus noise so layernorm weights and biases are not trivially 1 and 0."""
    flat = init_parameters(cfg, seed)
    flat += np.random.default_rng(seed + 1).normal(0, 0.05, flat.shape).astype(np.float32)
    return flat


def batch(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


def test_presets_match_gpt2_sizes():
    assert num_parameters(preset("d12")) == 124475904  # llm.c's count for GPT-2 124M with padded vocab
    assert preset("d12").padded_vocab_size == 50304
    assert [s for n, s in parameter_shapes(preset("d12"))][:2] == [(50304, 768), (1024, 768)]
    with pytest.raises(ValueError, match="unknown model"):
        preset("d13")


@pytest.mark.parametrize("B,T", [(3, 11), (2, 16)])
def test_forward_backward_match_torch(backend, B, T):
    cfg = TINY
    flat = perturbed_init(cfg, 7)
    x, y = batch(cfg, B, T, 3)
    model = GPT2(cfg, backend, B, T)
    model.load_parameters(flat)

    ref = torch.tensor(flat, dtype=torch.float64, requires_grad=True)
    logits_ref, loss_ref = torch_forward(ref, cfg, torch.tensor(x).long(), torch.tensor(y).long())
    loss_ref.backward()

    model.forward(x)
    assert rel(backend.download(model.acts["logits"]), logits_ref.detach().numpy()) < tol(backend, 1e-5, 2e-2)
    model.zero_grad()
    model.forward(x, y, dloss=1.0 / (B * T))
    assert abs(model.mean_loss() - loss_ref.item()) < tol(backend, 1e-5, 2e-2) * loss_ref.item()
    model.backward()
    grads = backend.download(model.grads.buf).astype(np.float64)
    gref = ref.grad.numpy()
    off = 0
    for name, shape in parameter_shapes(cfg):
        n = int(np.prod(shape))
        assert rel(grads[off:off + n], gref[off:off + n]) < tol(backend, 1e-4, 5e-2), name
        off += n


def test_ten_adamw_steps_match_torch(backend):
    """10 steps of losses match PyTorch's AdamW to 1e-4 relative in fp32 (weight decay, clipping, cosine LR)."""
    cfg, B, T = TINY, 4, 8
    flat = perturbed_init(cfg, 11)
    batches = [batch(cfg, B, T, s) for s in range(3)]
    ocfg = AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    model = GPT2(cfg, backend, B, T)
    model.load_parameters(flat)
    opt = AdamW(backend, model.params, model.grads, model.tensor_names(), ocfg)
    opt.sync_master_from_params()
    ours = []
    for s in range(10):
        x, y = batches[s % 3]
        model.zero_grad()
        model.forward(x, y, dloss=1.0 / (B * T))
        model.backward()
        ours.append(model.mean_loss())
        opt.step(ocfg.lr, opt.grad_norm(), seed=s)
    ref = train_losses(flat, cfg, batches, 10, lr=ocfg.lr, weight_decay=0.1, grad_clip=1.0)
    np.testing.assert_allclose(ours, ref, rtol=tol(backend, 1e-4, 2e-2))
    assert ours[-1] < ours[0]


def test_gradient_accumulation_equals_big_batch(backend):
    """Two micro-batches of B=2 with dloss 1/(2*B*T) give the gradient of one batch of B=4."""
    cfg, T = TINY, 8
    flat = perturbed_init(cfg, 5)
    x, y = batch(cfg, 4, T, 9)
    big = GPT2(cfg, backend, 4, T)
    big.load_parameters(flat)
    big.zero_grad()
    big.forward(x, y, dloss=1.0 / (4 * T))
    big.backward()
    small = GPT2(cfg, backend, 2, T)
    small.load_parameters(flat)
    small.zero_grad()
    for i in range(2):
        small.forward(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2], dloss=1.0 / (4 * T))
        small.backward()
    g1, g2 = backend.download(big.grads.buf), backend.download(small.grads.buf)
    assert rel(g2, g1) < tol(backend, 1e-5, 2e-2)


def test_deterministic(backend):
    """Same seed, same data, same backend: bit-identical losses and parameters."""
    def run():
        cfg = TINY
        m = GPT2(cfg, backend, 2, 8)
        m.load_parameters(init_parameters(cfg, 3))
        opt = AdamW(backend, m.params, m.grads, m.tensor_names(), AdamWConfig(lr=1e-3))
        opt.sync_master_from_params()
        losses = []
        for s in range(3):
            x, y = batch(cfg, 2, 8, s)
            m.zero_grad()
            m.forward(x, y, dloss=1 / 16)
            m.backward()
            losses.append(m.mean_loss())
            opt.step(1e-3, opt.grad_norm(), seed=s)
        return losses, m.parameters_host()
    (l1, p1), (l2, p2) = run(), run()
    assert l1 == l2
    assert np.array_equal(p1, p2)


def test_init_is_gpt2_and_seeded():
    cfg = preset("d2", vocab_size=1000)
    a, b = init_parameters(cfg, 1), init_parameters(cfg, 1)
    assert np.array_equal(a, b) and not np.array_equal(a, init_parameters(cfg, 2))
    off, stds = 0, {}
    for name, shape in parameter_shapes(cfg):
        n = int(np.prod(shape))
        stds[name] = float(a[off:off + n].std())
        if name in ("ln1w", "lnfw"):
            assert np.all(a[off:off + n] == 1.0)
        if name.endswith("b"):
            assert np.all(a[off:off + n] == 0.0)
        off += n
    assert abs(stds["fcw"] - 0.02) < 1e-3
    assert abs(stds["fcprojw"] - 0.02 / np.sqrt(2 * cfg.n_layer)) < 1e-3


def test_lr_schedule():
    assert lr_at(0, 1.0, 0, 10, 1.0) == 1.0 and lr_at(9, 1.0, 0, 10, 1.0) == 1.0  # llm.c default: constant
    assert lr_at(0, 1.0, 4, 10, 0.0) == 0.25 and lr_at(3, 1.0, 4, 10, 0.0) == 1.0  # linear warmup
    assert lr_at(4, 1.0, 4, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 4, 10, 0.1) == pytest.approx(0.1)  # cosine to the final fraction
    assert 0.1 < lr_at(7, 1.0, 4, 10, 0.1) < 1.0


def test_t_longer_than_block_size_is_refused(backend):
    with pytest.raises(ValueError, match="block size"):
        GPT2(TINY, backend, 1, TINY.block_size + 1)


@pytest.mark.parametrize("recompute", ["gelu", "layernorm", "gelu+layernorm"])
def test_recompute_matches_keeping_activations(backend, recompute):
    """Recomputing GELU / layernorm outputs in backward gives the same loss and gradients as keeping them."""
    cfg, B, T = TINY, 2, 8
    flat = perturbed_init(cfg, 13)
    x, y = batch(cfg, B, T, 4)
    grads = []
    for mode in ("none", recompute):
        m = GPT2(cfg, backend, B, T, recompute=mode)
        m.load_parameters(flat)
        m.zero_grad()
        m.forward(x, y, dloss=1.0 / (B * T))
        m.backward()
        grads.append((m.mean_loss(), backend.download(m.grads.buf)))
    assert grads[0][0] == grads[1][0]
    assert rel(grads[1][1], grads[0][1]) < tol(backend, 1e-6, 1e-2)
    with pytest.raises(ValueError, match="^recompute must be one of"):
        GPT2(cfg, backend, B, T, recompute="everything")


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_classifier_matches_whole_batch(backend, chunks):
    """The training classifier run in batch chunks (lm-head forward, classifier, lm-head backward per chunk, wte's
    gradient accumulated over them) gives the loss and every gradient of the whole-batch classifier, also with
    gradient accumulation over two micro-steps and under recompute (the scratch placed in a smaller logits
    buffer)."""
    cfg, B, T = TINY, 4, 8
    flat = perturbed_init(cfg, 17)
    xs = [batch(cfg, B, T, s) for s in (5, 6)]
    out = []
    for n, recompute in ((1, "none"), (chunks, "none"), (chunks, "gelu+layernorm")):
        m = GPT2(cfg, backend, B, T, recompute=recompute, classifier_chunks=n)
        assert m.acts["logits"].shape == (B // n, T, cfg.padded_vocab_size)
        m.load_parameters(flat)
        m.zero_grad()
        losses = []
        for x, y in xs:
            m.forward(x, y, dloss=1.0 / (2 * B * T))
            m.backward()
            losses.append(backend.download(m.acts["losses"]))
        m.forward(xs[0][0], xs[0][1])  # an evaluation forward (no dloss) on the chunked plan
        losses.append(backend.download(m.acts["losses"]))
        out.append((losses, backend.download(m.grads.buf).astype(np.float64)))
    (l1, g1) = out[0]
    for ln, gn in out[1:]:
        for a, b in zip(ln, l1):
            np.testing.assert_allclose(a, b, rtol=tol(backend, 1e-6, 1e-2), atol=tol(backend, 1e-6, 1e-2))
        assert rel(gn, g1) < tol(backend, 1e-6, 1e-2)
    m = GPT2(cfg, backend, B, T, classifier_chunks=chunks)
    with pytest.raises(ValueError, match="chunks"):
        m.forward(xs[0][0])
    with pytest.raises(ValueError, match="divide"):
        GPT2(cfg, backend, B, T, classifier_chunks=3)


def test_classifier_chunk_plan():
    """d12 at B=64, T=1024 in bf16: 16 chunks of 4 sequences (a 393 MiB logits buffer instead of 6.1 GiB, with
    dfch inside it and dqkv sharing dfch's memory), and the --dry-run plan counts what the model allocates."""
    from llmc_cli.models.gpt2 import auto_classifier_chunks, in_logits
    from llmc_cli.models.families import memory_plan
    cfg = preset("d12")
    assert auto_classifier_chunks(cfg, 64, 1024, True, 2) == 16
    assert auto_classifier_chunks(cfg, 64, 1024, True, 4) == 16
    assert auto_classifier_chunks(cfg, 64, 1024, False, 2) == 1
    assert auto_classifier_chunks(cfg, 4, 64, True, 4) == 1
    assert in_logits(cfg, 64, 1024, True, "none", 16) == {"dfch": 0}
    assert set(in_logits(cfg, 64, 1024, True, "none", 8)) == {"dfch", "btc"}
    plan = memory_plan(cfg, 64, 1024, "bfloat16", recompute="none")
    assert plan["activations"] / 2**30 < 19.0  # was 24.6 GiB with the whole-batch logits


def test_scratch_partners_share_memory(backend):
    """dresidual lives in btc's memory and dqkv in dfch's (never live at the same time), and the results are
    those of the plan without chunks."""
    cfg, B, T = TINY, 4, 8
    m = GPT2(cfg, backend, B, T, classifier_chunks=4)
    for a, b in (("dresidual", "btc"), ("dqkv", "dfch")):
        assert backend.download(m.acts[a]).size <= backend.download(m.acts[b]).size
        backend.fill(m.acts[b], 0.0)
        backend.fill(m.acts[a], 3.0)
        assert backend.download(m.acts[b]).reshape(-1)[0] == 3.0, f"{a} does not share {b}'s memory"


def test_dry_run_plan_matches_allocation(backend):
    """memory_plan (what --dry-run prints) is what the model and the optimizer allocate, chunks included."""
    from llmc_cli.models.families import memory_plan
    cfg, B, T = TINY, 4, 8
    for recompute in ("none", "layernorm"):
        before = dict(backend.memory_report().by_tag)
        m = GPT2(cfg, backend, B, T, recompute=recompute)
        after = backend.memory_report().by_tag
        plan = memory_plan(cfg, B, T, backend.dtype, recompute=recompute)
        assert after.get("activations", 0) - before.get("activations", 0) == plan["activations"]
        del m


def test_inference_model_shares_layer_buffers(backend):
    """A model planned without training keeps one activation buffer for all layers and gives the same logits."""
    cfg, B, T = TINY, 2, 8
    flat = perturbed_init(cfg, 2)
    x, _ = batch(cfg, B, T, 1)
    train_m, infer_m = GPT2(cfg, backend, B, T), GPT2(cfg, backend, B, T, training=False)
    for m in (train_m, infer_m):
        m.load_parameters(flat)
        m.forward(x)
    assert rel(backend.download(infer_m.acts["logits"]), backend.download(train_m.acts["logits"])) < 1e-6
    assert infer_m.acts["qkv"].size * cfg.n_layer == train_m.acts["qkv"].size
