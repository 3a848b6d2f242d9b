"""`llmc bench` with no --backend measures every usable backend: one that fails to start or raises on a kernel
gets one line saying why, the others are measured, and the exit status is 1. The reference is the cpu backend
whatever else declares itself one, and the message names the reference it used."""

from __future__ import annotations

import json

import faulty_plugins
import pytest
from faulty_plugins import ep
from click.testing import CliRunner

from llmc_cli.bench.backends import choose_reference, resolve_backends
from llmc_cli.commands import main

KERNELS = ["bench", "kernels", "--model", "d2", "--n-embd", "32", "--n-head", "2", "-b", "2", "-t", "16",
           "--only", "gelu", "--repeat", "1", "--warmup", "0"]
DECODE = ["bench", "decode", "--model", "d2", "--n-embd", "32", "--n-head", "2", "-t", "16", "--prompt-len", "4",
          "--tokens", "2", "--warmup", "0"]


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("attr, needle", [
    ("CreateRaises", "cannot start (RuntimeError: create boom (test))"),
    ("CreateNone", "create() returned NoneType None"),
    ("CreateExit", "SystemExit: bye from create (test)"),
    ("CreateHalf", "TypeError: Can't instantiate abstract class Half"),
    ("CreateCapsNone", "capabilities must be a set or frozenset of str"),
    ("CreateGeluNotImplemented", "NotImplementedError: gelu_forward is not written yet (test)"),
])
def test_kernels_measure_the_others_when_one_backend_fails(install, attr, needle):
    install(ep("broken", attr))
    r = llmc(*KERNELS, "--json")
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    out = json.loads(r.stdout)
    assert {(x["kernel"], x["backend"]) for x in out["results"]} >= {("gelu_fwd", "cpu"), ("gelu_bwd", "cpu")}
    assert all(x["backend"] != "broken" for x in out["results"] if x["kernel"] == "gelu_fwd")
    fails = [f for f in out["failed"] if f["backend"] == "broken"]
    assert fails and needle in fails[0]["error"], out["failed"]
    assert out["mismatches"] == []
    line = r.stderr.strip()
    assert "\n" not in line and "backend(s) failed" in line and "broken" in line, r.stderr
    # the table says it too, once per backend
    r = llmc(*KERNELS)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.stdout.count("failed: broken") == 1 and "gelu_fwd" in r.stdout, r.stdout


def test_a_named_backend_that_fails_to_start_is_one_line(install):
    install(ep("broken", "CreateRaises"))
    r = llmc(*KERNELS, "--backend", "broken")
    assert r.exit_code == 2 and r.stderr.strip() == \
        "error: --backend broken: cannot start (RuntimeError: create boom (test))", r.output


def test_resolve_backends_without_a_failed_list_skips_them(install):
    install(ep("broken", "CreateNone"))
    chosen, skipped = resolve_backends([], None)
    assert [label for label, _ in chosen] == ["cpu"] and skipped[0][0] == "broken"


def test_decode_measures_the_others_when_one_backend_has_no_attention_decode(install):
    install(ep("nokv", "CreateKvWithoutDecode"))
    r = llmc(*DECODE, "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    rows = {x["backend"]: x for x in out["results"]}
    assert rows["cpu"]["past_tok_s"] > 0
    assert "has no attention_decode" in rows["nokv"]["failed"], rows["nokv"]
    r = llmc(*DECODE)
    assert r.exit_code == 1 and "Traceback" not in r.output and "failed:" in r.stdout, r.output


def test_decode_lists_a_backend_that_failed_to_start(install):
    install(ep("broken", "CreateNone"))
    r = llmc(*DECODE, "--json")
    assert r.exit_code == 1, r.output
    rows = {x["backend"]: x for x in json.loads(r.stdout)["results"]}
    assert "create() returned NoneType" in rows["broken"]["failed"] and "past_tok_s" in rows["cpu"]


def test_the_cpu_backend_is_the_reference_over_a_louder_one(install):
    """A plugin declaring `reference` with a priority above cpu's became the reference: cpu's correct gelu was
    then the mismatch, "differ from the cpu reference"."""
    install(ep("loudref", "LoudReference"))
    r = llmc(*KERNELS, "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert [(m["kernel"], m["backend"]) for m in out["mismatches"]] == [("gelu_fwd", "loudref")]
    assert out["config"]["reference_backend"] == "cpu"
    assert "differ from the cpu reference" in r.stderr
    name, _ = choose_reference(resolve_backends(["loudref"], None)[0])
    assert name == "cpu"


def test_the_message_names_the_reference_it_used(install):
    install(ep("loudref", "LoudReference"), ep("fake", "Fake"), cpu_too=False)
    r = llmc(*KERNELS, "--json")
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert out["config"]["reference_backend"] == "loudref"
    assert [(m["kernel"], m["backend"]) for m in out["mismatches"]] == [("gelu_fwd", "fake")]
    assert "differ from the loudref reference" in r.stderr and "cpu" not in r.stderr


def test_train_times_the_others_when_one_backend_fails(install):
    install(ep("broken", "CreateGeluNotImplemented"), ep("nothere", "CreateNone"))
    r = llmc("bench", "train", "--model", "d2", "--n-embd", "32", "--n-head", "2", "-b", "1", "-t", "8", "--steps", "1",
             "--warmup", "0", "--json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    out = json.loads(r.stdout)
    assert [x["name"] for x in out["results"]] == ["cpu"]
    failed = {f["backend"]: f["error"] for f in out["failed"]}
    assert "gelu_forward is not written yet" in failed["broken"] and "returned NoneType" in failed["nothere"]
    assert "2 backend(s) failed to train" in r.stderr


class _OverlapPlugin(faulty_plugins.Fake):
    name = "hostoverlap"

    def create(self, device=None, dtype=None, options=None):
        from llmc_test_support import overlap_backend
        return overlap_backend()


class _BrokenOverlap(faulty_plugins.Fake):
    def create(self, device=None, dtype=None, options=None):
        from llmc_cli.kernels import CAP_COPY_OVERLAP

        class NoOverlap(faulty_plugins.CpuBackend):
            capabilities = frozenset({CAP_COPY_OVERLAP})

            def overlap_layernorm(self, *a, **k):
                raise NotImplementedError("overlap_layernorm is not written yet (test)")
        return NoOverlap()


def test_overlap_runs_the_others_when_one_backend_fails(install):
    faulty_plugins.AdvOverlap, faulty_plugins.AdvBrokenOverlap = _OverlapPlugin, _BrokenOverlap
    install(ep("hostoverlap", "AdvOverlap"), ep("broken", "AdvBrokenOverlap"))
    r = llmc("bench", "overlap", "-b", "2", "-t", "8", "-c", "16", "--streams", "2", "--block", "32",
             "--host-memory", "pinned", "--repeat", "1", "--warmup", "0", "--json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    out = json.loads(r.stdout)
    assert {x["backend"] for x in out["results"]} == {"hostoverlap"} and out["mismatches"] == []
    assert [f["backend"] for f in out["failed"]] == ["broken"], out["failed"]
    assert "1 backend(s) failed to overlap copies: broken" in r.stderr
