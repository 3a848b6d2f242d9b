"""Which backends the kit tests: every plugin installed in the entry-point group ``llmc.backends``, or those named
in LLMC_TEST_BACKENDS (comma-separated), or one plugin object given as LLMC_TEST_PLUGIN=module:attr (a
BackendPlugin class or instance that need not be installed). Each is created once per session and dtype; one that
is installed but cannot run here is a skip carrying its plugin's own reason, never silently dropped."""

from __future__ import annotations

import importlib
import os

import pytest

from llmc_cli import registry
from llmc_cli.kernels import Backend, BackendUnavailable

_DISCOVERED: list[registry.PluginInfo] | None = None
_CREATED: dict[tuple[str, str | None], object] = {}  # (name, dtype) -> backend, skip reason, or exception


def _discovered() -> list[registry.PluginInfo]:
    global _DISCOVERED
    if _DISCOVERED is None:
        _DISCOVERED = _chosen()
    return _DISCOVERED


def _chosen() -> list[registry.PluginInfo]:
    spec = os.environ.get("LLMC_TEST_PLUGIN", "").strip()
    if spec:
        return [_plugin_from_spec(spec)]
    found = registry.discover()
    names = [n.strip() for n in os.environ.get("LLMC_TEST_BACKENDS", "").split(",") if n.strip()]
    if names:
        missing = [n for n in names if n not in {p.name for p in found}]
        found = [p for p in found if p.name in names] + [
            registry.PluginInfo(n, None, False, f"not installed (entry-point group {registry.GROUP})", "?")
            for n in missing]
    return found


def _plugin_from_spec(spec: str) -> registry.PluginInfo:
    """LLMC_TEST_PLUGIN=module:attr, probed as `registry.discover` probes an installed one."""
    mod, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr or "Plugin")
        plugin = obj() if isinstance(obj, type) else obj
    except Exception as e:
        return registry.PluginInfo(spec, None, False, f"LLMC_TEST_PLUGIN={spec} failed to load: {type(e).__name__}: {e}",
                                   "LLMC_TEST_PLUGIN")
    try:
        usable, reason = plugin.probe()
    except Exception as e:
        usable, reason = False, f"probe failed: {type(e).__name__}: {e}"
    return registry.PluginInfo(plugin.name, plugin, usable, reason, "LLMC_TEST_PLUGIN")


def _info(name: str) -> registry.PluginInfo:
    for p in _discovered():
        if p.name == name:
            return p
    pytest.skip(f"backend '{name}' is not installed (entry-point group {registry.GROUP})")


def make_backend(name: str, dtype: str | None = None) -> Backend:
    """The installed backend `name` in `dtype` (None = its default), created once per session; skips the
    calling test with the plugin's own reason when it cannot run here."""
    key = (name, dtype)
    if key not in _CREATED:
        info = _info(name)
        if info.plugin is None or not info.usable:
            _CREATED[key] = f"backend '{name}' ({info.distribution}) is installed but not usable here: {info.reason}"
        else:
            try:
                _CREATED[key] = info.plugin.create(dtype=dtype)
            except BackendUnavailable as e:
                _CREATED[key] = f"backend '{name}' could not be created (dtype={dtype}): {e}"
            except Exception as e:  # a usable backend that fails to start is an error, reported once in full
                _CREATED[key] = e
                raise
    b = _CREATED[key]
    if isinstance(b, str):
        pytest.skip(b)
    if isinstance(b, Exception):
        pytest.fail(f"creating backend '{name}' (dtype={dtype}) raised {type(b).__name__}: {b}", pytrace=False)
    return b


def unusable_reason(name: str) -> str | None:
    """Why the backend `name` cannot run here (not installed, or its plugin's own probe line), else None."""
    info = next((p for p in _discovered() if p.name == name), None)
    if info is None:
        return f"backend '{name}' is not installed (entry-point group {registry.GROUP})"
    if info.plugin is None or not info.usable:
        return f"backend '{name}' ({info.distribution}) is installed but not usable here: {info.reason}"
    return None


def backend_names() -> list:
    names = [p.name for p in _discovered()]
    if not names:  # still collect one (skipped) case so the absence is visible
        return [pytest.param(None, id="no-backend")]
    return names


def reset() -> None:
    """Forget what was discovered and created (tests that change the installed plugins call this)."""
    global _DISCOVERED
    _DISCOVERED = None
    _CREATED.clear()
