"""Which backends the kit tests: every plugin installed in the entry-point group ``llmc.backends``, or those named
in LLMC_TEST_BACKENDS (comma-separated), or one plugin object given as LLMC_TEST_PLUGIN=module:attr (a
BackendPlugin class or instance that need not be installed). Each is created once per session and dtype. Only a
correct plugin whose probe says it cannot run here is a skip, carrying its own reason; a plugin that breaks the
contract (fails to import, declares a bad attribute, answers its probe out of contract, create() returns no
Backend) fails its cases, and one asked for by name that is missing or broken fails the run at collection
(`requested_problems`), so that a typo or an import error is never a green run of skips."""

from __future__ import annotations

import importlib
import os

import pytest

from llmc_cli import registry
from llmc_cli.kernels import Backend, BackendUnavailable

_DISCOVERED: list[registry.PluginInfo] | None = None
_CREATED: dict[tuple[str, str | None], object] = {}  # (name, dtype) -> backend, skip reason, or exception
# what the environment asked for by name ("LLMC_TEST_BACKENDS=..." or "LLMC_TEST_PLUGIN=..."), None: everything
_REQUESTED: list[str | None] = [None]


def _discovered() -> list[registry.PluginInfo]:
    global _DISCOVERED
    if _DISCOVERED is None:
        _DISCOVERED = _chosen()
    return _DISCOVERED


def _chosen() -> list[registry.PluginInfo]:
    spec = os.environ.get("LLMC_TEST_PLUGIN", "").strip()
    if spec:
        _REQUESTED[0] = f"LLMC_TEST_PLUGIN={spec}"
        return [_plugin_from_spec(spec)]
    names = list(dict.fromkeys(n.strip() for n in os.environ.get("LLMC_TEST_BACKENDS", "").split(",") if n.strip()))
    if not names:
        _REQUESTED[0] = None
        return _one_per_name(registry.discover())
    _REQUESTED[0] = f"LLMC_TEST_BACKENDS={os.environ.get('LLMC_TEST_BACKENDS', '').strip()}"
    found = _one_per_name(registry.plugins_named(names))
    have = {p.name for p in found}
    installed = ", ".join(registry.installed_names()) or "none"
    return found + [registry.PluginInfo(n, None, False, f"not installed (entry-point group {registry.GROUP}; "
                                                        f"installed: {installed})", "?", broken=True)
                    for n in names if n not in have]


def _one_per_name(found: list[registry.PluginInfo]) -> list[registry.PluginInfo]:
    """Where two distributions register one name, the one `--backend NAME` takes (the first usable), as the kit
    tests backends by name."""
    by: dict[str, registry.PluginInfo] = {}
    for p in found:
        have = by.get(p.name)
        if have is None or (not (have.usable and have.plugin is not None) and p.usable and p.plugin is not None):
            by[p.name] = p
    return list(by.values())


class _SpecEntry:
    """LLMC_TEST_PLUGIN=module:attr as an entry point, so that it loads and probes as an installed one does."""

    def __init__(self, spec: str) -> None:
        self.name = self.value = spec
        self.dist = None

    def load(self) -> object:
        mod, _, attr = self.value.partition(":")
        if not mod.strip():
            raise ValueError("expected module:attr, e.g. llmc_skeleton:SkeletonPlugin")
        return getattr(importlib.import_module(mod.strip()), attr.strip() or "Plugin")


def _plugin_from_spec(spec: str) -> registry.PluginInfo:
    """LLMC_TEST_PLUGIN=module:attr, loaded, checked and probed as `registry.discover` does an installed one."""
    with registry.quiet_stdout():
        plugin, why = registry.load_entry(_SpecEntry(spec))
        if plugin is None:
            return registry.PluginInfo(spec, None, False, why, "LLMC_TEST_PLUGIN", broken=True)
        usable, reason, broken = registry.probe_plugin(plugin, ("spec", spec))
    return registry.PluginInfo(plugin.name, None if broken else plugin, usable, reason, "LLMC_TEST_PLUGIN",
                               broken=broken)


def requested_problems() -> list[str]:
    """One line for each backend the environment asked for by name that is missing or breaks the contract (the
    run must fail, not skip); [] when nothing was asked for by name or all of it is sound."""
    found = _discovered()
    asked = _REQUESTED[0]
    if asked is None:
        return []
    return [f"{asked}: backend '{p.name}' {_broken_words(p)}" for p in found if p.broken]


def _broken_words(p: registry.PluginInfo) -> str:
    reason = registry.one_line(p.reason)
    return f"is {reason}" if reason.startswith("not installed") else f"({p.distribution}) is broken: {reason}"


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
        if info.broken:  # a plugin that breaks the contract fails its cases: a skip would read as a pass
            _CREATED[key] = registry.PluginError(f"backend '{name}' {_broken_words(info)}")
        elif info.plugin is None or not info.usable:
            _CREATED[key] = f"backend '{name}' ({info.distribution}) is installed but not usable here: {info.reason}"
        else:
            try:
                _CREATED[key] = registry.create_with(info.plugin, None, dtype, None)
            except registry.PluginError as e:  # create() returned no Backend, or raised SystemExit
                _CREATED[key] = e
            except BackendUnavailable as e:
                _CREATED[key] = f"backend '{name}' could not be created (dtype={dtype}): {e}"
            except Exception as e:  # a usable backend that fails to start is an error, reported once in full
                _CREATED[key] = e
                raise
    b = _CREATED[key]
    if isinstance(b, str):
        pytest.skip(b)
    if isinstance(b, registry.PluginError):
        pytest.fail(str(b), pytrace=False)
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
    _REQUESTED[0] = None
    _CREATED.clear()
