"""A run whose plan cannot fit is refused from the plan alone, before anything is allocated: `--n-layer 100000` on
the cpu backend spent minutes and 20 GB initialising weights before the allocation that failed. The plan of one
rank is compared with the device's total memory where the backend reports one, else (its buffers on the host) with
the host's memory and swap; the host also holds the float32 weights that initialising or loading makes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmc_cli.registry import create_backend
from llmc_cli.training import memory
from llmc_cli.training import trainer as trainer_mod
from llmc_cli.training.args import TrainArgs, TrainError
from llmc_cli.training.trainer import Trainer

GiB, MiB = 2**30, 2**20


def device_with(total: int | None):
    """The cpu backend reporting a device of `total` bytes (None: no device, as the cpu backend's own report)."""
    cls = type(create_backend("cpu"))

    def memory_report(self):
        return replace(cls.memory_report(self), device_total=total, device_free=total)
    return type("Sized", (cls,), {"memory_report": memory_report})()


def base(shards, **kw) -> dict:
    return dict(data=str(shards / "*train*.bin"), model="d2", n_embd=32, batch_size=2, seq_len=16, steps=1,
                val_every=0, sample_every=0) | kw


# d2 with n_embd 32, B=2 T=16 on float32: 25.4 MiB of weights, gradients and AdamW moments, 6.3 MiB of activations;
# and 6.4 MiB of float32 weights on the host
CASES = [
    # (arguments, device total, host memory, what the refusal says; None: not refused)
    (dict(model="d12", n_layer=100000, n_embd=768), None, 64 * GiB, ["the host has (memory and swap) 64.00 GiB",
                                                          "use a smaller model (model, n_layer, n_embd)"]),
    (dict(), None, 35 * MiB, ["the host has (memory and swap) 0.03 GiB", "lower batch_size or seq_len",
                              "recompute='gelu+layernorm'"]),
    (dict(recompute="gelu+layernorm"), None, 35 * MiB,
     ["lower batch_size or seq_len (total_batch_size keeps the step size);"]),
    (dict(), 30 * MiB, 64 * GiB,
     ["on backend cpu (B=2 T=16) but the device has 0.03 GiB", "lower batch_size or seq_len"]),
    (dict(), 20 * MiB, 64 * GiB, ["the device has 0.02 GiB", "use a smaller model"]),
    (dict(), 64 * GiB, 1 * MiB, ["the host has (memory and swap) 0.00 GiB", "use a smaller model"]),
    (dict(), None, 64 * GiB, None),
    (dict(), 40 * MiB, 8 * MiB, None),  # (the host holds only the float32 weights where a device holds the rest)
    (dict(), 40 * MiB, None, None),     # (a host that does not say its memory)
]


@pytest.mark.parametrize("kw, device, host, needles", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_plan_that_cannot_fit_is_refused_before_any_allocation(shards, tmp_path, monkeypatch, kw, device, host,
                                                                   needles):
    real_family_for, inits = trainer_mod.family_for, []

    def counted(name):  # (the family whose init_parameters is counted; never run where a refusal is due)
        fam = real_family_for(name)

        def init(cfg, seed):
            inits.append(cfg)
            if needles is not None:
                raise AssertionError("the weights were initialised before the refusal")
            return fam.init_parameters(cfg, seed)
        return replace(fam, init_parameters=init)
    monkeypatch.setattr(trainer_mod, "family_for", counted)
    monkeypatch.setattr(memory, "host_memory", lambda: host)
    backend, out = device_with(device), tmp_path / "run"
    if needles is None:
        Trainer(TrainArgs(**base(shards, out=str(out), **kw)), backend, say=lambda s: None).close()
        assert len(inits) == 1
        return
    with pytest.raises(TrainError) as e:
        Trainer(TrainArgs(**base(shards, out=str(out), **kw)), backend, say=lambda s: None)
    msg = str(e.value)
    assert msg.startswith("the run needs ") and "\n" not in msg and "`llmc train --dry-run` shows the plan" in msg
    for n in needles:
        assert n in msg, msg
    assert backend.memory_report().allocated == 0, "allocated before the refusal"
    assert not out.exists()  # (the run directory the lock made is gone again)

