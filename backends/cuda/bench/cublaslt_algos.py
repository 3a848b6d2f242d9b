"""cuBLASLt's algorithm candidates for every matmul of one GPT-2 training step, each timed on the real buffers.

    python backends/cuda/bench/cublaslt_algos.py --model d12 -b 64 -t 1024 [--candidates 16] [--reps 20] [--json out.json]

Six training steps run with the backend asking cuBLASLt's heuristic for up to --candidates algorithms per
product (the backend's tuner keeps the fastest of those bit-identical to the first, timed in the steps); then every product is
replayed on the pointers of its last call with each candidate, timed with CUDA events (median of --reps bursts
of 4 calls after 3 warm-up calls). Each candidate is listed with its configuration (id, tile, stages, split-k,
reduction scheme, swizzle, custom option, cluster, inner shape), "=" where the tuner raced it (the first's
order of summation, its output bit-identical to the first's), "~" where not, and the one the tuner kept. Replays of the
weight-gradient products accumulate into the gradients: this is a benchmark, the model is thrown away. It also
times cuDNN's deterministic attention backward with the batch split into slices.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import cupy as cp
import numpy as np

from llmc_cli import registry
from llmc_cli.formats.shards import write_shard
from llmc_cli.kernels import BFLOAT16, FLOAT32
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=64)
    ap.add_argument("-t", type=int, default=1024)
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def _trained(o, rng):
    """(backend, trainer) after six bf16 training steps on random tokens: the tuner has settled every product."""
    be = next(p for p in registry.discover() if p.name == "cuda").plugin.create(dtype="bfloat16")
    be.lt.candidates = o.candidates
    tmp = tempfile.mkdtemp()
    write_shard(f"{tmp}/synth_train_000.bin", rng.integers(0, 50257, o.b * o.t * 8 + 1).astype(np.uint16))
    args = TrainArgs(data=f"{tmp}/synth_train_*.bin", model=o.model, batch_size=o.b, seq_len=o.t, steps=6,
                     optim=AdamWConfig(lr=6e-4, weight_decay=0.1), val_every=0, sample_every=0)
    tr = Trainer(args, be, say=print)
    for step in range(6):  # the backend's tuner has settled every d12 product by step 5
        tr.train_step(step)
    be.synchronize()
    return be, tr


def _timer(be, reps: int):
    """ms per call of a function on the backend's stream: median of `reps` bursts of 4 calls after 3 warm-ups."""
    def timed(fn):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(3):
            fn()
        ts = []
        for _ in range(reps):  # bursts of 4 back-to-back calls, as the tuner times them
            e0.record(be.stream)
            for _ in range(4):
                fn()
            e1.record(be.stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 4)
        return float(np.median(ts))
    return timed


def _product(be, key, plan, timed) -> dict:
    """Every candidate of one product replayed on its last call's pointers, printed and returned."""
    kind, N, C, OC, epi = key[0], key[1], key[2], key[3], key[5]
    flops = 2 * N * C * OC
    rows = []
    pick = plan.choice
    tuned = {r[0]: r for r in be.lt.tuning.get(key, [])}
    for i in range(plan.count):
        plan.choose(i)
        try:
            ms = timed(lambda: plan.run(*plan.last))
        except Exception as e:  # a candidate that cannot run here
            rows.append({"i": i, "config": plan.config(i), "error": str(e)[:80]})
            continue
        same = tuned[i][2] if i in tuned else None
        rows.append({"i": i, "config": plan.config(i), "ms": ms, "tflops": flops / ms / 1e9, "identical": same})
    plan.choose(pick)
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    label = f"{kind} N={N} C={C} OC={OC} epi={epi}"
    print(f"\n{label}: {plan.count} candidates; heuristic's first {ok[0]['ms']:.3f} ms "
          f"({ok[0]['tflops']:.0f} TFLOP/s), best #{best['i']} {best['ms']:.3f} ms ({best['tflops']:.0f} TFLOP/s), "
          f"tuner kept #{pick} {rows[pick].get('ms', 0):.3f} ms")
    for r in rows:
        print(f"  #{r['i']:2d} {r['config']} " + ("=" if r.get("identical") else "~") + " " +
              (f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s" if "ms" in r else r["error"]))
    return {"key": [str(k) for k in key], "label": label, "candidates": rows}


def _attention_slices(be, cfg, B: int, T: int, rng, timed) -> list[dict]:
    """cuDNN attention backward: the whole batch in one call vs slices (workspace vs time)."""
    NH, C = cfg.n_head, cfg.n_embd
    hd = C // NH

    def filled(shape):
        buf = be.alloc(shape, BFLOAT16)
        be.upload(buf, rng.standard_normal(shape).astype(np.float32))
        return buf
    qkv, dout = filled((B, T, 3 * C)), filled((B, T, C))
    out, lse = be.alloc((B, T, C), BFLOAT16), be.alloc((B, NH, T), FLOAT32)
    be.attention_forward(out, lse, qkv, NH, NH)
    dqkv = be.alloc((B, T, 3 * C), BFLOAT16)
    att = be._cudnn
    rows = []
    for limit in (1 << 40, 1 << 30, 512 << 20, 256 << 20, 128 << 20, 64 << 20):
        att.bwd_workspace_max = limit
        att.bwd_slices.clear()
        ms = timed(lambda: be.attention_backward(dqkv, dout, qkv, out, lse, NH, NH))
        g, Bs, _ = att.bwd_slices[(B, T, NH, NH, hd)]
        ws = g.get_workspace_size()
        flops = 2.5 * 4 * B * NH * T * T * hd / 2
        print(f"attention_backward B={B}: slices of {Bs} sequences, workspace {ws / 2**20:.1f} MiB, {ms:.3f} ms "
              f"({flops / ms / 1e9:.0f} TFLOP/s)")
        rows.append({"limit": limit, "slice": Bs, "workspace_mib": ws / 2**20, "ms": ms})
    return rows


def main():
    o = _args()
    rng = np.random.default_rng(0)
    be, tr = _trained(o, rng)
    timed = _timer(be, o.reps)
    report = {"device": be.describe(), "model": o.model, "B": o.b, "T": o.t, "products": []}
    for key, plan in be.lt.plans.items():
        if plan is not None and plan.last is not None:
            report["products"].append(_product(be, key, plan, timed))
    if be._cudnn_ready():
        report["attention_backward"] = _attention_slices(be, tr.cfg, o.b, o.t, rng, timed)
    if o.json:
        with open(o.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
