"""On a machine with OpenCL devices: does each device build and run a tiny kernel, and with which build
options? Prints one line per (device, options). Used to check PoCL on CPUs that LLVM does not know
(`unknown target CPU 'generic'`) and NVIDIA's OpenCL driver; see docs/reliability.md.
  python3 backends/opencl/bench/opencl_probe_check.py [extra build options ...]"""
import sys

import numpy as np
import pyopencl as cl

SRC = "__kernel void k(__global float *o) { size_t i = get_global_id(0); o[i] = 2.0f * (float)i + 1.0f; }"
for plat in cl.get_platforms():
    for dev in plat.get_devices():
        for opts in [""] + sys.argv[1:]:
            label = f"{plat.name.strip()} | {dev.name.strip()} | {dev.version.strip()} | driver {dev.driver_version}"
            try:
                ctx = cl.Context([dev])
                q = cl.CommandQueue(ctx)
                prg = cl.Program(ctx, SRC).build(options=opts)
                out = np.empty(64, np.float32)
                buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
                prg.k(q, (64,), None, buf)
                cl.enqueue_copy(q, out, buf)
                ok = np.array_equal(out, 2 * np.arange(64, dtype=np.float32) + 1)
                print(f"{label} | options {opts!r}: {'OK' if ok else 'WRONG RESULT'}")
            except Exception as e:  # noqa: BLE001
                first = next((l for l in str(e).splitlines() if "error" in l.lower()), str(e).splitlines()[0])
                print(f"{label} | options {opts!r}: FAILED {type(e).__name__}: {first.strip()[:200]}")
