"""Installs broken plugins (faulty_plugins) beside the real cpu plugin for one test, through the registry's
entry-point source, so that no other installed plugin (opencl, cuda) is probed or timed meanwhile."""

from __future__ import annotations

import faulty_plugins
import pytest

from llmc_cli import registry


@pytest.fixture
def install(monkeypatch):
    """install(*entry_points, cpu=True): the plugins `llmc` sees from now until the test ends."""
    cpu = [e for e in registry._entry_points() if e.name == "cpu"]
    monkeypatch.setenv("LLMC_PROBE_TIMEOUT", "1")

    def use(*eps, cpu_too: bool = True):
        listed = (cpu if cpu_too else []) + list(eps)
        monkeypatch.setattr(registry, "_entry_points", lambda: list(listed))
    faulty_plugins.RELEASE.clear()
    faulty_plugins.PROBED.clear()
    use()
    yield use
    faulty_plugins.RELEASE.set()  # a hung probe's thread returns
    registry._STUCK.clear()
