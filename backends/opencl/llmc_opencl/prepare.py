"""`llmc backends --prepare` for OpenCL: the work a first run would wait for, done once beforehand.

A first OpenCL run pays three things, each kept in a cache afterwards: the build verdicts and the SGEMM autotune
(llmc's, ``llmc_opencl.probe`` and ``llmc_opencl.tune``), the programs' builds (pyopencl's binary cache), and
PoCL's compilation of each kernel for the work-group size it is launched with (PoCL's own kernel cache, which
only a launch fills). So preparing a device creates a backend on it and runs, on a tiny model of each family,
what `llmc train` and `llmc sample` run: a training step (forward, backward, gradient norm, AdamW) and tokens
decoded over the key/value cache.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from llmc_cli.formats.shards import write_shard
from llmc_cli.inference.sampling import generate
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

SHAPES = {"d2": (2, 64), "llama3-tiny": (2, 64)}  # model preset -> (B, T) of its one training step
DECODED = 4  # tokens decoded after a prompt, per model


def exercise(backend, model: str, B: int, T: int, directory: Path) -> None:
    """One training step of preset `model` at (B, T) on random tokens, then DECODED tokens from its weights."""
    shard = directory / f"prepare_{model}_train_000000.bin"
    write_shard(shard, np.random.default_rng(0).integers(0, 50257, 4 * B * T + 1))
    args = TrainArgs(data=str(shard), model=model, batch_size=B, seq_len=T, steps=1, val_every=0, sample_every=0)
    trainer = Trainer(args, backend, say=lambda s: None)
    try:
        trainer.run()
        sampler = trainer.family.model_class(trainer.cfg, backend, 1, T, training=False, share_params=trainer.model)
        list(generate(sampler, [1, 2, 3], DECODED, np.random.default_rng(0), kv_cache=True))
    finally:
        trainer.close()


def prepare_device(backend) -> None:
    """Every kernel a training or sampling run launches, launched once on `backend`'s device."""
    with tempfile.TemporaryDirectory(prefix="llmc_opencl_prepare_") as d:
        for model, (B, T) in SHAPES.items():
            exercise(backend, model, B, T, Path(d))
