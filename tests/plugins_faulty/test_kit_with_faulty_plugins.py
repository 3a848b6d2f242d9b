"""The conformance kit never gives a green run of skips for a backend it was asked to test that is missing or
broken: LLMC_TEST_BACKENDS with a typo, LLMC_TEST_PLUGIN naming a class that does not exist, a plugin that fails
to import or whose probe raises or answers None end the run with one line (pytest's usage error, exit status 4);
only a correct plugin whose probe says it cannot run here is skipped."""

from __future__ import annotations

import subprocess

import pytest
from faulty_plugins import HERE, dist_info, ep, subprocess_env
from llmc_test_support import KIT_PYTEST

from llmc_cli import registry
from llmc_cli.testing import backends as kit


def kit_run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`pytest --pyargs llmc_cli.testing` with `env`, outside llmc's tests (its own conftest only)."""
    pytest.importorskip("torch", reason="the kit's oracle")
    site = dist_info(tmp_path / "site", {"skeleton_broken": "faulty_plugins:ProbeRaises"}, dist="adv-kit")
    return subprocess.run([*KIT_PYTEST, "-k", "alloc_shapes or gelu_forward"], cwd=tmp_path,
                          env=subprocess_env(site, **env), capture_output=True, text=True, timeout=600, check=False)


ASKED_AND_BROKEN = [
    ({"LLMC_TEST_BACKENDS": "skeletn"}, "LLMC_TEST_BACKENDS=skeletn: backend 'skeletn' is not installed"),
    ({"LLMC_TEST_PLUGIN": "faulty_plugins:TypoClass"},
     "failed to load: AttributeError: module 'faulty_plugins' has no attribute 'TypoClass'"),
    ({"LLMC_TEST_PLUGIN": "no_such_module_adv:Plugin"}, "failed to load: ModuleNotFoundError"),
    ({"LLMC_TEST_PLUGIN": "faulty_plugins:ProbeNone"}, "probe() must answer (usable: bool, reason: str), not NoneType"),
    ({"LLMC_TEST_PLUGIN": "faulty_plugins:BadPriority"}, "priority must be a finite number"),
    ({"LLMC_TEST_BACKENDS": "skeleton_broken"}, "probe failed: RuntimeError: probe boom (test)"),
]


def test_a_backend_asked_for_by_name_that_is_broken_fails_the_kit(tmp_path):
    """The kit's run ends with the problem's one line (pytest's usage error); the problems themselves are the
    table below, found in process."""
    r = kit_run(tmp_path, LLMC_TEST_BACKENDS="skeleton_broken")
    needle = "probe failed: RuntimeError: probe boom (test)"
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    err = r.stderr
    assert needle in err and "Traceback" not in err and "passed" not in r.stdout, err
    lines = [line for line in err.splitlines() if needle in line]
    assert len(lines) == 1, err


@pytest.mark.parametrize("env, needle", ASKED_AND_BROKEN)
def test_a_backend_asked_for_by_name_that_is_missing_or_broken_is_a_problem(install, fresh_kit, env, needle):
    install(ep("skeleton_broken", "ProbeRaises"))
    for name, value in env.items():
        fresh_kit.setenv(name, value)
    problems = kit.requested_problems()
    assert len(problems) == 1 and needle in problems[0] and "\n" not in problems[0], problems


def test_an_honest_probe_is_a_skip(tmp_path):
    r = kit_run(tmp_path, LLMC_TEST_PLUGIN="faulty_plugins:Honest")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "skipped" in r.stdout and "failed" not in r.stdout and "error" not in r.stdout.lower()


def test_a_correct_plugin_passes(tmp_path):
    r = kit_run(tmp_path, LLMC_TEST_PLUGIN="faulty_plugins:Fake")
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# in-process: the pieces

@pytest.fixture
def fresh_kit(monkeypatch):
    monkeypatch.setattr(kit, "_DISCOVERED", None)
    monkeypatch.setattr(kit, "_CREATED", {})
    monkeypatch.setattr(kit, "_REQUESTED", [None])
    monkeypatch.delenv("LLMC_TEST_PLUGIN", raising=False)
    monkeypatch.delenv("LLMC_TEST_BACKENDS", raising=False)
    return monkeypatch


def test_an_installed_broken_plugin_fails_its_cases_rather_than_skipping(install, fresh_kit):
    install(ep("bad", "ProbeNone"), ep("none", "CreateNone"), ep("honest", "Honest"))
    assert kit.requested_problems() == []  # nothing asked for by name: the run goes on, the broken ones fail
    with pytest.raises(pytest.fail.Exception, match="backend 'bad' \\(adv-test\\) is broken: probe\\(\\) must answer"):
        kit.make_backend("bad")
    with pytest.raises(pytest.fail.Exception, match="create\\(\\) returned NoneType None"):
        kit.make_backend("none")
    with pytest.raises(pytest.skip.Exception, match="no such device here"):
        kit.make_backend("honest")
    assert kit.make_backend("cpu").name == "cpu"


def test_requested_problems_name_each_backend_once(install, fresh_kit):
    install(ep("bad", "ExitInProbe"), ep("honest", "Honest"))
    fresh_kit.setenv("LLMC_TEST_BACKENDS", "bad, honest,typo, bad")
    problems = kit.requested_problems()
    asked = "LLMC_TEST_BACKENDS=bad, honest,typo, bad"
    assert problems == [f"{asked}: backend 'bad' (adv-test) is broken: probe failed: SystemExit: bye from probe (test)",
                        f"{asked}: backend 'typo' is not installed (entry-point group llmc.backends; installed: cpu, "
                        f"bad, honest)"]


def test_the_spec_loads_through_the_registry(fresh_kit):
    fresh_kit.syspath_prepend(str(HERE))
    fresh_kit.setenv("LLMC_TEST_PLUGIN", "faulty_plugins:Printer")
    info = kit._discovered()[0]
    assert info.name == "fake" and info.usable and not info.broken
    assert kit.requested_problems() == []
    registry._STUCK.clear()
