"""What two GPUs of one host move over their link without NCCL: copy engines (cudaMemcpyPeerAsync) and SM kernels
that load from / store to the peer's memory, at the size of GPT-2 d12's bf16 gradient halves (62M values, 124.5
MB), each alone and beside a kernel-heavy stream on the same GPU. One process, both GPUs (peer access enabled).

    python backends/cuda/bench/p2p_probe.py        (needs 2 visible GPUs with peer access)
"""

from __future__ import annotations

import statistics
import sys

import cupy as cp

N = 124_475_904 // 2  # bf16 values: half of d12's gradient
SRC = r"""
extern "C" __global__ void load_add(const uint4* __restrict__ mine, const uint4* __restrict__ peer,
                                    uint4* __restrict__ out, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 a = mine[i], b = __ldcv(peer + i);
    out[i] = make_uint4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
  }
}
extern "C" __global__ void store_both(const uint4* __restrict__ src, uint4* __restrict__ mine,
                                      uint4* __restrict__ peer, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 a = src[i];
    mine[i] = a;
    peer[i] = a;
  }
}
"""


def timed(fn, stream, reps=20):
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(out)


def main() -> int:
    if cp.cuda.runtime.getDeviceCount() < 2:
        print("p2p_probe: needs 2 GPUs")
        return 2
    if not cp.cuda.runtime.deviceCanAccessPeer(0, 1):
        print("p2p_probe: GPU 0 cannot access GPU 1's memory (no peer access)")
        return 2
    with cp.cuda.Device(1):
        cp.cuda.runtime.deviceEnablePeerAccess(0)
        remote = cp.ones(N, dtype=cp.uint16)
        remote_out = cp.zeros(N, dtype=cp.uint16)
        cp.cuda.Device(1).synchronize()
    with cp.cuda.Device(0):
        cp.cuda.runtime.deviceEnablePeerAccess(1)
        mod = cp.RawModule(code=SRC)
        load_add, store_both = mod.get_function("load_add"), mod.get_function("store_both")
        mine = cp.ones(N, dtype=cp.uint16)
        out = cp.empty(N, dtype=cp.uint16)
        s = cp.cuda.Stream(non_blocking=True)
        n16 = N // 8
        nbytes = N * 2
        res = {}
        with s:
            res["copy engine, peer -> here (memcpyPeerAsync)"] = timed(
                lambda: cp.cuda.runtime.memcpyPeerAsync(out.data.ptr, 0, remote.data.ptr, 1, nbytes, s.ptr), s)
            res["copy engine, here -> peer"] = timed(
                lambda: cp.cuda.runtime.memcpyPeerAsync(remote_out.data.ptr, 1, mine.data.ptr, 0, nbytes, s.ptr), s)
            res["local copy (device to device)"] = timed(
                lambda: cp.cuda.runtime.memcpyAsync(out.data.ptr, mine.data.ptr, nbytes, 3, s.ptr), s)
            for blocks in (132, 264, 528, 1056):
                res[f"kernel: load peer + local, store local ({blocks} blocks)"] = timed(
                    lambda b=blocks: load_add((b,), (256,), (mine, remote, out, cp.int64(n16)), stream=s), s)
                res[f"kernel: store local and peer ({blocks} blocks)"] = timed(
                    lambda b=blocks: store_both((b,), (256,), (mine, out, remote_out, cp.int64(n16)), stream=s), s)
            # beside a busy stream: a matmul loop on another stream of this GPU
            busy = cp.cuda.Stream(non_blocking=True)
            x = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
            with busy:
                mm = timed(lambda: x @ x, busy, reps=5)
            def both(fn):
                def go():
                    ev = cp.cuda.Event()
                    with busy:
                        for _ in range(4):
                            x @ x
                    fn()
                    ev.record(busy)
                    s.wait_event(ev)
                return go
            res[f"matmul 8192^3 fp16 x4 alone ({mm * 4:.2f})"] = mm * 4
            res["matmul x4 + copy engine peer -> here"] = timed(both(
                lambda: cp.cuda.runtime.memcpyPeerAsync(out.data.ptr, 0, remote.data.ptr, 1, nbytes, s.ptr)), s, 10)
            res["matmul x4 + kernel load peer (528 blocks)"] = timed(both(
                lambda: load_add((528,), (256,), (mine, remote, out, cp.int64(n16)), stream=s)), s, 10)
    for k, ms in res.items():
        print(f"{k}: {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s for {nbytes / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
