"""The cpu backend's products and attention, run in slices side by side on its pool (products too small to share
BLAS threads well), give what one thread gives and the same bits on every run."""

from __future__ import annotations

import numpy as np
import pytest
from llmc_cpu import SMALL_GEMM_MACS, SPLIT_GEMM_MACS, CpuBackend


def _case(rng, B=12, T=64, C=128, OC=512):
    return {"x": rng.standard_normal((B, T, C), np.float32), "w": rng.standard_normal((OC, C), np.float32) * 0.05,
            "b": rng.standard_normal(OC, np.float32), "g": rng.standard_normal((B, T, OC), np.float32),
            "qkv": rng.standard_normal((B, T, 3 * C), np.float32), "dout": rng.standard_normal((B, T, C), np.float32)}


def _run(be: CpuBackend, c: dict) -> dict:
    B, T, C = c["x"].shape
    OC = c["w"].shape[0]
    out, pre = np.empty((B, T, OC), np.float32), np.empty((B, T, OC), np.float32)
    be.matmul_forward(out, c["x"], c["w"], c["b"], pre_gelu=pre)
    dinp, dw, db = np.zeros((B, T, C), np.float32), np.ones((OC, C), np.float32), np.zeros(OC, np.float32)
    dgelu, dw2, db2 = np.empty((B, T, C), np.float32), np.zeros((C, C), np.float32), np.zeros(C, np.float32)
    be.matmul_backward(dinp, dw, db, c["g"], c["x"], c["w"])
    be.matmul_backward(dgelu, dw2, db2, c["g"][..., :C].copy(), c["x"], c["w"][:C].copy(), pre_gelu=c["x"])
    att, lse = np.empty((B, T, C), np.float32), np.empty((B, 4, T), np.float32)
    be.attention_forward(att, lse, c["qkv"], 4, 4)
    dqkv = np.zeros_like(c["qkv"])
    be.attention_backward(dqkv, c["dout"], c["qkv"], att, lse, 4, 4)
    return {"out": out, "pre": pre, "dinp": dinp, "dw": dw, "db": db, "dgelu": dgelu, "dw2": dw2, "att": att, "lse": lse,
            "dqkv": dqkv}


def test_the_case_is_sliced():
    assert SPLIT_GEMM_MACS <= 12 * 64 * 128 * 512 < SMALL_GEMM_MACS
    assert SPLIT_GEMM_MACS <= 12 * 4 * 64 * 64 * 32 < SMALL_GEMM_MACS


@pytest.mark.parametrize("threads", [2, 3])
def test_slices_match_one_thread_and_repeat_bit_for_bit(threads):
    c = _case(np.random.default_rng(0))
    one = _run(CpuBackend(1), c)
    sliced, again = _run(CpuBackend(threads), c), _run(CpuBackend(threads), c)
    for k in one:
        np.testing.assert_allclose(sliced[k], one[k], rtol=1e-4, atol=1e-4, err_msg=k)
        assert np.array_equal(sliced[k], again[k]), k
