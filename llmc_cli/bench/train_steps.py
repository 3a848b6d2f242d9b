"""`llmc bench train`: whole training steps through the same Trainer `llmc train` uses, and optionally PyTorch
on the same model, weights, data and optimizer."""

from __future__ import annotations

import gc
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc_cli.bench.backends import BenchError
from llmc_cli.bench.kernel_cases import _cfg_dict, _spread
from llmc_cli.bench.torch_gpt2 import build_torch_gpt2
from llmc_cli.kernels import (
    BFLOAT16,
    FLOAT32,
    Backend,
)
from llmc_cli.models.families import flops_per_token
from llmc_cli.models.gpt2 import GPT2Config

# ---------------------------------------------------------------------------------------------------------------
# end-to-end training

# the families `llmc bench train` times (it builds a PyTorch twin of the model for --compare torch)
TRAIN_FAMILIES = ("gpt2",)


def flops_per_step(cfg: GPT2Config, B: int, T: int) -> int:
    """llm.c's estimate (models.families.flops_per_token) for a step of B sequences of T tokens."""
    return flops_per_token(cfg, T) * B * T


def _rss_peak_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _peak_flops(backend: Backend) -> float | None:
    fn = getattr(backend, "peak_flops", None)
    try:
        v = fn(backend.dtype) if callable(fn) else fn
    except Exception:
        return None
    return float(v) if v else None


def _train_record(label: str, kind: str, times_s: list[float], losses: list[float], B: int, T: int,
                  flops: int, peak: float | None) -> dict:
    r = {"name": label, "kind": kind, **_spread(times_s)}
    med = r["median_ms"] / 1e3
    r["tok_s"] = B * T / med
    r["tflop_s"] = flops / med / 1e12
    r["peak_flops"] = peak
    r["mfu"] = flops / med / peak if peak else None
    r["loss_first"], r["loss_last"] = losses[0], losses[-1]
    return r


def train_llmc(label: str, backend: Backend, cfg: GPT2Config, B: int, T: int, data: str, *, steps: int,
               warmup: int, seed: int) -> dict:
    """`steps` timed training steps after `warmup` ones, through llmc's Trainer (data loader + optimizer)."""
    from llmc_cli.optim import AdamWConfig
    from llmc_cli.training.trainer import TrainArgs, Trainer
    args = TrainArgs(data=data, model="d2", n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                     block_size=cfg.block_size, vocab_size=cfg.vocab_size, batch_size=B, seq_len=T,
                     steps=warmup + steps, seed=seed, optim=AdamWConfig(weight_decay=0.1), val_every=0,
                     sample_every=0)
    trainer = Trainer(args, backend, say=lambda s: None)
    times, losses = [], []
    try:
        for s in range(warmup + steps):
            rec = trainer.train_step(s)
            losses.append(rec["loss"])
            if s >= warmup:
                times.append(rec["ms"] / 1e3)
        mem = backend.memory_report()
    finally:
        del trainer
        gc.collect()
    r = _train_record(label, "llmc", times, losses, B, T, flops_per_step(cfg, B, T), _peak_flops(backend))
    r.update(describe=backend.describe(), dtype=backend.dtype, allocated_bytes=mem.allocated,
             device_total_bytes=mem.device_total,
             device_used_bytes=(mem.device_total - mem.device_free) if (mem.device_total and mem.device_free is not None)
             else None, host_rss_peak_bytes=_rss_peak_bytes())
    return r


def train_torch(cfg: GPT2Config, B: int, T: int, data: str, *, steps: int, warmup: int, seed: int,
                compile: bool = False, dtype: str = FLOAT32) -> dict:
    """PyTorch on the same model (llmc's initial weights), data loader, AdamW and clipping. Raises on failure."""
    import torch

    from llmc_cli.data.loader import DataLoader
    from llmc_cli.models.gpt2 import init_parameters, parameter_shapes
    from llmc_cli.optim import AdamWConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_torch_gpt2(cfg, init_parameters(cfg, seed), parameter_shapes(cfg)).to(device)
    oc = AdamWConfig(weight_decay=0.1)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                             {"params": plain, "weight_decay": 0.0}], lr=oc.lr, betas=(oc.beta1, oc.beta2),
                            eps=oc.eps)
    step_fn = torch.compile(model) if compile else model
    loader = DataLoader(data, B, T, seed=seed, vocab_size=cfg.vocab_size)
    amp = torch.autocast(device, dtype=torch.bfloat16) if dtype == BFLOAT16 else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, first = [], [], None
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        x, y = loader.next_batch()
        xt = torch.from_numpy(x.astype(np.int64)).to(device)
        yt = torch.from_numpy(y.astype(np.int64)).to(device)
        if amp is not None:
            with amp:
                loss = step_fn(xt, yt)
        else:
            loss = step_fn(xt, yt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        opt.step()
        lv = loss.item()
        dt = time.perf_counter() - t0
        if s == 0:
            first = dt
        if s >= warmup:
            times.append(dt)
        losses.append(lv)
    label = "torch " + ("compile" if compile else "eager") + (" bf16" if dtype == BFLOAT16 else "")
    r = _train_record(label, "torch", times, losses, B, T, flops_per_step(cfg, B, T), None)
    r.update(describe=f"PyTorch {torch.__version__} on {device}"
             + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else f", {torch.get_num_threads()} threads"),
             dtype=dtype, first_step_s=first, host_rss_peak_bytes=_rss_peak_bytes(),
             allocated_bytes=int(torch.cuda.max_memory_allocated()) if device == "cuda" else None)
    return r


def random_shard(directory: str | Path, cfg: GPT2Config, ntokens: int, seed: int) -> str:
    """A shard of `ntokens` uniformly random token ids (seeded) in `directory`; returns a glob for it."""
    from llmc_cli.formats.shards import write_shard
    rng = np.random.default_rng(seed)
    path = Path(directory) / "bench_train_000000.bin"
    write_shard(path, rng.integers(0, cfg.vocab_size, ntokens, dtype=np.int64).astype(np.uint16))
    return str(path)


def run_train(backends: Sequence[tuple[str, Backend]], cfg: GPT2Config, B: int, T: int, *, steps: int = 10,
              warmup: int = 2, seed: int = 1337, data: str | None = None, compare: Sequence[str] = (),
              torch_dtype: str = FLOAT32, progress: Callable[[str], None] | None = None) -> dict:
    """Training steps on every backend (and PyTorch for `compare` entries "torch-eager" / "torch-compile").
    `data`: a glob of shards; None writes a temporary shard of random tokens. Returns {"config", "results",
    "notes"}; a PyTorch variant that fails is a note, not an error."""
    if steps < 1 or warmup < 0:
        raise BenchError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    if T > cfg.block_size:
        raise BenchError(f"-t {T} is longer than the model's block size {cfg.block_size}")
    results, notes = [], []
    with tempfile.TemporaryDirectory(prefix="llmc-bench-") as tmp:
        if data is None:
            data = random_shard(tmp, cfg, max((warmup + steps) * B * T + 1, 2 * B * T + 1), seed)
            data_desc = "random tokens (temporary shard)"
        else:
            data_desc = data
        for label, be in backends:
            if progress:
                progress(f"training on {label}")
            try:
                results.append(train_llmc(label, be, cfg, B, T, data, steps=steps, warmup=warmup, seed=seed))
            except ValueError as e:  # TrainError / DataError: options the trainer refuses
                raise BenchError(f"training on {label}: {e}") from None
        torch_modes = [m for m in compare if m.startswith("torch")]
        if torch_modes:
            try:
                import torch  # noqa: F401
            except ImportError:
                notes.append("PyTorch is not installed: --compare torch skipped (pip install torch)")
                torch_modes = []
        for mode in torch_modes:
            if progress:
                progress(f"training with {mode}")
            try:
                r = train_torch(cfg, B, T, data, steps=steps, warmup=warmup, seed=seed,
                                compile=mode == "torch-compile", dtype=torch_dtype)
                results.append(r)
                if mode == "torch-compile":
                    notes.append(f"torch compile: first step {r['first_step_s']:.1f} s (compilation, untimed)")
            except Exception as e:  # torch.compile needs a working compiler toolchain; report, don't fail
                first = (str(e).strip().splitlines() or [""])[0][:200]
                notes.append(f"{mode} failed: {type(e).__name__}: {first}")
                gc.collect()
    return {"config": {**_cfg_dict(cfg), "B": B, "T": T, "steps": steps, "warmup": warmup, "seed": seed,
                       "data": data_desc, "flops_per_step": flops_per_step(cfg, B, T)},
            "results": results, "notes": notes}
