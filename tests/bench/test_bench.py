"""`llmc bench`: the kernel and training harness on the cpu and OpenCL backends with tiny shapes, a deliberately
wrong kernel flagged as a mismatch, and the CLI plumbing (JSON, plugin injection, --plot without matplotlib)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from llmc_test_support import make_backend, run

from llmc_cli.bench import backends as bench_backends
from llmc_cli.bench import kernel_cases as kc
from llmc_cli.bench import report, train_steps
from llmc_cli import registry
from llmc_cli.commands import main
from llmc_cli.models.gpt2 import preset
from llmc_cli.kernels import BFLOAT16, CAP_KV_CACHE, FLOAT32, BackendPlugin

TINY = ["--model", "d2", "--n-embd", "64", "-b", "2", "-t", "16"]
ALL_KERNELS = {c.name for c in kc.kernel_cases(preset("d2", n_embd=64), 2, 16)}


def _cpu_class():
    return type(make_backend("cpu"))


def _bad_cpu():
    """The cpu backend with gelu_forward 1% too large (the fused matmul+GELU inherits the error)."""
    class OffByOnePercent(_cpu_class()):
        name = "bad"

        def gelu_forward(self, out, inp):
            super().gelu_forward(out, inp)
            out *= 1.01
    return OffByOnePercent()


def _backends(*names):
    return [(n, make_backend(n)) for n in names]


def _sane(r):
    assert r["min_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], r
    assert all(t > 0 for t in r["times_ms"])
    rate = r["tflop_s"] if r["kind"] == "compute" else r["gb_s"]
    assert rate is not None and rate > 0 and math.isfinite(rate), r


@pytest.mark.opencl
def test_kernels_cpu_and_opencl_agree():
    cfg = preset("d2", n_embd=64, vocab_size=1000)
    backends = _backends("cpu", "opencl")
    res = kc.run_kernels(backends, cfg, 2, 16, repeat=2, warmup=1, seed=0,
                            reference=bench_backends.reference_backend(backends))
    names = {c.name for c in kc.kernel_cases(cfg, 2, 16)}
    assert {r["kernel"] for r in res["results"]} == names == ALL_KERNELS
    assert {"matmul_fwd qkv", "matmul_bwd fcproj +gelu'", "matmul_fwd classifier", "attention_bwd", "adamw",
            "global_norm", "classifier_fwd_bwd", "encoder_bwd", "fused_residual_layernorm_fwd"} <= names
    decode = sum(CAP_KV_CACHE in b.capabilities for _, b in backends)  # attention_decode is optional
    assert len(res["results"]) == 2 * (len(names) - 1) + decode
    for r in res["results"]:
        _sane(r)
        if r["backend"] == "cpu":
            assert r["max_rel_err"] == 0.0, r
        else:
            assert r["max_rel_err"] < 1e-4, r
        assert r["ok"] is True
    assert res["mismatches"] == []


def test_wrong_kernel_is_flagged():
    cfg = preset("d2", n_embd=64, vocab_size=1000)
    cpu = make_backend("cpu")
    res = kc.run_kernels([("cpu", cpu), ("bad", _bad_cpu())], cfg, 2, 16, repeat=1, warmup=0,
                            reference=cpu, only=["gelu", "matmul_fwd", "layernorm_fwd"])
    flagged = {(m["kernel"], m["backend"]) for m in res["mismatches"]}
    assert flagged == {("gelu_fwd", "bad"), ("matmul_fwd fc +gelu", "bad")}
    by = {(r["kernel"], r["backend"]): r for r in res["results"]}
    assert by[("gelu_fwd", "bad")]["max_rel_err"] == pytest.approx(0.01, rel=0.05)
    assert by[("gelu_bwd", "bad")]["ok"] and by[("matmul_fwd qkv", "bad")]["ok"]
    table = report.kernels_table(res)
    from rich.console import Console
    con = Console(width=200, record=True)
    con.print(table)
    assert "MISMATCH" in con.export_text()


class _FakePlugin(BackendPlugin):
    name = "bad"

    def probe(self):
        return True, "the cpu backend with a 1% GELU error (test)"

    def create(self, device=None, dtype=None):
        return _bad_cpu()


def test_cli_kernels_json_flags_injected_plugin(monkeypatch):
    real = registry.discover()
    fake = registry.PluginInfo("bad", _FakePlugin(), True, "test plugin", "test")
    monkeypatch.setattr(registry, "discover", lambda: real + [fake])
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", "--backend", "bad", *TINY,
                                  "--repeat", "1", "--warmup", "0", "--only", "gelu", "--json"])
    assert r.exit_code == 1, r.output
    out = json.loads(r.stdout)
    assert [(m["kernel"], m["backend"]) for m in out["mismatches"]] == [("gelu_fwd", "bad")]
    assert out["machine"]["cpu"] and [b["label"] for b in out["machine"]["backends"]] == ["cpu", "bad"]
    assert "differ from the cpu reference" in r.stderr


def test_cli_kernels_table_and_errors(monkeypatch):
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", *TINY, "--repeat", "1", "--warmup", "0",
                                  "--only", "residual", "--only", "attention"])
    assert r.exit_code == 0, r.output
    assert "attention_bwd" in r.stdout and "residual_fwd" in r.stdout and "machine:" in r.stdout
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "nope", *TINY])
    assert r.exit_code == 2 and "--backend nope: not installed" in r.stderr
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", *TINY, "--only", "zzz"])
    assert r.exit_code == 2 and "matches no kernel" in r.stderr
    # --plot without matplotlib fails at once, with one line
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", *TINY, "--plot", "x.png"])
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.stderr and "Traceback" not in r.output


@pytest.mark.opencl
def test_train_cpu_opencl_and_torch():
    """Every backend trains the same model from the same weights on the same data: first losses agree; MFU
    appears only where the backend reports its peak FLOP/s."""
    class Peak(_cpu_class()):
        def peak_flops(self, dtype=None):
            return 1e12

    cfg = preset("d2", n_embd=64)  # the gpt2 vocabulary: the data loader checks shards against it
    res = train_steps.run_train([("cpu", Peak()), ("opencl", make_backend("opencl"))], cfg, 2, 16, steps=1, warmup=1,
                          seed=5, compare=["torch-eager"])
    rs = {r["name"]: r for r in res["results"]}
    assert {"cpu", "opencl"} <= set(rs)
    for r in res["results"]:
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["tok_s"] == pytest.approx(32 / (r["median_ms"] / 1e3))
        assert np.isfinite(r["loss_first"]) and r["loss_first"] == pytest.approx(math.log(50257), rel=0.02)
        assert r["loss_first"] == pytest.approx(rs["cpu"]["loss_first"], rel=1e-4)
    assert rs["cpu"]["mfu"] == pytest.approx(rs["cpu"]["tflop_s"])  # peak 1 TFLOP/s
    assert rs["opencl"]["mfu"] is None
    assert rs["cpu"]["allocated_bytes"] > 0 and rs["cpu"]["host_rss_peak_bytes"] > 0
    try:
        import torch  # noqa: F401
        assert "torch eager" in rs and rs["torch eager"]["loss_last"] == pytest.approx(rs["cpu"]["loss_last"],
                                                                                       rel=1e-3)
        assert rs["torch eager"]["optimizer"] == "AdamW foreach"  # fused is for CUDA
    except ImportError:
        assert any("not installed" in n for n in res["notes"])


def test_cli_train_json(tmp_path):
    from llmc_cli.formats.shards import write_shard
    data = write_shard(tmp_path / "d_train_000000.bin", np.arange(2000) % 50257)
    r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", *TINY, "--steps", "1", "--warmup", "0",
                                  "--data", str(data), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["data"] == str(data) and out["results"][0]["name"] == "cpu"
    assert out["results"][0]["median_ms"] > 0 and out["config"]["flops_per_step"] > 0


def test_cli_train_counts_the_data_waits_of_the_timed_steps(tmp_path):
    from llmc_cli.formats.shards import write_shard
    data = write_shard(tmp_path / "d_train_000000.bin", np.arange(2000) % 50257)
    got = {}
    for flag in ("--prefetch", "--no-prefetch"):
        r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", *TINY, "--steps", "3", "--warmup", "1",
                                      "--data", str(data), "--json", flag])
        assert r.exit_code == 0, r.output
        got[flag] = json.loads(r.stdout)["results"][0]
    assert got["--no-prefetch"]["prefetch"] is False and got["--prefetch"]["prefetch"] is True
    assert (got["--no-prefetch"]["data_waits"], got["--no-prefetch"]["data_batches"]) == (3, 3)
    assert got["--prefetch"]["data_batches"] == 3 and 0 <= got["--prefetch"]["data_waits"] <= 3
    assert got["--prefetch"]["loss_last"] == got["--no-prefetch"]["loss_last"]
    r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", *TINY, "--steps", "2", "--warmup", "0",
                                  "--data", str(data), "--no-prefetch"])
    assert r.exit_code == 0 and "data waits" in r.stdout and "2/2" in r.stdout, r.output


# ---- Llama 3 kernels, attention_decode, and backends that hold inputs in another dtype ------------------------
@pytest.mark.opencl
def test_llama_kernels_cpu_and_opencl_agree_and_a_wrong_rope_is_flagged():
    from llmc_cli.models.llama3 import preset as llama_preset
    cfg = llama_preset("llama3-tiny", vocab_size=300)
    names = {c.name for c in kc.kernel_cases(cfg, 2, 16)}
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd", "attention_fwd",
            "attention_bwd", "attention_decode", "matmul_fwd w13", "matmul_bwd lm_head"} <= names
    assert cfg.n_kv_head < cfg.n_head  # grouped-query attention on the model's real head counts
    backends = _backends("cpu", "opencl")
    res = kc.run_kernels(backends, cfg, 2, 16, repeat=1, warmup=0, reference=backends[0][1])
    got = {(r["kernel"], r["backend"]) for r in res["results"]}
    assert {(n, "cpu") for n in names} <= got and res["mismatches"] == []
    for r in res["results"]:
        _sane(r)

    class BadRope(_cpu_class()):
        name = "badrope"

        def rope_forward(self, qkv, freqs_cis, n_head, n_kv_head):
            super().rope_forward(qkv, -freqs_cis, n_head, n_kv_head)  # rotates the wrong way
    res = kc.run_kernels([("cpu", backends[0][1]), ("badrope", BadRope())], cfg, 2, 16, repeat=1, warmup=0,
                            reference=backends[0][1], only=["rope", "rmsnorm"])
    assert {(m["kernel"], m["backend"]) for m in res["mismatches"]} == {("rope_fwd", "badrope")}


@pytest.mark.opencl
def test_attention_decode_is_benchmarked_where_the_backend_has_it():
    cfg = preset("d2", n_embd=64, vocab_size=1000)
    backends = _backends("cpu", "opencl")
    res = kc.run_kernels(backends, cfg, 2, 16, repeat=1, warmup=0, reference=backends[0][1],
                            only=["attention_decode"])
    for label, be in backends:
        rows = [r for r in res["results"] if r["backend"] == label]
        assert len(rows) == (1 if CAP_KV_CACHE in be.capabilities else 0)
    assert res["results"] and all(r["ok"] for r in res["results"])


def test_reference_gets_the_inputs_from_before_the_call():
    """A backend computing in another dtype is checked against the reference on the inputs it held *before*
    the kernel ran: accumulating (+=) and in-place kernels must not be compared against their own output."""
    class FakeBF16(_cpu_class()):
        name, dtype = "fakebf16", BFLOAT16

        def alloc(self, shape, dtype=FLOAT32, tag="other"):
            return super().alloc(shape, FLOAT32 if dtype == BFLOAT16 else dtype, tag)
    cfg = preset("d2", n_embd=64, vocab_size=1000)
    cpu = make_backend("cpu")
    res = kc.run_kernels([("fakebf16", FakeBF16())], cfg, 2, 16, repeat=1, warmup=0, reference=cpu,
                            only=["layernorm_bwd", "matmul_bwd", "encoder_bwd"])
    assert len(res["results"]) == 7 and res["mismatches"] == []
    assert all(r["max_rel_err"] < 1e-6 for r in res["results"]), [(r["kernel"], r["max_rel_err"])
                                                                   for r in res["results"]]


def test_cli_kernels_llama_model_and_a_bad_llama_shape_is_one_line():
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", "--model", "llama3-tiny", "-b", "1",
                                  "-t", "8", "--vocab-size", "256", "--repeat", "1", "--warmup", "0",
                                  "--only", "rope", "--only", "swiglu", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["family"] == "llama3" and out["config"]["n_kv_head"] == 2
    assert {x["kernel"] for x in out["results"]} == {"rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd"}
    # `bench train` takes Llama models too (tests/bench/test_torch_twins.py); a shape the preset refuses is one line
    r = CliRunner().invoke(main, ["bench", "train", "--backend", "cpu", "--model", "llama3-tiny", "-b", "1",
                                  "-t", "8", "--n-head", "3"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "not a multiple of n_head 3" in r.stderr


# ---- decoding ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,slides", [("d2", False), ("llama3-tiny", True)])
def test_bench_decode_times_inside_and_past_the_window(model, slides):
    r = run("bench", "decode", "--backend", "cpu", "--model", model, "-t", 24, "--prompt-len", 4, "--json")
    res = json.loads(r.stdout)
    (rec,) = res["results"]
    assert res["config"]["window"] == 24 and rec["window_tokens"] == 20 and rec["past_tokens"] == 24
    assert rec["window_tok_s"] > 0 and rec["past_tok_s"] > 0 and rec["slides"] is slides
    assert rec["refills"] == (0 if slides else 2)  # GPT-2 refills from its newest half every 12 tokens


def test_bench_decode_refuses_a_prompt_longer_than_the_window():
    r = run("bench", "decode", "--backend", "cpu", "--model", "d2", "-t", 16, "--prompt-len", 16, ok=False)
    assert r.exit_code == 2 and "--prompt-len 16" in r.output and "Traceback" not in r.output
