"""Whole-model parity: 10 AdamW training steps of a tiny GPT-2 on the OpenCL backend give the CPU backend's
losses to 1e-4 relative (same initial weights, same batches)."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli import registry
from llmc_cli.kernels import BackendUnavailable

gpt2 = pytest.importorskip("llmc_cli.models.gpt2")
optim = pytest.importorskip("llmc_cli.optim")


pytestmark = pytest.mark.opencl


def _backend(name):
    try:
        return registry.create_backend(name)
    except BackendUnavailable as e:
        pytest.skip(str(e))


def _losses(backend, cfg, B, T, steps):
    flat = gpt2.init_parameters(cfg, 1337)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)) for _ in range(3)]
    ocfg = optim.AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    model = gpt2.GPT2(cfg, backend, B, T)
    model.load_parameters(flat)
    opt = optim.AdamW(backend, model.params, model.grads, model.tensor_names(), ocfg)
    opt.sync_master_from_params()
    out = []
    for s in range(steps):
        x, y = batches[s % len(batches)]
        model.zero_grad()
        model.forward(x, y, dloss=1.0 / (B * T))
        model.backward()
        out.append(model.mean_loss())
        opt.step(ocfg.lr, opt.grad_norm(), seed=s)
    return np.array(out)


def test_ten_steps_match_cpu():
    cfg = gpt2.GPT2Config(block_size=32, vocab_size=250, n_layer=2, n_head=4, n_embd=64)
    B, T = 4, 32
    ref = _losses(_backend("cpu"), cfg, B, T, 10)
    got = _losses(_backend("opencl"), cfg, B, T, 10)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    assert got[-1] < got[0]


def test_zero2_gradients_train_as_the_whole_buffer(tmp_path):
    """--zero 2 on one rank (each layer's gradients in one slot of views, added into the shard after its backward)
    trains as --zero 0 on the OpenCL backend, two micro-steps a step: the same losses and norms."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer
    write_shard(tmp_path / "z_train_000001.bin", np.random.default_rng(0).integers(0, 1000, 20_000))
    runs = {}
    for zero in (0, 2):
        a = TrainArgs(data=str(tmp_path / "z_train_*.bin"), model="d2", n_layer=2, n_embd=64, batch_size=2,
                      seq_len=32, total_batch_size=2 * 2 * 32, steps=3, val_every=0, sample_every=0, zero=zero)
        tr = Trainer(a, _backend("opencl"), say=lambda m: None)
        runs[zero] = [(r["loss"], r["norm"]) for r in (tr.train_step(s) for s in range(a.steps))]
    np.testing.assert_allclose(np.ravel(runs[2]), np.ravel(runs[0]), rtol=1e-6)
