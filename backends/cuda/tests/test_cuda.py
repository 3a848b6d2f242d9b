"""CUDA-backend specific checks (the kernel conformance suite in test_kernels.py runs on it too):
NVRTC build and on-disk cache, cuBLASLt epilogue paths vs plain products + own kernels, cuDNN attention vs the
own attention kernels, fp32 kernels vs the CPU backend at 1e-5, bf16 kernels within bf16 bounds, determinism of
the backward kernels, and whole tiny GPT-2 training runs vs the CPU backend.

Everything skips, with the plugin's own reason, where the CUDA backend cannot run."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from cuda_support import cuda_backend, cuda_plugin_info

from llmc_cli.kernels import BFLOAT16, FLOAT32, TF32
from llmc_cli.testing.helpers import rel_err as rel

pytestmark = pytest.mark.cuda


_INFO = cuda_plugin_info()


def cuda(dtype, tf32: bool = False):
    """The backend for `dtype`; float32 multiplies in IEEE fp32 here (checked against the CPU at fp32's bounds)
    unless `tf32` asks for the default TF32 matmuls."""
    return cuda_backend(dtype, {"tf32": "off"} if dtype == FLOAT32 and not tf32 else None)


@pytest.fixture(scope="module")
def cpu():
    from llmc_cpu import CpuBackend
    return CpuBackend()


def up(b, x, dtype=None):
    x = np.asarray(x)
    dt = dtype or ("int32" if np.issubdtype(x.dtype, np.integer) else b.dtype)
    buf = b.alloc(x.shape, dt)
    b.upload(buf, x.astype(np.int32 if dt == "int32" else np.float32))
    return buf


def down(b, buf):
    b.synchronize()
    return np.asarray(b.download(buf), dtype=np.float64)


def held(b, x):
    """What `x` becomes on backend b (bf16 rounding)."""
    return down(b, up(b, np.asarray(x, np.float32)))


def poisoned(b, shape, dtype=None):
    buf = b.alloc(shape, dtype or b.dtype)
    b.fill(buf, math.nan)
    return buf


# =============================================================================================================
# plugin

def test_probe_reports_device():
    if _INFO is None:
        pytest.skip("llmc-cuda is not installed")
    ok, reason = _INFO.plugin.probe()
    assert isinstance(ok, bool) and reason.strip()
    if not ok:
        pytest.skip(f"cuda backend not usable here: {reason}")
    assert "sm_" in reason


# =============================================================================================================
# NVRTC build and cache

def test_nvrtc_build_and_disk_cache(tmp_path):
    """The kernels compile through NVRTC for this device, the cubin lands in CuPy's on-disk cache, and a fresh
    process loads it from there instead of compiling again. Both processes use a cache of this test's own: the
    shared one gains other workers' kernels while the test looks."""
    import subprocess
    import sys
    from llmc_cuda.backend import KERNEL_SOURCE
    b = cuda(BFLOAT16)
    cache = tmp_path / "kernel_cache"
    probe = tmp_path / "llmc_cache_probe.cu"
    probe.write_text(KERNEL_SOURCE.read_text())
    code = ("import sys, time, cupy as cp; src = open(sys.argv[1]).read(); t0 = time.perf_counter(); "
            "cp.RawModule(code=src, options=tuple(sys.argv[2:])).get_function('gelu_forward'); "
            "print(time.perf_counter() - t0)")
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache))
    env.pop("CUPY_CACHE_IN_MEMORY", None)  # (set, CuPy would keep the cubin off the disk)

    def build() -> float:
        out = subprocess.check_output([sys.executable, "-c", code, str(probe), *b.compile_options(True)], env=env)
        return float(out.split()[-1])

    cold = build()
    cached = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} if cache.is_dir() else {}
    assert cached, f"NVRTC output was not cached in {cache}"
    warm = build()
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == cached, \
        "a second process compiled again instead of loading the cached cubin"
    print(f"nvrtc: cold build {cold * 1e3:.0f} ms, another process from the disk cache {warm * 1e3:.1f} ms, "
          f"arch sm_{b.cc}")


# =============================================================================================================
# fp32 kernels vs the CPU backend at 1e-5

def test_fp32_kernels_match_cpu(cpu):
    b = cuda(FLOAT32)
    rng = np.random.default_rng(0)
    B, T, C, OC, NH = 2, 33, 96, 160, 4
    N = B * T
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = (rng.standard_normal((OC, C)) / math.sqrt(C)).astype(np.float32)
    bias = rng.standard_normal(OC).astype(np.float32)
    lw, lb = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    # layernorm
    out_c, m_c, r_c = np.empty_like(x), np.empty(N, np.float32), np.empty(N, np.float32)
    cpu.layernorm_forward(out_c, m_c, r_c, x, lw, lb)
    out_g, m_g, r_g = poisoned(b, x.shape), poisoned(b, N, FLOAT32), poisoned(b, N, FLOAT32)
    b.layernorm_forward(out_g, m_g, r_g, up(b, x), up(b, lw), up(b, lb))
    assert rel(down(b, out_g), out_c) < 1e-5 and rel(down(b, r_g), r_c) < 1e-5
    # matmul with bias and gelu (epilogue path)
    pre_c, o_c = np.empty((B, T, OC), np.float32), np.empty((B, T, OC), np.float32)
    cpu.matmul_forward(o_c, x, w, bias, pre_gelu=pre_c)
    pre_g, o_g = poisoned(b, (B, T, OC)), poisoned(b, (B, T, OC))
    b.matmul_forward(o_g, up(b, x), up(b, w), up(b, bias), pre_gelu=pre_g)
    assert rel(down(b, pre_g), pre_c) < 1e-5
    assert rel(down(b, o_g), o_c) < 1e-5
    # attention (own kernels in fp32)
    W = 3 * C
    qkv = rng.standard_normal((B, T, W)).astype(np.float32)
    ao_c, lse_c = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    cpu.attention_forward(ao_c, lse_c, qkv, NH, NH)
    ao_g, lse_g = poisoned(b, (B, T, C)), poisoned(b, (B, NH, T), FLOAT32)
    b.attention_forward(ao_g, lse_g, up(b, qkv), NH, NH)
    assert rel(down(b, ao_g), ao_c) < 1e-5 and rel(down(b, lse_g), lse_c) < 1e-5
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    d_c = np.empty_like(qkv)
    cpu.attention_backward(d_c, dout, qkv, ao_c, lse_c, NH, NH)
    d_g = poisoned(b, qkv.shape)
    b.attention_backward(d_g, up(b, dout), up(b, qkv), up(b, ao_c), up(b, lse_c), NH, NH)
    assert rel(down(b, d_g), d_c) < 1e-5
    # classifier
    V, Vp = 1000, 1024
    logits = rng.standard_normal((N, Vp)).astype(np.float32) * 3
    tg = rng.integers(0, V, N).astype(np.int32)
    l_c, loss_c = logits.copy(), np.empty(N, np.float32)
    cpu.classifier_forward_backward(l_c, loss_c, tg, V, 1.0 / N)
    l_g, loss_g = up(b, logits), poisoned(b, N, FLOAT32)
    b.classifier_forward_backward(l_g, loss_g, up(b, tg), V, 1.0 / N)
    assert rel(down(b, loss_g), loss_c) < 1e-5 and rel(down(b, l_g), l_c) < 1e-5


# =============================================================================================================
# cuBLASLt epilogues vs plain products + own kernels

@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_cublaslt_epilogues_match_unfused(dtype):
    b = cuda(dtype)
    rng = np.random.default_rng(1)
    B, T, C, OC = 4, 64, 128, 512
    x = held(b, rng.standard_normal((B, T, C)))
    w = held(b, rng.standard_normal((OC, C)) / math.sqrt(C))
    bias = held(b, rng.standard_normal(OC))
    dout = held(b, rng.standard_normal((B, T, C)))
    w2h = held(b, rng.standard_normal((C, OC)) / math.sqrt(OC))
    results = {}
    for fused in (True, False):
        b.use_epilogues = fused
        try:
            pre, out = poisoned(b, (B, T, OC)), poisoned(b, (B, T, OC))
            b.matmul_forward(out, up(b, x), up(b, w), up(b, bias), pre_gelu=pre)
            # backward of the projection that follows: (B,T,OC)->(B,T,C), input gelu(pre)
            w2 = up(b, w2h)
            dinp, dw, db = poisoned(b, (B, T, OC)), up(b, np.zeros((C, OC))), up(b, np.zeros(C))
            b.matmul_backward(dinp, dw, db, up(b, dout), out, w2, pre_gelu=pre)
            results[fused] = [down(b, t) for t in (pre, out, dinp, dw, db)]
        finally:
            b.use_epilogues = True
    tolerance = 1e-5 if dtype == FLOAT32 else 2e-2
    for name, f, u in zip(("pre_gelu", "out", "dinp", "dweight", "dbias"), results[True], results[False]):
        assert np.all(np.isfinite(f)), name
        assert rel(f, u) < tolerance, f"{name}: fused epilogue vs unfused {rel(f, u):.2e}"
    used = [k for k, p in b.lt.plans.items() if p is not None]
    print("cuBLASLt plans with epilogues:", sorted({(k[0], k[5]) for k, p in b.lt.plans.items() if p is not None}))
    assert used, "no cuBLASLt plan was made"


# =============================================================================================================
# cuDNN attention vs own kernels

def test_cudnn_attention_matches_own_kernels():
    b = cuda(BFLOAT16)
    if not b._cudnn_ready():
        pytest.skip(f"cuDNN not available: {b.cudnn_reason}")
    rng = np.random.default_rng(2)
    for (B, T, NH, NKV, hd) in [(2, 128, 4, 4, 64), (1, 70, 4, 2, 32)]:
        W = (NH + 2 * NKV) * hd
        qkv = up(b, rng.standard_normal((B, T, W)))
        out1, lse1 = poisoned(b, (B, T, NH * hd)), poisoned(b, (B, NH, T), FLOAT32)
        b.attention_forward(out1, lse1, qkv, NH, NKV)
        assert b.attention_path[("fwd", B, T, NH, NKV, hd)] == "cudnn", b._cudnn.failed
        out2, lse2 = poisoned(b, (B, T, NH * hd)), poisoned(b, (B, NH, T), FLOAT32)
        b.attention_forward_own(out2, lse2, qkv, NH, NKV)
        assert rel(down(b, out1), down(b, out2)) < 1e-2
        assert rel(down(b, lse1), down(b, lse2)) < 1e-3
        dout = up(b, rng.standard_normal((B, T, NH * hd)))
        d1, d2 = poisoned(b, (B, T, W)), poisoned(b, (B, T, W))
        b.attention_backward(d1, dout, qkv, out2, lse2, NH, NKV)
        assert b.attention_path[("bwd", B, T, NH, NKV, hd)] == "cudnn", b._cudnn.failed
        b.attention_backward_own(d2, dout, qkv, out2, lse2, NH, NKV)
        assert rel(down(b, d1), down(b, d2)) < 2e-2


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_tiled_attention_matches_the_reference_kernels(dtype):
    """The tiled kernels (head sizes 64, 128) against the one-warp-per-row reference kernels: ragged T (a partial
    last tile, T < 64), grouped-query heads; the same bits on a second call."""
    b = cuda(dtype)
    rng = np.random.default_rng(4)
    bound = 1e-5 if dtype == FLOAT32 else 2e-2
    for (B, T, NH, NKV, hd) in [(2, 100, 4, 4, 64), (1, 64, 2, 2, 128), (2, 200, 8, 2, 64), (1, 17, 2, 1, 128),
                                (1, 130, 6, 3, 64)]:
        assert b._tiled(hd, 0) and b._tiled(hd, 1) and b._tiled(hd, 2)
        W = (NH + 2 * NKV) * hd
        qkv = up(b, rng.standard_normal((B, T, W)))
        dout = up(b, rng.standard_normal((B, T, NH * hd)))
        scale = np.float32(1.0 / np.sqrt(hd))
        dims = (np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV), np.int32(hd), scale)
        out_r, lse_r = poisoned(b, (B, T, NH * hd)), poisoned(b, (B, NH, T), FLOAT32)
        b._att_launch("attention_forward_ref", B * NH * T, T, (out_r, lse_r, qkv) + dims, out_r)
        d_r = poisoned(b, (B, T, W))
        D = b.scratch("test_D", B * NH * T)
        b._att_launch("attention_backward_dq_ref", B * NH * T, T, (d_r, D, dout, qkv, out_r, lse_r) + dims, d_r)
        b._att_launch("attention_backward_dkv_ref", B * NKV * T, 2 * T, (d_r, D, dout, qkv, lse_r) + dims, d_r)
        runs = []
        for _ in range(2):
            out, lse, d = poisoned(b, (B, T, NH * hd)), poisoned(b, (B, NH, T), FLOAT32), poisoned(b, (B, T, W))
            b.attention_forward_own(out, lse, qkv, NH, NKV)
            b.attention_backward_own(d, dout, qkv, out_r, lse_r, NH, NKV)
            runs.append([down(b, x) for x in (out, lse, d)])
        what = f"B={B} T={T} NH={NH} NKV={NKV} hd={hd}"
        assert rel(runs[0][0], down(b, out_r)) < bound, what
        assert rel(runs[0][1], down(b, lse_r)) < 1e-5, what
        assert rel(runs[0][2], down(b, d_r)) < bound * 2, what
        for x, y in zip(*runs):
            np.testing.assert_array_equal(x, y, what)


@pytest.mark.parametrize("B,NH,NKV", [(4, 4, 2), (1, 8, 2), (3, 4, 4)])
def test_cudnn_attention_backward_in_batch_slices_is_exact(B, NH, NKV):
    """A workspace limit that forces one sequence and one key/value head (with its query heads) per cuDNN call
    gives the bits of the whole-batch call."""
    b = cuda(BFLOAT16)
    if not b._cudnn_ready():
        pytest.skip(f"cuDNN not available: {b.cudnn_reason}")
    rng = np.random.default_rng(3)
    T, hd = 96, 64
    W = (NH + 2 * NKV) * hd
    qkv = up(b, rng.standard_normal((B, T, W)))
    out, lse = poisoned(b, (B, T, NH * hd)), poisoned(b, (B, NH, T), FLOAT32)
    b.attention_forward(out, lse, qkv, NH, NKV)
    dout = up(b, rng.standard_normal((B, T, NH * hd)))
    att = b._cudnn
    whole = poisoned(b, (B, T, W))
    b.attention_backward(whole, dout, qkv, out, lse, NH, NKV)
    assert att.bwd_slices[(B, T, NH, NKV, hd)][1:] == (B, NKV)
    limit, att.bwd_workspace_max = att.bwd_workspace_max, -1
    try:
        att.bwd_slices.clear()
        sliced = poisoned(b, (B, T, W))
        b.attention_backward(sliced, dout, qkv, out, lse, NH, NKV)
        assert att.bwd_slices[(B, T, NH, NKV, hd)][1:] == (1, 1), att.failed
    finally:
        att.bwd_workspace_max = limit
        att.bwd_slices.clear()
    np.testing.assert_array_equal(down(b, sliced), down(b, whole))


@pytest.mark.parametrize("B,T,NH,NKV,hd", [(1, 64, 4, 4, 16), (2, 96, 4, 2, 64), (1, 100, 4, 4, 32),
                                           (3, 1024, 12, 12, 64), (1, 2048, 32, 8, 64), (1, 8192, 32, 8, 128),
                                           (2, 320, 25, 25, 64)])
def test_planned_attention_workspace_is_what_cudnn_asks_for(B, T, NH, NKV, hd):
    """--dry-run plans cuDNN's attention backward workspace without a device (attention_backward_workspace): the
    bytes are the ones cuDNN's deterministic backward asks for, and the backend's default cap (1/32 of the device)
    runs Llama 3.1 8B's T=8192 sequence whole on a GPU of 139 GiB or more."""
    from llmc_cuda import CUDNN_WORKSPACE_SHARE, attention_backward_workspace
    b = cuda(BFLOAT16)
    if not b._cudnn_ready():
        pytest.skip(f"cuDNN not available: {b.cudnn_reason}")
    g = b._cudnn.graph("bwd", B, T, NH, NKV, hd)
    assert g is not None, b._cudnn.failed
    assert attention_backward_workspace(B, T, NH, NKV, hd) == g.get_workspace_size(), g.get_workspace_size()
    assert b.cudnn_workspace == b.props["totalGlobalMem"] // CUDNN_WORKSPACE_SHARE
    if b.props["totalGlobalMem"] >= 139 << 30:
        assert attention_backward_workspace(1, 8192, 32, 8, 128) <= b.cudnn_workspace


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_attention_decode_ignores_what_its_scratch_held(dtype):
    """The decode's key splits past a row's last key write their (empty) partial in full: a scratch that held NaN
    from earlier work gives the bits of a clean one (a chunk of 64 queries at position 130 of a 300-slot ring:
    the early rows see 3 of 5 splits)."""
    b = cuda(dtype)
    rng = np.random.default_rng(3)
    B, NH, NKV, hd, S, pos, Tn = 1, 8, 2, 64, 300, 130, 64
    qkv = rng.standard_normal((B, Tn, (NH + 2 * NKV) * hd)).astype(np.float32)
    cache = rng.standard_normal((B, NKV, S, hd)).astype(np.float32)
    outs = []
    for stale in (0.0, math.nan):
        b.fill(b.scratch("att_decode", B * NH * Tn * 5 * (hd + 2)), stale)
        k, v, out = up(b, cache), up(b, cache[:, ::-1].copy()), b.alloc((B, Tn, NH * hd), b.dtype)
        b.attention_decode(out, up(b, qkv), k, v, pos, NH, NKV)
        outs.append(down(b, out))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[1], outs[0])


# =============================================================================================================
# bf16 kernels vs the CPU backend (fp32) within bf16 bounds

def test_bf16_kernels_within_bounds(cpu):
    b = cuda(BFLOAT16)
    rng = np.random.default_rng(3)
    B, T, C, OC = 4, 64, 256, 768
    N = B * T
    x = held(b, rng.standard_normal((B, T, C))).astype(np.float32)
    w = held(b, rng.standard_normal((OC, C)) / math.sqrt(C)).astype(np.float32)
    bias = held(b, rng.standard_normal(OC)).astype(np.float32)
    o_c = np.empty((B, T, OC), np.float32)
    cpu.matmul_forward(o_c, x, w, bias)
    o_g = poisoned(b, (B, T, OC))
    b.matmul_forward(o_g, up(b, x), up(b, w), up(b, bias))
    assert rel(down(b, o_g), o_c) < 1e-2
    lw, lb = held(b, rng.standard_normal(C)).astype(np.float32), held(b, rng.standard_normal(C)).astype(np.float32)
    ln_c, m_c, r_c = np.empty_like(x), np.empty(N, np.float32), np.empty(N, np.float32)
    cpu.layernorm_forward(ln_c, m_c, r_c, x, lw, lb)
    ln_g, m_g, r_g = poisoned(b, x.shape), poisoned(b, N, FLOAT32), poisoned(b, N, FLOAT32)
    b.layernorm_forward(ln_g, m_g, r_g, up(b, x), up(b, lw), up(b, lb))
    assert rel(down(b, ln_g), ln_c) < 1e-2 and rel(down(b, r_g), r_c) < 1e-5
    V, Vp = 50257, 50304
    logits = held(b, rng.standard_normal((64, Vp)) * 2).astype(np.float32)
    tg = rng.integers(0, V, 64).astype(np.int32)
    l_c, loss_c = logits.copy(), np.empty(64, np.float32)
    cpu.classifier_forward_backward(l_c, loss_c, tg, V, 1.0 / 64)
    l_g, loss_g = up(b, logits), poisoned(b, 64, FLOAT32)
    b.classifier_forward_backward(l_g, loss_g, up(b, tg), V, 1.0 / 64)
    assert rel(down(b, loss_g), loss_c) < 1e-4
    assert rel(down(b, l_g), l_c) < 1e-2


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_cublaslt_tuner_keeps_the_heuristic_bits(dtype):
    """The tuned algorithm choice computes the bits of the heuristic's first algorithm, for every epilogue."""
    b = cuda(dtype)
    rng = np.random.default_rng(5)
    N, C, OC = 2048, 768, 2304
    x, w = up(b, rng.standard_normal((N, C))), up(b, rng.standard_normal((OC, C)) / math.sqrt(C))
    bias, dout = up(b, rng.standard_normal(OC)), up(b, rng.standard_normal((N, OC)))
    g_in = up(b, rng.standard_normal((N, C)))

    def products():
        out, pre = poisoned(b, (N, OC)), poisoned(b, (N, OC))
        b.matmul_forward(out, x, w, bias, pre_gelu=pre)
        out2 = poisoned(b, (N, OC))
        b.matmul_forward(out2, x, w, bias)
        dinp, dw, db = poisoned(b, (N, C)), up(b, np.full((OC, C), 0.5)), up(b, np.full(OC, 0.25))
        b.matmul_backward(dinp, dw, db, dout, x, w)
        dinp2 = poisoned(b, (N, C))
        b.matmul_backward(dinp2, dw, db, dout, x, w, pre_gelu=g_in)  # accumulates a second time
        return [down(b, t) for t in (out, pre, out2, dinp, dinp2, dw, db)]

    lt = b.lt
    saved = lt.plans, lt.tune, lt.candidates, dict(lt.tuning), lt.tune_after, lt.decisions, lt.on_decided, \
        lt.check_spacing
    try:
        lt.plans, lt.tune, lt.candidates = {}, False, 1
        want = products()
        # a race from scratch (no decisions from earlier runs, none written to the cache), checks back to back
        lt.plans, lt.tune, lt.candidates, lt.tune_after = {}, True, 8, 0
        lt.decisions, lt.on_decided, lt.check_spacing = {}, None, 0
        lt.tuning.clear()
        runs = []
        for _ in range(40):  # every call of the race (each candidate in turn), then the kept one
            runs.append(products())
            if all(p is None or p.tuned for p in lt.plans.values()):
                break
        runs.append(products())
        assert all(p is None or p.tuned for p in lt.plans.values()), "the race did not finish"
        assert any(sum(r[2] for r in rows) > 1 for rows in lt.tuning.values()), "no product had a second candidate"
        assert lt.decisions, "the race's decisions were not kept"
        raced = {k: p.choice for k, p in lt.plans.items() if p is not None}
        for p in lt.plans.values():  # a decision is kept as the pick's config, which must tell candidates apart
            if p is not None:
                configs = [p.config(i) for i in range(p.count)]
                assert all(c[0] >= 0 for c in configs), f"unreadable algorithm ids {configs}"
                assert p.count < 2 or len(set(configs)) > 1, f"every candidate has the same config: {configs}"
        kept = [k for k in raced if repr(k) in lt.decisions]
        assert kept, "no decision names its candidate alone"
        # a later run with those decisions takes them at its first call: the very candidates the race picked (a
        # decision that brought back the heuristic's first would cost the run what the race won), same bits
        lt.plans = {}
        runs.append(products())
        assert all(lt.plans[k].tuned for k in kept), "a kept decision was not taken"
        assert {k: lt.plans[k].choice for k in kept} == {k: raced[k] for k in kept}, "a decision came back changed"
    finally:
        lt.plans, lt.tune, lt.candidates = saved[:3]
        lt.tuning.clear()
        lt.tuning.update(saved[3])
        lt.tune_after, lt.decisions, lt.on_decided, lt.check_spacing = saved[4:]
    for got in runs:
        for g, wnt in zip(got, want):
            np.testing.assert_array_equal(g, wnt)


def test_cublaslt_tuner_races_only_candidates_that_sum_in_the_first_ones_order():
    """A match on one call's operands does not make a candidate the heuristic's first's equal: FP8's sums are often
    exact, so a candidate that splits the sum over k otherwise (split-K) matches by chance and differs on the next
    call's operands (backends/cuda/bench/tuner_identity.py found such values in d12's FP8 weight gradients). On zero
    operands, where every candidate matches, the race still admits only the candidates summing in the first's
    order, and a decision on disk naming another is raced again, not taken."""
    import cupy as cp
    b = cuda("fp8")  # (skips where FP8 cannot run)
    lt = b.lt
    N, C, OC = 16384, 768, 768  # (H200: the heuristic's first splits k in three, others in one, two or four)
    a8, g8 = cp.zeros(C * N, dtype=cp.uint8), cp.zeros(OC * N, dtype=cp.uint8)
    dw, scales = cp.zeros(OC * C, dtype=cp.uint16), cp.ones(128, dtype=cp.float32)
    cp.cuda.Device().synchronize()  # (written on CuPy's stream, read on the backend's)
    saved = lt.plans, lt.tune, lt.candidates, lt.tune_after, lt.decisions, lt.on_decided, dict(lt.tuning)
    try:
        lt.plans, lt.tune, lt.candidates, lt.tune_after, lt.decisions, lt.on_decided = {}, True, 8, 10**9, {}, None

        def product():  # (a race never starts: tune_after)
            assert lt.backward_weight_fp8(dw.data.ptr, g8.data.ptr, a8.data.ptr, N, C, OC, b.stream.ptr,
                                          (scales.data.ptr, scales.data.ptr + 256))  # (aligned as the slots)
            return next(p for k, p in lt.plans.items() if k[0] == "bwd_w8")
        plan = product()
        other = [i for i in range(plan.count) if not plan.same_order(i) and plan.only(plan.config(i)) == i]
        if not other:  # (the case needs one: H200s offer three)
            configs = [plan.config(i) for i in range(plan.count)]
            pytest.skip(f"this GPU's heuristic splits k one way only here: {configs}")
        admitted = lt._identical(plan, plan.last, True, 0, 0, ())
        assert admitted and all(plan.same_order(i) for i in admitted), admitted
        lt.decisions = {repr(plan.key): list(plan.config(other[0]))}
        lt.plans = {}
        assert not product().tuned, "a decision for a candidate summing in another order was taken"
    finally:
        lt.plans, lt.tune, lt.candidates, lt.tune_after, lt.decisions, lt.on_decided = saved[:6]
        lt.tuning.clear()
        lt.tuning.update(saved[6])


# =============================================================================================================
# determinism of backward kernels

def test_bits_signature_tells_outputs_apart_by_place_and_value():
    """The cuBLASLt tuner's bit signature (CublasLt._identical): the same words sign alike whatever the grid; one
    word an ulp off signs otherwise, and so do two neighbouring values trading places, which sums of the words and of
    their squares would miss."""
    import cupy as cp
    b = cuda(BFLOAT16)
    words = np.random.default_rng(11).integers(0, 1 << 16, 100_000).astype(np.uint16)

    def sign(w, blocks=64):
        out = cp.zeros(2, dtype=cp.uint64)
        b._signature((blocks,), (256,), (out, cp.asarray(w), np.int64(w.size), np.int32(0)))
        return tuple(int(v) for v in cp.asnumpy(out))
    i, j = 10, 50_000
    words[i], words[j] = 0x3f80, 0x3f81  # (neighbouring bf16 values: 1.0 and the next)
    swapped, off = words.copy(), words.copy()
    swapped[i], swapped[j] = words[j], words[i]
    off[i] += 1
    assert sign(words) == sign(words, blocks=1) == sign(words.copy(), blocks=7)
    assert sign(swapped) != sign(words) and sign(off) != sign(words)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_backward_kernels_bit_identical(dtype):
    b = cuda(dtype)
    rng = np.random.default_rng(4)
    B, T, C, NH, Vp = 4, 128, 128, 4, 512
    N = B * T
    inp = up(b, rng.integers(0, 20, (B, T)).astype(np.int32))  # many repeated tokens
    dout = up(b, rng.standard_normal((B, T, C)))
    x = up(b, rng.standard_normal((B, T, C)))
    lw = up(b, rng.standard_normal(C))
    mean, rstd, ln = b.alloc(N, FLOAT32), b.alloc(N, FLOAT32), b.alloc((B, T, C), b.dtype)
    b.layernorm_forward(ln, mean, rstd, x, lw, lw)
    W = 3 * C
    qkv = up(b, rng.standard_normal((B, T, W)))
    ao, lse = b.alloc((B, T, C), b.dtype), b.alloc((B, NH, T), FLOAT32)
    b.attention_forward(ao, lse, qkv, NH, NH)
    w = up(b, rng.standard_normal((W, C)) / math.sqrt(C))
    dqkv_in = up(b, rng.standard_normal((B, T, W)))

    def run():
        dwte, dwpe = up(b, np.zeros((Vp, C))), up(b, np.zeros((T, C)))
        b.encoder_backward(dwte, dwpe, dout, inp)
        dinp, dw, db = up(b, np.zeros((B, T, C))), up(b, np.zeros(C)), up(b, np.zeros(C))
        b.layernorm_backward(dinp, dw, db, dout, x, lw, mean, rstd)
        dqkv = poisoned(b, (B, T, W))
        b.attention_backward(dqkv, dout, qkv, ao, lse, NH, NH)
        mi, mw, mb = poisoned(b, (B, T, C)), up(b, np.zeros((W, C))), up(b, np.zeros(W))
        b.matmul_backward(mi, mw, mb, dqkv_in, x, w)
        norm = b.alloc(1, FLOAT32)
        b.global_norm_squared(norm, [mw, mb, dwte])
        return [down(b, t) for t in (dwte, dwpe, dinp, dw, db, dqkv, mi, mw, mb, norm)]

    r1, r2 = run(), run()
    for name, a1, a2 in zip(("dwte", "dwpe", "ln dinp", "ln dw", "ln db", "dqkv", "mm dinp", "mm dw", "mm db",
                             "norm"), r1, r2):
        assert np.all(np.isfinite(a1)), name
        assert np.array_equal(a1, a2), f"{name} differs between two identical runs"


# =============================================================================================================
# whole tiny GPT-2 vs the CPU backend

def _train(backend, steps=10):
    from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters
    from llmc_cli.optim import AdamW, AdamWConfig
    cfg = GPT2Config(block_size=64, vocab_size=250, n_layer=2, n_head=4, n_embd=64)
    B, T = 4, 32
    model = GPT2(cfg, backend, B, T)
    flat = init_parameters(cfg, 7)
    model.load_parameters(flat)
    ocfg = AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    opt = AdamW(backend, model.params, model.grads, model.tensor_names(), ocfg)
    opt.sync_master_from_params()
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
             rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)) for _ in range(3)]
    losses, norms = [], []
    for s in range(steps):
        x, y = data[s % 3]
        model.zero_grad()
        model.forward(x, y, dloss=1.0 / (B * T))
        model.backward()
        losses.append(model.mean_loss())
        n = opt.grad_norm()
        norms.append(n)
        opt.step(ocfg.lr, n, seed=s)
    return np.array(losses), np.array(norms)


def test_tiny_gpt2_fp32_matches_cpu(cpu):
    b = cuda(FLOAT32)
    lc, nc = _train(cpu)
    lg, ng = _train(b)
    print("cpu ", lc, "\ncuda", lg)
    np.testing.assert_allclose(lg, lc, rtol=1e-4)
    np.testing.assert_allclose(ng, nc, rtol=1e-2)


def test_tiny_gpt2_tf32_close_to_cpu_and_deterministic(cpu):
    """fp32 with TF32 matmuls (the default): close to the CPU's IEEE fp32 run, and the same bits twice."""
    b = cuda(FLOAT32, tf32=True)
    assert b.matmul_dtype == TF32
    lc, nc = _train(cpu)
    lg, ng = _train(b)
    print("cpu ", lc, "\ntf32", lg)
    np.testing.assert_allclose(lg, lc, rtol=2e-3)
    np.testing.assert_allclose(ng, nc, rtol=3e-2)
    l2, _ = _train(b)
    assert np.array_equal(lg, l2), "tf32 training is not deterministic"


def test_tiny_gpt2_bf16_close_to_cpu(cpu):
    b = cuda(BFLOAT16)
    lc, nc = _train(cpu)
    lg, ng = _train(b)
    print("cpu ", lc, "\nbf16", lg)
    np.testing.assert_allclose(lg, lc, atol=2e-2)
    np.testing.assert_allclose(ng, nc, rtol=5e-2)
    l2, n2 = _train(b)
    assert np.array_equal(lg, l2), "bf16 training is not deterministic"


# =============================================================================================================
# FP8 matmuls (--dtype fp8)

def _fp8_held(x, e5m2=False, amax=None):
    """What the backend's cast makes of `x` (float64 values held in bf16), dequantized: float32 scale = largest
    finite / amax (x's own, current scaling, unless given), round to nearest even in e4m3 / e5m2 saturating at the
    largest finite, times the float32 inverse."""
    import ml_dtypes
    x32 = np.asarray(x, dtype=np.float32)
    amax = np.float32(np.abs(x32).max() if amax is None else amax)
    top = np.float32(57344.0 if e5m2 else 448.0)
    s = np.float32(57344.0 if e5m2 else 448.0) / amax if amax > 0 else np.float32(1.0)
    s = np.minimum(s, np.float32(3.0e38))
    q = np.clip(x32 * s, -top, top).astype(ml_dtypes.float8_e5m2 if e5m2 else ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * np.float64(np.float32(1.0) / s)


def test_fp8_dgelu_product_runs_in_bf16_unless_fp8_dgelu_is_on():
    """Under --dtype fp8 the forward fused with GELU runs in FP8 like any product, but the product fused with
    GELU's derivative runs in bf16 by default (fp8_dgelu=off: in FP8 it cost more than it saved,
    docs/performance.md): the bf16 backend's dinp bits exactly, while the weight gradient beside it is FP8's.
    With fp8_dgelu=on both run in FP8: other bits, within FP8's error."""
    cuda("fp8")  # (skips where FP8 cannot run)
    rng = np.random.default_rng(4)
    N, C, OC = 256, 128, 512
    x, w = rng.standard_normal((N, C)), rng.standard_normal((OC, C)) / math.sqrt(C)
    bias, dout = rng.standard_normal(OC), rng.standard_normal((N, C)) * 1e-2
    w2, pre_h = rng.standard_normal((C, OC)) / math.sqrt(OC), rng.standard_normal((N, OC))
    fwd, bwd = {}, {}
    for name, b in (("bf16", cuda(BFLOAT16)), ("fp8", _INFO.plugin.create(dtype="fp8")),
                    ("fp8_dgelu", _INFO.plugin.create(dtype="fp8", options={"fp8_dgelu": "on"}))):
        pre, out = poisoned(b, (N, OC)), poisoned(b, (N, OC))
        b.matmul_forward(out, up(b, x), up(b, w), up(b, bias), pre_gelu=pre)
        fwd[name] = [down(b, t) for t in (pre, out)]
        dinp, dw, pre_in = poisoned(b, (N, OC)), up(b, np.zeros((C, OC))), up(b, pre_h)
        b.matmul_backward(dinp, dw, None, up(b, dout), up(b, np.tanh(pre_h)), up(b, w2), pre_gelu=pre_in)
        bwd[name] = [down(b, t) for t in (dinp, dw)]
    for name in ("fp8", "fp8_dgelu"):  # the forward: FP8 either way
        for got, want in zip(fwd[name], fwd["bf16"]):
            assert np.all(np.isfinite(got)) and 0 < rel(got, want) < 0.1, (name, rel(got, want))
    np.testing.assert_array_equal(bwd["fp8"][0], bwd["bf16"][0])
    assert np.all(np.isfinite(bwd["fp8"][1])) and 0 < rel(bwd["fp8"][1], bwd["bf16"][1]) < 0.1
    for got, want in zip(bwd["fp8_dgelu"], bwd["bf16"]):
        assert np.all(np.isfinite(got)) and 0 < rel(got, want) < 0.1, rel(got, want)


@pytest.mark.parametrize("T", [64, 40])  # (40: rows that end in a part of a 64-row tile)
def test_fp8_matmuls_compute_the_cast_operands(T):
    """The three products against float64 products of the operands cast as the backend casts them: close to
    that (bf16 output rounding, fp32 accumulation), and far from the uncast product, so FP8 really ran. The bias
    gradient (summed by the gradient's cast) is the bf16 sum of the uncast gradient, added to what it held."""
    b = cuda("fp8")
    rng = np.random.default_rng(3)
    B, C, OC = 2, 256, 192
    x = held(b, rng.standard_normal((B, T, C)))
    w = held(b, rng.standard_normal((OC, C)) / math.sqrt(C))
    dout = held(b, rng.standard_normal((B, T, OC)) * 1e-2)
    out = poisoned(b, (B, T, OC))
    b.matmul_forward(out, up(b, x), up(b, w))
    dinp, dw, db = poisoned(b, (B, T, C)), up(b, np.zeros((OC, C))), up(b, np.full(OC, 0.25))
    b.matmul_backward(dinp, dw, db, up(b, dout), up(b, x), up(b, w))
    e_db = rel(down(b, db), 0.25 + dout.reshape(-1, OC).sum(0))
    assert e_db < 1e-2, f"dbias: {e_db:.2e}"
    xq, wq, dq = _fp8_held(x), _fp8_held(w), _fp8_held(dout, e5m2=True)
    for name, got, cast, exact in (
            ("out", down(b, out), xq @ wq.T, x @ w.T),
            ("dinp", down(b, dinp), dq @ wq, dout @ w),
            ("dweight", down(b, dw), dq.reshape(-1, OC).T @ xq.reshape(-1, C),
             dout.reshape(-1, OC).T @ x.reshape(-1, C))):
        e_cast, e_exact = rel(got, cast), rel(got, exact)
        print(f"{name}: vs cast operands {e_cast:.2e}, vs exact {e_exact:.2e}")
        assert e_cast < 6e-3, f"{name}: {e_cast:.2e} from the FP8 product of the cast operands"
        assert e_exact > 1e-2, f"{name}: {e_exact:.2e} from the exact product: was it FP8 at all?"
    assert any(k[0] == "fwd8" for k, p in b.lt.plans.items() if p is not None), "no FP8 cuBLASLt plan"


def _train_llama(backend, steps=6):
    from llmc_cli.models.llama3 import Llama3, Llama3Config, init_parameters
    from llmc_cli.optim import AdamW, AdamWConfig
    cfg = Llama3Config(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       ffn_dim_multiplier=1.0, multiple_of=32)
    B, T = 4, 32
    model = Llama3(cfg, backend, B, T)
    model.load_parameters(init_parameters(cfg, 7))
    ocfg = AdamWConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    opt = AdamW(backend, model.params, model.grads, model.tensor_names(), ocfg)
    opt.sync_master_from_params()
    rng = np.random.default_rng(0)
    losses = []
    for s in range(steps):
        x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        model.zero_grad()
        model.forward(x, np.roll(x, -1, axis=1), dloss=1.0 / (B * T))
        model.backward()
        losses.append(model.mean_loss())
        opt.step(ocfg.lr, opt.grad_norm(), seed=s)
    return np.array(losses)


def test_tiny_models_train_in_fp8_close_to_bf16_and_deterministic():
    f8, bf = cuda("fp8"), cuda(BFLOAT16)
    lg8, ng8 = _train(f8)
    lgb, _ = _train(bf)
    print("bf16", lgb, "\nfp8 ", lg8)
    assert np.isfinite(lg8).all() and np.isfinite(ng8).all()
    np.testing.assert_allclose(lg8, lgb, atol=5e-2)
    l2, _ = _train(f8)
    assert np.array_equal(lg8, l2), "fp8 training is not deterministic"
    ll8, llb = _train_llama(f8), _train_llama(bf)
    print("llama bf16", llb, "\nllama fp8 ", ll8)
    np.testing.assert_allclose(ll8, llb, atol=5e-2)
    assert np.array_equal(ll8, _train_llama(f8)), "fp8 Llama training is not deterministic"


def test_fp8_delayed_scaling_casts_by_the_history_and_carries_it():
    """fp8_scaling=delayed: a tensor's first step casts by its own amax; later steps by the largest amax of the
    earlier steps (values past it saturate), the step's own amax recorded by the cast; calls between steps neither
    record nor roll. The history goes through carried_state into a new backend, which then computes the same bits."""
    if _INFO is None or not _INFO.usable:
        cuda("fp8")  # (skips with the reason)
    b = _INFO.plugin.create(dtype="fp8", options={"fp8_scaling": "delayed"})
    rng = np.random.default_rng(5)
    B, T, C, OC = 2, 64, 256, 192
    w = held(b, rng.standard_normal((OC, C)) / math.sqrt(C))
    xs = [held(b, rng.standard_normal((B, T, C)) * f) for f in (1.0, 0.5, 3.0, 1.0)]
    dout = held(b, rng.standard_normal((B, T, OC)) * 1e-2)
    W = up(b, w)
    amax_w = np.abs(w).max()

    def step(x, train=True):
        out = poisoned(b, (B, T, OC))
        if train:
            b.begin_step()
        b.matmul_forward(out, up(b, x), W)
        if train:
            dinp, dw = poisoned(b, (B, T, C)), up(b, np.zeros((OC, C)))
            b.matmul_backward(dinp, dw, None, up(b, dout), up(b, x), W)
            b.end_step()
        return down(b, out)

    amaxes = []
    for i, x in enumerate(xs):
        want = _fp8_held(x, amax=max(amaxes) if amaxes else None) @ _fp8_held(w, amax=amax_w).T
        e = rel(step(x), want)
        assert e < 6e-3, f"step {i}: {e:.2e} from the product cast by the history"
        amaxes.append(np.abs(x).max())
        if i == 1:  # an evaluation between steps: cast by the history, and nothing recorded
            big = xs[2] * 10
            got = step(big, train=False)
            assert rel(got, _fp8_held(big, amax=max(amaxes)) @ _fp8_held(w, amax=amax_w).T) < 6e-3
    state = b.carried_state()
    hist = state["fp8_amax_history"]
    assert len(hist) == 3 and all(len(h) == 16 for h in hist)  # x, w, dout of the one weight
    assert hist[0][:4] == [float(np.float32(a)) for a in amaxes[::-1]] and hist[0][4:] == [0.0] * 12
    assert state["fp8_sites"] == ["x 192x256", "w 192x256", "dout 192x256"]  # (role, then the weight's OC x C)
    json.loads(json.dumps(state))  # (JSON-able; floats exact)
    again = _INFO.plugin.create(dtype="fp8", options={"fp8_scaling": "delayed"})
    again.load_carried_state(json.loads(json.dumps(state)))
    x = xs[1]
    outs = []
    for be in (b, again):
        out = poisoned(be, (B, T, OC))
        be.begin_step()
        be.matmul_forward(out, up(be, x), up(be, w) if be is again else W)
        outs.append(down(be, out))
    assert np.array_equal(outs[0], outs[1]), "a loaded history must scale as the original"
    for bad in ({"fp8_amax_history": [[1.0] * 15]}, {"fp8_amax_history": [[float("nan")] * 16]},
                {"fp8_amax_history": "x"}, {"fp8_amax_history": [["a"] * 16]}):
        with pytest.raises(ValueError, match="fp8_amax_history"):
            again.load_carried_state(bad)
    for names in (["a", "b"], [3], "x 192x256", None):
        with pytest.raises(ValueError, match="^fp8_sites"):
            again.load_carried_state({"fp8_amax_history": [[1.0] * 16], "fp8_sites": names})
    # nothing taken from the refused ones; the site the step has not cast yet keeps its loaded name
    assert again.carried_state() == state
    cuda(BFLOAT16).load_carried_state(state)  # a bf16 run continuing an FP8 one ignores it


def test_fp8_delayed_scaling_drops_the_histories_of_other_tensors():
    """A checkpoint whose site names (fp8_sites) differ from the run's tensors at a site (the model's sites changed
    since it was saved): its histories from that site on are dropped, so those tensors scale as in a new run (by
    their own amax on the first step), while the sites before keep theirs. Bit for bit the run of a backend that
    loaded only the matching first history; unlike a fresh one's (x's history kept) and the full load's."""
    if _INFO is None or not _INFO.usable:
        cuda("fp8")  # (skips with the reason)
    runs = {name: _INFO.plugin.create(dtype="fp8", options={"fp8_scaling": "delayed"})
            for name in ("other", "first", "all", "fresh")}
    some = runs["fresh"]
    rng = np.random.default_rng(6)
    B, T, C, OC = 2, 64, 256, 192
    w = held(some, rng.standard_normal((OC, C)) / math.sqrt(C))
    x = held(some, rng.standard_normal((B, T, C)))
    dout = held(some, rng.standard_normal((B, T, OC)) * 1e-2)
    # histories of 3x this step's amax: a kept history scales otherwise than the tensor's own amax
    hist = [[float(np.float32(3 * np.abs(t).max()))] * 16 for t in (x, w, dout)]
    names = ["x 192x256", "w 192x256", "dout 192x256"]
    runs["other"].load_carried_state({"fp8_amax_history": hist, "fp8_sites": [names[0], "w 64x256", names[2]]})
    runs["first"].load_carried_state({"fp8_amax_history": hist[:1], "fp8_sites": names[:1]})
    runs["all"].load_carried_state({"fp8_amax_history": hist, "fp8_sites": names})

    def step(be):
        W = up(be, w)
        out, dinp, dw = poisoned(be, (B, T, OC)), poisoned(be, (B, T, C)), up(be, np.zeros((OC, C)))
        be.begin_step()
        be.matmul_forward(out, up(be, x), W)
        be.matmul_backward(dinp, dw, None, up(be, dout), up(be, x), W)
        be.end_step()
        return [down(be, t) for t in (out, dinp, dw)]

    got = {name: step(be) for name, be in runs.items()}
    for i, what in enumerate(("out", "dinp", "dweight")):
        np.testing.assert_array_equal(got["other"][i], got["first"][i], err_msg=what)
    assert not np.array_equal(got["other"][0], got["fresh"][0]), "x's history was dropped, or never used"
    assert not np.array_equal(got["other"][0], got["all"][0]), "w's history of another tensor was kept"
    state = runs["other"].carried_state()
    assert state == runs["first"].carried_state() and state["fp8_sites"] == names
    amax = [float(np.float32(np.abs(t).max())) for t in (x, w, dout)]
    assert state["fp8_amax_history"] == [[amax[0]] + hist[0][:15], [amax[1]] + [0.0] * 15, [amax[2]] + [0.0] * 15]
    assert runs["all"].carried_state()["fp8_amax_history"] == [[a] + h[:15] for a, h in zip(amax, hist)]


def test_fp8_delayed_scaling_resumes_bit_exactly(tmp_path):
    """8 steps straight against 4 + 4 resumed from the checkpoint (amax histories in state.json); and
    a bf16 run continuing the FP8 checkpoint."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer
    if _INFO is None or not _INFO.usable:
        cuda("fp8")
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "g_train_000001.bin", rng.integers(0, 1000, 40_000))
    mk = lambda dtype="fp8": _INFO.plugin.create(dtype=dtype, options={"fp8_scaling": "delayed"})  # noqa: E731
    base = dict(data=str(tmp_path / "g_train_*.bin"), model="d2", n_embd=128, batch_size=4, seq_len=64, steps=8,
                val_every=0, sample_every=0, checkpoint_minutes=0)
    straight = Trainer(TrainArgs(**base), mk(), say=lambda s: None)
    want = [straight.train_step(s)["loss"] for s in range(8)]
    first = Trainer(TrainArgs(**base, out=str(tmp_path / "run"), checkpoint_every=4), mk(), say=lambda s: None)
    got = [first.train_step(s)["loss"] for s in range(4)]
    first.save(4)
    first.close()
    state = json.loads((tmp_path / "run" / "step_00000004" / "state.json").read_text())
    # 2 layers, 4 matmuls, x / w / dout (the output projection's gradient: cast for its FP8 weight gradient)
    assert len(state["backend_state"]["fp8_amax_history"]) == 2 * 4 * 3
    second = Trainer(TrainArgs(**base, out=str(tmp_path / "run"), resume=True), mk(), say=lambda s: None)
    got += [second.train_step(s)["loss"] for s in range(second.start_step, 8)]
    second.close()
    assert got == want, (got, want)
    bf = Trainer(TrainArgs(**base, out=str(tmp_path / "run"), resume=True), cuda(BFLOAT16), say=lambda s: None)
    assert np.isfinite(bf.train_step(bf.start_step)["loss"])
    bf.close()


def test_fp8_backward_in_two_passes_computes_the_same_bits():
    """A product whose one-pass casts would outgrow cuDNN's workspace (which they share) casts its gradient twice
    instead: dinp, dweight and dbias are the one-pass path's, bit for bit, with current and delayed scaling."""
    if _INFO is None or not _INFO.usable:
        cuda("fp8")
    rng, hb = np.random.default_rng(6), cuda("fp8")
    B, T, C, OC = 2, 64, 256, 192
    x, w = held(hb, rng.standard_normal((B, T, C))), held(hb, rng.standard_normal((OC, C)) / math.sqrt(C))
    dout = held(hb, rng.standard_normal((B, T, OC)) * 1e-2)
    for scaling in ("current", "delayed"):
        got = []
        for cap in (None, 0):  # 0: every product with a dinp takes two passes
            b = _INFO.plugin.create(dtype="fp8", options={"fp8_scaling": scaling})
            if cap is not None:
                b.cudnn_workspace = cap
            W, X, D = up(b, w), up(b, x), up(b, dout)
            outs = []
            for step in range(2):  # (delayed: the second step scales by the first one's history)
                b.begin_step()
                dinp, dw, db = poisoned(b, (B, T, C)), up(b, np.zeros((OC, C))), up(b, np.full(OC, 0.5))
                b.matmul_backward(dinp, dw, db, D, X, W)
                b.end_step()
                outs += [down(b, dinp), down(b, dw), down(b, db)]
            got.append(outs)
        for one, two in zip(*got):
            assert np.array_equal(one, two), scaling


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_classifier_backward_casts_its_weight_once_a_step(scaling):
    """fp8_classifier=backward: the classifier's (`precise`) forward keeps the bf16 backend's bits, its backward's
    two products run in FP8 (near the products of the cast operands). Within a training step its weight is cast
    once for all the chunks, outside one every call: the same bits either way."""
    if _INFO is None or not _INFO.usable:
        cuda("fp8")
    rng, hb = np.random.default_rng(8), cuda("fp8")
    N, C, V = 128, 128, 512  # (one chunk of rows; two chunks a step)
    w = held(hb, rng.standard_normal((V, C)) / math.sqrt(C))
    xs = [held(hb, rng.standard_normal((N, C))) for _ in range(2)]
    ds = [held(hb, rng.standard_normal((N, V)) * 1e-3) for _ in range(2)]
    got, casts = {}, {}
    for in_step in (False, True):
        b = _INFO.plugin.create(dtype="fp8", options={"fp8_classifier": "backward", "fp8_scaling": scaling})
        W, seen, cast = up(b, w), [], b._fp8_cast
        b._fp8_cast = lambda src, *a, **kw: (seen.append(src is W), cast(src, *a, **kw))[1]
        if in_step:
            b.begin_step()
        dw, dinps = up(b, np.zeros((V, C))), []
        for x, d in zip(xs, ds):
            dinp = poisoned(b, (N, C))
            b.matmul_backward(dinp, dw, None, up(b, d), up(b, x), W, precise=True)
            dinps.append(down(b, dinp))
        if in_step:
            b.end_step()
        got[in_step], casts[in_step] = dinps + [down(b, dw)], sum(seen)
    assert (casts[False], casts[True]) == (2, 1), casts
    for one, two in zip(got[False], got[True]):
        assert np.array_equal(one, two)
    if scaling == "current":  # (each operand scaled by its own amax: the cast the reference makes)
        wq, dq = _fp8_held(w), _fp8_held(ds[0], e5m2=True)
        assert rel(got[True][0], dq @ wq) < 6e-3 and rel(got[True][0], ds[0] @ w) > 1e-2
    dw_exact = sum(d.T @ x for x, d in zip(xs, ds))
    assert 1e-2 < rel(got[True][2], dw_exact) < 0.1
    fwd = []
    for be in (b, cuda(BFLOAT16)):
        out = poisoned(be, (N, V))
        be.matmul_forward(out, up(be, xs[0]), up(be, w), precise=True)
        fwd.append(down(be, out))
    np.testing.assert_array_equal(fwd[0], fwd[1])


@pytest.mark.parametrize("model,recompute,dgelu,head", [
    ("d2", "none", "off", "off"), ("d2", "gelu+layernorm", "off", "off"), ("d2", "none", "on", "off"),
    ("d2", "gelu+layernorm", "off", "backward"), ("llama3-tiny", "none", "off", "off"),
    ("llama3-tiny", "gelu+layernorm", "off", "off")])  # (llama3-tiny's head, 50257 wide, is no FP8 shape)
def test_fp8_producers_train_the_bits_of_the_casts(tmp_path, model, recompute, dgelu, head):
    """fp8_fuse (the default): from a site's second step the norms, SwiGLU and GELU write the FP8 operands their
    next products read, which then cast nothing; the losses are fp8_fuse=off's, where every product casts, bit for
    bit, over uncaptured steps and replayed graphs (with a recompute, the backward's producers too; with
    fp8_dgelu=on, GELU's output feeds an FP8 backward with GELU's derivative; with fp8_classifier=backward, the
    fused classifier writes the gradient its weight's FP8 backward reads)."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.steps import GRAPH_AFTER
    from llmc_cli.training.trainer import Trainer
    cuda("fp8")
    llama = model.startswith("llama")
    write_shard(tmp_path / "p_train_000001.bin", np.random.default_rng(0).integers(0, 1000, 40_000))
    runs, produced = {}, {}
    for fuse in ("on", "off"):
        b = _INFO.plugin.create(dtype="fp8", options={"fp8_fuse": fuse, "fp8_dgelu": dgelu, "fp8_classifier": head})
        a = TrainArgs(data=str(tmp_path / "p_train_*.bin"), model=model, batch_size=4, seq_len=64,
                      steps=GRAPH_AFTER + 3, val_every=0, sample_every=0, recompute=recompute,
                      **({} if llama else {"n_embd": 128}))
        tr = Trainer(a, b, say=lambda m: None)
        runs[fuse] = [tr.train_step(s)["loss"] for s in range(a.steps)]
        produced[fuse] = dict(b.fp8_produced)
        tr.close()
    print(model, recompute, produced, runs["on"])
    # the norms' and SwiGLU's forward outputs, and (Llama) SwiGLU's gradient, (head) the classifier's
    assert produced["on"].get("x") and bool(produced["on"].get("dout")) == llama and not produced["off"]
    assert bool(produced["on"].get("classifier")) == (head != "off")
    assert runs["on"] == runs["off"]


@pytest.mark.parametrize("x_held,d_held,C", [(True, False, 128), (False, True, 128), (True, True, 128),
                                             (True, True, 4096)])  # (C = 4096: the norm's kernel for wide rows)
def test_fp8_backward_takes_produced_operands_in_any_mix(x_held, d_held, C):
    """A product's backward where a producer wrote its input (rmsnorm), its gradient (SwiGLU's backward), both
    or neither: dinp and dweight are fp8_fuse=off's bits, each step."""
    cuda("fp8")
    rng = np.random.default_rng(8)
    N, H = 256, 96
    host = {"res": rng.standard_normal((N, C)), "g": 1 + rng.standard_normal(C) / 4,
            "w": rng.standard_normal((2 * H, C)) / math.sqrt(C), "h13": rng.standard_normal((N, 2 * H)),
            "dhs": rng.standard_normal((N, H)) * 1e-2}
    got = {}
    for fuse in ("on", "off"):
        b = _INFO.plugin.create(dtype="fp8", options={"fp8_fuse": fuse})
        d = {k: up(b, v) for k, v in host.items()}
        ln, rstd, h, dh13 = poisoned(b, (N, C)), b.alloc(N), poisoned(b, (N, 2 * H)), poisoned(b, (N, 2 * H))
        outs = []
        for step in range(2):  # (the first step's sites have no history: nothing is produced then)
            b.begin_step()
            b.rmsnorm_forward(ln, rstd, d["res"], d["g"], 1e-5, **({"fp8_next": d["w"]} if x_held else {}))
            b.matmul_forward(h, ln, d["w"])
            b.swiglu_backward(dh13, d["dhs"], d["h13"], **({"fp8_next": d["w"]} if d_held else {}))
            dinp, dw = poisoned(b, (N, C)), up(b, np.zeros((2 * H, C)))
            b.matmul_backward(dinp, dw, None, dh13, ln, d["w"])
            b.end_step()
            outs += [down(b, h), down(b, dinp), down(b, dw)]
        got[fuse] = outs
        if fuse == "on":
            assert b.fp8_produced == {k: 1 for k, held in (("x", x_held), ("dout", d_held)) if held}
    for one, two in zip(got["on"], got["off"]):
        assert np.isfinite(one).all() and np.array_equal(one, two)


@pytest.mark.parametrize("refuse", ["none", "weight"])
def test_fp8_gelu_output_is_its_products_operand(refuse, monkeypatch):
    """GELU as a producer (GPT-2's MLP, with biases): the input projection with pre_gelu and fp8_next writes the
    output projection's FP8 input, which that product reads forward and, transposed, for its FP8 weight gradient
    (its input gradient bf16, GELU's derivative fused): every output is fp8_fuse=off's, bit for bit. Where cuBLASLt
    refuses the FP8 weight gradient, the bf16 one runs on the values the bytes stand for, dbias added once."""
    cuda("fp8")
    rng = np.random.default_rng(9)
    N, C, H = 256, 128, 512
    host = {"x": rng.standard_normal((N, C)), "w1": rng.standard_normal((H, C)) / math.sqrt(C),
            "b1": rng.standard_normal(H) / 4, "w2": rng.standard_normal((C, H)) / math.sqrt(H),
            "b2": rng.standard_normal(C) / 4, "dy": rng.standard_normal((N, C)) * 1e-2}
    got = {}
    for fuse in ("on", "off"):
        b = _INFO.plugin.create(dtype="fp8", options={"fp8_fuse": fuse})
        d = {k: up(b, v) for k, v in host.items()}
        pre, h = poisoned(b, (N, H)), poisoned(b, (N, H))
        for step in range(2):  # (the first step's sites have no history: nothing is produced then)
            if step == 1 and refuse == "weight":
                monkeypatch.setattr(b.lt, "backward_weight_fp8", lambda *a, **k: False)
            b.begin_step()
            b.matmul_forward(h, d["x"], d["w1"], d["b1"], pre_gelu=pre, fp8_next=d["w2"])
            y, dh = poisoned(b, (N, C)), poisoned(b, (N, H))
            b.matmul_forward(y, h, d["w2"], d["b2"])
            dw, db = up(b, np.zeros((C, H))), up(b, np.full(C, 0.25))
            b.matmul_backward(dh, dw, db, d["dy"], h, d["w2"], pre_gelu=pre)
            b.end_step()
        got[fuse] = [down(b, t) for t in (y, dh, db, dw)]
        assert b.fp8_produced == ({"x": 1} if fuse == "on" else {})
    for name, one, two in zip(("y", "dinp", "dbias", "dweight"), got["on"], got["off"]):
        assert np.isfinite(one).all(), name
        if refuse == "none" or name != "dweight":
            assert np.array_equal(one, two), name
        else:  # (bf16 on the FP8 bytes' values against bf16 on GELU's: e4m3's rounding, a few %)
            assert 0 < rel(one, two) < 0.1, rel(one, two)
    assert rel(got["on"][2], 0.25 + host["dy"].sum(0)) < 1e-2, "dbias: the column sums of dy, added once"


@pytest.mark.parametrize("refuse", [False, True])
def test_fp8_classifier_writes_the_gradient_its_backward_reads(refuse, monkeypatch):
    """fp8_classifier=backward: from the site's second step the fused classifier writes its gradient in e5m2 for
    the head's backward (the losses as ever, a vocabulary that is no multiple of 8 too). That backward gives the
    bits of its own cast of the act gradient; run in bf16 after all (cuBLASLt refusing), the values the bytes
    stand for."""
    cuda("fp8")
    b = _INFO.plugin.create(dtype="fp8", options={"fp8_classifier": "backward"})
    rng = np.random.default_rng(9)
    N, C, V, Vp = 128, 128, 500, 512
    lnf, w = up(b, rng.standard_normal((N, C))), up(b, rng.standard_normal((Vp, C)) / math.sqrt(C))
    targets, logits_h = up(b, rng.integers(0, V, N)), rng.standard_normal((N, Vp)) * 3
    got = []
    for step in range(2):  # (the first: no history yet, so the gradient is act, cast by the backward)
        if step == 1 and refuse:
            monkeypatch.setattr(b.lt, "backward_input_fp8", lambda *a, **k: False)
        b.begin_step()
        logits, losses = up(b, logits_h), up(b, np.zeros(N), FLOAT32)
        b.classifier_forward_backward(logits, losses, targets, V, 1.0 / N, fp8_next=w)
        dlnf, dw = poisoned(b, (N, C)), up(b, np.zeros((Vp, C)))
        b.matmul_backward(dlnf, dw, None, logits, lnf, w, precise=True)
        b.end_step()
        got.append([down(b, t) for t in (losses, dlnf, dw)])
    assert b.fp8_produced == {"classifier": 1}
    assert np.isfinite(got[0][0]).all() and np.array_equal(got[0][0], got[1][0])
    for one, two in zip(got[0][1:], got[1][1:]):
        assert np.isfinite(two).all()
        if not refuse:
            assert np.array_equal(one, two), "the classifier's bytes are the cast's"
        else:
            assert rel(two, one) < 0.1, "a bf16 product on the values the FP8 bytes stand for"


@pytest.mark.parametrize("C", [128, 32])
def test_fp8_classifier_gradient_is_spent_by_its_backward(C):
    """fp8_classifier=backward on a GPT-2 whose logits are exactly as large as the scratch placed at their start
    (Vp = C: btc, so dresidual; Vp = 4C: dfch): once the head's backward has read the e5m2 gradient the classifier
    wrote, the layers' products that read that scratch as their gradient next meet act, not those bytes. Losses and
    gradients are fp8_fuse=off's, bit for bit."""
    from llmc_cli.models.gpt2 import GPT2, GPT2Config, in_logits, init_parameters
    cuda("fp8")
    cfg = GPT2Config(block_size=64, vocab_size=100, n_layer=1, n_head=2, n_embd=C)
    B, T = 4, 64
    assert in_logits(cfg, B, T, True) == {"btc" if C == 128 else "dfch": 0} and cfg.padded_vocab_size in (C, 4 * C)
    tokens = np.random.default_rng(12).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    got, produced = {}, {}
    for fuse in ("on", "off"):
        b = _INFO.plugin.create(dtype="fp8", options={"fp8_fuse": fuse, "fp8_classifier": "backward"})
        m = GPT2(cfg, b, B, T, classifier_chunks=1)
        m.load_parameters(init_parameters(cfg, 1))
        got[fuse] = []
        for _ in range(3):  # (from the second step the classifier writes the gradient's bytes, with fp8_fuse=on)
            b.begin_step()
            m.zero_grad()
            m.forward(x, y, dloss=1 / (B * T))
            m.backward()
            b.end_step()
            got[fuse].append([down(b, m.acts["losses"]), down(b, m.grads.buf)])
        produced[fuse] = b.fp8_produced["classifier"]
    assert produced == {"on": 2, "off": 0}
    for on, off in zip(got["on"], got["off"]):
        assert np.isfinite(on[0]).all()
        for what, one, two in zip(("losses", "gradients"), on, off):
            np.testing.assert_array_equal(one, two, err_msg=what)


@pytest.mark.parametrize("refuse", ["none", "forward", "backward"])
def test_fp8_produced_operands_reach_their_product_or_become_act(refuse, monkeypatch):
    """A producer's FP8 bytes stand in for its output before the product fp8_next named: that product reads them
    (the cast's bits), another product meeting them is refused, and a product that runs in bf16 after all
    (cuBLASLt refusing its FP8 form, the classifier's `precise`) reads the values they stand for."""
    cuda("fp8")
    b = _INFO.plugin.create(dtype="fp8")
    rng = np.random.default_rng(7)
    N, C, H = 256, 128, 96
    x, g = up(b, rng.standard_normal((N, C))), up(b, np.ones(C))
    w, w2 = (up(b, rng.standard_normal((2 * H, C)) / math.sqrt(C)) for _ in range(2))
    h13, dhs = up(b, rng.standard_normal((N, 2 * H))), up(b, rng.standard_normal((N, H)) * 1e-2)
    ln, rstd, out, dh13 = poisoned(b, (N, C)), b.alloc(N), poisoned(b, (N, 2 * H)), poisoned(b, (N, 2 * H))
    got = []
    for step in range(2):  # (the first: the sites have no history, act written)
        if step == 1 and refuse != "none":
            monkeypatch.setattr(b.lt, f"{'forward' if refuse == 'forward' else 'backward_input'}_fp8",
                                lambda *a, **k: False)
        b.begin_step()
        b.rmsnorm_forward(ln, rstd, x, g, 1e-5, fp8_next=w)
        b.matmul_forward(out, ln, w)
        b.swiglu_backward(dh13, dhs, h13, fp8_next=w)
        dinp, dw = poisoned(b, (N, C)), up(b, np.zeros((2 * H, C)))
        b.matmul_backward(dinp, dw, None, dh13, ln, w)
        b.end_step()
        got.append([down(b, t) for t in (out, dinp, dw)])
    assert b.fp8_produced == {"x": 1, "dout": 1}
    for one, two in zip(*got):  # (the same operands both steps: the second scales by the first one's history)
        assert np.isfinite(two).all()
        if refuse == "none":
            assert np.array_equal(one, two), "the producer's bytes are the cast's"
        else:  # (against the FP8 product: e4m3's and e5m2's rounding of the other operands, 4-6 %)
            assert rel(two, one) < 0.1, "a bf16 product on the values the FP8 bytes stand for"
    b.begin_step()
    b.rmsnorm_forward(ln, rstd, x, g, 1e-5, fp8_next=w)
    with pytest.raises(RuntimeError, match="another one"):
        b.matmul_forward(out, ln, w2)
    b.matmul_forward(out, ln, w, precise=True)
    assert rel(down(b, out), got[0][0]) < 0.1
    b.end_step()


def test_fp8_wgrad_off_keeps_the_weight_gradient_in_bf16():
    b = cuda("fp8")
    rng = np.random.default_rng(4)
    B, T, C, OC = 2, 64, 256, 192
    x = held(b, rng.standard_normal((B, T, C)))
    w = held(b, rng.standard_normal((OC, C)) / math.sqrt(C))
    dout = held(b, rng.standard_normal((B, T, OC)) * 1e-2)
    b.fp8_wgrad = False
    try:
        dinp, dw, db = poisoned(b, (B, T, C)), up(b, np.zeros((OC, C))), up(b, np.zeros(OC))
        b.matmul_backward(dinp, dw, db, up(b, dout), up(b, x), up(b, w))
    finally:
        b.fp8_wgrad = True
    dq, wq = _fp8_held(dout, e5m2=True), _fp8_held(w)
    assert rel(down(b, dinp), dq @ wq) < 6e-3
    exact = dout.reshape(-1, OC).T @ x.reshape(-1, C)
    assert rel(down(b, dw), exact) < 1e-2, "the weight gradient should be a bf16 product"
    assert rel(down(b, db), dout.reshape(-1, OC).sum(0)) < 1e-2


# =============================================================================================================
# training steps replayed as CUDA graphs

@pytest.mark.parametrize("model,dtype", [("d2", BFLOAT16), ("llama3-tiny", BFLOAT16), ("d2", "fp8"), ("d2", FLOAT32),
                                         ("llama3-tiny", "fp8-current")])
def test_graph_replayed_training_matches_uncaptured(tmp_path, model, dtype):
    """The trainer captures each micro-step once GRAPH_AFTER steps ran and replays it: the losses are the
    uncaptured run's, bit for bit (two micro-steps a step, so both graphs replay)."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.steps import GRAPH_AFTER
    from llmc_cli.training.trainer import Trainer
    llama = model.startswith("llama")  # (llama3-tiny reads GPT-2 shards: its vocabulary is GPT-2's)
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "g_train_000001.bin", rng.integers(0, 1000, 40_000))
    runs = {}
    for graphs in (False, True):
        said = []
        opts = {"fp8_scaling": "current"} if dtype == "fp8-current" else None
        dt = "fp8" if dtype == "fp8-current" else dtype
        b = _INFO.plugin.create(dtype=dt, options=opts) if _INFO and _INFO.usable else cuda(dt)
        a = TrainArgs(data=str(tmp_path / "g_train_*.bin"), model=model, batch_size=4, seq_len=64,
                      total_batch_size=2 * 4 * 64, steps=GRAPH_AFTER + 4, val_every=0, sample_every=0, graphs=graphs,
                      **({} if llama else {"n_embd": 128}))
        tr = Trainer(a, b, say=said.append)
        runs[graphs] = [tr.train_step(s)["loss"] for s in range(a.steps)]
        if graphs:
            assert any("graphs: micro-steps replay" in s for s in said), said
    print(model, dtype, runs[True])
    assert runs[True] == runs[False]


# =============================================================================================================
# ZeRO-2's gradients (one layer's slot, the shard) on the device, one rank

@pytest.mark.parametrize("model,dtype", [("d2", BFLOAT16), ("llama3-tiny", BFLOAT16), ("llama3-tiny", "fp8"),
                                         ("d2", FLOAT32)])
def test_zero2_gradients_train_as_the_whole_buffer(tmp_path, model, dtype):
    """--zero 2 on one rank keeps the gradients as LayerSlotGrads (each layer's written into one slot, added into
    the shard after its backward, the slot zeroed) with the backend's kernels on views of the slot: with one
    micro-step a step the losses are --zero 0's bit for bit (0 + g is g); with two they stay within bf16's
    rounding of the different order (each micro-step's gradient rounded before the sum)."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer
    llama = model.startswith("llama")
    write_shard(tmp_path / "z_train_000001.bin", np.random.default_rng(0).integers(0, 1000, 40_000))
    for accum in (1, 2):
        runs = {}
        for zero in (0, 2):
            a = TrainArgs(data=str(tmp_path / "z_train_*.bin"), model=model, batch_size=4, seq_len=64,
                          total_batch_size=accum * 4 * 64, steps=5, val_every=0, sample_every=0, zero=zero,
                          **({} if llama else {"n_embd": 128}))
            cuda(dtype)  # (skips where the backend cannot run) then a fresh one: FP8 carries scales across steps
            b = _INFO.plugin.create(dtype=dtype, options={"tf32": "off"} if dtype == FLOAT32 else None)
            tr = Trainer(a, b, say=lambda m: None)
            runs[zero] = [tr.train_step(s) for s in range(a.steps)]
            if zero == 2:
                assert tr.model.grads.shard is not None and tr.reducer is not None
        losses0, losses2 = ([r["loss"] for r in runs[z]] for z in (0, 2))
        print(model, dtype, accum, losses0, losses2)
        if accum == 1:
            assert losses2 == losses0
            assert [r["norm"] for r in runs[2]] == [r["norm"] for r in runs[0]]
        else:
            np.testing.assert_allclose(losses2, losses0, rtol=2e-3 if dtype != FLOAT32 else 1e-6)


# =============================================================================================================
# overlapped collectives (NCCL on its own stream), on one rank

def test_nccl_overlapped_collectives_wait_for_the_compute_stream_and_join_it():
    """The overlapped path's plumbing on a 1-rank NCCL communicator (a side stream, one event and one NCCL group
    per block, the join): it runs, and the values come out as queued. Whether the side stream really waits shows only with two
    ranks (multi_gpu.sh); one rank's in-place reductions change nothing whenever they run."""
    from llmc_cuda.nccl import NCCLCommunicator, _nccl_unique_id
    b = cuda(FLOAT32)
    comm = NCCLCommunicator(b, 0, 1, 0, _nccl_unique_id()[1])
    n = 1 << 22
    buf = up(b, np.zeros(n))
    for _ in range(20):  # a queue of work on the compute stream that the side stream must wait for
        b.fill(buf, 1.0)
        b.scale(buf, 3.0)
    with comm.overlapped():
        comm.all_reduce(b.view(buf, 0, n // 2))
        comm.reduce(b.view(buf, n // 2, n // 2), 0)
    comm.join()
    b.scale(buf, 2.0)  # queued behind the collectives
    assert (down(b, buf) == 6.0).all()


# =============================================================================================================
# batches copied ahead on a side stream (CAP_ASYNC_INPUTS)

_SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}'''


def test_input_queue_never_overwrites_a_batch_the_compute_stream_has_not_read():
    """The compute stream is held up by a spinning kernel while three batches go through a queue of two slots: the
    third goes into the first's slot before the compute stream has read the first. put() returns without waiting
    for the compute stream, and each take() still delivers its own batch."""
    import cupy as cp

    from llmc_cli.kernels import CAP_ASYNC_INPUTS
    b = cuda(BFLOAT16)
    assert CAP_ASYNC_INPUTS in b.capabilities
    rng = np.random.default_rng(9)
    batches = [rng.integers(0, 50257, (64, 1024)).astype(np.int32) for _ in range(3)]
    x = b.alloc((64, 1024), "int32")
    seen = [b.alloc((64, 1024), "int32") for _ in batches]
    q = b.input_queue([x], depth=2)
    spin = cp.RawKernel(_SPIN, "spin")
    b.synchronize()
    with b.stream:
        spin((1,), (1,), (np.int64(int(1e9)),))  # about half a second of a held-up compute stream
    q.put([batches[0]])
    q.take()
    b.copy(seen[0], x)
    q.put([batches[1]])
    q.put([batches[2]])  # the first batch's slot, not yet read by the compute stream
    assert not b.stream.done, "put() must not wait for the compute stream (or the spin was too short to test)"
    for k in (1, 2):
        q.take()
        b.copy(seen[k], x)
    for k, want in enumerate(batches):
        np.testing.assert_array_equal(b.download(seen[k]), want, err_msg=f"batch {k}")


@pytest.mark.parametrize("model,dtype", [("d2", BFLOAT16), ("llama3-tiny", BFLOAT16), ("d2", FLOAT32)])
def test_prefetched_training_matches_reading_in_the_step(tmp_path, model, dtype):
    """Batches read by the data thread and copied on the side stream (two micro-steps a step, replayed as graphs
    once GRAPH_AFTER steps ran): the losses and the final weights of reading each batch in its step, bit for bit."""
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.steps import GRAPH_AFTER
    from llmc_cli.training.trainer import Trainer
    llama = model.startswith("llama")
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "p_train_000001.bin", rng.integers(0, 1000, 40_000))
    runs = {}
    for prefetch in (False, True):
        opts = {"fp8_scaling": "current"} if dtype == "fp8-current" else None
        dt = "fp8" if dtype == "fp8-current" else dtype
        b = _INFO.plugin.create(dtype=dt, options=opts) if _INFO and _INFO.usable else cuda(dt)
        a = TrainArgs(data=str(tmp_path / "p_train_*.bin"), model=model, batch_size=4, seq_len=64,
                      total_batch_size=2 * 4 * 64, steps=GRAPH_AFTER + 4, val_every=0, sample_every=0, shuffle=True,
                      prefetch=prefetch, **({} if llama else {"n_embd": 128}))
        tr = Trainer(a, b, say=lambda s: None)
        try:
            losses = [r["loss"] for r in tr.run() if "loss" in r]
        finally:
            tr.close()
        runs[prefetch] = (losses, tr.model.parameters_host(), tr.feed.position,
                          "inputs ahead" in b.memory_report().by_tag)
    print(model, dtype, runs[True][0])
    assert runs[True][0] == runs[False][0]
    assert np.array_equal(runs[True][1], runs[False][1]), "the final weights must be the same bits"
    assert runs[True][2] == runs[False][2]
    assert runs[True][3] and not runs[False][3], "with prefetch the CUDA input queue stages the batches"


def test_event_timer_marks_cut_the_queued_work_in_order():
    """EventTimer.mark records an event between start and stop without the host waiting: marks() are increasing,
    within the total, and a mark after a long kernel sits after most of it (LLMC_STEP_PHASES relies on this)."""
    b = cuda(BFLOAT16)
    x = b.alloc(1 << 24, FLOAT32)
    t = b.timer()
    t.start()
    t.mark()
    for _ in range(20):
        b.fill(x, 1.0)
    t.mark()
    b.fill(x, 2.0)
    t.mark()
    total = t.stop()
    m = t.marks()
    assert len(m) == 3 and 0.0 <= m[0] <= m[1] <= m[2] <= total
    assert m[1] - m[0] > m[2] - m[1]  # twenty fills take longer than one
    t.start()
    assert t.marks() == []  # a new start forgets the last step's marks
