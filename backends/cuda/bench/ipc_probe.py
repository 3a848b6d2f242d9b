"""Can two ranks, each a process that sees only its own GPU (as `llmc train --gpus 2` starts them), map each other's
memory through CUDA IPC and move a d12 gradient half over the link with kernels? Rank 1 allocates from CuPy's pool
(an interior pointer), sends the allocation's IPC handle and the offset; rank 0 opens it, loads and stores through
it (values checked) and times both.

    python backends/cuda/bench/ipc_probe.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N = 124_475_904 // 2


SRC = r"""
extern "C" __global__ void load_add(const unsigned short* __restrict__ peer, unsigned short* __restrict__ out, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = __ldcv(peer + i) + 1;
}
extern "C" __global__ void store(unsigned short* __restrict__ peer, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    peer[i] = 7;
  __threadfence_system();
}
"""


def rank(r: int, d: Path) -> None:
    import cupy as cp
    from llmc_cuda.p2p import allocation_base
    if r == 1:
        pad = cp.zeros(1000, dtype=cp.uint16)  # so the buffer is not at its allocation's start
        buf = cp.full(N, 3, dtype=cp.uint16)
        cp.cuda.Device().synchronize()
        ptr = buf.data.ptr
        base = allocation_base(ptr)
        h = cp.cuda.runtime.ipcGetMemHandle(ptr)
        (d / "h.tmp").write_bytes(bytes(h) + (ptr - base).to_bytes(8, "little"))
        os.rename(d / "h.tmp", d / "h")
        while not (d / "done").exists():
            time.sleep(0.05)
        ok = bool((buf == 7).all())
        print(f"rank 1: stores from rank 0 {'seen' if ok else 'NOT seen'} (pad {int(pad.sum())})", flush=True)
        return
    while not (d / "h").exists():
        time.sleep(0.05)
    raw = (d / "h").read_bytes()
    h, off = raw[:-8], int.from_bytes(raw[-8:], "little")
    try:
        peer_base = cp.cuda.runtime.ipcOpenMemHandle(h, 1)  # cudaIpcMemLazyEnablePeerAccess
    except Exception as e:  # noqa: BLE001
        print(f"rank 0: ipcOpenMemHandle failed: {type(e).__name__}: {e}", flush=True)
        (d / "done").write_text("x")
        return
    peer = peer_base + off
    mod = cp.RawModule(code=SRC)
    load_add, store = mod.get_function("load_add"), mod.get_function("store")
    out = cp.empty(N, dtype=cp.uint16)
    s = cp.cuda.Stream(non_blocking=True)
    t = {"load": [], "store": []}
    def timed(fn):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        fn()
        b.record(s)
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b)
    with s:
        t["load"] = [timed(lambda: load_add((528,), (256,), (cp.uint64(peer), out, cp.int64(N)), stream=s))
                     for _ in range(13)]
        t["store"] = [timed(lambda: store((528,), (256,), (cp.uint64(peer), cp.int64(N)), stream=s))
                      for _ in range(3)]
    ok = bool((out == 4).all())
    print(f"rank 0: opened rank 1's buffer through IPC (offset {off}); loads {'right' if ok else 'WRONG'}; "
          f"load {statistics.median(t['load'][3:]):.3f} ms, store {statistics.median(t['store']):.3f} ms for {N * 2 / 1e6:.1f} MB",
          flush=True)
    cp.cuda.runtime.ipcCloseMemHandle(peer_base)
    (d / "done").write_text("x")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        rank(int(sys.argv[1]), Path(sys.argv[2]))
        sys.exit(0)
    d = Path(tempfile.mkdtemp(prefix="ipc-probe-"))
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(d)],
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(r))) for r in (0, 1)]
    try:
        rcs = [p.wait(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        print("ipc_probe: timed out")
        sys.exit(1)
    sys.exit(max(rcs))
