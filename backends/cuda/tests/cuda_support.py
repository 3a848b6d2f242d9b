"""The CUDA tests' backends: one per (dtype, options) for the whole run, or the test skipped with the plugin's own
reason where the CUDA backend cannot run here (not installed, no GPU, no CuPy)."""

from __future__ import annotations

import pytest

from llmc_cli import registry

_INFO: list = []  # the cuda plugin's registry entry (None: not installed), looked up once
_BACKENDS: dict = {}


def cuda_plugin_info():
    if not _INFO:
        _INFO.append(next((p for p in registry.discover() if p.name == "cuda"), None))
    return _INFO[0]


def cuda_backend(dtype: str, options: dict[str, str] | None = None):
    info = cuda_plugin_info()
    if info is None:
        pytest.skip("llmc-cuda is not installed (pip install -e backends/cuda)")
    if info.plugin is None or not info.usable:
        pytest.skip(f"cuda backend not usable here: {info.reason}")
    key = (dtype, tuple(sorted((options or {}).items())))
    if key not in _BACKENDS:
        _BACKENDS[key] = info.plugin.create(dtype=dtype, options=options)
    return _BACKENDS[key]
