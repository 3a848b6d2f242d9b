"""Peer writes as `llmc train --gpus N` makes them: N processes, each seeing only its own GPU, map every other
rank's buffer through CUDA IPC (as llmc_cuda/p2p.py does) and then all at once store a bf16 value a thread into
their own chunk of all their peers' copies, as ZeRO's update does with its mirrors. Per rank: the kernel's ms and
GB/s out, over rounds started together (a file barrier); then each rank alone, the others idle.

    python backends/cuda/bench/ipc_matrix.py [--gpus N] [--mb 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def barrier(d: Path, name: str, r: int, world: int) -> None:
    (d / f"{name}.{r}").write_text("")
    while sum(1 for q in range(world) if (d / f"{name}.{q}").exists()) < world:
        time.sleep(0.001)


def rank(r: int, world: int, d: Path, mb: int, rounds: int) -> None:
    import cupy as cp
    from llmc_cuda.p2p import allocation_base
    from p2p_matrix import SRC  # (the same stores, a bf16 value a thread; this folder is the script's first path)
    n = mb * 2**20 // 2  # this rank's chunk; every rank holds all the chunks
    src, dst = cp.full(n, r + 1, dtype=cp.uint16), cp.zeros(world * n, dtype=cp.uint16)
    cp.cuda.Device().synchronize()
    base = allocation_base(dst.data.ptr)
    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
    (d / f"h{r}.tmp").write_bytes(handle + (dst.data.ptr - base).to_bytes(8, "little"))
    os.rename(d / f"h{r}.tmp", d / f"h{r}")
    ptrs = []
    for q in range(world):
        if q == r:
            continue
        while not (d / f"h{q}").exists():
            time.sleep(0.01)
        raw = (d / f"h{q}").read_bytes()
        peer = cp.cuda.runtime.ipcOpenMemHandle(raw[:-8], 1) + int.from_bytes(raw[-8:], "little")
        ptrs.append(peer + r * n * 2)  # (this rank's chunk of the peer's copy)
    kern = cp.RawModule(code=SRC).get_function("store_to_u16")
    s = cp.cuda.Stream(non_blocking=True)

    arr = cp.asarray(ptrs, dtype=cp.uint64)
    cp.cuda.Device().synchronize()

    def timed() -> float:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        kern((528,), (256,), (src, arr, cp.int32(len(ptrs)), cp.int64(n)), stream=s)
        b.record(s)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b)

    timed()  # (warm-up: the lazy peer mappings)
    together, alone = [], []
    for k in range(rounds):
        barrier(d, f"t{k}", r, world)
        together.append(timed())
    for q in range(world):
        barrier(d, f"a{q}", r, world)
        if q == r:
            alone = [timed() for _ in range(rounds)]
    barrier(d, "end", r, world)
    step = max(1, n // 4096)
    ok = all(bool((dst[q * n:(q + 1) * n:step] == q + 1).all()) for q in range(world) if q != r)
    out = len(ptrs) * n * 2
    t, a1 = statistics.median(together), statistics.median(alone)
    print(f"rank {r}: all ranks at once {t:.1f} ms ({out / t / 1e6:.0f} GB/s out); alone {a1:.1f} ms "
          f"({out / a1 / 1e6:.0f} GB/s out); peers' writes {'seen' if ok else 'NOT seen'}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=0, help="ranks (default: every GPU nvidia-smi lists)")
    ap.add_argument("--mb", type=int, default=4096, help="the chunk each rank writes into each peer, MB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    o = ap.parse_args()
    if o.rank >= 0:
        rank(o.rank, o.gpus, Path(o.dir), o.mb, o.rounds)
        return 0
    world = o.gpus or len(subprocess.check_output(["nvidia-smi", "-L"], text=True).splitlines())
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--gpus", str(world), "--dir", d,
                                   "--mb", str(o.mb), "--rounds", str(o.rounds)],
                                  env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(r))) for r in range(world)]
        return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
