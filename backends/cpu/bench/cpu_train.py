"""CPU training step time: llmc's numpy backend against PyTorch eager on the same GPT-2, shapes and optimizer.

    python backends/cpu/bench/cpu_train.py --model d12 -b 4 -t 64 --steps 10        # needs: pip install torch==2.13.0

Both sides: fp32, random init, AdamW (0.9, 0.95, eps 1e-8, weight decay 0.1 on matrices), grad clip 1.0, the
same token batches, the same number of threads. Prints the median step time of each after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np


def bench_llmc(cfg, B, T, batches, steps, warmup):
    from llmc_cli.models.gpt2 import GPT2, init_parameters
    from llmc_cli.optim import AdamW, AdamWConfig
    from llmc_cli.registry import create_backend
    be = create_backend("cpu")
    m = GPT2(cfg, be, B, T)
    m.load_parameters(init_parameters(cfg, 0))
    opt = AdamW(be, m.params, m.grads, m.tensor_names(), AdamWConfig(weight_decay=0.1))
    times, losses = [], []
    for s in range(warmup + steps):
        x, y = batches[s % len(batches)]
        t0 = time.perf_counter()
        m.zero_grad()
        m.forward(x, y, dloss=1.0 / (B * T))
        m.backward()
        opt.step(3e-4, opt.grad_norm(), seed=s)
        loss = m.mean_loss()
        dt = time.perf_counter() - t0
        if s >= warmup:
            times.append(dt)
        losses.append(loss)
    return times, losses


def bench_torch(cfg, B, T, batches, steps, warmup, threads):
    import torch
    from llmc_cli.bench.torch_gpt2 import build_torch_gpt2
    from llmc_cli.models.gpt2 import init_parameters, parameter_shapes
    torch.set_num_threads(threads)
    # the same module `llmc bench --compare torch-eager` times, starting from llmc's own initial weights
    model = build_torch_gpt2(cfg, init_parameters(cfg, 0), parameter_shapes(cfg))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    times, losses = [], []
    for s in range(warmup + steps):
        x, y = batches[s % len(batches)]
        xt, yt = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
        t0 = time.perf_counter()
        loss = model(xt, yt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        dt = time.perf_counter() - t0
        if s >= warmup:
            times.append(dt)
        losses.append(lv)
    return times, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="d12")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", default=None, help="write the results to this file")
    a = ap.parse_args()
    from llmc_cli.models.gpt2 import preset
    cfg = preset(a.model)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cfg.vocab_size, (a.b, a.t)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (a.b, a.t)).astype(np.int32)) for _ in range(4)]
    from llmc_cli.models.gpt2 import num_parameters
    n_params = num_parameters(cfg)
    # 6 N per token for the weights plus attention's 12 L T C per token (PaLM's MFU accounting)
    flops = (6 * n_params + 12 * cfg.n_layer * a.t * cfg.n_embd) * a.b * a.t
    res = {"model": a.model, "B": a.b, "T": a.t, "steps": a.steps, "threads": a.threads,
           "cpu": platform.processor() or platform.machine(), "gflop_per_step": flops / 1e9}
    lt, ll = bench_llmc(cfg, a.b, a.t, batches, a.steps, a.warmup)
    res["llmc_s_per_step"] = {"min": min(lt), "median": statistics.median(lt), "max": max(lt)}
    print(f"llmc cpu : median {statistics.median(lt):.3f} s/step (min {min(lt):.3f}, max {max(lt):.3f}), "
          f"{flops / statistics.median(lt) / 1e9:.0f} GFLOP/s, losses {ll[0]:.4f} -> {ll[-1]:.4f}")
    if not a.skip_torch:
        tt, tl = bench_torch(cfg, a.b, a.t, batches, a.steps, a.warmup, a.threads)
        res["torch_s_per_step"] = {"min": min(tt), "median": statistics.median(tt), "max": max(tt)}
        import torch
        res["torch"] = torch.__version__
        print(f"torch    : median {statistics.median(tt):.3f} s/step (min {min(tt):.3f}, max {max(tt):.3f}), "
              f"{flops / statistics.median(tt) / 1e9:.0f} GFLOP/s, losses {tl[0]:.4f} -> {tl[-1]:.4f}")
        print(f"speed-up : {statistics.median(tt) / statistics.median(lt):.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
