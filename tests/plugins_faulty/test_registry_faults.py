"""Every command survives a broken third-party plugin: the plugin is listed unusable with one line saying why,
the others are listed and usable, --json stays JSON with nothing else on stdout, and nothing prints a traceback.
A command naming its backend imports and probes no other plugin."""

from __future__ import annotations

import contextlib
import io
import json
import time

import faulty_plugins
import pytest
from faulty_plugins import ep
from click.testing import CliRunner

from llmc_cli import registry
from llmc_cli.commands import main

DRY = ["train", "--model", "d2", "-b", "1", "-t", "8", "--dry-run"]


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def listed(*args) -> dict:
    """`llmc backends --json`: its rows by (name, distribution), after checking that stdout is JSON alone."""
    r = llmc("backends", "--json", *args)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    rows = json.loads(r.stdout)
    return {(row["name"], row["distribution"]): row for row in rows}


def one_row(name: str, dist: str = "adv-test") -> dict:
    rows = listed()
    assert rows[("cpu", "llmc-cpu")]["usable"] is True, rows  # the others still listed and usable
    row = rows[(name, dist)]
    assert "\n" not in row["reason"] and "\x1b" not in row["reason"], row
    return row


def table_ok(*args) -> str:
    r = llmc("backends", *args)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return r.stdout


# ---------------------------------------------------------------------------------------------------------------
# a probe that never answers

def test_a_hung_probe_is_unusable_after_the_timeout(install):
    install(ep("hang", "HangProbe"))
    row = one_row("hang")
    assert row["usable"] is False and "probe did not answer within 1 s" in row["reason"], row
    assert "LLMC_PROBE_TIMEOUT" in row["reason"]
    # the thread is still stuck: the next discovery in this process answers at once, without a second thread
    listed()
    assert faulty_plugins.PROBED.count("HangProbe") == 1


def test_a_named_backend_probes_no_other_plugin(install):
    install(ep("hang", "HangProbe"), ep("fake", "Fake"))
    r = llmc(*DRY, "--backend", "cpu")
    assert r.exit_code == 0, r.output
    be = registry.create_backend("cpu")
    assert be.name == "cpu"
    assert registry.usable_plugin("fake").name == "fake"
    assert "HangProbe" not in faulty_plugins.PROBED


def test_auto_selection_survives_a_hung_probe(install):
    install(ep("hang", "HangProbe"))
    assert registry.usable_plugin("auto").name == "cpu"
    with pytest.raises(registry.BackendUnavailable, match="probe did not answer within 1 s"):
        registry.usable_plugin("hang")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", " "])
def test_a_bad_probe_timeout_falls_back_to_the_default(monkeypatch, value, capsys):
    monkeypatch.setenv("LLMC_PROBE_TIMEOUT", value)
    monkeypatch.setattr(registry, "_WARNED", [])
    assert registry.probe_timeout() == registry.DEFAULT_PROBE_TIMEOUT
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and "LLMC_PROBE_TIMEOUT" in err) if value.strip() else err == ""


def test_the_probe_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMC_PROBE_TIMEOUT", "2.5")
    assert registry.probe_timeout() == 2.5


# ---------------------------------------------------------------------------------------------------------------
# declarations of the wrong type

@pytest.mark.parametrize("attr, needle", [
    ("BadPriority", "priority must be a finite number (got str 'high')"),
    ("NanPriority", "priority must be a finite number"),
    ("BadName", "name must be a non-empty str (got int 7)"),
    ("BadOptions", "options must be a dict"),
    ("BadDtype", "default_dtype must be one of float32, bfloat16, fp8 (got str 'fp16')"),
    ("BadReference", "reference must be a bool"),
    ("ProbeSetsBadPriority", "after probe(): priority must be a finite number"),
    ("NOT_A_PLUGIN", "not a backend plugin (int 42)"),
    ("NotAPlugin", "not a backend plugin"),
    ("Half", "not a backend plugin"),
])
def test_a_bad_declaration_is_one_unusable_row(install, attr, needle):
    install(ep("bad", attr))
    row = one_row("bad")
    assert row["usable"] is False and needle in row["reason"], row
    assert row["options"] == {} and row["devices"] == []
    out = table_ok("--options")
    assert "bad" in out and "threads" in out  # the cpu plugin's option still listed
    r = llmc(*DRY, "--backend", "cpu")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert registry.create_backend("cpu").name == "cpu"
    assert registry.usable_plugin().name == "cpu"
    with pytest.raises(registry.BackendUnavailable, match="cannot run here"):
        registry.usable_plugin("bad")


# ---------------------------------------------------------------------------------------------------------------
# SystemExit and exceptions from plugin code

def test_systemexit_on_import_does_not_end_the_command(install, tmp_path, monkeypatch):
    (tmp_path / "adv_exit_on_import.py").write_text("import sys\nsys.exit('bye from import (test)')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install(ep("exits", "adv_exit_on_import:Plugin"))
    row = one_row("exits")
    assert row["reason"] == "failed to load: SystemExit: bye from import (test)", row
    assert llmc(*DRY, "--backend", "cpu").exit_code == 0


@pytest.mark.parametrize("attr, needle", [
    ("ExitInProbe", "probe failed: SystemExit: bye from probe (test)"),
    ("ExitInInit", "failed to load: SystemExit: bye from __init__ (test)"),
    ("RaiseInInit", "failed to load: RuntimeError: ctor boom (test)"),
    ("ProbeRaises", "probe failed: RuntimeError: probe boom (test)"),
])
def test_plugin_code_that_raises_is_its_rows_reason(install, attr, needle):
    install(ep("bad", attr))
    row = one_row("bad")
    assert row["usable"] is False and row["reason"] == needle, row
    table_ok()


def test_dry_run_on_a_plugin_whose_constructor_raises(install):
    """load_plugin called the class outside its try: a traceback, exit 1."""
    install(ep("ctor", "RaiseInInit"))
    r = llmc(*DRY, "--backend", "ctor")
    assert r.exit_code in (0, 2) and "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert registry.load_plugin("ctor") is None
    assert registry.default_dtype("ctor") == "float32"
    r = llmc("train", "--backend", "ctor", "--data", "x.bin", "--steps", "1")
    line = r.stderr.strip()
    assert r.exit_code == 2 and "\n" not in line and "ctor boom (test)" in line, r.output


@pytest.mark.parametrize("attr, code, needle", [
    ("ScratchRaises", 2, "--backend fake: planned_scratch() failed: RuntimeError: scratch boom (test)"),
    ("ScratchExit", 2, "--backend fake: planned_scratch() failed: SystemExit: bye from planned_scratch (test)"),
    ("ScratchNone", 2, "--backend fake: planned_scratch() returned NoneType None, not names to byte counts"),
    ("ScratchNegative", 2, "--backend fake: planned_scratch() returned dict {'lib workspace': -1}, not names to"),
    ("ScratchWithoutAttention", 0, "fake: lib workspace"),
    ("ScratchOfTheShape", 0, "fake: per score"),
    ("ScratchKeywords", 0, "fake: per score"),
    ("ScratchPositional", 0, "fake: per score"),
])
def test_dry_run_on_a_plugins_planned_scratch(install, attr, code, needle):
    """--dry-run asks the backend's plugin for its workspaces: what the plugin raises or returns out of contract is
    one line and exit 2; a plugin whose planned_scratch predates the attention argument is asked without it."""
    install(ep("bad", attr))
    r = llmc(*DRY, "--backend", "bad", "--n-layer", 1)
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    if code:
        assert r.stderr.strip().startswith("error: " + needle) and "\n" not in r.stderr.strip(), r.stderr
    else:
        assert needle in r.stdout, r.stdout
    if attr == "ScratchOfTheShape":  # d2 at B=1 T=8: 2 heads -> 256 bytes, 0.00 GiB
        assert registry.planned_scratch(faulty_plugins.ScratchOfTheShape(), "float32", None,
                                        (1, 8, 2, 2, 64)) == {"per score": 256}


def test_create_raising_systemexit_is_a_plugin_error(install):
    install(ep("bad", "CreateExit"))
    with pytest.raises(registry.PluginError, match="create\\(\\) failed: SystemExit: bye from create"):
        registry.create_backend("bad")
    r = llmc("train", "--backend", "bad", "--data", "x.bin", "--steps", "1")
    assert r.exit_code == 2 and "bye from create" in r.stderr and "\n" not in r.stderr.strip(), r.output


@pytest.mark.parametrize("attr, needle", [("CreateNone", "create() returned NoneType None, not a"),
                                          ("CreateCapsNone", "capabilities must be a set or frozenset of str")])
def test_create_must_give_a_backend(install, attr, needle):
    install(ep("bad", attr))
    with pytest.raises(registry.PluginError) as e:
        registry.create_backend("bad")
    assert needle in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# answers of the wrong type

@pytest.mark.parametrize("attr, usable, needle", [
    ("ProbeDict", False, "probe() must answer (usable: bool, reason: str), not tuple (True, {'device':"),
    ("ProbeStr", False, "not str 'ok'"),
    ("ProbeNoStr", False, "not tuple ('no',"),
    ("ProbeNone", False, "not NoneType None"),
    ("ProbeNumpyBool", True, "numpy bool (test)"),
])
def test_a_probe_must_answer_a_bool_and_a_line(install, attr, usable, needle):
    install(ep("p", attr))
    row = one_row("p")
    assert row["usable"] is usable and needle in row["reason"], row
    assert table_ok().count("\n") > 3


def test_a_reason_of_several_lines_and_escapes_is_one_printable_line(install):
    install(ep("ml", "ProbeMultiline"))
    row = one_row("ml")
    assert row["reason"] == "first line second line\\x1b[31m red", row
    out = table_ok()
    assert "\x1b" not in out and "second line" in out


def test_devices_that_raise_or_are_odd(install):
    install(ep("dr", "DevicesRaise"), ep("do", "DevicesOdd"))
    rows = listed()
    dr, do = rows[("dr", "adv-test")], rows[("do", "adv-test")]
    assert dr["usable"] is True and dr["devices"] == [] and "devices boom (test)" in dr["devices_error"], dr
    assert do["devices"] == ["1.5", "dev 1"], do
    assert rows[("cpu", "llmc-cpu")]["devices"] == ["host"]


# ---------------------------------------------------------------------------------------------------------------
# standard output

def test_prints_from_a_plugin_go_to_stderr(install, tmp_path, monkeypatch):
    (tmp_path / "adv_print_on_import.py").write_text(
        "print('hello from import (test)')\nfrom faulty_plugins import Printer as Plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install(ep("printer", "adv_print_on_import:Plugin"))
    r = llmc("backends", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.stdout)  # nothing else on stdout
    assert next(x for x in rows if x["name"] == "printer")["usable"] is True
    assert "hello from import" in r.stderr and "hello from probe" in r.stderr
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # what eval --json and sample --json create their backend through
        registry.create_backend("printer")
    assert out.getvalue() == ""


# ---------------------------------------------------------------------------------------------------------------
# two plugins of one name

def test_a_broken_duplicate_does_not_hijack_its_name(install):
    install(ep("cpu", "BrokenCpu", dist="evil-cpu"))  # listed before the real one, and of higher priority
    assert registry.usable_plugin("cpu").__class__.__name__ == "CpuPlugin"
    assert registry.create_backend("cpu").name == "cpu"
    assert registry.load_plugin("cpu").__class__.__name__ == "CpuPlugin"
    assert llmc(*DRY, "--backend", "cpu").exit_code == 0
    rows = listed()
    assert rows[("cpu", "evil-cpu")]["same_name"] == ["evil-cpu", "llmc-cpu"] or \
        sorted(rows[("cpu", "evil-cpu")]["same_name"]) == ["evil-cpu", "llmc-cpu"]
    assert rows[("cpu", "evil-cpu")]["usable"] is False and rows[("cpu", "llmc-cpu")]["usable"] is True
    out = " ".join(table_ok().split())
    assert "2 plugins are registered as 'cpu' (" in out and "takes the first usable one" in out


def test_two_broken_plugins_of_one_name_say_both(install):
    install(ep("twin", "ProbeRaises", dist="a-dist"), ep("twin", "ProbeNone", dist="b-dist"), cpu_too=False)
    with pytest.raises(registry.BackendUnavailable) as e:
        registry.usable_plugin("twin")
    msg = str(e.value)
    assert "installed 2 times" in msg and "a-dist" in msg and "b-dist" in msg and "\n" not in msg


def test_an_unknown_name_lists_the_installed_without_importing_them(install):
    install(ep("hang", "HangProbe"))
    with pytest.raises(registry.BackendUnavailable, match=r"unknown backend 'nope' \(installed: cpu, hang\)"):
        registry.usable_plugin("nope")
    assert faulty_plugins.PROBED == []


def test_prepare_survives_a_plugin_that_exits(install):
    class Exits(faulty_plugins.Fake):
        def prepare(self):
            raise SystemExit("bye from prepare (test)")
    faulty_plugins.ExitsInPrepare = Exits
    install(ep("exits", "ExitsInPrepare"))
    r = llmc("backends", "--prepare", "--json")
    assert r.exit_code == 1, r.output
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows["exits"]["prepared"] is False and "SystemExit: bye from prepare" in rows["exits"]["line"]
    assert rows["cpu"]["prepared"] is True


def test_a_slow_import_is_taken_once_it_has_finished(install, tmp_path, monkeypatch):
    """A thread cannot be stopped: an import past the timeout is not started again, and its plugin is taken
    by a later discovery once the import has finished."""
    gate = tmp_path / "open"  # the import finishes once the test makes this file
    (tmp_path / "adv_slow_import.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
        "from faulty_plugins import Fake as Plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install(ep("slow", "adv_slow_import:Plugin"))
    assert one_row("slow")["reason"] == "import did not answer within 1 s (LLMC_PROBE_TIMEOUT sets the limit)"
    gate.touch()
    deadline = time.monotonic() + 120  # (only a hang guard: the import ends within moments of the gate)
    while not (row := one_row("slow"))["usable"]:
        assert time.monotonic() < deadline and "did not answer" in row["reason"], row
        time.sleep(0.01)
