"""`--dtype fp8` where the engine sees it: the memory plan, the refusal on backends without FP8 matmuls, the bench's
one backend per dtype, and the classifier's `precise` products. The FP8 kernels themselves are checked by the
conformance kit (fp8_backend) and backends/cuda/tests on a GPU."""

from __future__ import annotations

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
