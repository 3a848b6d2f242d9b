"""`--dtype fp8` where the engine sees it: the memory plan, the refusal on backends without FP8 matmuls, the bench's
one backend per dtype, and the classifier's `precise` products. The FP8 kernels themselves are checked by the
conformance kit (fp8_backend) and backends/cuda/tests on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.models.families import family_for, fp8_cast_bytes, memory_plan


@pytest.mark.parametrize("model,B,T", [("d12", 64, 1024), ("llama3.2-1b", 8, 2048)])
def test_fp8_plan_is_bf16_plus_the_cast_scratch(model, B, T):
    fam = family_for(model)
    cfg = fam.preset(model)
    bf, f8 = memory_plan(cfg, B, T, "bfloat16"), memory_plan(cfg, B, T, "fp8")
    casts = f8.pop("FP8 casts")
    assert {k: v for k, v in f8.items()} == bf, "fp8 keeps every engine buffer as bf16 keeps it"
    N, C = B * T, cfg.n_embd
    if model == "d12":  # the fc product's backward needs most: dout^T (N,4C), then dout (N,4C) and W^T (4C,C)
        assert casts == N * 4 * C + N * 4 * C + 4 * C * C
    assert casts == fp8_cast_bytes(fam, cfg, N, True) > fp8_cast_bytes(fam, cfg, N, False)
    r = run("train", "--model", model, "--dry-run", "-b", B, "-t", T, "--dtype", "fp8")
    assert "FP8 casts" in r.output and f"{casts / 2**30:.2f}" in r.output and ", fp8" in r.output


@pytest.mark.parametrize("backend", ["cpu", "opencl"])
def test_fp8_on_a_backend_without_it_is_one_line_and_writes_nothing(backend, tmp_path):
    out = tmp_path / "run"
    one_line_error(run("train", "--backend", backend, "--dtype", "fp8", "--model", "d2", "--data", tmp_path,
                       "--out", out, "--steps", 1, ok=False), f"--backend {backend}", "fp8",
                   "capability")
    assert not out.exists()
    one_line_error(run("bench", "kernels", "--backend", backend, "--dtype", "fp8", "--model", "d2", "-b", 1, "-t",
                       16, ok=False), f"--backend {backend}", "fp8")


def test_bench_runs_each_backend_once_per_dtype(tmp_path):
    import json
    r = run("bench", "kernels", "--backend", "cpu", "--dtype", "fp32", "--dtype", "auto", "--model", "d2", "-b", 1,
            "-t", 16, "--only", "matmul_fwd qkv", "--repeat", 1, "--warmup", 0, "--json")
    res = json.loads(r.output[r.output.index("{"):])
    assert sorted({x["backend"] for x in res["results"]}) == ["cpu auto", "cpu fp32"]


def test_classifier_products_are_precise_only_on_fp8_backends():
    """The engine passes precise=True to the classifier's matmuls on a CAP_FP8 backend (and nothing new to the
    others, whose matmul signatures need not know the keyword)."""
    from llmc_cli.kernels import CAP_FP8
    from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters
    from llmc_cli.registry import create_backend
    be = create_backend("cpu")
    seen = []

    class Spy(type(be)):
        capabilities = be.capabilities | {CAP_FP8}

        def matmul_forward(self, out, inp, weight, bias=None, pre_gelu=None, precise=False):
            seen.append(("fwd", weight.shape, precise))
            super().matmul_forward(out, inp, weight, bias, pre_gelu)

        def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu=None, precise=False):
            seen.append(("bwd", weight.shape, precise))
            super().matmul_backward(dinp, dweight, dbias, dout, inp, weight, pre_gelu)

    spy = Spy()
    cfg = GPT2Config(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=48)
    m = GPT2(cfg, spy, 2, 8)
    m.load_parameters(init_parameters(cfg, 1))
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    m.zero_grad()
    m.forward(x, x, dloss=1 / 16)
    m.backward()
    head = [(k, p) for k, shape, p in seen if shape == (cfg.padded_vocab_size, 48)]
    layers = [p for k, shape, p in seen if shape != (cfg.padded_vocab_size, 48)]
    assert head == [("fwd", True), ("bwd", True)] and layers and not any(layers)
    seen.clear()
    plain = GPT2(cfg, be, 2, 8)  # a backend without CAP_FP8 is called as before
    plain.load_parameters(init_parameters(cfg, 1))
    plain.forward(x, x, dloss=1 / 16)
