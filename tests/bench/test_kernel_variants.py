"""`llmc bench kernels`: a backend's own tuning is settled before the timed calls, and `--variants` times and
checks every implementation a backend has of a kernel. Both with fake backends (the cpu backend with a fake clock,
so that the times are exact): one whose calls get slow once it starts tuning, one whose variants are fast, slow,
wrong, or unable to take the shape."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

import pytest
from click.testing import CliRunner
from llmc_test_support import make_backend

from llmc_cli import registry
from llmc_cli.bench import kernel_cases as kc
from llmc_cli.bench import report
from llmc_cli.commands import main
from llmc_cli.kernels import Backend, BackendPlugin, VariantUnsupported
from llmc_cli.models.gpt2 import preset

CFG = preset("d2", n_embd=64, vocab_size=1000)
CPU = type(make_backend("cpu"))
TINY = ["--model", "d2", "--n-embd", "64", "--vocab-size", "1000", "-b", "2", "-t", "16"]


class FakeClock:
    """A timer reading the backend's fake clock, which each gelu_forward call advances by its cost."""

    def __init__(self, backend):
        self.backend = backend
        self.t0 = 0.0

    def start(self):
        self.t0 = self.backend.clock

    def stop(self):
        return self.backend.clock - self.t0


def _clocked(cls):
    """The cpu backend's class with a fake clock that only gelu_forward advances, by `cost()` ms a call."""
    class Clocked(cls):
        def __init__(self):
            super().__init__()
            self.clock = 0.0
            self.calls = 0

        def gelu_forward(self, out, inp):
            super().gelu_forward(out, inp)
            self.calls += 1
            self.clock += self.cost() * 1e-3

        def timer(self):
            return FakeClock(self)
    return Clocked


def tuning_backend():
    """Tunes itself on real calls, as the CUDA backend's cuBLASLt races do: from its 4th call (1 checked + 2
    warm-up) until settled, a call costs 50 ms instead of 1 ms; settle() drives the race with two reruns."""
    class Tuning(_clocked(CPU)):
        name = "tuning"

        def __init__(self):
            super().__init__()
            self.settled = False
            self.reruns = 0

        def cost(self):
            return 50.0 if self.calls > 3 and not self.settled else 1.0

        def settle(self, rerun=None):
            for _ in range(2 if rerun is not None else 0):
                rerun()
                self.reruns += 1
            self.settled = True
    return Tuning()


def test_bench_settles_a_self_tuning_backend_before_timing():
    be = tuning_backend()
    res = kc.run_kernels([("tuning", be)], CFG, 2, 16, repeat=5, warmup=2, only=["gelu_fwd"])
    (r,) = res["results"]
    assert be.settled and be.reruns == 2
    assert be.calls == 1 + 2 + 2 + 5  # checked once, warm-up, the reruns settle() asked for, timed
    assert r["times_ms"] == pytest.approx([1.0] * 5)


def test_without_settle_the_race_lands_in_the_timed_calls(monkeypatch):
    """The control: the same backend, with settle() not called, puts its 50 ms calls among the timed ones."""
    be = tuning_backend()
    monkeypatch.setattr(type(be), "settle", Backend.settle)
    r = kc.run_kernels([("tuning", be)], CFG, 2, 16, repeat=5, warmup=2, only=["gelu_fwd"])["results"][0]
    assert r["times_ms"] == pytest.approx([50.0] * 5)


def variants_backend():
    """gelu_forward in five implementations: the default (1 ms), "fast" (0.5 ms), "slow" (2 ms), "wrong" (0.1 ms
    but 1% off) and "narrow" (cannot take this shape)."""
    class Variants(_clocked(CPU)):
        name = "variants"
        COST = {None: 1.0, "fast": 0.5, "slow": 2.0, "wrong": 0.1}

        def __init__(self):
            super().__init__()
            self.chosen = None

        def cost(self):
            return self.COST[self.chosen]

        def variants(self, kernel):
            return ["slow", "fast", "wrong", "narrow"] if kernel == "gelu_forward" else []

        @contextmanager
        def variant(self, kernel, name):
            if name is not None and name not in self.variants(kernel):
                raise ValueError(f"no variant {name!r} of {kernel}")
            self.chosen = name
            try:
                yield
            finally:
                self.chosen = None

        def gelu_forward(self, out, inp):
            if self.chosen == "narrow":
                raise VariantUnsupported("needs rows of 1024")
            super().gelu_forward(out, inp)
            if self.chosen == "wrong":
                out *= 1.01
    return Variants()


def test_variants_are_timed_checked_and_the_wrong_one_is_never_the_fastest():
    cpu, be = make_backend("cpu"), variants_backend()
    res = kc.run_kernels([("cpu", cpu), ("variants", be)], CFG, 2, 16, repeat=3, warmup=1, reference=cpu,
                         only=["gelu_fwd", "residual"], variants=True)
    assert res["config"]["variants"] is True
    by = {(r["kernel"], r["backend"]): r for r in res["results"]}
    assert set(by) == {(k, b) for k in ("gelu_fwd", "residual_fwd") for b in ("cpu", "variants")}
    r = by[("gelu_fwd", "variants")]
    assert r["median_ms"] == pytest.approx(1.0) and r["ok"] is True
    rows = {v["variant"]: v for v in r["variants"]}
    assert list(rows) == ["slow", "fast", "wrong", "narrow"]
    assert rows["fast"]["median_ms"] == pytest.approx(0.5) and rows["slow"]["median_ms"] == pytest.approx(2.0)
    assert rows["fast"]["ok"] is True and rows["fast"]["max_rel_err"] < 1e-6
    assert rows["wrong"]["median_ms"] == pytest.approx(0.1) and rows["wrong"]["ok"] is False
    assert rows["wrong"]["max_rel_err"] == pytest.approx(0.01, rel=0.05)
    assert rows["narrow"] == {"variant": "narrow", "skipped": "needs rows of 1024"}
    assert r["fastest"] == "fast"  # not "wrong", though its time is lower
    assert [(m["kernel"], m["backend"], m["variant"]) for m in res["mismatches"]] == [("gelu_fwd", "variants", "wrong")]
    # no variants: the default alone, and the fastest
    for key in (("gelu_fwd", "cpu"), ("residual_fwd", "variants")):
        assert by[key]["variants"] == [] and by[key]["fastest"] == "default"
    # the default, when wrong, is not the fastest either
    assert kc._fastest({"median_ms": 0.1, "ok": False, "variants": [dict(rows["slow"])]}) == "slow"
    assert kc._fastest({"median_ms": 0.1, "ok": False, "variants": []}) is None


def test_without_variants_the_results_keep_their_shape():
    cpu = make_backend("cpu")
    res = kc.run_kernels([("variants", variants_backend())], CFG, 2, 16, repeat=1, warmup=0, reference=cpu,
                         only=["gelu_fwd"])
    (r,) = res["results"]
    assert "variants" not in r and "fastest" not in r and res["mismatches"] == []


def test_every_case_names_a_kernel_of_the_contract():
    from llmc_cli.models.llama3 import preset as llama_preset
    for cfg in (CFG, llama_preset("llama3-tiny", vocab_size=300)):
        for case in kc.kernel_cases(cfg, 2, 16):
            assert callable(getattr(Backend, case.kernel, None)), case.name


def test_the_default_backend_has_no_variants():
    cpu = make_backend("cpu")
    assert cpu.variants("gelu_forward") == []
    with cpu.variant("gelu_forward", None):
        pass
    with pytest.raises(ValueError, match="no variant 'b64' of gelu_forward"):
        with cpu.variant("gelu_forward", "b64"):
            pass


class _VariantsPlugin(BackendPlugin):
    name = "variants"

    def probe(self):
        return True, "the cpu backend with gelu_forward variants (test)"

    def create(self, device=None, dtype=None):
        return variants_backend()


def _with_plugin(monkeypatch):
    real = registry.discover()
    fake = registry.PluginInfo("variants", _VariantsPlugin(), True, "test plugin", "test")
    monkeypatch.setattr(registry, "discover", lambda: real + [fake])


def test_cli_variants_json_with_only(monkeypatch):
    _with_plugin(monkeypatch)
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", "--backend", "variants", *TINY,
                                  "--repeat", "2", "--warmup", "0", "--only", "gelu_fwd", "--variants", "--json"])
    assert r.exit_code == 1, r.output  # the wrong variant is a mismatch
    out = json.loads(r.stdout)
    assert {x["kernel"] for x in out["results"]} == {"gelu_fwd"}
    v = {x["backend"]: x for x in out["results"]}
    assert v["variants"]["fastest"] == "fast" and v["cpu"]["fastest"] == "default"
    assert [x["variant"] for x in v["variants"]["variants"]] == ["slow", "fast", "wrong", "narrow"]
    slow = v["variants"]["variants"][0]
    assert {"median_ms", "min_ms", "max_ms", "times_ms", "gb_s", "max_rel_err", "ok"} <= set(slow)
    assert out["mismatches"] == [{"kernel": "gelu_fwd", "backend": "variants", "variant": "wrong",
                                  "max_rel_err": pytest.approx(0.01, rel=0.05), "tol": 1e-4}]
    assert "gelu_fwd on variants (variant wrong)" in r.stderr


def test_cli_variants_table(monkeypatch):
    _with_plugin(monkeypatch)
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", "--backend", "variants", *TINY,
                                  "--repeat", "2", "--warmup", "0", "--only", "gelu_fwd", "--only", "residual",
                                  "--variants"])
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    row = {w: next(line for line in lines if re.search(rf"│ (\* )?{w} +│", line)) for w in ("fast", "slow", "narrow")}
    assert "* fast" in row["fast"] and "2.00x" in row["fast"]  # the default's 1 ms over its 0.5 ms
    assert "0.50x" in row["slow"] and "n/a: needs rows of 1024" in row["narrow"]
    assert any("wrong" in line and "MISMATCH" in line for line in lines)
    assert sum("residual_fwd" in line for line in lines) == 2  # both backends, the default only
    assert sum("gelu_fwd" in line for line in lines) == 2
    from rich.console import Console
    con = Console(width=200, record=True)
    con.print(report.variants_table({"config": {"n_layer": 1, "n_head": 1, "n_embd": 8, "padded_vocab_size": 8,
                                                "B": 1, "T": 1, "repeat": 1, "warmup": 0}, "results": []}))
    assert "variant" in con.export_text()
