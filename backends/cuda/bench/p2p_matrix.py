"""What every ordered pair of this host's GPUs moves over peer memory, and what one GPU moves when it writes all
its peers at once (as ZeRO-1's update does when it stores every rank's copy of its chunk): an SM kernel's stores
and the copy engines (cudaMemcpyPeerAsync), GB/s for a buffer of --mb megabytes. One process sees every GPU.

    python backends/cuda/bench/p2p_matrix.py [--mb 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import cupy as cp
from p2p_probe import timed  # (this folder is the script's first path)

SRC = r"""
extern "C" __global__ void store_to(const uint4* __restrict__ src, uint4** __restrict__ dst, int ndst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 a = src[i];
    for (int d = 0; d < ndst; d++) dst[d][i] = a;
  }
}
extern "C" __global__ void store_to_u16(const unsigned short* __restrict__ src, unsigned short** __restrict__ dst,
                                        int ndst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    unsigned short a = src[i];
    for (int d = 0; d < ndst; d++) dst[d][i] = a;
  }
}
"""


def one_gpu(d: int, bufs, kernels, nbytes: int) -> None:
    """GPU d's stores and copies into each peer alone, then its stores into all of them at once."""
    n = len(bufs)
    with cp.cuda.Device(d):
        s = cp.cuda.Stream(non_blocking=True)
        src = bufs[d][0]
        row_k, row_ce = [], []
        for q in range(n):
            if q == d:
                row_k.append("    -")
                row_ce.append("    -")
                continue
            ptrs = cp.asarray([bufs[q][1].data.ptr], dtype=cp.uint64)
            ms = timed(lambda: kernels[d][0]((528,), (256,), (src, ptrs, cp.int32(1), cp.int64(nbytes // 16)),
                                             stream=s), s, reps=5)
            row_k.append(f"{nbytes / ms / 1e6:5.0f}")
            ms = timed(lambda: cp.cuda.runtime.memcpyPeerAsync(bufs[q][1].data.ptr, q, src.data.ptr, d, nbytes,
                                                               s.ptr), s, reps=5)
            row_ce.append(f"{nbytes / ms / 1e6:5.0f}")
        others = [q for q in range(n) if q != d]
        ptrs = cp.asarray([bufs[q][1].data.ptr for q in others], dtype=cp.uint64)
        ms = timed(lambda: kernels[d][0]((528,), (256,), (src, ptrs, cp.int32(len(others)), cp.int64(nbytes // 16)),
                                         stream=s), s, reps=5)
        print(f"GPU {d} -> each peer, GB/s: kernel stores {' '.join(row_k)}; copy engine {' '.join(row_ce)}; "
              f"kernel to all {len(others)} peers at once {len(others) * nbytes / ms / 1e6:.0f} GB/s out")


def all_at_once(bufs, kernels, nbytes: int) -> None:
    """Every GPU stores into all its peers at once, as every rank's update does: 16-byte stores a thread, and
    2-byte ones (a bf16 value a thread)."""
    n = len(bufs)
    streams, args = [], []
    for d in range(n):
        with cp.cuda.Device(d):
            streams.append(cp.cuda.Stream(non_blocking=True))
            args.append(cp.asarray([bufs[q][1].data.ptr for q in range(n) if q != d], dtype=cp.uint64))
    for width, unit in ((16, 0), (2, 1)):
        times = []
        for _ in range(4):
            for d in range(n):
                cp.cuda.Device(d).synchronize()
            t0 = time.perf_counter()
            for d in range(n):
                with cp.cuda.Device(d):
                    kernels[d][unit]((528,), (256,), (bufs[d][0], args[d], cp.int32(n - 1),
                                                      cp.int64(nbytes // width)), stream=streams[d])
            for d in range(n):
                streams[d].synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        print(f"all {n} GPUs writing all peers at once, {width}-byte stores: {t * 1e3:.1f} ms, "
              f"{(n - 1) * nbytes / t / 1e9:.0f} GB/s out a GPU")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    o = ap.parse_args()
    n = cp.cuda.runtime.getDeviceCount()
    nbytes = o.mb * 2**20
    bufs, kernels = [], []
    for d in range(n):
        with cp.cuda.Device(d):
            for q in range(n):
                if q != d and cp.cuda.runtime.deviceCanAccessPeer(d, q):
                    cp.cuda.runtime.deviceEnablePeerAccess(q)
            bufs.append((cp.ones(nbytes // 2, cp.uint16), cp.zeros(nbytes // 2, cp.uint16)))
            mod = cp.RawModule(code=SRC)
            kernels.append((mod.get_function("store_to"), mod.get_function("store_to_u16")))
    access = [[int(q == d or cp.cuda.runtime.deviceCanAccessPeer(d, q)) for q in range(n)] for d in range(n)]
    print("peer access:", access)
    if not all(map(all, access)):
        print("p2p_matrix: every pair of GPUs needs peer access (NVLink or PCIe); run it where they have it")
        return 2
    for d in range(n):
        one_gpu(d, bufs, kernels, nbytes)
    all_at_once(bufs, kernels, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
