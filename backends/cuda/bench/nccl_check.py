"""NCCL through llmc_cli.parallel.comm on N GPUs: correctness of every collective (fp32 and bf16) and all-reduce bandwidth.
    python backends/cuda/bench/nccl_check.py N        (starts N ranks itself, one per GPU, like `llmc train --gpus N`)"""
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def child():
    from llmc_cli.parallel import comm as C
    from llmc_cli.registry import create_backend
    be = create_backend("cuda", dtype="bfloat16")
    c = C.create(be)
    r, W = c.rank, c.world_size
    ok = []
    for dt in ("float32", "bfloat16"):
        n = 1024 * W
        buf = be.alloc(n, dt)
        be.upload(buf, np.full(n, r + 1, np.float32))
        c.all_reduce(buf, C.SUM)
        got = be.download(buf)
        ok.append(("all_reduce sum " + dt, np.all(got == W * (W + 1) / 2)))
        be.upload(buf, np.full(n, r + 1, np.float32))
        c.all_reduce(buf, C.AVG)
        ok.append(("all_reduce avg " + dt, np.allclose(be.download(buf), (W + 1) / 2)))
        be.upload(buf, np.arange(n, dtype=np.float32) % 64 + r)
        c.reduce_scatter(buf, C.SUM)
        ch = be.download(buf)[r * 1024:(r + 1) * 1024]
        ok.append(("reduce_scatter " + dt, np.allclose(ch, W * (np.arange(r * 1024, (r + 1) * 1024) % 64)
                                                      + W * (W - 1) / 2)))
        h = np.zeros(n, np.float32)
        h[r * 1024:(r + 1) * 1024] = r + 1
        be.upload(buf, h)
        c.all_gather(buf)
        ok.append(("all_gather " + dt, np.all(be.download(buf) == np.repeat(np.arange(1, W + 1), 1024))))
        be.upload(buf, np.full(n, r, np.float32))
        c.broadcast(buf, root=W - 1)
        ok.append(("broadcast " + dt, np.all(be.download(buf) == W - 1)))
    ok.append(("all_reduce_value", c.all_reduce_value(r + 1.0, C.SUM) == W * (W + 1) / 2))
    # bandwidth: a GPT-2 d12-sized bf16 gradient (124M values)
    g = be.alloc(124_475_904, "bfloat16")
    be.fill(g, 1.0)
    for _ in range(3):
        c.all_reduce(g, C.AVG)
    be.synchronize()
    t0 = time.perf_counter()
    iters = 10
    for _ in range(iters):
        c.all_reduce(g, C.AVG)
    be.synchronize()
    dt = (time.perf_counter() - t0) / iters
    nbytes = g.size * 2
    bus = 2 * (W - 1) / W * nbytes / dt / 1e9

    def timed(fn):  # ms a call, device events around `iters` calls after 3 more warm-ups
        for _ in range(3):
            fn()
        a = be.timer()
        a.start()
        for _ in range(iters):
            fn()
        return a.stop() / iters * 1e3
    rs_ms = timed(lambda: c.reduce_scatter(g, C.AVG))  # ZeRO-1's step: these two around the sharded update
    ag_ms = timed(lambda: c.all_gather(g))
    fence_ms = timed(c.device_barrier) if hasattr(c, "device_barrier") else float("nan")  # a 1-value all-reduce
    bad = [k for k, v in ok if not v]
    print(f"rank {r}/{W} via {c.binding} ({c.how}): {len(ok) - len(bad)}/{len(ok)} collectives correct"
          + (f", WRONG: {bad}" if bad else ""), flush=True)
    if r == 0:
        print(f"all-reduce of 124.5M bf16 (d12 grads, {nbytes / 1e6:.0f} MB): {dt * 1e3:.2f} ms, "
              f"bus bandwidth {bus:.0f} GB/s; reduce-scatter {rs_ms:.3f} ms, all-gather {ag_ms:.3f} ms "
              f"({(W - 1) / W * nbytes / 1e6:.0f} MB each way a rank); device barrier {fence_ms * 1e3:.1f} us",
              flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if os.environ.get("LLMC_RANK") is not None:
        child()
    from llmc_cli.parallel.launch import supervise
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    d = Path(tempfile.mkdtemp(prefix="nccl-check-"))
    envs = [dict(os.environ, LLMC_RANK=str(r), LLMC_WORLD_SIZE=str(n), LLMC_LOCAL_RANK=str(r),
                 LLMC_INIT_FILE=str(d / "id"), CUDA_VISIBLE_DEVICES=str(r)) for r in range(n)]
    rc = supervise([[sys.executable, __file__]] * n, envs, d)
    for r in range(1, n):
        print((d / f"rank{r}.log").read_text().strip())
    sys.exit(rc)
