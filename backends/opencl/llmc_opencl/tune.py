"""SGEMM autotuning: a short run over a few tile configurations, the winner cached per device.

The cache is a JSON file (``$LLMC_OPENCL_TUNE_CACHE``, else ``$XDG_CACHE_HOME/llmc/opencl_tune.json``, else
``~/.cache/llmc/opencl_tune.json``) mapping a device key (platform, device, driver, tuner version) to the chosen
configuration and the GFLOP/s each candidate reached. ``LLMC_OPENCL_TUNE=0`` skips tuning (the default
configuration is used), ``LLMC_OPENCL_TUNE=force`` re-runs it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from . import cache, probe

TUNE_VERSION = 5  # 5: VEC tiles (float4 local-memory reads, float4 global reads where aligned)
LAYOUTS = ("NT", "NN", "TN")  # forward, dinp, dweight
TILED_KEYS = ("TM", "TN", "TK", "WPTM", "WPTN")
DIRECT_KEYS = ("RM", "RN", "VK", "LX", "LY")
# local-memory tiles: GPUs
TILED = [
    {"kind": "tiled", "TM": 64, "TN": 64, "TK": 16, "WPTM": 4, "WPTN": 4},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 16, "WPTM": 8, "WPTN": 8},
    {"kind": "tiled", "TM": 128, "TN": 64, "TK": 16, "WPTM": 8, "WPTN": 4},
    {"kind": "tiled", "TM": 64, "TN": 128, "TK": 16, "WPTM": 4, "WPTN": 8},
    {"kind": "tiled", "TM": 64, "TN": 64, "TK": 16, "WPTM": 8, "WPTN": 8},
    {"kind": "tiled", "TM": 32, "TN": 32, "TK": 16, "WPTM": 4, "WPTN": 4},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 8, "WPTM": 8, "WPTN": 8},
    {"kind": "tiled", "TM": 64, "TN": 128, "TK": 8, "WPTM": 4, "WPTN": 8},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 32, "WPTM": 8, "WPTN": 8},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 8, "WPTM": 8, "WPTN": 8, "PREF": 1},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 16, "WPTM": 8, "WPTN": 8, "PREF": 1},
    {"kind": "tiled", "TM": 64, "TN": 128, "TK": 16, "WPTM": 4, "WPTN": 8, "PREF": 1},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 8, "WPTM": 8, "WPTN": 8, "PREF": 1, "VEC": 1},
    {"kind": "tiled", "TM": 128, "TN": 128, "TK": 16, "WPTM": 8, "WPTN": 8, "PREF": 1, "VEC": 1},
    {"kind": "tiled", "TM": 64, "TN": 128, "TK": 8, "WPTM": 4, "WPTN": 8, "PREF": 1, "VEC": 1},
    {"kind": "tiled", "TM": 128, "TN": 64, "TK": 8, "WPTM": 8, "WPTN": 4, "PREF": 1, "VEC": 1},
]
# register blocks straight from global memory (no barriers): CPUs
DIRECT = [
    {"kind": "direct", "RM": 4, "RN": 4, "VK": 16, "LX": 8, "LY": 8},
    {"kind": "direct", "RM": 4, "RN": 8, "VK": 8, "LX": 8, "LY": 4},
    {"kind": "direct", "RM": 4, "RN": 16, "VK": 8, "LX": 4, "LY": 4},
    {"kind": "direct", "RM": 8, "RN": 16, "VK": 8, "LX": 4, "LY": 4},
    {"kind": "direct", "RM": 4, "RN": 4, "VK": 8, "LX": 8, "LY": 8},
    {"kind": "direct", "RM": 8, "RN": 8, "VK": 8, "LX": 8, "LY": 1},
]
DEFAULT_GPU = TILED[0]
DEFAULT_CPU = DIRECT[2]


def config_key(c: dict) -> tuple:
    if c.get("kind", "tiled") == "direct":
        return ("direct",) + tuple(int(c[k]) for k in DIRECT_KEYS)
    # trailing flags only when set, so configurations cached before they existed keep their keys
    flags = (1,) if c.get("PREF") else ()
    if c.get("VEC"):
        flags = (int(bool(c.get("PREF"))), 1)
    return ("tiled",) + tuple(int(c[k]) for k in TILED_KEYS) + flags


def config_name(c: dict) -> str:
    k = config_key(c)
    if k[0] == "direct":
        return f"direct {k[1]}x{k[2]} per item, vec {k[3]}, work-group {k[4]}x{k[5]}"
    return (f"tiled {k[1]}x{k[2]}x{k[3]}, {k[4]}x{k[5]} per item" + (", prefetch" if len(k) > 6 and k[6] else "")
            + (", float4" if len(k) > 7 and k[7] else ""))


def default_config(device) -> dict:
    """{layout: config} without tuning."""
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
    c = DEFAULT_CPU if device.type & cl.device_type.CPU else DEFAULT_GPU
    if not fits(device, c):
        c = next((x for x in (DIRECT + TILED if c is DEFAULT_CPU else TILED + DIRECT) if fits(device, x)), c)
    return {lay: dict(c) for lay in LAYOUTS}


def candidates(device) -> list[dict]:
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
    if device.type & cl.device_type.CPU:
        return DIRECT + TILED[:1]
    return TILED + DIRECT[:1]


def cache_path() -> Path:
    return cache.cache_file("LLMC_OPENCL_TUNE_CACHE", "opencl_tune.json")


def device_key(platform, device) -> str:
    return (f"{platform.name.strip()}|{device.name.strip()}|{device.driver_version.strip()}"
            f"|v{TUNE_VERSION}")


def load_cache() -> dict:
    """The tune cache's contents ({} when absent or damaged)."""
    return cache.load_cache(cache_path())


def save_cache(data: dict) -> None:
    cache.save_cache(data, cache_path())


def build_options(c: dict, layout: str, va: int = 0, vb: int = 0) -> tuple[str, str]:
    """(program file, build options) of configuration `c` for layout "NT", "NN" or "TN" (vector reads va, vb)."""
    a_t, b_t = int(layout[0] == "T"), int(layout[1] == "T")
    if c.get("kind", "tiled") == "direct":
        return "sgemm_direct.cl", f"-DRM={c['RM']} -DRN={c['RN']} -DVK={c.get('VK', 4)} -DA_T={a_t} -DB_T={b_t}"
    return "sgemm.cl", (f"-DTM={c['TM']} -DTN={c['TN']} -DTK={c['TK']} -DWPTM={c['WPTM']} -DWPTN={c['WPTN']} "
                        f"-DA_T={a_t} -DB_T={b_t} -DPREF={int(c.get('PREF', 0))} -DVEC={int(c.get('VEC', 0))} "
                        f"-DVA={va} -DVB={vb}")


def builds(device, configs: list[dict]) -> list[bool]:
    """Whether each configuration builds on `device` in every layout (asked in one child process for all of them
    and cached: probe.build_verdicts). Not every compiler builds every configuration (PoCL's znver3 target and
    float16 vectors)."""
    jobs = [build_options(c, lay) for c in configs for lay in LAYOUTS]
    ok = probe.build_verdicts(device, jobs)
    return [all(ok[f"{n} {o}"] == "" for n, o in (build_options(c, lay) for lay in LAYOUTS)) for c in configs]


def fits(device, c: dict) -> bool:
    if c.get("kind", "tiled") == "direct":
        return c["LX"] * c["LY"] <= device.max_work_group_size and builds(device, [c])[0]
    threads = (c["TM"] // c["WPTM"]) * (c["TN"] // c["WPTN"])
    pad = 4 if c.get("VEC") else 1
    local = 4 * c["TK"] * (c["TM"] + c["TN"] + 2 * pad)
    return (threads <= device.max_work_group_size and local <= device.local_mem_size
            and c["TM"] % c["WPTM"] == 0 and c["TN"] % c["WPTN"] == 0
            and (not c.get("VEC") or (c["WPTM"] % 4 == 0 and c["WPTN"] % 4 == 0))
            and c["TN"] // c["WPTN"] <= device.max_work_item_sizes[0]
            and c["TM"] // c["WPTM"] <= device.max_work_item_sizes[1]
            and builds(device, [c])[0])


def measure(be, c: dict, M: int, N: int, K: int, reps: int = 2, check: bool = True, layout: str = "NT") -> float:
    """GFLOP/s of config `c` on C (M,N) = op(A) @ op(B) with layout "NT" (A (M,K), B stored (N,K)),
    "NN" (B stored (K,N)) or "TN" (A stored (K,M)); 0.0 when it fails or is wrong."""
    import pyopencl.array as cla  # (optional: the plugin loads without it, to say why it cannot run)
    rng = np.random.default_rng(0)
    a_t, b_t = int(layout[0] == "T"), int(layout[1] == "T")
    a = rng.standard_normal((K, M) if a_t else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if b_t else (K, N), dtype=np.float32)
    A, B = cla.to_device(be.queue, a), cla.to_device(be.queue, b)
    Cm = cla.empty(be.queue, (M, N), np.float32)
    lda, ldb = (M if a_t else K), (K if b_t else N)
    run = lambda: be.gemm(a_t, b_t, M, N, K, A.data, 0, lda, B.data, 0, ldb, Cm.data, 0, N,  # noqa: E731
                          config=c)
    try:
        run()
        be.queue.finish()
        if check:
            ref = (a.T if a_t else a) @ (b.T if b_t else b)
            if not np.allclose(Cm.get(), ref, rtol=1e-4, atol=1e-3):
                return 0.0
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            be.queue.finish()
            best = min(best, time.perf_counter() - t0)
    except Exception:
        return 0.0
    return 2.0 * M * N * K / best / 1e9


def autotune(be) -> tuple[dict, dict]:
    """({layout: best config}, {layout: {config name: GFLOP/s}}) over the candidates that fit the device."""
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
    gpu = bool(be.device.type & cl.device_type.GPU)
    size = 2048 if gpu else 384
    builds(be.device, candidates(be.device))  # (one child process checks every candidate's build first)
    best_all, results = default_config(be.device), {}
    for lay in LAYOUTS:
        best_g = -1.0
        results[lay] = {}
        for c in candidates(be.device):
            if not fits(be.device, c):
                continue
            g = measure(be, c, size, size, size, reps=3 if gpu else 2, layout=lay)
            results[lay][config_name(c)] = round(g, 2)
            if g > best_g:
                best_all[lay], best_g = dict(c), g
    return best_all, results


def get_config(be, tune: bool | None = None, mode: str | None = None) -> dict:
    """{layout: SGEMM configuration} for `be`'s device: cached, freshly tuned, or the default; plus "source".
    `mode` (the backend option tune: on, off or force) wins over LLMC_OPENCL_TUNE."""
    mode = (mode or os.environ.get("LLMC_OPENCL_TUNE", "1")).lower()
    if tune is False or mode in ("0", "no", "off", "false"):
        return dict(default_config(be.device), source="default")
    key = device_key(be.platform, be.device)
    hit = load_cache().get(key)
    if hit and mode != "force":
        try:
            # only one of today's candidates is taken from the cache, as the candidate itself: a damaged or
            # edited entry ("RM": "4", "RM": 4096) must not reach the compiler's options
            ours = {config_key(c): c for c in TILED + DIRECT}
            cfg = {lay: dict(ours[config_key(hit["config"][lay])]) for lay in LAYOUTS}
            if all(fits(be.device, c) for c in cfg.values()):
                return dict(cfg, source="autotuned, cached")
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # (any JSON where a config belongs)
            pass
    best, results = autotune(be)
    data = load_cache()  # another process may have written meanwhile
    data[key] = {"config": best, "gflops": results, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    save_cache(data)
    return dict(best, source="autotuned")
