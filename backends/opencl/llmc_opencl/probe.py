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
_BUILT: dict[str, list[str]] = {}  # this process's wide_builds answers: device key -> the options that built


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


# Float16 vectors (sgemm_direct's 16-wide register blocks) are their own hazard: PoCL 3.0 from PyPI targets a Zen 4
# EPYC as znver3 (its LLVM 14 knows no znver4), whose ABI has no 512-bit vectors, and then "builds" some such
# kernels into a program without them (INVALID_KERNEL_NAME later), which ones depending on the layout; worse, once
# such a build was tried LLVM aborts the process at exit ("still have references to IRs"), so one candidate tried
# would fail a whole run. So every 16-wide configuration is built in a child process, once per device, and the
# ones that built are cached beside the probe's verdict.
_WIDE_CHILD = r"""
import json, sys
import pyopencl as cl
pi, di, path, todo = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
ctx = cl.Context([cl.get_platforms()[pi].get_devices()[di]])
src = open(path).read()
for opts in todo:
    try:
        names = cl.Program(ctx, src).build(options=opts).get_info(cl.program_info.KERNEL_NAMES)
    except Exception:
        names = ""
    print(("built " if "sgemm" in names.split(";") else "failed ") + opts, flush=True)
"""


def _direct_options(c: dict, layout: str) -> str:
    """sgemm_direct.cl's build options for configuration `c` and layout "NT", "NN" or "TN"."""
    return (f"-DRM={c['RM']} -DRN={c['RN']} -DVK={c['VK']} -DA_T={int(layout[0] == 'T')} "
            f"-DB_T={int(layout[1] == 'T')}")


def _wide_in_child(device, todo: list[str]) -> tuple[list[str], bool]:
    """(the options of `todo` that built, whether the answer may be cached)."""
    import json
    import subprocess
    import sys

    import pyopencl as cl
    where = next(((pi, di) for pi, plat in enumerate(cl.get_platforms()) for di, d in enumerate(plat.get_devices())
                  if d.int_ptr == device.int_ptr), None)
    if where is None:
        return [], False
    try:
        r = subprocess.run([sys.executable, "-c", _WIDE_CHILD, str(where[0]), str(where[1]),
                            str(Path(__file__).with_name("sgemm_direct.cl")), json.dumps(todo)],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return [], False
    said = dict(line.split(" ", 1)[::-1] for line in r.stdout.splitlines() if line.startswith(("built ", "failed ")))
    # (a child that died before answering everything is asked again next time)
    return [o for o in todo if said.get(o) == "built"], all(o in said for o in todo)


def wide_builds(device, c: dict) -> bool:
    """Whether the 16-wide direct configuration `c` builds on `device` in every layout (see above)."""
    todo = [_direct_options(w, lay) for w in tune.DIRECT if 16 in (w["VK"], w["RN"]) for lay in tune.LAYOUTS]
    key = device_key(device.platform, device) + "|float16"
    built = _BUILT.get(key)
    if built is None:
        path = cache_path()
        hit = tune.load_cache(path).get(key)
        if isinstance(hit, dict) and isinstance(hit.get("built"), list) and hit.get("tried") == todo:
            built = hit["built"]
        else:
            built, keep = _wide_in_child(device, todo)
            if keep:
                cache = tune.load_cache(path)
                cache[key] = {"tried": todo, "built": built}
                tune.save_cache(cache, path)
        _BUILT[key] = built
    return all(_direct_options(c, lay) in built for lay in tune.LAYOUTS)
