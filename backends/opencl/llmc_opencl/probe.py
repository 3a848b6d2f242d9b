"""Does an OpenCL device really run kernels? Listing a device proves nothing: PoCL from PyPI lists every CPU
and then cannot compile for one its LLVM does not know (`error: unknown target CPU 'generic'`, pocl/pocl#1049,
AMD EPYCs of family 1Ah among them). So each device builds and runs a tiny kernel once; the verdict is cached
per platform, device and driver (``$LLMC_OPENCL_PROBE_CACHE``, else ``$XDG_CACHE_HOME/llmc/opencl_probe.json``,
else ``~/.cache/llmc/opencl_probe.json``), so later starts pay nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from . import sources
from .cache import cache_file, load_cache, save_cache

PROBE_VERSION = 1
_SRC = "__kernel void probe(__global float* o) { const int i = get_global_id(0); o[i] = 2.0f * (float)i + 1.0f; }"
_N = 64
_SEEN: dict[str, str] = {}  # this process's verdicts: device key -> "" (usable) or the reason


def cache_path() -> Path:
    return cache_file("LLMC_OPENCL_PROBE_CACHE", "opencl_probe.json")


NO_DEVICE = "no OpenCL device found (install a driver, e.g. pip install 'pyopencl[pocl]')"


def pocl_cache_dir() -> Path | None:
    """The kernel cache folder PoCL makes at start (its pocl_cache.c): $POCL_CACHE_DIR, else
    $XDG_CACHE_HOME/pocl/kcache, else $HOME/.cache/pocl/kcache; None when neither variable is set."""
    if os.environ.get("POCL_CACHE_DIR"):
        return Path(os.environ["POCL_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "pocl" / "kcache"
    return Path(os.environ["HOME"]) / ".cache" / "pocl" / "kcache" if os.environ.get("HOME") else None


def pocl_cache_problem() -> str | None:
    """Why PoCL cannot make or write its cache folder, or None. PoCL then lists its platform with no device and
    says nothing, so the user would be told to install a driver they have."""
    folder = pocl_cache_dir()
    if folder is None:
        return None
    existing = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), None)
    if existing is None:
        return None
    if not existing.is_dir():
        why = f"{existing} is not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
    else:
        return None
    return (f"PoCL cannot make its cache folder {folder} ({why}); set POCL_CACHE_DIR to a writable folder, or fix "
            "HOME or XDG_CACHE_HOME")


def no_device_reason(platforms) -> str:
    """Why no OpenCL device is listed: PoCL's cache folder when a PoCL platform lists none, else no driver."""
    pocl = any("portable computing language" in p.name.lower() for p in platforms)
    return (pocl and pocl_cache_problem()) or NO_DEVICE


def device_key(platform, device) -> str:
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
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
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
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
    cache = load_cache(path)
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("reason"), str):
        _SEEN[key] = hit["reason"]
        return hit["reason"]
    reason, keep = _run(device)
    _SEEN[key] = reason
    if keep:
        cache = load_cache(path)  # another process may have written meanwhile
        cache[key] = {"reason": reason}
        save_cache(cache, path)
    return reason


# A build that fails can take the process down with it: PoCL 3.0 from PyPI targets a Zen 4 EPYC as znver3 (its
# LLVM 14 knows no znver4), whose ABI has no 512-bit vectors, and then "builds" some float16 kernels (sgemm_direct's
# 16-wide register blocks, which ones depending on the layout) into a program without them; once such a build was
# tried, LLVM aborts the process at exit ("still have references to IRs"): one tuning candidate would fail a whole
# run or test session. So every program is first built in a child process, once per device, file and options (a
# batch in one child), and the verdicts are cached beside the probe's; only programs that built there, every
# kernel present, are built in-process.
_BUILD_CHILD = r"""
import json, sys
import pyopencl as cl
pi, di, jobs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.stdin.read())
ctx = cl.Context([cl.get_platforms()[pi].get_devices()[di]])
for path, opts, want in jobs:
    why = ""
    try:
        for _ in range(2):  # PoCL's first build can list a kernel that its cached binary, the next build's, lacks
            prg = cl.Program(ctx, open(path).read()).build(options=opts)
            missing = sorted(set(want) - set(prg.get_info(cl.program_info.KERNEL_NAMES).split(";")))
            why = why or ("gave no kernel " + ", ".join(missing) if missing else "")
            for name in want:
                cl.Kernel(prg, name)
    except Exception as e:
        why = why or str(e)
    print(json.dumps([path, opts, why]), flush=True)
"""
_BUILT: dict[str, dict[str, str]] = {}  # this process's build verdicts: device key -> {"file options": "" or why}


def _builds_in_child(device, jobs: list[tuple[str, str]]) -> dict[str, str]:
    """{"file options": "" or why not} for the jobs a child process answered (a child that died answers fewer)."""
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
    where = next(((pi, di) for pi, plat in enumerate(cl.get_platforms()) for di, d in enumerate(plat.get_devices())
                  if d.int_ptr == device.int_ptr), None)
    if where is None:
        return {}
    todo = [[str(sources.path(name)), opts, sorted(sources.signatures(sources.source(name)))] for name, opts in jobs]
    try:
        r = subprocess.run([sys.executable, "-c", _BUILD_CHILD, str(where[0]), str(where[1])], input=json.dumps(todo),
                           capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    said = {}
    for line in r.stdout.splitlines():
        try:
            path, opts, why = json.loads(line)
        except ValueError:
            continue
        missing = why.startswith("gave no kernel ")
        said[f"{Path(path).name} {opts}"] = why if not why or missing else first_error_line(RuntimeError(why))
    return said


def build_verdicts(device, jobs: list[tuple[str, str]]) -> dict[str, str]:
    """{"file options": "" when that program builds on `device` with every kernel it declares, else why not}
    for each (file, options) of `jobs`, asking one child process about those not known yet (see above)."""
    key = device_key(device.platform, device) + "|builds"
    known = _BUILT.get(key)
    if known is None:
        hit = load_cache(cache_path()).get(key)
        known = _BUILT[key] = dict(hit) if isinstance(hit, dict) and all(
            isinstance(v, str) for v in hit.values()) else {}
    names = [f"{name} {opts}" for name, opts in jobs]
    missing = [job for job, n in zip(jobs, names) if n not in known]
    if missing:
        said = _builds_in_child(device, list(dict.fromkeys(missing)))
        known.update(said)
        if said:
            cache = load_cache(cache_path())  # another process may have written meanwhile
            cache[key] = {**(cache.get(key) if isinstance(cache.get(key), dict) else {}), **said}
            save_cache(cache, cache_path())
    # (a job the child never answered, its process dead: not built here, and asked again next time)
    return {n: known.get(n, "the build check's child process ended without an answer") for n in names}
