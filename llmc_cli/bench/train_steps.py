"""`llmc bench train`: whole training steps through the same Trainer `llmc train` uses, and optionally PyTorch
on the same model, weights, data and optimizer."""

from __future__ import annotations

import gc
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc_cli.bench.backends import BenchError, failure_line
from llmc_cli.bench.kernel_cases import _cfg_dict, _spread
from llmc_cli.bench.torch_gpt2 import build_torch_gpt2
from llmc_cli.bench.torch_llama3 import build_torch_llama3, sdpa_enable_gqa
from llmc_cli.data.loader import DataLoader
from llmc_cli.formats.files import temporary_directory
from llmc_cli.formats.shards import SHARD_VOCAB, write_shard
from llmc_cli.kernels import (
    BFLOAT16,
    FLOAT32,
    Backend,
)
from llmc_cli.models.base import INT32_MAX, check_seq_len
from llmc_cli.models.families import family_of, flops_per_token
from llmc_cli.models.family import Config
from llmc_cli.naming import arg
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

# ---------------------------------------------------------------------------------------------------------------
# end-to-end training

# the PyTorch twin of each family's model, (cfg, flat parameters, T, device, dtype) -> nn.Module whose
# forward(idx, targets) is the mean loss; `llmc bench train --compare torch` needs one for the model's family
TORCH_TWINS: dict[str, Callable] = {
    "gpt2": lambda cfg, flat, T, device, dtype: build_torch_gpt2(cfg, flat, family_of(cfg).parameter_shapes(cfg)),
    "llama3": lambda cfg, flat, T, device, dtype: build_torch_llama3(
        cfg, flat, T, gqa=sdpa_enable_gqa(device, dtype == BFLOAT16)),
}


def flops_per_step(cfg: Config, B: int, T: int) -> int:
    """llm.c's estimate (models.families.flops_per_token) for a step of B sequences of T tokens."""
    return flops_per_token(cfg, T) * B * T


def _rss_peak_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _peak_flops(backend: Backend) -> float | None:
    fn = getattr(backend, "peak_flops", None)
    try:
        v = fn() if callable(fn) else fn  # (the backend's own precision: TF32 and FP8 have their own peaks)
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


# the shape fields the trainer takes as overrides of a preset (TrainArgs' names); the rest come with the preset
_SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "n_kv_head", "block_size", "vocab_size")


def _preset_for(cfg: Config) -> tuple[str, dict]:
    """A preset name and overrides from which the trainer rebuilds exactly `cfg` (it builds its model from
    --model and the shape options, not from a config object)."""
    fam = family_of(cfg)
    over = {k: getattr(cfg, k) for k in _SHAPE_FIELDS if hasattr(cfg, k)}
    for name in fam.preset_names:
        if fam.preset(name, **over) == cfg:
            return name, over
    fields = "/".join(arg(f) for f in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))
    raise BenchError(f"no {fam.label} preset gives this model with {fields} overrides: {cfg}")


def _steps_progress(progress: Callable[[str], None] | None, what: str) -> Callable[[int, int, int], None] | None:
    """(step, warmup, total) -> `what: step 3/12 (warm-up)` for a training loop: a long run's status line moves
    with its steps (it said only `training on cpu` for hours)."""
    if progress is None:
        return None
    return lambda s, warmup, total: progress(f"{what}: step {s + 1:,}/{total:,}"
                                             + (" (warm-up)" if s < warmup else ""))


def train_llmc(label: str, backend: Backend, cfg: Config, B: int, T: int, data: str, *, steps: int,
               warmup: int, seed: int, recompute: str = "none", graphs: bool = True, prefetch: bool = True,
               progress: Callable[[int, int, int], None] | None = None) -> dict:
    """`steps` timed training steps after `warmup` ones, through llmc's Trainer (data loader + optimizer).
    `data_waits`: how often the timed steps found a batch not ready when they asked for it (the next one, read
    ahead; without `prefetch` each is read inside its step: all of them), `data_wait_ms` the time that took,
    `data_batches` the batches the timed steps trained on."""
    model, over = _preset_for(cfg)
    args = TrainArgs(data=data, model=model, **over, batch_size=B, seq_len=T, steps=warmup + steps, seed=seed,
                     optim=AdamWConfig(weight_decay=0.1), val_every=0, sample_every=0, recompute=recompute,
                     graphs=graphs, prefetch=prefetch)
    trainer = Trainer(args, backend, say=lambda s: None)
    times, losses = [], []
    try:
        for s in range(warmup + steps):
            if progress is not None:
                progress(s, warmup, warmup + steps)
            if s == warmup:
                feed = trainer.feed
                waits0, wait_s0 = feed.waits, feed.wait_s
            rec = trainer.train_step(s)
            losses.append(rec["loss"])
            if s >= warmup:
                times.append(rec["ms"] / 1e3)
        mem = backend.memory_report()
        waits = {"prefetch": prefetch, "data_waits": feed.waits - waits0, "data_batches": steps * trainer.grad_accum,
                 "data_wait_ms": (feed.wait_s - wait_s0) * 1e3}
    finally:
        trainer.close()
        del trainer
        gc.collect()
    r = _train_record(label, "llmc", times, losses, B, T, flops_per_step(cfg, B, T), _peak_flops(backend))
    r.update(describe=backend.describe(), dtype=backend.matmul_dtype or backend.dtype, allocated_bytes=mem.allocated,
             device_total_bytes=mem.device_total,
             device_used_bytes=(mem.device_total - mem.device_free) if (mem.device_total and mem.device_free is not None)
             else None, host_rss_peak_bytes=_rss_peak_bytes(), **waits)
    return r


def torch_adamw(groups: list[dict], device: str, oc) -> tuple[object, str]:
    """torch.optim.AdamW with llmc's hyper-parameters: fused (one kernel over every tensor, as llmc's own AdamW is
    one pass) on CUDA, where the GPU comparison is made and fused is what a tuned PyTorch run uses; foreach (the
    multi-tensor path every torch has) on the CPU and wherever fused is refused. Returns (optimizer, flavour):
    the flavour goes into the results, since it moves the step time."""
    import torch  # (optional and heavy: only for --compare)
    kw = dict(lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps)
    if device == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw), "fused"
        except (RuntimeError, TypeError, ValueError):  # a torch without the fused kernel for these tensors
            pass
    return torch.optim.AdamW(groups, foreach=True, **kw), "foreach"


def train_torch(cfg: Config, B: int, T: int, data: str, *, steps: int, warmup: int, seed: int,
                compile: bool = False, dtype: str = FLOAT32, device: str | None = None,
                progress: Callable[[int, int, int], None] | None = None) -> dict:
    """PyTorch on the same model (llmc's initial weights), data loader, AdamW and clipping. Raises on failure.
    `device`: None = CUDA when torch sees one, else the CPU."""
    import torch  # (optional and heavy: only for --compare)
    fam = family_of(cfg)
    twin = TORCH_TWINS.get(fam.name)
    if twin is None:
        raise BenchError(f"no PyTorch {fam.label} to compare with")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):  # modules made on the device: no second host copy of a 1B model's weights
        model = twin(cfg, fam.init_parameters(cfg, seed), T, device, dtype)
    model = model.to(device)  # (what was made from numpy: the rotary tables)
    oc = AdamWConfig(weight_decay=0.1)
    # weight decay on the tensors llmc decays (its DECAYED: the matrices), none on norms and biases
    decay = [p for n, p in model.named_parameters() if n in model.decayed]
    plain = [p for n, p in model.named_parameters() if n not in model.decayed]
    opt, flavour = torch_adamw([{"params": decay, "weight_decay": oc.weight_decay},
                                {"params": plain, "weight_decay": 0.0}], device, oc)
    step_fn = torch.compile(model) if compile else model
    loader = DataLoader(data, B, T, seed=seed, vocab_size=cfg.vocab_size)
    amp = torch.autocast(device, dtype=torch.bfloat16) if dtype == BFLOAT16 else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, first = [], [], None
    for s in range(warmup + steps):
        if progress is not None:
            progress(s, warmup, warmup + steps)
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
        lv = loss.item()  # waits for the device: the step is over when its loss is on the host
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
             dtype=dtype, optimizer=f"AdamW {flavour}", attention=model.attention,
             first_step_s=first, host_rss_peak_bytes=_rss_peak_bytes(),
             allocated_bytes=int(torch.cuda.max_memory_allocated()) if device == "cuda" else None)
    return r


RANDOM_SHARD_TOKENS = 1 << 24  # the most tokens `bench train` writes to its temporary shard (32 MiB of GPT-2 ids)


def random_shard(directory: str | Path, cfg: Config, ntokens: int, seed: int) -> str:
    """A shard of `ntokens` uniformly random token ids (seeded) in `directory`; returns a glob for it. The
    format is the one the trainer takes for the model's vocabulary: GPT-2's (16-bit ids) up to 50257 ids,
    Llama 3's (32-bit) for 128256 and more; a vocabulary between the two has no shard format."""
    fits = [t for t, n in sorted(SHARD_VOCAB.items(), key=lambda kv: -kv[1])
            if cfg.vocab_size >= n and (t != "bytes" or cfg.vocab_size == n)]  # (bytes: a byte model's alone)
    if not fits or (fits[0] == "gpt2" and cfg.vocab_size > 2**16):
        raise BenchError(f"{arg('vocab_size', cfg.vocab_size)}: random tokens need a vocabulary of GPT-2's 50257 to "
                         f"65536 ids or Llama 3's 128256 or more (shard formats); give {arg('data')} instead")
    rng = np.random.default_rng(seed)
    path = Path(directory) / "bench_train_000000.bin"
    write_shard(path, rng.integers(0, cfg.vocab_size, ntokens, dtype=np.int64), tokenizer=fits[0])
    return str(path)


def torch_dtype_for(backends: Sequence[tuple[str, Backend]]) -> str:
    """PyTorch's dtype for --torch-dtype auto: the backends' when they share one (so `--dtype bf16` compares
    bf16 with bf16 autocast, not with float32), else float32."""
    dts = {be.dtype for _, be in backends}
    return dts.pop() if len(dts) == 1 and dts <= {FLOAT32, BFLOAT16} else FLOAT32


def _torch_modes(compare: Sequence[str], notes: list[str]) -> list[str]:
    """The PyTorch variants of `compare` to run: none, with a note, when torch does not import."""
    modes = [m for m in compare if m.startswith("torch")]
    if modes:
        try:
            import torch  # noqa: F401  (optional and heavy: only for --compare)
        except Exception as e:  # not installed, or installed but broken (a CUDA library that fails to load)
            why = "not installed" if isinstance(e, ImportError) else \
                f"not importable ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]})"
            notes.append(f"PyTorch is {why}: --compare torch skipped (pip install torch)")
            return []
    return modes


def _train_torch_mode(mode: str, cfg: Config, B: int, T: int, data: str, run: dict, torch_dtype: str,
                      results: list, notes: list, progress: Callable[[str], None] | None) -> None:
    """One PyTorch variant ("torch-eager", "torch-compile") into `results` and its notes; a failure is a note
    (torch.compile needs a working compiler toolchain), not an error."""
    if progress:
        progress(f"training with {mode}")
    try:
        r = train_torch(cfg, B, T, data, **run, compile=mode == "torch-compile", dtype=torch_dtype,
                        progress=_steps_progress(progress, f"training with {mode}"))
        results.append(r)
        notes.append(f"{r['name']}: {r['describe']}; {r['optimizer']} (torch.optim.AdamW"
                     f"{'(fused=True)' if r['optimizer'].endswith('fused') else '(foreach=True)'}), "
                     f"attention {r['attention']}"
                     + (", bf16 autocast over float32 weights" if torch_dtype == BFLOAT16 else ", float32"))
        if mode == "torch-compile":
            notes.append(f"torch compile: first step {r['first_step_s']:.1f} s (compilation, untimed)")
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:200]
        notes.append(f"{mode} failed: {type(e).__name__}: {first}")
        gc.collect()


def run_train(backends: Sequence[tuple[str, Backend]], cfg: Config, B: int, T: int, *, steps: int = 10,
              warmup: int = 2, seed: int = 1337, data: str | None = None, compare: Sequence[str] = (),
              torch_dtype: str | None = FLOAT32, progress: Callable[[str], None] | None = None,
              recompute: str = "none", graphs: bool = True, prefetch: bool = True) -> dict:
    """Training steps on every backend (and PyTorch for `compare` entries "torch-eager" / "torch-compile").
    `data`: a glob of shards; None writes a temporary shard of random tokens. `torch_dtype` None: the
    backends' dtype where they share one (bf16 runs PyTorch under bf16 autocast), else float32. `recompute`:
    llmc's --recompute (PyTorch has none here, so it cannot be compared with one). Returns
    {"config", "results", "notes", "failed"}; a PyTorch variant that fails is a note, not an error, and a backend
    that raises (other than the trainer refusing the options) is a line in "failed" while the others train."""
    if steps < 1 or warmup < 0:
        raise BenchError(f"{arg('steps')} must be >= 1 and {arg('warmup')} >= 0 (got {steps}, {warmup})")
    if steps + warmup > INT32_MAX:  # (the trainer, given their sum, named a --steps no one had typed)
        raise BenchError(f"{arg('steps', steps)} {arg('warmup', warmup)}: {steps + warmup:,} steps in all, more "
                         f"than a run counts ({INT32_MAX:,})")
    try:
        check_seq_len(T, cfg.block_size, arg("T", cli="seq_len"))
    except ValueError as e:
        raise BenchError(str(e)) from None
    if recompute != "none" and any(m.startswith("torch") for m in compare):
        raise BenchError(f"{arg('recompute', recompute)} times llmc only; {arg('compare')} runs PyTorch without it, so "
                         "leave one out")
    if torch_dtype is None:
        torch_dtype = torch_dtype_for(backends)
    results, notes, failed = [], [], []
    run = dict(steps=steps, warmup=warmup, seed=seed)
    with temporary_directory("llmc-bench-") as tmp:
        if data is None:
            # every step its own tokens, up to RANDOM_SHARD_TOKENS: past that the loader starts the shard again (a
            # step costs the same), so --steps 2147483647 is not a 128 GiB array of token ids
            need = (warmup + steps) * B * T + 1
            data = random_shard(tmp, cfg, max(min(need, RANDOM_SHARD_TOKENS), 2 * B * T + 1), seed)
            data_desc = "random tokens (temporary shard)"
        else:
            data_desc = data
        for label, be in backends:
            if progress:
                progress(f"training on {label}")
            try:
                results.append(train_llmc(label, be, cfg, B, T, data, **run, recompute=recompute, graphs=graphs,
                                          prefetch=prefetch,
                                          progress=_steps_progress(progress, f"training on {label}")))
            except ValueError as e:  # TrainError / DataError: options the trainer refuses
                raise BenchError(f"training on {label}: {e}") from None
            except Exception as e:  # noqa: BLE001  (a backend's failure is its line; the others still train)
                failed.append({"backend": label, "kernel": None, "error": failure_line(e)})
                gc.collect()
        torch_modes = _torch_modes(compare, notes)
        for mode in torch_modes:
            _train_torch_mode(mode, cfg, B, T, data, run, torch_dtype, results, notes, progress)
    return {"config": {**_cfg_dict(cfg), "B": B, "T": T, "steps": steps, "warmup": warmup, "seed": seed,
                       "data": data_desc, "flops_per_step": flops_per_step(cfg, B, T),
                       **({"torch_dtype": torch_dtype} if torch_modes else {})},
            "results": results, "notes": notes, "failed": failed}
