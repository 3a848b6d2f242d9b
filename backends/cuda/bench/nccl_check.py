"""NCCL through llmc_cli.parallel.comm on N GPUs: correctness of every collective (fp32 and bf16) and all-reduce bandwidth.
    python backends/cuda/bench/nccl_check.py N        (starts N ranks itself, one per GPU, like `llmc train --gpus N`)"""
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from llmc_cli.parallel import comm as C
from llmc_cli.parallel.launch import supervise
from llmc_cli.registry import create_backend

BLOCK = 1024  # elements each rank owns in the correctness checks


def _correct(be, c, dt: str) -> list[tuple[str, bool]]:
    """(collective, right) for each collective in dtype `dt`, on values whose result every rank can check."""
    r, W = c.rank, c.world_size
    ok = []
    n = BLOCK * W
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
    ch = be.download(buf)[r * BLOCK:(r + 1) * BLOCK]
    ok.append(("reduce_scatter " + dt, np.allclose(ch, W * (np.arange(r * BLOCK, (r + 1) * BLOCK) % 64)
                                                  + W * (W - 1) / 2)))
    h = np.zeros(n, np.float32)
    h[r * BLOCK:(r + 1) * BLOCK] = r + 1
    be.upload(buf, h)
    c.all_gather(buf)
    ok.append(("all_gather " + dt, np.all(be.download(buf) == np.repeat(np.arange(1, W + 1), BLOCK))))
    be.upload(buf, np.full(n, r, np.float32))
    c.broadcast(buf, root=W - 1)
    ok.append(("broadcast " + dt, np.all(be.download(buf) == W - 1)))
    return ok


def _bandwidth(be, c, iters: int = 10) -> dict:
    """All-reduce, reduce-scatter and all-gather of a GPT-2 d12-sized bf16 gradient (124M values), and the
    device barrier: seconds and ms a call, and the all-reduce's bus bandwidth."""
    W = c.world_size
    g = be.alloc(124_475_904, "bfloat16")
    be.fill(g, 1.0)
    for _ in range(3):
        c.all_reduce(g, C.AVG)
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        c.all_reduce(g, C.AVG)
    be.synchronize()
    dt = (time.perf_counter() - t0) / iters
    nbytes = g.size * 2

    def timed(fn):  # ms a call, device events around `iters` calls after 3 more warm-ups
        for _ in range(3):
            fn()
        a = be.timer()
        a.start()
        for _ in range(iters):
            fn()
        return a.stop() / iters * 1e3
    return {"dt": dt, "nbytes": nbytes, "bus": 2 * (W - 1) / W * nbytes / dt / 1e9,
            "rs_ms": timed(lambda: c.reduce_scatter(g, C.AVG)),  # ZeRO-1's step: these two around the update
            "ag_ms": timed(lambda: c.all_gather(g)),
            "fence_ms": timed(c.device_barrier) if hasattr(c, "device_barrier") else float("nan")}  # 1 value


def child():
    be = create_backend("cuda", dtype="bfloat16")
    c = C.create(be)
    r, W = c.rank, c.world_size
    ok = _correct(be, c, "float32") + _correct(be, c, "bfloat16")
    ok.append(("all_reduce_value", c.all_reduce_value(r + 1.0, C.SUM) == W * (W + 1) / 2))
    bw = _bandwidth(be, c)
    bad = [k for k, v in ok if not v]
    print(f"rank {r}/{W} via {c.binding} ({c.how}): {len(ok) - len(bad)}/{len(ok)} collectives correct"
          + (f", WRONG: {bad}" if bad else ""), flush=True)
    if r == 0:
        nbytes = bw["nbytes"]
        print(f"all-reduce of 124.5M bf16 (d12 grads, {nbytes / 1e6:.0f} MB): {bw['dt'] * 1e3:.2f} ms, "
              f"bus bandwidth {bw['bus']:.0f} GB/s; reduce-scatter {bw['rs_ms']:.3f} ms, all-gather "
              f"{bw['ag_ms']:.3f} ms ({(W - 1) / W * nbytes / 1e6:.0f} MB each way a rank); device barrier "
              f"{bw['fence_ms'] * 1e3:.1f} us", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if os.environ.get("LLMC_RANK") is not None:
        child()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    d = Path(tempfile.mkdtemp(prefix="nccl-check-"))
    envs = [dict(os.environ, LLMC_RANK=str(r), LLMC_WORLD_SIZE=str(n), LLMC_LOCAL_RANK=str(r),
                 LLMC_INIT_FILE=str(d / "id"), CUDA_VISIBLE_DEVICES=str(r)) for r in range(n)]
    rc = supervise([[sys.executable, __file__]] * n, envs, d)
    for r in range(1, n):
        print((d / f"rank{r}.log").read_text().strip())
    sys.exit(rc)
