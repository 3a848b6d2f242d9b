"""OpenCL backend (PoCL on this machine) against the CPU backend (llmc_cpu), side by side, one process.

    python backends/opencl/bench/opencl_vs_cpu.py --model d12 -b 4 -t 64 --rounds 5        # prints medians + load average
    python backends/opencl/bench/opencl_vs_cpu.py --profile                                  # + per-kernel time on each backend

Both backends train the same GPT-2 (fp32, same init, same token batches, AdamW + grad clip as `llmc train`).
Steps alternate between the two backends (round r: one CPU step, one OpenCL step) so that load from other
processes on the machine hits both alike; the ratio of the medians is the number reported. `uptime`'s load
average is printed before and after, since the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import numpy as np


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split(" ")[:3].__str__()
    except OSError:
        return "?"


class Runner:
    def __init__(self, backend: str, cfg, B, T, device=None):
        from llmc_cli.models.gpt2 import GPT2, init_parameters
        from llmc_cli.optim import AdamW, AdamWConfig
        from llmc_cli.registry import create_backend
        self.be = create_backend(backend, device=device) if device else create_backend(backend)
        self.m = GPT2(cfg, self.be, B, T)
        self.m.load_parameters(init_parameters(cfg, 0))
        self.opt = AdamW(self.be, self.m.params, self.m.grads, self.m.tensor_names(), AdamWConfig(weight_decay=0.1))
        self.B, self.T = B, T
        self.s = 0

    def step(self, x, y) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.m.zero_grad()
        self.m.forward(x, y, dloss=1.0 / (self.B * self.T))
        self.m.backward()
        self.opt.step(3e-4, self.opt.grad_norm(), seed=self.s)
        loss = self.m.mean_loss()
        self.be.synchronize()
        self.s += 1
        return time.perf_counter() - t0, loss


def profile(r: Runner, x, y, steps: int = 2) -> dict[str, float]:
    """Seconds per step spent in each Backend method (synchronizing around every call)."""
    from llmc_cli.kernels import Backend
    be = r.be
    acc: dict[str, float] = defaultdict(float)
    names = [n for n in dir(Backend) if not n.startswith("_") and callable(getattr(Backend, n))
             and n not in ("alloc", "view", "synchronize", "memory_report", "describe")]
    orig = {}
    for n in names:
        f = getattr(be, n, None)
        if f is None:
            continue
        orig[n] = f

        def wrap(*a, _f=f, _n=n, **k):
            be.synchronize()
            t0 = time.perf_counter()
            out = _f(*a, **k)
            be.synchronize()
            acc[_n] += time.perf_counter() - t0
            return out
        setattr(be, n, wrap)
    try:
        for _ in range(steps):
            r.step(x, y)
    finally:
        for n in orig:
            delattr(be, n)
    return {k: v / steps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per backend (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default=None, help="OpenCL device selector")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from llmc_cli.models.gpt2 import preset
    cfg = preset(a.model)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cfg.vocab_size, (a.b, a.t)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (a.b, a.t)).astype(np.int32)) for _ in range(4)]
    print(f"load before: {loadavg()}  cores: {os.cpu_count()}", flush=True)
    cpu = Runner("cpu", cfg, a.b, a.t)
    ocl = Runner("opencl", cfg, a.b, a.t, a.device)
    print("opencl:", ocl.be.describe(), flush=True)
    t_cpu, t_ocl, l_cpu, l_ocl = [], [], [], []
    for s in range(a.warmup + a.rounds):
        x, y = batches[s % len(batches)]
        dc, lc = cpu.step(x, y)
        do, lo = ocl.step(x, y)
        l_cpu.append(lc)
        l_ocl.append(lo)
        if s >= a.warmup:
            t_cpu.append(dc)
            t_ocl.append(do)
            print(f"round {s - a.warmup}: cpu {dc * 1e3:7.1f} ms  opencl {do * 1e3:7.1f} ms  "
                  f"ratio {do / dc:5.2f}  (loss cpu {lc:.4f} opencl {lo:.4f})", flush=True)
    mc, mo = statistics.median(t_cpu), statistics.median(t_ocl)
    ratios = [o / c for o, c in zip(t_ocl, t_cpu)]
    print(f"{a.model} B={a.b} T={a.t} fp32: cpu median {mc * 1e3:.1f} ms, opencl median {mo * 1e3:.1f} ms, "
          f"ratio of medians {mo / mc:.2f}, median per-round ratio {statistics.median(ratios):.2f}")
    print(f"load after: {loadavg()}", flush=True)
    res = dict(model=a.model, B=a.b, T=a.t, cpu_ms=[round(t * 1e3, 1) for t in t_cpu],
               opencl_ms=[round(t * 1e3, 1) for t in t_ocl], ratio=round(mo / mc, 3), opencl=ocl.be.describe(),
               max_loss_diff=float(np.max(np.abs(np.array(l_cpu) - np.array(l_ocl)))))
    print(f"max |loss cpu - loss opencl| over {len(l_cpu)} steps: {res['max_loss_diff']:.2e}")
    if a.profile:
        x, y = batches[0]
        for name, r in (("cpu", cpu), ("opencl", ocl)):
            p = profile(r, x, y)
            res[f"profile_{name}"] = {k: round(v * 1e3, 2) for k, v in p.items()}
            print(f"per-kernel ms/step, {name}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.items() if v > 5e-4))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
