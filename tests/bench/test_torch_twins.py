"""The PyTorch twins `llmc bench train --compare torch` times (llmc_cli/bench/torch_gpt2.py, torch_llama3.py):
the same model as llmc's from the same flat parameters (loss, every gradient, one AdamW step), the AdamW flavour
chosen per device, and the Llama path through the command line."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from llmc_test_support import make_backend

torch = pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli import naming  # noqa: E402
from llmc_cli.bench import train_steps  # noqa: E402
from llmc_cli.bench.backends import BenchError  # noqa: E402
from llmc_cli.bench.torch_gpt2 import build_torch_gpt2  # noqa: E402
from llmc_cli.bench.torch_llama3 import build_torch_llama3  # noqa: E402
from llmc_cli.commands import main  # noqa: E402
from llmc_cli.models import gpt2, llama3  # noqa: E402
from llmc_cli.models.llama3 import Llama3, Llama3Config, parameter_shapes  # noqa: E402
from llmc_cli.optim import AdamW, AdamWConfig  # noqa: E402
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


def test_one_training_step_of_llmc_and_the_twin_agrees():
    """One step of llmc (cpu backend, its AdamW and clipping) and of the twin (torch AdamW as the bench builds
    it, clip_grad_norm_) from the same weights and batch: the same parameters after it, and the same loss on
    the next batch."""
    cfg = TINY
    flat = _perturbed(cfg, 4)
    x, y = _batch(cfg, 1)
    x2, y2 = _batch(cfg, 2)
    oc = AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    cpu = make_backend("cpu")
    m = Llama3(cfg, cpu, B, T)
    m.load_parameters(flat)
    opt = AdamW(cpu, m.params, m.grads, m.tensor_names(), oc)
    opt.sync_master_from_params()
    m.zero_grad()
    m.forward(x, y, dloss=1.0 / (B * T))
    m.backward()
    grads = llama3.split_flat(cpu.download(m.grads.buf).copy(), parameter_shapes(cfg))
    norm = opt.grad_norm()
    assert norm > oc.grad_clip  # the clipping rule is exercised too
    opt.step(oc.lr, norm, seed=0)
    ours = llama3.split_flat(cpu.download(m.params.buf), parameter_shapes(cfg))
    m.forward(x2, y2)
    ours_next = m.mean_loss()

    model = build_torch_llama3(cfg, flat, T)
    decay = [p for n, p in model.named_parameters() if n in model.decayed]
    plain = [p for n, p in model.named_parameters() if n not in model.decayed]
    topt, flavour = train_steps.torch_adamw([{"params": decay, "weight_decay": oc.weight_decay},
                                             {"params": plain, "weight_decay": 0.0}], "cpu", oc)
    assert flavour == "foreach"
    model(torch.tensor(x).long(), torch.tensor(y).long()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
    topt.step()
    with torch.no_grad():
        theirs_next = model(torch.tensor(x2).long(), torch.tensor(y2).long()).item()
    assert abs(theirs_next - ours_next) < 2e-6 * ours_next

    before = llama3.split_flat(flat, parameter_shapes(cfg))
    theirs = {n: p.detach().numpy() for n, p in model.named_parameters()}
    key = {"wte": "wte.weight", "norm": "norm", "lm_head": "lm_head.weight"}
    for name in ours:
        got = theirs[key[name]] if name in key else np.stack(
            [theirs[f"blocks.{l}.{name if name.endswith('norm') else name + '.weight'}"] for l in range(cfg.n_layer)])
        step_ours, step_theirs = ours[name] - before[name], got - before[name]
        assert np.abs(step_ours).max() > 0.5 * oc.lr, name  # every tensor moved (Adam's first step ~ lr)
        # Adam's first step is lr * g / (|g| + eps): it turns the float32 rounding of a gradient near eps into a
        # difference of order lr, so the steps are held equal where the gradient is well above that (all but a
        # few elements; rows of tokens not in the batch: no gradient, only weight decay); the next batch's loss
        # above covers the whole vector
        sure = (np.abs(grads[name]) > 1e-6) | (grads[name] == 0)
        assert sure.mean() > 0.99, name
        assert np.abs(step_ours - step_theirs)[sure].max() < 1e-3 * oc.lr, name


def test_twins_decay_llmcs_tensors():
    """AdamW decays the tensors llmc decays (its DECAYED set: the matrices), none of the norms or biases."""
    g_cfg = gpt2.preset("d2", n_embd=32, vocab_size=64, block_size=16)
    twins = (build_torch_gpt2(g_cfg, gpt2.init_parameters(g_cfg, 0), gpt2.parameter_shapes(g_cfg)),
             build_torch_llama3(TINY, llama3.init_parameters(TINY, 0), T))
    for model in twins:
        params = dict(model.named_parameters())
        assert model.decayed and model.decayed == {n for n, p in params.items() if p.dim() >= 2}
    assert {"norm", "blocks.0.attn_norm"} <= set(params) - model.decayed


class _FakeAdamW:
    """Records how it was built; refuses fused=True when told to (a torch without the fused kernel)."""
    refuse_fused = False
    made: list = []

    def __init__(self, groups, **kw):
        if kw.get("fused") and self.refuse_fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        type(self).made.append(kw)


@pytest.mark.parametrize("device,refuse,want", [("cuda", False, "fused"), ("cuda", True, "foreach"),
                                                ("cpu", False, "foreach")])
def test_adamw_flavour_per_device(monkeypatch, device, refuse, want):
    monkeypatch.setattr(torch.optim, "AdamW", _FakeAdamW)
    monkeypatch.setattr(_FakeAdamW, "refuse_fused", refuse)
    monkeypatch.setattr(_FakeAdamW, "made", [])
    oc = AdamWConfig(lr=2e-4, beta1=0.8, beta2=0.9, eps=1e-7)
    _, flavour = train_steps.torch_adamw([], device, oc)
    assert flavour == want
    kw = _FakeAdamW.made[-1]
    assert kw.get(want) is True and kw["lr"] == 2e-4 and kw["betas"] == (0.8, 0.9) and kw["eps"] == 1e-7


def test_enable_gqa_only_where_a_fused_kernel_takes_it():
    from llmc_cli.bench.torch_llama3 import sdpa_enable_gqa
    assert sdpa_enable_gqa("cuda", True) and sdpa_enable_gqa("cpu", False) and sdpa_enable_gqa("cpu", True)
    assert not sdpa_enable_gqa("cuda", False)  # CUDA's fp32 kernel takes no grouped heads: repeat them
    # the CPU claim, checked on the dispatcher itself: grouped heads go to a fused kernel, not the math path
    from torch.nn.attention import SDPBackend
    q, kv = torch.randn(1, 8, 64, 16), torch.randn(1, 2, 64, 16)
    assert SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=True)) != SDPBackend.MATH


def test_torch_dtype_auto_follows_the_backends():
    from types import SimpleNamespace as NS

    from llmc_cli.kernels import BFLOAT16, FLOAT32
    assert train_steps.torch_dtype_for([("cuda", NS(dtype=BFLOAT16))]) == BFLOAT16
    assert train_steps.torch_dtype_for([("cpu", NS(dtype=FLOAT32))]) == FLOAT32
    assert train_steps.torch_dtype_for([("a", NS(dtype=BFLOAT16)), ("b", NS(dtype=FLOAT32))]) == FLOAT32


def test_random_shard_format_follows_the_vocabulary(tmp_path):
    from llmc_cli.formats.shards import read_shard_header
    big = llama3.preset("llama3.2-1b")
    info = read_shard_header(train_steps.random_shard(tmp_path, big, 100, 0))
    assert info.tokenizer == "llama3" and info.num_tokens == 100
    small = llama3.preset("llama3-tiny")
    assert read_shard_header(train_steps.random_shard(tmp_path / "..", small, 100, 0)).tokenizer == "gpt2"
    with naming.flags(), pytest.raises(BenchError, match="--vocab-size 70000.*--data"):
        train_steps.random_shard(tmp_path, replace(small, vocab_size=70000), 100, 0)


# ---- the command line -------------------------------------------------------------------------------------------
LLAMA_TINY = ["bench", "train", "--backend", "cpu", "--model", "llama3-tiny", "-b", "2", "-t", "32", "--steps", "3"]


def test_cli_llama_train_against_torch_eager():
    r = CliRunner().invoke(main, [*LLAMA_TINY, "--compare", "torch-eager", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["family"] == "llama3" and out["config"]["n_kv_head"] == 2
    assert out["config"]["torch_dtype"] == "float32"
    rs = {x["name"]: x for x in out["results"]}
    assert set(rs) == {"cpu", "torch eager"}
    llmc, tch = rs["cpu"], rs["torch eager"]
    # same weights, data and optimizer: the first loss to float32 rounding, the last after 4 updates close too
    assert llmc["loss_first"] == pytest.approx(math.log(50257), rel=0.01)
    assert tch["loss_first"] == pytest.approx(llmc["loss_first"], rel=1e-6)
    assert tch["loss_last"] == pytest.approx(llmc["loss_last"], rel=1e-5)
    assert tch["optimizer"] == "AdamW foreach" and tch["attention"] == "SDPA enable_gqa"
    assert tch["tflop_s"] == pytest.approx(out["config"]["flops_per_step"] / (tch["median_ms"] / 1e3) / 1e12)
    assert any("torch eager" in n and "AdamW foreach" in n for n in out["notes"])


def test_cli_llama_table_names_the_adamw_flavour():
    r = CliRunner().invoke(main, [*LLAMA_TINY, "--steps", "1", "--warmup", "0", "--compare", "torch-eager"])
    assert r.exit_code == 0, r.output
    assert "torch eager" in r.stdout and "AdamW foreach" in r.stdout and "torch.optim.AdamW(foreach=True)" in r.stdout


def test_cli_llama32_shape_on_llama3_shards():
    """Llama 3.2 1B's features (128256-id vocabulary on 32-bit shards, tied head, rope scaling 32) on a shrunk
    model: llmc and torch agree."""
    r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", "--model", "llama3.2-1b", "--n-layer", "1",
                                  "--n-embd", "64", "--n-head", "8", "-b", "1", "-t", "16", "--steps", "1",
                                  "--warmup", "1", "--compare", "torch-eager", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["vocab_size"] == 128256
    rs = {x["name"]: x for x in out["results"]}
    assert rs["torch eager"]["loss_first"] == pytest.approx(rs["cpu"]["loss_first"], rel=1e-6)
    assert rs["torch eager"]["loss_last"] == pytest.approx(rs["cpu"]["loss_last"], rel=1e-5)


def test_cli_compare_torch_without_torch_is_one_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    r = CliRunner().invoke(main, [*LLAMA_TINY, "--steps", "1", "--warmup", "0", "--compare", "torch"])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stdout.splitlines() if "PyTorch" in ln]
    assert lines == ["PyTorch is not installed: --compare torch skipped (pip install torch)"]
    assert "torch eager" not in r.stdout


def test_cli_llama_bad_vocab_is_one_line():
    r = CliRunner().invoke(main, [*LLAMA_TINY, "--vocab-size", "70000"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "--vocab-size 70000" in r.stderr
