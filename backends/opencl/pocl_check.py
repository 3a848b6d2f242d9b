"""install.sh's check: can some PoCL CPU device here build and run a kernel? Exit 0 if one can, or if the
failures are not PoCL's unknown-CPU one (nothing a second PoCL would mend), 1 otherwise. Prints one line."""

import sys

SRC = "__kernel void k(__global float *o) { o[get_global_id(0)] = 2.0f * (float)get_global_id(0); }"


def main() -> int:
    try:
        import numpy as np
        import pyopencl as cl
    except Exception as e:  # noqa: BLE001  (no pyopencl: the backend itself will say so)
        print(f"pocl_check: pyopencl not importable ({e})")
        return 0
    unknown_cpu = []
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        print(f"pocl_check: no OpenCL platform ({e})")
        return 0
    for plat in platforms:
        if "portable computing language" not in plat.name.lower():
            continue
        for dev in plat.get_devices():
            try:
                ctx = cl.Context([dev])
                q = cl.CommandQueue(ctx)
                out = np.empty(8, np.float32)
                buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
                cl.Program(ctx, SRC).build().k(q, (8,), None, buf)
                cl.enqueue_copy(q, out, buf)
                if np.array_equal(out, 2 * np.arange(8, dtype=np.float32)):
                    print(f"pocl_check: {dev.name.strip()} ({plat.version.strip()[:40]}) builds and runs kernels")
                    return 0
            except Exception as e:  # noqa: BLE001
                if "unknown target cpu" in str(e).lower():
                    unknown_cpu.append(f"{dev.name.strip()} ({dev.driver_version})")
    if unknown_cpu:
        print(f"pocl_check: PoCL cannot build kernels for this CPU (unknown target CPU 'generic'): "
              f"{', '.join(unknown_cpu)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
