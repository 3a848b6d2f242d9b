"""Run `llmc ...` on GPU 0 of its visible GPUs while a thread of the same process copies between GPU 0 and GPU 1
over their link with the copy engines, at a fixed pace, unsynchronized with the run: does traffic on the link, with
no communication in the run itself, slow the GPU's own kernels? (multi_gpu.sh LINKS=...; a data-parallel rank's
compute phase ran about 1 % slower than the same GPU's 1-GPU run, docs/performance.md, and on two H200s at their
power cap the slower GPU clocked lower in the data-parallel run than beside a busy neighbour.)

    LLMC_LINK_TRAFFIC=awake CUDA_VISIBLE_DEVICES=0,1 python backends/cuda/bench/with_link_traffic.py train ...
    LLMC_LINK_TRAFFIC=bulk  ...   (same, other direction: CUDA_VISIBLE_DEVICES=1,0)

awake: 64 KiB to the peer every 5 ms, bytes too few to cost anything but the link kept out of its idle state.
bulk: 250 MB to the peer every 115 ms, what a d12 data-parallel rank sends a step (its half of the bf16 gradients
to the peer's reduce-scatter, and the update's writes into the peer's copy of the parameters).
The copies run on GPU 0's copy engines, from a stream of their own; the peer's buffer is allocated in this process,
so the other GPU's own process (PAIR=1's other run) is never preempted for them.
"""

import os
import runpy
import sys
import threading
import time

import cupy

MODES = {"awake": (64 << 10, 0.005), "bulk": (250_000_000, 0.115)}
nbytes, every = MODES[os.environ.get("LLMC_LINK_TRAFFIC", "awake")]
cupy.cuda.Device(0).use()
cupy.cuda.runtime.deviceEnablePeerAccess(1)
with cupy.cuda.Device(1):
    far = cupy.cuda.alloc(nbytes)
near = cupy.cuda.alloc(nbytes)
copies = 0


def traffic() -> None:
    global copies
    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        while True:
            t = time.monotonic()
            cupy.cuda.runtime.memcpyPeerAsync(far.ptr, 1, near.ptr, 0, nbytes, stream.ptr)
            stream.synchronize()
            copies += 1
            time.sleep(max(0.0, every - (time.monotonic() - t)))


threading.Thread(target=traffic, daemon=True).start()
sys.argv[0] = "llmc"
try:
    runpy.run_module("llmc_cli", run_name="__main__")
finally:
    print(f"with_link_traffic: {copies} copies of {nbytes} bytes to GPU 1, one every {every * 1e3:g} ms",
          file=sys.stderr)
