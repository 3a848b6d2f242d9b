"""Does an OpenCL device really run kernels? Listing a device proves nothing: PoCL from PyPI lists every CPU
and then cannot compile for one its LLVM does not know (`error: unknown target CPU 'generic'`, pocl/pocl#1049,
AMD EPYCs of family 1Ah among them). So each device builds and runs a tiny kernel once; the verdict is cached
per platform, device and driver (``$LLMC_OPENCL_PROBE_CACHE``, else ``$XDG_CACHE_HOME/llmc/opencl_probe.json``,
else ``~/.cache/llmc/opencl_probe.json``), so later starts pay nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from . import tune

PROBE_VERSION = 1
_SRC = "__kernel void probe(__global float* o) { const int i = get_global_id(0); o[i] = 2.0f * (float)i + 1.0f; }"
_N = 64
_SEEN: dict[str, str] = {}  # this process's verdicts: device key -> "" (usable) or the reason


def cache_path() -> Path:
    return tune.cache_file("LLMC_OPENCL_PROBE_CACHE", "opencl_probe.json")


def device_key(platform, device) -> str:
    import pyopencl as cl
    return "|".join(s.strip() for s in (platform.name, platform.version, device.name, device.version,
                                        device.driver_version, f"pyopencl {cl.VERSION_TEXT}", f"v{PROBE_VERSION}"))


def first_error_line(e: BaseException) -> str:
    """The compiler's first error line out of a pyopencl build failure (its build log follows the status
    words), else the exception's first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        low = line.lower()
        if "error" in low and "clbuildprogram failed" not in low and not low.startswith("build on"):
            return line[:200]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _run(device) -> tuple[str, bool]:
    """("" or why not, whether the verdict may be cached: a compiler's refusal stays, a lack of resources may not)."""
    import pyopencl as cl
    try:
        ctx = cl.Context([device])
        queue = cl.CommandQueue(ctx)
        out = np.empty(_N, np.float32)
        buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
        try:
            with warnings.catch_warnings():  # a driver's chatter about a 1-line kernel is no news to the user
                warnings.simplefilter("ignore")
                prg = cl.Program(ctx, _SRC).build()
        except Exception as e:  # noqa: BLE001  (pyopencl raises RuntimeError / ProgramBuildError / LogicError)
            return f"cannot build a kernel: {first_error_line(e)}", True
        prg.probe(queue, (_N,), None, buf)
        cl.enqueue_copy(queue, out, buf)
        queue.finish()
    except Exception as e:  # noqa: BLE001
        return f"cannot run a kernel: {first_error_line(e)}", False
    if not np.array_equal(out, 2 * np.arange(_N, dtype=np.float32) + 1):
        return "a test kernel computed wrong values", True
    return "", True


def check(platform, device) -> str:
    """"" when `device` builds and runs a kernel, else one line saying why not (cached, see the module)."""
    key = device_key(platform, device)
    if key in _SEEN:
        return _SEEN[key]
    path = cache_path()
    cache = tune.load_cache(path)
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("reason"), str):
        _SEEN[key] = hit["reason"]
        return hit["reason"]
    reason, keep = _run(device)
    _SEEN[key] = reason
    if keep:
        cache = tune.load_cache(path)  # another process may have written meanwhile
        cache[key] = {"reason": reason}
        tune.save_cache(cache, path)
    return reason
