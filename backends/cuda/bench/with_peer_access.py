"""Run `llmc ...` on GPU 0 in a process that first enables peer access to every other visible GPU, which then stay
idle: does a peer mapping by itself slow the GPU's own kernels? (multi_gpu.sh PEER=1; a data-parallel rank's compute
phase ran about 1 % slower than the same GPU's 1-GPU run, docs/performance.md.)

    CUDA_VISIBLE_DEVICES=0,1 python backends/cuda/bench/with_peer_access.py train ...
"""

import runpy
import sys

import cupy

cupy.cuda.Device(0).use()
for peer in range(1, cupy.cuda.runtime.getDeviceCount()):
    cupy.cuda.runtime.deviceEnablePeerAccess(peer)
sys.argv[0] = "llmc"
runpy.run_module("llmc_cli", run_name="__main__")
