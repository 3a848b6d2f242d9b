"""Per-kernel time table of one GPT-2 or Llama 3 training step on the CUDA backend, plus end-to-end step timing.

    python backends/cuda/bench/cuda_profile.py --model d12 -b 64 -t 1024 [--recompute gelu] [--steps 10] [--json out.json]

End to end: `Trainer.train_step` (data loader, forward, backward, norm, AdamW) timed by the trainer itself
(device events), median over --steps after --warmup steps (default 6: the CUDA backend's cuBLASLt tuner
races its candidates in steps 2-5 at d12), and device memory (total - free).

Per kernel: one more step is queued behind a ~0.3 s spin kernel with a pair of CUDA events around every backend
call (inputs already uploaded, the norm read back afterwards), so the GPU runs the calls back to back with no
host gaps: the sum of the rows is the step's pure device time, and host overhead = step time - that sum.
Achieved TFLOP/s (matmuls, attention) or GB/s (the rest, counting each input read once and each output written
once) beside each row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict

import cupy as cp
import numpy as np

from llmc_cli import registry
from llmc_cli.formats.shards import write_shard
from llmc_cli.models import gpt2, llama3
from llmc_cli.models.base import STAGED
from llmc_cli.models.families import family_for
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, or fp8 (bf16 with FP8 matmuls)")
    ap.add_argument("-b", type=int, default=64)
    ap.add_argument("-t", type=int, default=1024)
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--classifier-chunks", type=int, default=None, help="default: the engine's rule")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=6, help="steps before the timed ones")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--sustained", action="store_true",
                    help="profile the step right after the timed ones, with no spin kernel in front: the device "
                         "runs at its sustained clocks and idles wherever the host is late (gaps are listed)")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def _used(tag):
    free, total = cp.cuda.runtime.memGetInfo()
    pool = cp.get_default_memory_pool()
    print(f"MEM {tag}: device used {(total - free) / 2**30:.2f} GiB, CuPy pool {pool.used_bytes() / 2**30:.2f} "
          f"GiB used / {pool.total_bytes() / 2**30:.2f} GiB held", flush=True)


def _trainer(o):
    """(backend, trainer) on a shard of random tokens of the model's family."""
    plugin = next(p for p in registry.discover() if p.name == "cuda").plugin
    be = plugin.create(dtype=o.dtype)
    _used("backend created")
    B, T = o.b, o.t
    tmp = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    llama = family_for(o.model).name == "llama3"  # Llama 3 presets train on Llama 3 shards (uint32 ids)
    ntok = B * T * (o.steps + o.warmup + 8) + 1
    write_shard(f"{tmp}/synth_train_000.bin", rng.integers(0, 128256 if llama else 50257, ntok),
                tokenizer="llama3" if llama else "gpt2")
    args = TrainArgs(data=f"{tmp}/synth_train_*.bin", model=o.model, batch_size=B, seq_len=T, recompute=o.recompute,
                     steps=o.steps + o.warmup + 4, optim=AdamWConfig(lr=6e-4, weight_decay=0.1), val_every=0,
                     sample_every=0)
    if o.classifier_chunks is not None:  # the engine plans chunks by auto_classifier_chunks; override it here
        gpt2.auto_classifier_chunks = llama3.auto_classifier_chunks = lambda *a, **k: o.classifier_chunks
    tr = Trainer(args, be, say=print)
    print(f"classifier chunks: {tr.model.chunks}, logits buffer {tuple(tr.model.acts['logits'].shape)}")
    print(be.describe())
    print(tr.memory_line())
    _used("model planned")
    return be, tr


def _end_to_end(o, be, tr) -> dict:
    """--warmup then --steps training steps, timed by the trainer: the step time's median, rates and memory."""
    B, T, cfg = o.b, o.t, tr.cfg
    recs = []
    for s in range(o.warmup + o.steps):
        r = tr.train_step(s)
        recs.append(r)
        if s == 0:
            _used("after step 1")
        print(f"step {s + 1}: loss {r['loss']:.6f} norm {r['norm']:.4f} {r['ms']:.1f} ms "
              f"{r['tok_per_s'] / 1e3:.0f}k tok/s", flush=True)
    ms = float(np.median([r["ms"] for r in recs[o.warmup:]]))
    mem = be.memory_report()
    used = (mem.device_total - mem.device_free) / 2**30
    flops = (6 * tr.model.num_params + 6 * cfg.n_layer * cfg.n_embd * T) * B * T
    peak = be.peak_flops() if hasattr(be, "peak_flops") else None
    out = {"device": be.describe(), "model": o.model, "B": B, "T": T, "recompute": o.recompute,
           "classifier_chunks": tr.model.chunks,
           "ms_step": ms, "tok_s": B * T / ms * 1e3, "tflops": flops / ms / 1e9,
           "mfu": (flops / ms / 1e-3 / peak) if peak else None, "device_used_gib": used,
           "allocated_gib": mem.allocated / 2**30, "by_tag_mib": {k: v / 2**20 for k, v in mem.by_tag.items()},
           "losses": [r["loss"] for r in recs]}
    print(f"END2END {o.model} B={B} T={T} recompute={o.recompute}: {ms:.1f} ms/step, {out['tok_s'] / 1e3:.0f}k tok/s, "
          f"{out['tflops']:.0f} TFLOP/s" + (f", MFU {out['mfu'] * 100:.1f}%" if peak else "") +
          f", device used {used:.2f} GiB (allocated {out['allocated_gib']:.2f} GiB)")
    return out


def main():
    o = _args()
    be, tr = _trainer(o)
    out = _end_to_end(o, be, tr)
    if not o.no_profile:
        out["kernels"] = profile(be, tr, cp, o.b, o.t, tr.cfg, spin_first=not o.sustained)
    if o.json:
        with open(o.json, "w") as f:
            json.dump(out, f, indent=1)


def _nbytes(x):
    return int(x.nbytes) if hasattr(x, "nbytes") else 0


def cost(name, a, kw, be):
    """(flops, bytes) of one backend call."""
    if name == "matmul_forward":
        out, inp, w = a[0], a[1], a[2]
        OC, C = w.shape
        N = inp.size // C
        pre = kw.get("pre_gelu", a[4] if len(a) > 4 else None)
        return 2 * N * C * OC, _nbytes(inp) + _nbytes(w) + _nbytes(out) + _nbytes(pre)
    if name == "matmul_backward":
        dinp, dw, db, dout, inp, w = a[:6]
        OC, C = w.shape
        N = inp.size // C
        f = 2 * N * C * OC * (2 if dinp is not None else 1)
        return f, _nbytes(dout) * 2 + _nbytes(inp) + _nbytes(w) + 2 * _nbytes(dw) + _nbytes(dinp)
    if name in ("attention_forward", "attention_backward"):
        qkv = a[2] if name == "attention_forward" else a[2]
        Bq, Tq, W = qkv.shape
        hd = W // (3 * a[-2]) if name == "attention_forward" else W // (3 * a[-2])
        NH = a[-2]
        f = 4 * Bq * NH * Tq * Tq * hd / 2  # causal: half of QK^T and PV
        return (f if name == "attention_forward" else 2.5 * f), sum(_nbytes(x) for x in a if hasattr(x, "nbytes"))
    if name == "fused_residual_layernorm_forward":
        return 0, sum(_nbytes(x) for x in a[:4]) + _nbytes(a[4]) + _nbytes(a[5])
    if name == "layernorm_backward":  # dinp read+write, dout, inp
        return 0, 2 * _nbytes(a[0]) + _nbytes(a[3]) + _nbytes(a[4])
    if name == "classifier_forward_backward":
        return 0, 3 * _nbytes(a[0])  # read twice, write once
    if name == "adamw_update":
        return 0, 2 * sum(_nbytes(x) for x in a[:5] if x is not None) - _nbytes(a[1])
    if name == "global_norm_squared":
        return 0, sum(_nbytes(g) for g in a[1])
    return 0, sum(_nbytes(x) for x in a if hasattr(x, "nbytes"))


NAMES = ["encoder_forward", "encoder_backward", "layernorm_forward", "layernorm_backward",
         "fused_residual_layernorm_forward", "residual_forward", "matmul_forward", "matmul_backward", "gelu_forward",
         "gelu_backward", "attention_forward", "attention_backward", "classifier_forward_backward",
         "global_norm_squared", "loss_sum", "step_guard", "adamw_update", "adamw_update_all", "scale", "fill", "copy", "upload",
         "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "rope_forward", "rope_backward"]


def _label(name, a, kw) -> str:
    """A call's row: the kernel, and a matmul's shape N x C x OC with its fused GELU."""
    if name == "matmul_forward":
        w = a[2]
        return name + f" {a[1].size // w.shape[1]}x{w.shape[1]}x{w.shape[0]}" + (
            " +gelu" if kw.get("pre_gelu") is not None else "")
    if name == "matmul_backward":
        w = a[5]
        return name + f" {a[4].size // w.shape[1]}x{w.shape[1]}x{w.shape[0]}" + (
            " +dgelu" if kw.get("pre_gelu") is not None else "")
    return name


def _wrap_calls(be, calls: list) -> dict:
    """Every backend method of NAMES wrapped to record (label, event before, event after, flops, bytes) into
    `calls` (calls from inside another wrapped call are not recorded; uploads are skipped: the inputs are staged).
    Returns the original methods, to put back."""
    orig = {}
    inner = [0]

    def wrap(name):
        f = getattr(be, name)
        orig[name] = f

        def g(*a, **kw):
            if inner[0] or name == "upload":
                return None if name == "upload" else f(*a, **kw)
            inner[0] += 1
            try:
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(be.stream)
                r = f(*a, **kw)
                e1.record(be.stream)
            finally:
                inner[0] -= 1
            fl, by = cost(name, a, kw, be)
            calls.append((_label(name, a, kw), e0, e1, fl, by))
            return r
        setattr(be, name, g)

    for n in NAMES:
        if hasattr(be, n):
            wrap(n)
    return orig


def _one_step(be, tr, B, T, spin_first: bool):
    """One training step's calls queued (behind a spin kernel, so the device runs them back to back); the events
    around it."""
    model = tr.model
    be.synchronize()
    if spin_first:
        with be.stream:
            cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(int(6e8)),))
    t0 = cp.cuda.Event()
    t0.record(be.stream)
    model.zero_grad()
    model.forward(STAGED, STAGED, dloss=1.0 / (B * T))
    model.backward()
    opt = tr.opt  # the step as Trainer.train_step queues it: loss, norm, clip and verdict on the device
    be.loss_sum(opt.loss_buf, model.acts["losses"], 1.0 / (B * T), False)
    opt.guarded_step(3e-4, 1, float("inf"), float("inf"))
    t1 = cp.cuda.Event()
    t1.record(be.stream)
    t1.synchronize()
    return t0, t1


def profile(be, tr, cp, B, T, cfg, spin_first=True):
    tr.feed.stage()  # a batch in the model's inputs, before any call is wrapped
    calls = []  # (label, ev0, ev1, flops, bytes)
    orig = _wrap_calls(be, calls)
    try:
        t0, t1 = _one_step(be, tr, B, T, spin_first)
    finally:
        for n, f in orig.items():
            setattr(be, n, f)
    total = cp.cuda.get_elapsed_time(t0, t1)
    _print_gaps(calls, t0)
    return {"device_ms": total, "rows": _table(calls, total)}


def _print_gaps(calls: list, t0) -> None:
    """Device idle time between consecutive calls (host late), the largest first."""
    gaps = [(cp.cuda.get_elapsed_time(calls[i - 1][2], calls[i][1]), calls[i - 1][0], calls[i][0])
            for i in range(1, len(calls))]
    gaps.append((cp.cuda.get_elapsed_time(t0, calls[0][1]), "step start", calls[0][0]))
    gaps.sort(key=lambda g: -g[0])
    print(f"\nGAPS between calls: {sum(g[0] for g in gaps):.2f} ms in all; largest: " +
          "; ".join(f"{ms:.3f} ms {a} -> {b}" for ms, a, b in gaps[:8]))


def _table(calls: list, total: float) -> list[dict]:
    """The calls summed by label, the longest first: printed, and returned as rows."""
    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for label, e0, e1, fl, by in calls:
        a = agg[label]
        a[0] += 1
        a[1] += cp.cuda.get_elapsed_time(e0, e1)
        a[2] += fl
        a[3] += by
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    s = sum(v[1] for v in agg.values())
    print(f"\nPROFILE one step, device time {total:.2f} ms (sum of calls {s:.2f} ms)")
    print(f"{'call':58s} {'n':>4s} {'ms':>8s} {'share':>6s} {'TFLOP/s':>8s} {'GB/s':>7s}")
    table = []
    for label, (n, ms, fl, by) in rows:
        tf = fl / ms / 1e9 if fl else None
        gb = by / ms / 1e6 if by else None
        table.append({"call": label, "n": n, "ms": ms, "share": ms / total, "tflops": tf, "gbs": gb})
        print(f"{label:58s} {n:4d} {ms:8.2f} {100 * ms / total:5.1f}% {tf if tf else 0:8.0f} {gb if gb else 0:7.0f}")
    return table


if __name__ == "__main__":
    sys.exit(main())
