"""What a benchmark ran on: CPU, BLAS, GPUs, package versions, in a dict and as lines for a report."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from importlib.metadata import PackageNotFoundError, entry_points, requires
from typing import Sequence

import numpy as np

from llmc_cli.kernels import (
    CAP_DEVICE_EVENTS,
    Backend,
)
from llmc_cli.registry import one_line

# ---------------------------------------------------------------------------------------------------------------
# the machine

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _blas() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        b = cfg["Build Dependencies"]["blas"]
        return f"{b.get('name', '?')} {b.get('version', '')}".strip()
    except Exception:
        return "?"


def _nvidia_smi() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return [l.strip() for l in out.stdout.splitlines() if l.strip()]
    except Exception:
        return []


def _backend_distributions() -> list[str]:
    """Every installed backend's distribution and what it requires (the device libraries it runs on)."""

    out: list[str] = []
    for ep in entry_points(group="llmc.backends"):
        dist = ep.dist.name if ep.dist is not None else None
        if not dist:
            continue
        out.append(dist)
        try:
            reqs = requires(dist) or []
        except PackageNotFoundError:
            reqs = []
        out += [re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return list(dict.fromkeys(d for d in out if d != "llmc"))


def describe_machine(backends: Sequence[tuple[str, Backend]] = ()) -> dict:
    """CPU model, cores, OS, library versions, GPUs (nvidia-smi where present) and each backend's own line."""
    libs = {d: _version(d) for d in ("llmc", *_backend_distributions(), "numpy", "scipy", "torch", "click", "rich")}
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "os": platform.platform(),
        "python": platform.python_version(), "blas": _blas(),
        "libraries": {k: v for k, v in libs.items() if v},
        "gpus": _nvidia_smi(),
        "backends": [{"label": label, "describe": _describe(b), "dtype": b.dtype,
                      "timer": "device events" if CAP_DEVICE_EVENTS in b.capabilities else "host clock"}
                     for label, b in backends],
    }


def _describe(b: Backend) -> str:
    """The backend's own line; a plugin's describe() that fails is named, not the report's end."""
    try:
        return one_line(b.describe())
    except Exception as e:  # noqa: BLE001
        return f"describe() failed: {type(e).__name__}: {one_line(e)}"


def machine_lines(m: dict) -> list[str]:
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['os']}, Python {m['python']}, BLAS {m['blas']}",
             f"libraries: {libs}"]
    lines += [f"gpu: {g}" for g in m["gpus"]]
    lines += [f"backend {b['label']}: {b['describe']} ({b['dtype']}, timer: {b['timer']})" for b in m["backends"]]
    return lines
