"""Kernel conformance: every kernel of `llmc_cli.kernels.Backend` on every chosen backend (see testing.backends),
checked against a float64 PyTorch reference (autograd for the backward passes).

Run it against your own plugin:  pytest --pyargs llmc_cli.testing   (LLMC_TEST_BACKENDS=name, or
LLMC_TEST_PLUGIN=module:attr for a plugin that is not installed). Conventions:
* inputs are random (seeded per test), never zero, and the reference is computed from the values the backend
  actually holds after the upload (so bf16 rounding of inputs is not counted as kernel error);
* buffers a kernel overwrites are poisoned with NaN first, so an element it forgets to write fails the test;
* gradients that accumulate are pre-filled with random values and checked as prefill + delta (the delta is
  compared, so an error in it is not hidden under the prefill);
* shapes are small and odd (T=7, C=48, V=50 inside Vp=64...), with a larger case where GPU kernels tile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmc_cli.kernels import BFLOAT16, CAP_FP8, CAP_SAMPLING, FLOAT32, FP8, INT32, MemoryReport
from llmc_cli.testing.helpers import (
    FP8_TOL,
    assert_close,
    bf16_neighbours,
    bf16_round,
    check_accumulated,
    empty,
    from_device,
    poison,
    prefill,
    randn,
    to_device,
    tol,
)

torch.set_num_threads(1)


def t64(x, grad: bool = False) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64, requires_grad=grad)


def np64(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().astype(np.float64)


# =============================================================================================================
# memory

def test_alloc_shapes_and_dtypes(backend):
    a = backend.alloc(37, FLOAT32, tag="test")
    assert tuple(a.shape) == (37,) and a.size == 37
    assert np.dtype(a.dtype) == np.float32
    b = backend.alloc((3, 5, 7), INT32, tag="test")
    assert tuple(b.shape) == (3, 5, 7) and b.size == 105
    assert np.dtype(b.dtype) == np.int32
    c = backend.alloc([4, 6], backend.dtype)
    assert tuple(c.shape) == (4, 6) and c.size == 24


def test_upload_download_roundtrip(backend, rng):
    x = randn(rng, 5, 7, 3).astype(np.float32)
    buf = backend.alloc(x.shape, FLOAT32)
    backend.upload(buf, x)
    got = backend.download(buf)
    assert got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), x)
    # int32, including negative and large ids
    ids = rng.integers(-2**31, 2**31 - 1, size=(4, 9), dtype=np.int64).astype(np.int32)
    ibuf = backend.alloc(ids.shape, INT32)
    backend.upload(ibuf, ids)
    np.testing.assert_array_equal(np.asarray(backend.download(ibuf)), ids)
    # a download is a copy, not a view of the buffer
    got[...] = 0
    np.testing.assert_array_equal(np.asarray(backend.download(buf), dtype=np.float32), x)
    # float64 host data is converted to the buffer's dtype
    x64 = randn(rng, 33)
    f64buf = backend.alloc(33, FLOAT32)
    backend.upload(f64buf, x64)
    np.testing.assert_array_equal(np.asarray(backend.download(f64buf)), x64.astype(np.float32))
    # the compute dtype: float32 exactly, bfloat16 rounded to nearest
    abuf = backend.alloc(x.shape, backend.dtype)
    backend.upload(abuf, x)
    expect = x if backend.dtype == FLOAT32 else bf16_round(x)
    np.testing.assert_array_equal(np.asarray(backend.download(abuf), dtype=np.float32), expect)


def test_upload_bf16_rounds_to_nearest_even(bf16_backend, rng):
    b = bf16_backend
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F80C000, 0x3F807FFF, 0x40490FDB],
                    dtype=np.uint32).view(np.float32)
    x = np.concatenate([ties, randn(rng, 200).astype(np.float32) * 100])
    buf = b.alloc(x.shape, BFLOAT16)
    b.upload(buf, x)
    got = b.download(buf)
    assert np.dtype(got.dtype) == np.float32, "bfloat16 must come back as float32"
    np.testing.assert_array_equal(got, bf16_round(x))
    # copy float32 -> bfloat16 rounds the same way, bfloat16 -> float32 is exact
    src = b.alloc(x.shape, FLOAT32)
    b.upload(src, x)
    dst = empty(b, x.shape, BFLOAT16)
    b.copy(dst, src)
    np.testing.assert_array_equal(np.asarray(b.download(dst), dtype=np.float32), bf16_round(x))
    back = empty(b, x.shape, FLOAT32)
    b.copy(back, dst)
    np.testing.assert_array_equal(np.asarray(b.download(back), dtype=np.float32), bf16_round(x))


def test_view_shares_memory(backend, rng):
    parent, _ = to_device(backend, np.arange(1, 101, dtype=np.float32), FLOAT32)
    v = backend.view(parent, 13, (3, 5))
    assert tuple(v.shape) == (3, 5) and v.size == 15
    np.testing.assert_array_equal(from_device(backend, v), np.arange(14, 29).reshape(3, 5))
    x = randn(rng, 3, 5).astype(np.float32)
    backend.upload(v, x)
    expect = np.arange(1, 101, dtype=np.float64)
    expect[13:28] = x.ravel()
    np.testing.assert_array_equal(from_device(backend, parent), expect)
    backend.fill(v, -2.5)  # a kernel writing through a view
    expect[13:28] = -2.5
    np.testing.assert_array_equal(from_device(backend, parent), expect)
    # a view of a view, and of a multi-dimensional buffer
    vv = backend.view(v, 4, 6)
    backend.fill(vv, 7.0)
    expect[17:23] = 7.0
    np.testing.assert_array_equal(from_device(backend, parent), expect)
    two = backend.alloc((4, 25), FLOAT32)
    backend.copy(two, parent)
    w = backend.view(two, 50, (2, 25))
    np.testing.assert_array_equal(from_device(backend, w), expect[50:].reshape(2, 25))


def test_fill_and_copy(backend, rng):
    for dt in (FLOAT32, backend.dtype):
        buf = backend.alloc((7, 13), dt)
        for value in (0.0, -1.25, 3.0, 1e-3):
            backend.fill(buf, value)
            expect = np.float32(value) if dt == FLOAT32 else bf16_round(np.float32(value))
            np.testing.assert_array_equal(from_device(backend, buf), np.full((7, 13), expect, dtype=np.float64))
    ibuf = backend.alloc(11, INT32)
    backend.fill(ibuf, 42)
    np.testing.assert_array_equal(from_device(backend, ibuf), np.full(11, 42))
    # copy: same number of elements, any shapes; same dtype is exact
    src, x = to_device(backend, randn(rng, 4, 6), FLOAT32)
    dst = empty(backend, 24, FLOAT32)
    backend.copy(dst, src)
    np.testing.assert_array_equal(from_device(backend, dst), x.ravel())
    isrc, ix = to_device(backend, rng.integers(-1000, 1000, (5, 3)).astype(np.int32))
    idst = empty(backend, (15,), INT32)
    backend.copy(idst, isrc)
    np.testing.assert_array_equal(from_device(backend, idst), ix.ravel())
    # the compute dtype to float32 and back
    asrc, ax = to_device(backend, randn(rng, 9, 5))
    f = empty(backend, (9, 5), FLOAT32)
    backend.copy(f, asrc)
    np.testing.assert_array_equal(from_device(backend, f), ax)
    a2 = empty(backend, (45,), backend.dtype)
    backend.copy(a2, f)
    np.testing.assert_array_equal(from_device(backend, a2), ax.ravel())


def test_memory_report(backend):
    before = backend.memory_report()
    assert isinstance(before, MemoryReport)
    tag = "conformance-test-tag"
    a = backend.alloc((123, 45), FLOAT32, tag=tag)
    b = backend.alloc(77, INT32, tag=tag)
    after = backend.memory_report()
    nbytes = 123 * 45 * 4 + 77 * 4
    assert after.allocated - before.allocated >= nbytes
    assert after.by_tag.get(tag, 0) - before.by_tag.get(tag, 0) >= nbytes
    assert sum(after.by_tag.values()) == after.allocated
    if after.device_total is not None:
        assert after.device_total > 0
    if after.device_free is not None and after.device_total is not None:
        assert 0 <= after.device_free <= after.device_total
    del a, b


def test_synchronize_timer_describe(backend, rng):
    x, _ = to_device(backend, randn(rng, 64, 64))
    out = empty(backend, (64, 64))
    timer = backend.timer()
    timer.start()
    backend.gelu_forward(out, x)
    dt = timer.stop()
    assert isinstance(dt, float) and dt >= 0.0
    backend.synchronize()
    d = backend.describe()
    assert isinstance(d, str) and d.strip()


# =============================================================================================================
# encoder

ENC_SHAPES = [(2, 7, 48, 50, 64, 11), (3, 5, 32, 17, 17, 5), (4, 33, 64, 100, 128, 40)]  # B,T,C,V,Vp,maxT


def _tokens(rng, B, T, V):
    inp = rng.integers(0, V, (B, T))
    inp[0, 0] = inp[-1, -1] = inp[0, -1]  # repeated tokens: their gradients must add up
    inp[-1, 0] = V - 1
    return inp.astype(np.int32)


@pytest.mark.parametrize("B,T,C,V,Vp,maxT", ENC_SHAPES)
def test_encoder_forward(backend, rng, B, T, C, V, Vp, maxT):
    inp, inp_h = to_device(backend, _tokens(rng, B, T, V))
    wte, wte_h = to_device(backend, randn(rng, Vp, C))
    wpe, wpe_h = to_device(backend, randn(rng, maxT, C))
    out = empty(backend, (B, T, C))
    backend.encoder_forward(out, inp, wte, wpe)
    ref = F.embedding(torch.tensor(inp_h), t64(wte_h)) + t64(wpe_h)[:T]
    assert_close(from_device(backend, out), np64(ref), tol(backend), "encoder out")


@pytest.mark.parametrize("with_wpe", [True, False], ids=["wpe", "no-wpe"])
@pytest.mark.parametrize("B,T,C,V,Vp,maxT", ENC_SHAPES)
def test_encoder_backward(backend, rng, B, T, C, V, Vp, maxT, with_wpe):
    inp, inp_h = to_device(backend, _tokens(rng, B, T, V))
    dout, dout_h = to_device(backend, randn(rng, B, T, C))
    wte_t, wpe_t = t64(np.zeros((Vp, C)), True), t64(np.zeros((maxT, C)), True)
    ref = F.embedding(torch.tensor(inp_h), wte_t) + wpe_t[:T]
    ref.backward(t64(dout_h))
    dwte_prefill = randn(rng, Vp, C)
    dwpe_prefill = randn(rng, maxT, C)
    results = []
    for _ in range(2):  # twice from the same prefill: must be bit-identical (deterministic)
        dwte, dwte0 = to_device(backend, dwte_prefill)
        dwpe, dwpe0 = to_device(backend, dwpe_prefill) if with_wpe else (None, None)
        backend.encoder_backward(dwte, dwpe, dout, inp)
        check_accumulated(backend, dwte, dwte0, np64(wte_t.grad), tol(backend, "reduction"), "dwte")
        got_wte = from_device(backend, dwte)
        unused = np.setdiff1d(np.arange(Vp), inp_h.ravel())
        np.testing.assert_array_equal(got_wte[unused], dwte0[unused], err_msg="dwte rows of unused tokens changed")
        got = [got_wte]
        if with_wpe:
            check_accumulated(backend, dwpe, dwpe0, np64(wpe_t.grad), tol(backend, "reduction"), "dwpe")
            got_wpe = from_device(backend, dwpe)
            np.testing.assert_array_equal(got_wpe[T:], dwpe0[T:], err_msg="dwpe rows >= T changed")
            got.append(got_wpe)
        results.append(got)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b, err_msg="encoder_backward is not deterministic")


# =============================================================================================================
# layernorm, residual, rmsnorm

NORM_SHAPES = [(2, 7, 48, 2.0), (3, 5, 96, 1.0), (1, 1, 64, 1.0), (4, 9, 768, 1.0),
               (2, 3, 48, 3e-3), (2, 5, 2048, 1.0),  # B,T,C, input scale (small: eps matters); 2048: Llama 1B's C
               (8, 300, 256, 1.0), (3, 37, 4096, 1.0), (1, 3, 8192, 1.0)]  # rows > blocks; 8B's C; 70B's C


def _ln_inputs(backend, rng, B, T, C, s):
    inp, x = to_device(backend, randn(rng, B, T, C, scale=s, shift=0.35 * s))
    w, w_h = to_device(backend, randn(rng, C, shift=1.0))
    b, b_h = to_device(backend, randn(rng, C))
    return inp, x, w, w_h, b, b_h


def _ln_ref(x, w, b):
    xt = t64(x)
    out = F.layer_norm(xt, (x.shape[-1],), t64(w), t64(b), eps=1e-5)
    mean = xt.mean(-1)
    rstd = 1.0 / torch.sqrt(xt.var(-1, unbiased=False) + 1e-5)
    return np64(out), np64(mean), np64(rstd)


@pytest.mark.parametrize("B,T,C,s", NORM_SHAPES)
def test_layernorm_forward(backend, rng, B, T, C, s):
    inp, x, w, w_h, b, b_h = _ln_inputs(backend, rng, B, T, C, s)
    out, mean, rstd = empty(backend, (B, T, C)), empty(backend, (B, T), FLOAT32), empty(backend, (B, T), FLOAT32)
    backend.layernorm_forward(out, mean, rstd, inp, w, b)
    ro, rm, rr = _ln_ref(x, w_h, b_h)
    assert_close(from_device(backend, out), ro, tol(backend, "reduction"), "out")
    assert_close(from_device(backend, mean), rm, tol(backend, "reduction"), "mean")
    assert_close(from_device(backend, rstd), rr, tol(backend, "reduction"), "rstd")


@pytest.mark.parametrize("B,T,C,s", NORM_SHAPES)
def test_layernorm_backward(backend, rng, B, T, C, s):
    inp, x, w, w_h, b, b_h = _ln_inputs(backend, rng, B, T, C, s)
    _, rm, rr = _ln_ref(x, w_h, b_h)
    mean, _ = to_device(backend, rm, FLOAT32)
    rstd, _ = to_device(backend, rr, FLOAT32)
    dout, dout_h = to_device(backend, randn(rng, B, T, C))
    xt, wt, bt = t64(x, True), t64(w_h, True), t64(b_h, True)
    F.layer_norm(xt, (C,), wt, bt, eps=1e-5).backward(t64(dout_h))
    dinp, dinp0 = prefill(backend, rng, (B, T, C))
    dw, dw0 = prefill(backend, rng, (C,))
    db, db0 = prefill(backend, rng, (C,))
    backend.layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd)
    r = tol(backend, "reduction")
    check_accumulated(backend, dinp, dinp0, np64(xt.grad), r, "dinp")
    check_accumulated(backend, dw, dw0, np64(wt.grad), r, "dweight")
    check_accumulated(backend, db, db0, np64(bt.grad), r, "dbias")


@pytest.mark.parametrize("B,T,C,s", NORM_SHAPES[:3])
def test_fused_residual_layernorm_forward(backend, rng, B, T, C, s):
    in1, x1 = to_device(backend, randn(rng, B, T, C, scale=2.0, shift=0.3))
    in2, x2 = to_device(backend, randn(rng, B, T, C, shift=0.2))
    w, w_h = to_device(backend, randn(rng, C, shift=1.0))
    b, b_h = to_device(backend, randn(rng, C))
    residual, out = empty(backend, (B, T, C)), empty(backend, (B, T, C))
    mean, rstd = empty(backend, (B, T), FLOAT32), empty(backend, (B, T), FLOAT32)
    backend.fused_residual_layernorm_forward(residual, out, mean, rstd, in1, in2, w, b)
    ro, rm, rr = _ln_ref(x1 + x2, w_h, b_h)
    assert_close(from_device(backend, residual), x1 + x2, tol(backend), "residual")
    assert_close(from_device(backend, out), ro, tol(backend, "reduction"), "out")
    assert_close(from_device(backend, mean), rm, tol(backend, "reduction"), "mean")
    assert_close(from_device(backend, rstd), rr, tol(backend, "reduction"), "rstd")


@pytest.mark.parametrize("shape", [(2, 7, 48), (91,), (3, 1, 33), (5, 4099)])
def test_residual_forward(backend, rng, shape):
    a, xa = to_device(backend, randn(rng, *shape))
    b, xb = to_device(backend, randn(rng, *shape))
    out = empty(backend, shape)
    backend.residual_forward(out, a, b)
    assert_close(from_device(backend, out), xa + xb, tol(backend), "out")
    backend.residual_forward(a, a, b)  # out aliasing inp1
    assert_close(from_device(backend, a), xa + xb, tol(backend), "out aliasing inp1")


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("B,T,C,s", NORM_SHAPES)
def test_rmsnorm_forward(backend, rng, B, T, C, s, eps):
    inp, x = to_device(backend, randn(rng, B, T, C, scale=s, shift=0.2 * s))
    w, w_h = to_device(backend, randn(rng, C, shift=1.0))
    out, rstd = empty(backend, (B, T, C)), empty(backend, (B, T), FLOAT32)
    backend.rmsnorm_forward(out, rstd, inp, w, eps)
    xt = t64(x)
    rr = torch.rsqrt(xt.pow(2).mean(-1) + eps)
    ref = xt * rr[..., None] * t64(w_h)
    if hasattr(F, "rms_norm"):  # cross-check the reference itself
        assert np.allclose(np64(F.rms_norm(xt, (C,), t64(w_h), eps=eps)), np64(ref), rtol=1e-12, atol=1e-12)
    assert_close(from_device(backend, out), np64(ref), tol(backend, "reduction"), "out")
    assert_close(from_device(backend, rstd), np64(rr), tol(backend, "reduction"), "rstd")


@pytest.mark.parametrize("B,T,C,s", NORM_SHAPES)
def test_rmsnorm_backward(backend, rng, B, T, C, s):
    eps = 1e-5
    inp, x = to_device(backend, randn(rng, B, T, C, scale=s, shift=0.2 * s))
    w, w_h = to_device(backend, randn(rng, C, shift=1.0))
    xt, wt = t64(x, True), t64(w_h, True)
    rr = torch.rsqrt(xt.pow(2).mean(-1) + eps)
    rstd, _ = to_device(backend, np64(rr), FLOAT32)
    dout, dout_h = to_device(backend, randn(rng, B, T, C))
    (xt * rr[..., None] * wt).backward(t64(dout_h))
    dinp, dinp0 = prefill(backend, rng, (B, T, C))
    dw, dw0 = prefill(backend, rng, (C,))
    backend.rmsnorm_backward(dinp, dw, dout, inp, w, rstd)
    r = tol(backend, "reduction")
    check_accumulated(backend, dinp, dinp0, np64(xt.grad), r, "dinp")
    check_accumulated(backend, dw, dw0, np64(wt.grad), r, "dweight")


# =============================================================================================================
# matmul

# B,T,C,OC; the last two are a few rows (decoding), which a backend may run as matrix-vector products
MM_SHAPES = [(2, 7, 48, 40), (1, 5, 96, 144), (3, 17, 128, 200), (1, 1, 2048, 1003), (8, 1, 64, 33)]


@pytest.mark.parametrize("gelu", [False, True], ids=["plain", "gelu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("B,T,C,OC", MM_SHAPES)
def test_matmul_forward(backend, rng, B, T, C, OC, bias, gelu):
    inp, x = to_device(backend, randn(rng, B, T, C))
    w, w_h = to_device(backend, randn(rng, OC, C, scale=1 / math.sqrt(C)))
    b, b_h = to_device(backend, randn(rng, OC)) if bias else (None, None)
    out = empty(backend, (B, T, OC))
    pre = empty(backend, (B, T, OC)) if gelu else None
    backend.matmul_forward(out, inp, w, b, pre_gelu=pre)
    ref = F.linear(t64(x), t64(w_h), t64(b_h) if bias else None)
    r = tol(backend, "matmul")
    if gelu:
        pre_h = from_device(backend, pre)
        assert_close(pre_h, np64(ref), r, "pre_gelu")
        assert_close(from_device(backend, out), np64(F.gelu(ref, approximate="tanh")), r, "out = gelu(pre_gelu)")
    else:
        assert_close(from_device(backend, out), np64(ref), r, "out")


@pytest.mark.parametrize("variant", ["full", "no-dinp", "no-dbias", "gelu"])
@pytest.mark.parametrize("B,T,C,OC", MM_SHAPES)
def test_matmul_backward(backend, rng, B, T, C, OC, variant):
    use_gelu = variant == "gelu"
    want_dinp = variant != "no-dinp"
    want_dbias = variant != "no-dbias"
    r = tol(backend, "matmul")
    w, w_h = to_device(backend, randn(rng, OC, C, scale=1 / math.sqrt(C)))
    dout, dout_h = to_device(backend, randn(rng, B, T, OC))
    pre, pre_h = None, None
    if use_gelu:  # the matmul's input was gelu(pre_gelu); dinp is the gradient w.r.t. pre_gelu
        pre, pre_h = to_device(backend, randn(rng, B, T, C, scale=1.5))
        inp, x = to_device(backend, np64(F.gelu(t64(pre_h), approximate="tanh")))
    else:
        inp, x = to_device(backend, randn(rng, B, T, C))
    xt, wt, bt = t64(x, True), t64(w_h, True), t64(randn(rng, OC), True)
    F.linear(xt, wt, bt).backward(t64(dout_h))
    dinp_ref = xt.grad
    if use_gelu:
        pt = t64(pre_h, True)
        F.gelu(pt, approximate="tanh").backward(dinp_ref)
        dinp_ref = pt.grad
    dinp = empty(backend, (B, T, C)) if want_dinp else None
    dw, dw0 = prefill(backend, rng, (OC, C))
    db, db0 = prefill(backend, rng, (OC,)) if want_dbias else (None, None)
    backend.matmul_backward(dinp, dw, db, dout, inp, w, pre_gelu=pre)
    if want_dinp:
        assert_close(from_device(backend, dinp), np64(dinp_ref), r, "dinp (overwritten)")
    check_accumulated(backend, dw, dw0, np64(wt.grad), r, "dweight")
    if want_dbias:
        check_accumulated(backend, db, db0, np64(bt.grad), r, "dbias")
    # the inputs are left alone
    np.testing.assert_array_equal(from_device(backend, dout), dout_h)
    np.testing.assert_array_equal(from_device(backend, inp), x)


# =============================================================================================================
# FP8 matmuls (CAP_FP8: dtype=FP8 asked at creation). Shapes with every dimension a multiple of 16 (what FP8 tensor
# cores take) and one without, which the backend may serve in bf16; the bounds are FP8's either way.

FP8_SHAPES = [(2, 64, 128, 192), (4, 32, 256, 64), (1, 48, 64, 2048), (3, 17, 128, 200)]


def test_fp8_backend_declares_itself(fp8_backend):
    assert CAP_FP8 in fp8_backend.capabilities
    assert fp8_backend.dtype == BFLOAT16, "an FP8 backend keeps its buffers in bfloat16"
    assert fp8_backend.matmul_dtype == FP8


@pytest.mark.parametrize("bias,gelu", [(False, False), (True, False), (True, True)], ids=["plain", "bias", "gelu"])
@pytest.mark.parametrize("B,T,C,OC", FP8_SHAPES)
def test_fp8_matmul_forward(fp8_backend, rng, B, T, C, OC, bias, gelu):
    k = fp8_backend
    inp, x = to_device(k, randn(rng, B, T, C))
    w, w_h = to_device(k, randn(rng, OC, C, scale=1 / math.sqrt(C)))
    b, b_h = to_device(k, randn(rng, OC)) if bias else (None, None)
    out, again = empty(k, (B, T, OC)), empty(k, (B, T, OC))
    pre = empty(k, (B, T, OC)) if gelu else None
    k.matmul_forward(out, inp, w, b, pre_gelu=pre)
    ref = F.linear(t64(x), t64(w_h), t64(b_h) if bias else None)
    if gelu:
        assert_close(from_device(k, pre), np64(ref), FP8_TOL["forward"], "pre_gelu")
        ref = F.gelu(ref, approximate="tanh")
    assert_close(from_device(k, out), np64(ref), FP8_TOL["forward"], "out")
    k.matmul_forward(again, inp, w, b, pre_gelu=pre)
    np.testing.assert_array_equal(from_device(k, again), from_device(k, out), "a second call differs (determinism)")
    np.testing.assert_array_equal(from_device(k, inp), x)
    np.testing.assert_array_equal(from_device(k, w), w_h)


@pytest.mark.parametrize("variant", ["full", "no-dinp", "gelu"])
@pytest.mark.parametrize("B,T,C,OC", FP8_SHAPES)
def test_fp8_matmul_backward(fp8_backend, rng, B, T, C, OC, variant):
    k = fp8_backend
    w, w_h = to_device(k, randn(rng, OC, C, scale=1 / math.sqrt(C)))
    dout, dout_h = to_device(k, randn(rng, B, T, OC, scale=1e-3))  # gradients are small: scales must follow
    pre, pre_h = None, None
    if variant == "gelu":
        pre, pre_h = to_device(k, randn(rng, B, T, C, scale=1.5))
        inp, x = to_device(k, np64(F.gelu(t64(pre_h), approximate="tanh")))
    else:
        inp, x = to_device(k, randn(rng, B, T, C))
    xt, wt, bt = t64(x, True), t64(w_h, True), t64(randn(rng, OC), True)
    F.linear(xt, wt, bt).backward(t64(dout_h))
    dinp_ref = xt.grad
    if pre is not None:
        pt = t64(pre_h, True)
        F.gelu(pt, approximate="tanh").backward(dinp_ref)
        dinp_ref = pt.grad
    dinp = empty(k, (B, T, C)) if variant != "no-dinp" else None
    dw, dw0 = prefill(k, rng, (OC, C), scale=1e-3)
    db, db0 = prefill(k, rng, (OC,), scale=1e-3)
    k.matmul_backward(dinp, dw, db, dout, inp, w, pre_gelu=pre)
    if dinp is not None:
        assert_close(from_device(k, dinp), np64(dinp_ref), FP8_TOL["backward"], "dinp (overwritten)")
    check_accumulated(k, dw, dw0, np64(wt.grad), FP8_TOL["backward"], "dweight")
    check_accumulated(k, db, db0, np64(bt.grad), tol(k, "reduction"), "dbias")
    np.testing.assert_array_equal(from_device(k, dout), dout_h)
    np.testing.assert_array_equal(from_device(k, inp), x)


def test_fp8_scales_follow_the_magnitudes(fp8_backend, rng):
    """Per-tensor scales: inputs far from 1 (1e-30, 1e30 in bf16) keep FP8's relative error, and all-zero
    operands give exact zeros, not NaN (a scale of 1/0)."""
    k = fp8_backend
    B, T, C, OC = 2, 32, 128, 64
    for s in (1e-30, 1e30):
        inp, x = to_device(k, randn(rng, B, T, C, scale=s))
        w, w_h = to_device(k, randn(rng, OC, C, scale=1 / (s * math.sqrt(C))))
        out = empty(k, (B, T, OC))
        k.matmul_forward(out, inp, w)
        assert_close(from_device(k, out), np64(F.linear(t64(x), t64(w_h))), FP8_TOL["forward"], f"scale {s}")
    zero, _ = to_device(k, np.zeros((B, T, OC), np.float32))
    inp, _ = to_device(k, randn(rng, B, T, C))
    w, _ = to_device(k, randn(rng, OC, C))
    dinp = empty(k, (B, T, C))
    dw, dw0 = prefill(k, rng, (OC, C))
    k.matmul_backward(dinp, dw, None, zero, inp, w)
    assert (from_device(k, dinp) == 0).all(), "a zero gradient must give dinp = 0 exactly"
    np.testing.assert_array_equal(from_device(k, dw), dw0, "dweight += 0 must leave it as it was")


def test_fp8_precise_products_stay_in_the_compute_dtype(fp8_backend, rng):
    """`precise=True` (the classifier) is computed in bf16: within bf16's bound, far inside FP8's."""
    k = fp8_backend
    B, T, C, OC = 2, 64, 128, 256
    inp, x = to_device(k, randn(rng, B, T, C))
    w, w_h = to_device(k, randn(rng, OC, C, scale=1 / math.sqrt(C)))
    out = empty(k, (B, T, OC))
    k.matmul_forward(out, inp, w, precise=True)
    ref = F.linear(t64(x), t64(w_h))
    assert_close(from_device(k, out), np64(ref), tol(k, "reduction"), "out")
    dout, dout_h = to_device(k, randn(rng, B, T, OC))
    dinp = empty(k, (B, T, C))
    dw, dw0 = prefill(k, rng, (OC, C))
    k.matmul_backward(dinp, dw, None, dout, inp, w, precise=True)
    xt, wt = t64(x, True), t64(w_h, True)
    F.linear(xt, wt).backward(t64(dout_h))
    assert_close(from_device(k, dinp), np64(xt.grad), tol(k, "reduction"), "dinp")
    check_accumulated(k, dw, dw0, np64(wt.grad), tol(k, "reduction"), "dweight")


def _norm_ref(x, w, b=None, eps=1e-5):
    """(out, mean, rstd) of layernorm (with b) or rmsnorm (without), float64."""
    mean = x.mean(-1, keepdims=True) if b is not None else np.zeros(x.shape[:-1] + (1,))
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    out = (x - mean) * rstd * w + (b if b is not None else 0)
    return out, mean[..., 0], rstd[..., 0]


@pytest.mark.parametrize("producer", ["layernorm", "fused_residual_layernorm", "rmsnorm", "swiglu_forward",
                                      "swiglu_backward"])
def test_fp8_producer_outputs_reach_their_product(fp8_backend, rng, producer):
    """fp8_next (Backend.matmul_forward's FP8 producers): a producer told which product reads its output next, then
    that product (forward and backward; for swiglu_backward, the backward its gradient feeds), over two training
    steps, since a delayed-scaling backend writes the operand itself only once a step gave the tensor a history.
    The product's outputs stay within FP8's bounds of the float64 layer, the producer's others as ever."""
    k = fp8_backend
    N, C, H, OC = 128, 128, 96, 192
    x, xh = to_device(k, randn(rng, N, C))
    g, gh = to_device(k, 1 + randn(rng, C, scale=0.2))
    b, bh = to_device(k, randn(rng, C, scale=0.2))
    h13, h13h = to_device(k, randn(rng, N, 2 * H))
    dhs, dhsh = to_device(k, randn(rng, N, H, scale=1e-2))
    dy, dyh = to_device(k, randn(rng, N, OC, scale=1e-2))
    stats = (empty(k, (N,), FLOAT32), empty(k, (N,), FLOAT32))
    if producer == "swiglu_backward":  # the gate/up projection's backward reads the gradient SwiGLU writes
        w, wh = to_device(k, randn(rng, 2 * H, C, scale=1 / math.sqrt(C)))
        sig = 1 / (1 + np.exp(-h13h[:, :H]))
        dref = np.concatenate([dhsh * h13h[:, H:] * sig * (1 + h13h[:, :H] * (1 - sig)),
                               dhsh * h13h[:, :H] * sig], axis=1)
        out = empty(k, (N, 2 * H))
        for step in range(2):
            k.begin_step()
            k.swiglu_backward(out, dhs, h13, fp8_next=w)
            dx, dw = empty(k, (N, C)), to_device(k, np.zeros((2 * H, C)))[0]
            k.matmul_backward(dx, dw, None, out, x, w)
            k.end_step()
        assert_close(from_device(k, dx), dref @ wh, FP8_TOL["backward"], "dinp")
        assert_close(from_device(k, dw), dref.T @ xh, FP8_TOL["backward"], "dweight")
        return
    width = H if producer == "swiglu_forward" else C
    w, wh = to_device(k, randn(rng, OC, width, scale=1 / math.sqrt(width)))
    res, out = empty(k, (N, C)), empty(k, (N, width))
    run = {"layernorm": lambda: k.layernorm_forward(out, *stats, x, g, b, fp8_next=w),
           "fused_residual_layernorm": lambda: k.fused_residual_layernorm_forward(res, out, *stats, x, x, g, b,
                                                                                  fp8_next=w),
           "rmsnorm": lambda: k.rmsnorm_forward(out, stats[1], x, g, 1e-5, fp8_next=w),
           "swiglu_forward": lambda: k.swiglu_forward(out, h13, fp8_next=w)}[producer]
    if producer == "swiglu_forward":
        ref = h13h[:, :H] / (1 + np.exp(-h13h[:, :H])) * h13h[:, H:]
    else:
        ref, mean, rstd = _norm_ref(2 * xh if producer.startswith("fused") else xh, gh,
                                    None if producer == "rmsnorm" else bh)
    for step in range(2):
        k.begin_step()
        run()
        y, dp, dw = empty(k, (N, OC)), empty(k, (N, width)), to_device(k, np.zeros((OC, width)))[0]
        k.matmul_forward(y, out, w)
        k.matmul_backward(dp, dw, None, dy, out, w)
        k.end_step()
    assert_close(from_device(k, y), ref @ wh.T, FP8_TOL["forward"], "out")
    assert_close(from_device(k, dp), dyh @ wh, FP8_TOL["backward"], "dinp")
    assert_close(from_device(k, dw), dyh.T @ ref, FP8_TOL["backward"], "dweight")
    if producer != "swiglu_forward":
        assert_close(from_device(k, stats[1]), rstd, tol(k, "reduction"), "rstd")


@pytest.mark.parametrize("producer", ["gelu", "matmul_gelu"])
def test_fp8_gelu_outputs_reach_their_product(fp8_backend, rng, producer):
    """GELU as an FP8 producer (GPT-2's MLP): gelu_forward, or matmul_forward with pre_gelu, told which product
    reads its output next; then that product (with a bias) forward, and backward with GELU's derivative, as in the
    engine, over two steps (see test_fp8_producer_outputs_reach_their_product). Within FP8's bounds of the float64
    layer; dweight and dbias accumulate once."""
    k = fp8_backend
    N, C, H, OC = 128, 128, 96, 192
    x, xh = to_device(k, randn(rng, N, C))
    w1, w1h = to_device(k, randn(rng, H, C, scale=1 / math.sqrt(C)))
    b1, b1h = to_device(k, randn(rng, H, scale=0.2))
    w, wh = to_device(k, randn(rng, OC, H, scale=1 / math.sqrt(H)))
    b, bh = to_device(k, randn(rng, OC, scale=0.2))
    dy, dyh = to_device(k, randn(rng, N, OC, scale=1e-2))
    pre, out = (to_device(k, randn(rng, N, H))[0] if producer == "gelu" else empty(k, (N, H))), empty(k, (N, H))
    for step in range(2):
        k.begin_step()
        if producer == "gelu":
            k.gelu_forward(out, pre, fp8_next=w)
        else:
            k.matmul_forward(out, x, w1, b1, pre_gelu=pre, fp8_next=w)
        y, dp = empty(k, (N, OC)), empty(k, (N, H))
        (dw, dw0), (db, db0) = prefill(k, rng, (OC, H), scale=1e-3), prefill(k, rng, (OC,), scale=1e-3)
        k.matmul_forward(y, out, w, b)
        k.matmul_backward(dp, dw, db, dy, out, w, pre_gelu=pre)
        k.end_step()
    preh = from_device(k, pre).astype(np.float64)
    if producer == "matmul_gelu":
        assert_close(preh, xh @ w1h.T + b1h, FP8_TOL["forward"], "pre_gelu")
    pt = t64(preh, True)
    ref = F.gelu(pt, approximate="tanh")
    ref.backward(t64(dyh @ wh))
    assert_close(from_device(k, y), np64(ref) @ wh.T + bh, FP8_TOL["forward"], "out")
    assert_close(from_device(k, dp), np64(pt.grad), FP8_TOL["backward"], "dinp")
    check_accumulated(k, dw, dw0, dyh.T @ np64(ref), FP8_TOL["backward"], "dweight")
    check_accumulated(k, db, db0, dyh.sum(0), tol(k, "reduction"), "dbias")


# =============================================================================================================
# gelu, swiglu

ELT_SHAPES = [(2, 7, 48), (91,), (3, 5, 4099)]


@pytest.mark.parametrize("shape", ELT_SHAPES)
def test_gelu_forward(backend, rng, shape):
    inp, x = to_device(backend, randn(rng, *shape, scale=2.0))
    out = empty(backend, shape)
    backend.gelu_forward(out, inp)
    assert_close(from_device(backend, out), np64(F.gelu(t64(x), approximate="tanh")), tol(backend), "out")


@pytest.mark.parametrize("alias", [False, True], ids=["separate", "dinp-is-dout"])
@pytest.mark.parametrize("shape", ELT_SHAPES)
def test_gelu_backward(backend, rng, shape, alias):
    inp, x = to_device(backend, randn(rng, *shape, scale=2.0))
    dout, g = to_device(backend, randn(rng, *shape))
    xt = t64(x, True)
    F.gelu(xt, approximate="tanh").backward(t64(g))
    dinp = dout if alias else empty(backend, shape)
    backend.gelu_backward(dinp, inp, dout)
    assert_close(from_device(backend, dinp), np64(xt.grad), tol(backend), "dinp")


SWIGLU_SHAPES = [(2, 7, 40), (1, 3, 17), (3, 11, 1376)]  # B,T,H


@pytest.mark.parametrize("B,T,H", SWIGLU_SHAPES)
def test_swiglu_forward(backend, rng, B, T, H):
    inp, x = to_device(backend, randn(rng, B, T, 2 * H, scale=2.0))
    out = empty(backend, (B, T, H))
    backend.swiglu_forward(out, inp)
    xt = t64(x)
    ref = F.silu(xt[..., :H]) * xt[..., H:]
    assert_close(from_device(backend, out), np64(ref), tol(backend), "out")


@pytest.mark.parametrize("B,T,H", SWIGLU_SHAPES)
def test_swiglu_backward(backend, rng, B, T, H):
    inp, x = to_device(backend, randn(rng, B, T, 2 * H, scale=2.0))
    dout, g = to_device(backend, randn(rng, B, T, H))
    xt = t64(x, True)
    (F.silu(xt[..., :H]) * xt[..., H:]).backward(t64(g))
    dinp = empty(backend, (B, T, 2 * H))
    backend.swiglu_backward(dinp, dout, inp)
    assert_close(from_device(backend, dinp), np64(xt.grad), tol(backend), "dinp [dgate | dup]")


# =============================================================================================================
# rope

ROPE_CASES = [(2, 7, 4, 4, 8, 12), (1, 9, 4, 2, 16, 9), (2, 5, 6, 1, 32, 20), (1, 33, 8, 2, 64, 40),
              (1, 4, 2, 1, 6, 8)]  # B,T,NH,NKV,hd,maxT; the last has no 16-byte packs of pairs


def freqs_cis_host(hd: int, maxT: int, theta: float = 500000.0) -> np.ndarray:
    """(maxT, hd/2, 2) = (cos, sin), as Meta's precompute_freqs_cis."""
    freqs = 1.0 / theta ** (np.arange(0, hd, 2)[: hd // 2] / hd)
    ang = np.outer(np.arange(maxT), freqs)
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1)


def rope_ref(qkv: torch.Tensor, fc: np.ndarray, NH: int, NKV: int) -> torch.Tensor:
    """Meta's apply_rotary_emb: interleaved pairs as complex numbers, times cis; v passes through."""
    B, T, W = qkv.shape
    hd = W // (NH + 2 * NKV)
    qk = qkv[..., :(NH + NKV) * hd].reshape(B, T, NH + NKV, hd // 2, 2).contiguous()
    z = torch.view_as_complex(qk)
    cis = torch.view_as_complex(t64(fc[:T]).contiguous())  # (T, hd/2)
    rot = torch.view_as_real(z * cis[None, :, None, :]).reshape(B, T, (NH + NKV) * hd)
    return torch.cat([rot, qkv[..., (NH + NKV) * hd:]], dim=-1)


@pytest.mark.parametrize("B,T,NH,NKV,hd,maxT", ROPE_CASES)
def test_rope_forward(backend, rng, B, T, NH, NKV, hd, maxT):
    W = (NH + 2 * NKV) * hd
    fc, fc_h = to_device(backend, freqs_cis_host(hd, maxT), FLOAT32)
    qkv, x = to_device(backend, randn(rng, B, T, W))
    backend.rope_forward(qkv, fc, NH, NKV)
    got = from_device(backend, qkv)
    ref = np64(rope_ref(t64(x), fc_h, NH, NKV))
    split = (NH + NKV) * hd
    assert_close(got[..., :split], ref[..., :split], tol(backend), "rotated q, k")
    np.testing.assert_array_equal(got[..., split:], x[..., split:], err_msg="v must be untouched")


@pytest.mark.parametrize("B,T,NH,NKV,hd,maxT", ROPE_CASES)
def test_rope_backward(backend, rng, B, T, NH, NKV, hd, maxT):
    W = (NH + 2 * NKV) * hd
    fc, fc_h = to_device(backend, freqs_cis_host(hd, maxT), FLOAT32)
    x = t64(randn(rng, B, T, W), True)
    dqkv, g = to_device(backend, randn(rng, B, T, W))
    rope_ref(x, fc_h, NH, NKV).backward(t64(g))
    backend.rope_backward(dqkv, fc, NH, NKV)
    got = from_device(backend, dqkv)
    split = (NH + NKV) * hd
    assert_close(got[..., :split], np64(x.grad)[..., :split], tol(backend), "dq, dk")
    np.testing.assert_array_equal(got[..., split:], g[..., split:], err_msg="dv must be untouched")


def test_rope_backward_inverts_forward(backend, rng):
    B, T, NH, NKV, hd = 2, 7, 4, 2, 16
    fc, _ = to_device(backend, freqs_cis_host(hd, T), FLOAT32)
    qkv, x = to_device(backend, randn(rng, B, T, (NH + 2 * NKV) * hd))
    backend.rope_forward(qkv, fc, NH, NKV)
    backend.rope_backward(qkv, fc, NH, NKV)  # rotation is orthogonal: backward = inverse
    assert_close(from_device(backend, qkv), x, 2 * tol(backend), "rope_backward(rope_forward(x))")


# =============================================================================================================
# attention

ATT_CASES = [  # B, T, NH, NKV, hd
    (2, 7, 3, 3, 8),      # multi-head
    (1, 13, 4, 2, 16),    # grouped-query
    (2, 9, 4, 1, 8),      # multi-query
    (1, 1, 2, 2, 8),      # a single position
    (1, 70, 4, 4, 32),    # several tiles
    (2, 67, 6, 2, 64),    # GQA, several tiles, GPT-2's head size
    (1, 80, 2, 1, 128),   # Llama's head size, a partial tile
]
ATT_IDS = [f"B{b}T{t}NH{nh}NKV{nkv}hd{hd}" for b, t, nh, nkv, hd in ATT_CASES]


def attention_ref(qkv: torch.Tensor, NH: int, NKV: int):
    """Explicit causal softmax attention: (out (B,T,NH*hd), lse (B,NH,T))."""
    B, T, W = qkv.shape
    hd = W // (NH + 2 * NKV)
    q = qkv[..., :NH * hd].reshape(B, T, NH, hd).transpose(1, 2)
    k = qkv[..., NH * hd:(NH + NKV) * hd].reshape(B, T, NKV, hd).transpose(1, 2)
    v = qkv[..., (NH + NKV) * hd:].reshape(B, T, NKV, hd).transpose(1, 2)
    k = k.repeat_interleave(NH // NKV, dim=1)  # query head h uses kv head h // (NH/NKV)
    v = v.repeat_interleave(NH // NKV, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    y = torch.softmax(s, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, NH * hd), lse, (q, k, v)


@pytest.mark.parametrize("B,T,NH,NKV,hd", ATT_CASES, ids=ATT_IDS)
def test_attention_forward(backend, rng, B, T, NH, NKV, hd):
    W = (NH + 2 * NKV) * hd
    qkv, x = to_device(backend, randn(rng, B, T, W))
    out, lse = empty(backend, (B, T, NH * hd)), empty(backend, (B, NH, T), FLOAT32)
    backend.attention_forward(out, lse, qkv, NH, NKV)
    ref, ref_lse, (q, k, v) = attention_ref(t64(x), NH, NKV)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, NH * hd)
    assert np.allclose(np64(sdpa), np64(ref), atol=1e-10), "the reference disagrees with torch's SDPA"
    r = tol(backend, "reduction")
    assert_close(from_device(backend, out), np64(ref), r, "out")
    assert_close(from_device(backend, lse), np64(ref_lse), r, "lse")
    np.testing.assert_array_equal(from_device(backend, qkv), x, err_msg="qkv must be left alone")


@pytest.mark.parametrize("B,T,NH,NKV,hd", ATT_CASES, ids=ATT_IDS)
def test_attention_backward(backend, rng, B, T, NH, NKV, hd):
    W = (NH + 2 * NKV) * hd
    qkv, x = to_device(backend, randn(rng, B, T, W))
    xt = t64(x, True)
    ref, ref_lse, _ = attention_ref(xt, NH, NKV)
    out, _ = to_device(backend, np64(ref))
    lse, _ = to_device(backend, np64(ref_lse), FLOAT32)
    dout, g = to_device(backend, randn(rng, B, T, NH * hd))
    ref.backward(t64(g))
    dqkv = empty(backend, (B, T, W))
    backend.attention_backward(dqkv, dout, qkv, out, lse, NH, NKV)
    got = from_device(backend, dqkv)
    want = np64(xt.grad)
    r = tol(backend, "reduction")
    for name, lo, hi in (("dq", 0, NH * hd), ("dk", NH * hd, (NH + NKV) * hd), ("dv", (NH + NKV) * hd, W)):
        assert_close(got[..., lo:hi], want[..., lo:hi], r, name)


# attention over a key/value cache (CAP_KV_CACHE): the cache is a ring of S slots, position p in slot p % S
# (B, NH, NKV, hd, S, pos, Tn): a prompt chunk from 0, a chunk in the middle, a whole cache in one chunk, single
# tokens at the end of the ring and past it (the window slides), several key tiles, GQA and multi-query
DECODE_CASES = [
    (1, 2, 2, 8, 16, 0, 5), (2, 4, 2, 16, 16, 7, 4), (1, 2, 1, 8, 12, 0, 12), (2, 4, 4, 8, 16, 15, 1),
    (1, 4, 2, 16, 16, 19, 1), (2, 6, 2, 64, 300, 1203, 1), (1, 8, 2, 64, 300, 130, 64), (1, 4, 1, 32, 9, 40, 1),
]
DECODE_IDS = [f"B{b}NH{nh}NKV{nkv}hd{hd}S{s}pos{p}Tn{t}" for b, nh, nkv, hd, s, p, t in DECODE_CASES]


@pytest.mark.parametrize("pos_in", ["int", "buffer"])
@pytest.mark.parametrize("B,NH,NKV,hd,S,pos,Tn", DECODE_CASES, ids=DECODE_IDS)
def test_attention_decode(kv_backend, rng, B, NH, NKV, hd, S, pos, Tn, pos_in):
    backend = kv_backend
    if pos_in == "buffer" and Tn != 1:
        pytest.skip("a position held in a buffer comes with one new token")
    P = pos + Tn  # positions 0..P-1 exist once the call is done
    keys, values = randn(rng, B, NKV, P, hd), randn(rng, B, NKV, P, hd)
    q = randn(rng, B, Tn, NH * hd)
    def new(x):  # the new positions' rows in qkv's layout (B, Tn, NKV*hd)
        return x[:, :, pos:].transpose(0, 2, 1, 3).reshape(B, Tn, NKV * hd)
    qkv, x = to_device(backend, np.concatenate([q, new(keys), new(values)], axis=-1))
    # the ring before the call: slot s holds the newest earlier position p = s (mod S); slots no earlier position
    # reached are poisoned, since no query may read them
    before_k = np.full((B, NKV, S, hd), np.nan, np.float32)
    before_v = before_k.copy()
    for p in range(max(0, pos - S), pos):
        before_k[:, :, p % S], before_v[:, :, p % S] = keys[:, :, p], values[:, :, p]
    k_cache, k0 = to_device(backend, before_k)
    v_cache, v0 = to_device(backend, before_v)
    out = empty(backend, (B, Tn, NH * hd))
    where = pos if pos_in == "int" else to_device(backend, np.array([pos], np.int32))[0]
    backend.attention_decode(out, qkv, k_cache, v_cache, where, NH, NKV)

    # what the call should leave: the new positions' k, v (as the device holds them) in their slots, the rest
    # untouched; each query attends to the S positions up to its own
    xk = x[..., NH * hd:(NH + NKV) * hd].reshape(B, Tn, NKV, hd).transpose(0, 2, 1, 3)
    xv = x[..., (NH + NKV) * hd:].reshape(B, Tn, NKV, hd).transpose(0, 2, 1, 3)
    want_k, want_v = k0.copy(), v0.copy()
    all_k, all_v = t64(keys), t64(values)
    for i in range(Tn):
        want_k[:, :, (pos + i) % S], want_v[:, :, (pos + i) % S] = xk[:, :, i], xv[:, :, i]
        all_k[:, :, pos + i], all_v[:, :, pos + i] = t64(xk[:, :, i]), t64(xv[:, :, i])
    want = torch.empty(B, Tn, NH, hd, dtype=torch.float64)
    qd = t64(x[..., :NH * hd]).reshape(B, Tn, NH, hd)
    for i in range(Tn):
        lo, hi = max(0, pos + i - S + 1), pos + i + 1
        kk = all_k[:, :, lo:hi].repeat_interleave(NH // NKV, dim=1)  # (B,NH,n,hd)
        vv = all_v[:, :, lo:hi].repeat_interleave(NH // NKV, dim=1)
        s = torch.einsum("bhd,bhnd->bhn", qd[:, i], kk) / math.sqrt(hd)
        want[:, i] = torch.einsum("bhn,bhnd->bhd", torch.softmax(s, dim=-1), vv)
    assert_close(from_device(backend, out), np64(want.reshape(B, Tn, NH * hd)), tol(backend, "reduction"), "out")
    np.testing.assert_array_equal(from_device(backend, k_cache), want_k, err_msg="k_cache")
    np.testing.assert_array_equal(from_device(backend, v_cache), want_v, err_msg="v_cache")
    np.testing.assert_array_equal(from_device(backend, qkv), x, err_msg="qkv must be left alone")


@pytest.mark.parametrize("pos,Tn,S", [(10, 4, 12), (0, 13, 12), (-1, 1, 12), (3, 0, 12)])
def test_attention_decode_refuses_a_chunk_the_ring_cannot_hold(kv_backend, pos, Tn, S):
    B, NH, NKV, hd = 1, 2, 1, 8
    qkv = empty(kv_backend, (B, max(Tn, 1), (NH + 2 * NKV) * hd))
    k_cache, v_cache = empty(kv_backend, (B, NKV, S, hd)), empty(kv_backend, (B, NKV, S, hd))
    out = empty(kv_backend, (B, max(Tn, 1), NH * hd))
    with pytest.raises(ValueError, match="attention_decode"):
        kv_backend.attention_decode(out, qkv if Tn else kv_backend.view(qkv, 0, (B, 0, qkv.shape[-1])), k_cache,
                                    v_cache, pos, NH, NKV)


# drawing the next token where the logits are (CAP_SAMPLING): inference.sampling.choose_token's rule with top_k 0
# and top_p 1, from the same uniform. (V, Vp, logit scale): a padded row, a flat and a peaked one, GPT-2's and Llama
# 3's vocabularies (several ids a thread and a warp's walk over many rows)
SAMPLE_CASES = [(50, 64, 3.0), (1000, 1000, 0.3), (50257, 50304, 2.0), (128256, 128256, 6.0)]


class _Uniform:
    """choose_token's generator, drawing a given uniform."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def _sampling_backend(backend):
    if CAP_SAMPLING not in backend.capabilities:
        pytest.skip(f"backend '{backend.name}' does not announce the {CAP_SAMPLING} capability")
    return backend


@pytest.mark.parametrize("V,Vp,scale", SAMPLE_CASES, ids=[f"V{v}Vp{p}x{s:g}" for v, p, s in SAMPLE_CASES])
def test_sample_token_draws_as_choose_token(backend, rng, V, Vp, scale):
    from llmc_cli.inference.sampling import choose_token
    backend = _sampling_backend(backend)
    x = randn(rng, Vp, scale=scale)
    x[V // 3] = x[V - 2] = x.max() + 1.0  # a tie for the largest: the first id wins it
    row, held = to_device(backend, x)
    out = empty(backend, (2,), INT32)
    for temperature in (0.0, 1.0, 0.7, 2.5):
        for u in [0.0, 0.5, 0.999999] + list(rng.random(10)):
            poison(backend, out)
            backend.sample_token(out, row, float(u), temperature, V)
            want = choose_token(held[:V], _Uniform(float(u)), temperature)
            got = tuple(from_device(backend, out))
            assert got == (want, 0), f"temperature {temperature}, u {u}: drew {got[0]}, choose_token {want}"
    np.testing.assert_array_equal(from_device(backend, row), held, err_msg="the logits must be left alone")


def test_sample_token_counts_logits_it_cannot_draw_from(backend, rng):
    """NaN and +inf are counted (the host's error names how many), -inf is a masked id drawn never (all of them:
    the count is V), and the padding past V is not read."""
    from llmc_cli.inference.sampling import choose_token
    backend = _sampling_backend(backend)
    V, Vp = 3000, 3008
    out = empty(backend, (2,), INT32)
    for what, bad in (("nan+inf", 5), ("masked", 0), ("all masked", V), ("pad", 0)):
        x = randn(rng, Vp)
        x[V:] = np.nan if what == "pad" else x[V:]
        if what == "nan+inf":
            x[[3, 700, 2999]], x[[5, 1500]] = np.nan, np.inf
        if what == "masked":
            x[: V - 7] = -np.inf
        if what == "all masked":
            x[:V] = -np.inf
        row, held = to_device(backend, x)
        for temperature in (0.0, 1.0):
            for u in (0.0, 0.3, 0.99):
                poison(backend, out)
                backend.sample_token(out, row, u, temperature, V)
                tok, got_bad = from_device(backend, out)
                assert got_bad == bad, f"{what}: counted {got_bad}, expected {bad}"
                if not bad:
                    assert tok == choose_token(held[:V], _Uniform(u), temperature), what


def test_capture_replays_the_recorded_calls_on_new_inputs(backend, rng):
    """CAP_GRAPHS: a captured run of kernels replays them with whatever the input buffers hold at replay time,
    including a decode step whose position comes from a buffer."""
    from llmc_cli.kernels import CAP_GRAPHS
    if CAP_GRAPHS not in backend.capabilities:
        pytest.skip(f"backend '{backend.name}' does not announce the {CAP_GRAPHS} capability")
    B, NH, NKV, hd, S = 1, 4, 2, 16, 8
    W = (NH + 2 * NKV) * hd
    x, _ = to_device(backend, randn(rng, 3, 5, 32))
    y, hy = to_device(backend, randn(rng, 3, 5, 32))
    out = empty(backend, (3, 5, 32))
    qkv, _ = to_device(backend, randn(rng, B, 1, W))
    kc, vc = to_device(backend, randn(rng, B, NKV, S, hd))[0], to_device(backend, randn(rng, B, NKV, S, hd))[0]
    att = empty(backend, (B, 1, NH * hd))
    pos = to_device(backend, np.array([0], np.int32))[0]

    def step():
        backend.residual_forward(out, x, y)
        backend.attention_decode(att, qkv, kc, vc, pos, NH, NKV)
    step()  # the uncaptured first run
    replay = backend.capture(step)
    for p in (3, 11):  # positions past the ring's end too
        hx, hq = randn(rng, 3, 5, 32), randn(rng, B, 1, W)
        backend.upload(x, hx)
        backend.upload(qkv, hq)
        backend.upload(pos, np.array([p], np.int32))
        poison(backend, out, att)
        ref_att = empty(backend, (B, 1, NH * hd))
        kc_ref, vc_ref = (to_device(backend, from_device(backend, c).astype(np.float32))[0] for c in (kc, vc))
        backend.attention_decode(ref_att, qkv, kc_ref, vc_ref, p, NH, NKV)  # uncaptured, the same inputs
        replay()
        assert_close(from_device(backend, out), hx.astype(np.float64) + hy, tol(backend), "residual")
        assert_close(from_device(backend, att), from_device(backend, ref_att), tol(backend), "attention_decode")
        np.testing.assert_array_equal(from_device(backend, kc), from_device(backend, kc_ref), err_msg="k_cache")


def test_input_queue_hands_batches_over_in_order(backend, rng):
    """Backend.input_queue (the default, or CAP_ASYNC_INPUTS's copies on a side stream): after each take() the
    buffers hold, for the work enqueued next, the oldest batch put; `depth` batches may wait, one more is refused,
    and so is a take() with none. The next batch is put right after each take, as the trainer does."""
    x, y = empty(backend, (3, 5), INT32), empty(backend, (4,), FLOAT32)
    batches = [(rng.integers(0, 50000, (3, 5)).astype(np.int32), randn(rng, 4).astype(np.float32)) for _ in range(6)]
    seen = [(empty(backend, (3, 5), INT32), empty(backend, (4,), FLOAT32)) for _ in batches]
    q = backend.input_queue([x, y], depth=2)
    q.put(batches[0])
    q.put(batches[1])
    with pytest.raises(ValueError):
        q.put(batches[2])
    with pytest.raises(ValueError):
        q.put(batches[2][:1])  # one array for two buffers
    for k, (sx, sy) in enumerate(seen):
        q.take()
        backend.copy(sx, x)  # work enqueued after the take reads the batch
        backend.copy(sy, y)
        if k + 2 < len(batches):
            q.put(batches[k + 2])
    with pytest.raises(ValueError):
        q.take()
    for k, ((hx, hy), (sx, sy)) in enumerate(zip(batches, seen)):
        np.testing.assert_array_equal(from_device(backend, sx), hx, err_msg=f"inputs of batch {k}")
        np.testing.assert_array_equal(from_device(backend, sy), hy, err_msg=f"float32 values of batch {k}")


# =============================================================================================================
# fused classifier

# the last: Llama 3's vocabulary, a row too large for one block's shared memory on a GPU (bf16: 250 KiB)
CLS_CASES = [(2, 7, 50, 64), (1, 5, 37, 37), (3, 11, 1000, 1024), (1, 3, 50257, 50304), (1, 2, 128256, 128256)]


@pytest.mark.parametrize("dloss", [None, "mean", 0.37], ids=["no-dloss", "dloss-1/N", "dloss-0.37"])
@pytest.mark.parametrize("B,T,V,Vp", CLS_CASES)
def test_classifier_forward_backward(backend, rng, B, T, V, Vp, dloss):
    N = B * T
    if dloss == "mean":
        dloss = 1.0 / N
    logits_h = randn(rng, B, T, Vp, scale=3.0)
    logits_h[..., V:] += 8.0  # padded columns hold large garbage: they must not enter the softmax
    tgt = rng.integers(0, V, (B, T))
    tgt[0, 0], tgt[-1, -1] = V - 1, 0
    logits, L = to_device(backend, logits_h)
    targets, tgt = to_device(backend, tgt.astype(np.int32))
    losses = empty(backend, (B, T), FLOAT32)
    backend.classifier_forward_backward(logits, losses, targets, V, dloss)
    Lt = t64(L, True)
    loss = F.cross_entropy(Lt[..., :V].reshape(N, V), torch.tensor(tgt).reshape(N), reduction="none")
    assert_close(from_device(backend, losses), np64(loss).reshape(B, T), tol(backend, "reduction"), "losses")
    got = from_device(backend, logits)
    if dloss is None:
        np.testing.assert_array_equal(got, L, err_msg="without dloss the logits must be kept")
        return
    (loss.sum() * dloss).backward()
    want = np64(Lt.grad)
    assert_close(got[..., :V], want[..., :V], tol(backend, "reduction"), "dlogits")
    np.testing.assert_array_equal(got[..., V:], np.zeros((B, T, Vp - V)), err_msg="padded dlogits must be 0")


def test_classifier_flat_layout(backend, rng):
    """(N, Vp) logits with (N,) losses and targets, as the contract writes the shapes."""
    N, V, Vp = 13, 50, 64
    logits, L = to_device(backend, randn(rng, N, Vp, scale=2.0))
    targets, tgt = to_device(backend, rng.integers(0, V, N).astype(np.int32))
    losses = empty(backend, N, FLOAT32)
    backend.classifier_forward_backward(logits, losses, targets, V, 1.0 / N)
    Lt = t64(L, True)
    loss = F.cross_entropy(Lt[:, :V], torch.tensor(tgt), reduction="none")
    (loss.sum() / N).backward()
    assert_close(from_device(backend, losses), np64(loss), tol(backend, "reduction"), "losses")
    got = from_device(backend, logits)
    assert_close(got[:, :V], np64(Lt.grad)[:, :V], tol(backend, "reduction"), "dlogits")
    np.testing.assert_array_equal(got[:, V:], 0.0)


# =============================================================================================================
# optimizer: global norm, AdamW, scale

def test_global_norm_squared(backend, rng):
    shapes = [(7, 13), (48,), (3, 5, 32), (1,), (100003,)]
    bufs, hosts = zip(*(to_device(backend, randn(rng, *s)) for s in shapes))
    # one more gradient that is a view into a larger buffer, as the engine's per-tensor views are
    big, big_h = to_device(backend, randn(rng, 1000))
    bufs = list(bufs) + [backend.view(big, 101, (17, 9))]
    hosts = list(hosts) + [big_h[101:101 + 153]]
    ref = sum(float(np.sum(h.astype(np.float64) ** 2)) for h in hosts)
    out = empty(backend, (1,), FLOAT32)
    backend.global_norm_squared(out, bufs)
    first = from_device(backend, out)
    assert_close(first, [ref], tol(backend, "reduction"), "sum of squares")
    poison(backend, out)
    backend.global_norm_squared(out, bufs)
    np.testing.assert_array_equal(from_device(backend, out), first, err_msg="global_norm_squared not deterministic")
    backend.global_norm_squared(out, bufs[:1])
    assert_close(from_device(backend, out), [np.sum(hosts[0] ** 2)], tol(backend, "reduction"), "one tensor")


ADAM_SHAPES = [(7, 13), (1031,), (2, 131133)]


def _torch_adamw(p0, grads, lrs, beta1, beta2, eps, wd, grad_scale):
    p = t64(p0, True)
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=(beta1, beta2), eps=eps, weight_decay=wd)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = t64(g * grad_scale)
        opt.step()
    st = opt.state[p]
    return np64(p), np64(st["exp_avg"]), np64(st["exp_avg_sq"])


@pytest.mark.parametrize("wd,grad_scale", [(0.1, 1.0), (0.0, 0.37), (0.05, 2.5)])
@pytest.mark.parametrize("shape", ADAM_SHAPES)
def test_adamw_update(backend, rng, shape, wd, grad_scale):
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    lrs = [3e-3, 1e-2, 6e-3, 2e-3]
    param, p0 = to_device(backend, randn(rng, *shape), FLOAT32)
    m, v = backend.alloc(shape, FLOAT32), backend.alloc(shape, FLOAT32)
    backend.fill(m, 0.0)
    backend.fill(v, 0.0)
    grads = []
    for step, lr in enumerate(lrs, start=1):
        grad, g = to_device(backend, randn(rng, *shape, scale=0.1 * step), FLOAT32)
        grads.append(g)
        backend.adamw_update(param, grad, m, v, None, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                             step=step, grad_scale=grad_scale, seed=1234 + step)
    rp, rm, rv = _torch_adamw(p0, grads, lrs, beta1, beta2, eps, wd, grad_scale)
    assert_close(from_device(backend, m), rm, 1e-5, "m")
    assert_close(from_device(backend, v), rv, 1e-5, "v")
    assert_close(from_device(backend, param) - p0, rp - p0, 1e-4, "param update")


def test_adamw_master_weights(bf16_backend, rng):
    """bf16 params with float32 master weights: master follows torch's AdamW, param is master stochastically
    rounded to one of its two bf16 neighbours (seeded: same seed, same bits)."""
    b = bf16_backend
    shape = (64, 129)
    beta1, beta2, eps, wd, grad_scale = 0.9, 0.95, 1e-8, 0.1, 0.5
    lrs = [1e-2, 5e-3, 2e-3]
    master, p0 = to_device(b, randn(rng, *shape), FLOAT32)
    param, _ = to_device(b, p0, BFLOAT16)
    m, v = b.alloc(shape, FLOAT32), b.alloc(shape, FLOAT32)
    b.fill(m, 0.0)
    b.fill(v, 0.0)
    grads = []
    for step, lr in enumerate(lrs, start=1):
        grad, g = to_device(b, randn(rng, *shape, scale=0.1), BFLOAT16)
        grads.append(g)
        b.adamw_update(param, grad, m, v, master, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                       step=step, grad_scale=grad_scale, seed=77 + step)
    rp, rm, rv = _torch_adamw(p0, grads, lrs, beta1, beta2, eps, wd, grad_scale)
    assert_close(from_device(b, m), rm, 1e-5, "m")
    assert_close(from_device(b, v), rv, 1e-5, "v")
    got_master = from_device(b, master)
    assert_close(got_master - p0, rp - p0, 1e-4, "master update")
    got = from_device(b, param).astype(np.float32)
    lo, hi = bf16_neighbours(got_master.astype(np.float32))
    assert np.all((got == lo) | (got == hi)), "param is not a bf16 neighbour of master"
    inexact = lo != hi
    nearest = bf16_round(got_master.astype(np.float32))
    far = (got != nearest) & inexact
    frac = far.sum() / inexact.sum()
    assert 0.1 < frac < 0.4, f"{frac:.3f} of params rounded away from nearest: not stochastic rounding"
    ulp = np.where(inexact, np.abs(hi.astype(np.float64) - lo), 1.0)
    bias = np.mean(((got - got_master) / ulp)[inexact])
    assert abs(bias) < 0.05, f"stochastic rounding is biased: mean error {bias:.3f} ulp"

    # seeded: replaying the last step from the same state with the same seed gives the same bits
    def replay(seed):
        ms, _ = to_device(b, got_master, FLOAT32)
        ps = empty(b, shape, BFLOAT16)
        mm, _ = to_device(b, from_device(b, m), FLOAT32)
        vv, _ = to_device(b, from_device(b, v), FLOAT32)
        gg, _ = to_device(b, grads[-1], BFLOAT16)
        b.adamw_update(ps, gg, mm, vv, ms, lr=1e-3, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                       step=len(lrs) + 1, grad_scale=grad_scale, seed=seed)
        return from_device(b, ps)
    r1, r2, r3 = replay(5), replay(5), replay(6)
    np.testing.assert_array_equal(r1, r2, err_msg="same seed, different rounding")
    assert np.any(r1 != r3), "the seed does not change the rounding"


@pytest.mark.parametrize("n", [1, 37, 65536 + 13])
def test_loss_sum(backend, rng, n):
    """The step's mean loss on the device: float64 sum, one float32 rounding, deterministic, accumulating."""
    losses, h = to_device(backend, rng.uniform(0.0, 12.0, n).astype(np.float32), FLOAT32)
    out = empty(backend, (1,), FLOAT32)
    w = 1.0 / (3 * n)
    backend.loss_sum(out, losses, w, accumulate=False)
    first = from_device(backend, out)
    ref = np.sum(h.astype(np.float64)) * w
    assert abs(float(first[0]) - ref) <= 2 * np.spacing(np.float32(ref))
    poison(backend, out)
    backend.loss_sum(out, losses, w, accumulate=False)
    np.testing.assert_array_equal(from_device(backend, out), first, err_msg="loss_sum not deterministic")
    backend.loss_sum(out, losses, w, accumulate=True)
    backend.loss_sum(out, losses, w, accumulate=True)
    assert abs(float(from_device(backend, out)[0]) - 3 * ref) <= 4 * np.spacing(np.float32(3 * ref))


GUARD_CASES = [  # loss, norm squared, clip, max loss, max norm -> apply
    (3.5, 0.25, 1.0, np.inf, np.inf, 1),      # norm 0.5 under the clip: scale 1
    (3.5, 16.0, 1.0, np.inf, np.inf, 1),      # norm 4: scale 0.25
    (3.5, 16.0, 0.0, np.inf, np.inf, 1),      # clipping off
    (np.nan, 1.0, 1.0, np.inf, np.inf, 0),    # non-finite loss
    (3.5, np.inf, 1.0, np.inf, np.inf, 0),    # non-finite norm
    (3.5, 1.0, 1.0, 3.25, np.inf, 0),         # loss above its bound
    (3.25, 1.0, 1.0, 3.25, np.inf, 1),        # at the bound: kept
    (3.5, 9.0, 1.0, np.inf, 2.9, 0),          # norm 3 above its bound
]


@pytest.mark.parametrize("case", GUARD_CASES)
def test_step_guard(backend, case):
    from llmc_cli.kernels import guard_values
    loss, ns, clip, max_loss, max_norm, apply = case
    lb, _ = to_device(backend, np.array([loss], np.float32), FLOAT32)
    nb, _ = to_device(backend, np.array([ns], np.float32), FLOAT32)
    guard = empty(backend, (4,), FLOAT32)
    backend.step_guard(guard, lb, nb, clip, max_loss, max_norm)
    got = from_device(backend, guard)
    want = guard_values(loss, ns, clip, max_loss, max_norm)
    np.testing.assert_array_equal(got, want)
    assert got[3] == apply
    if apply:
        norm = math.sqrt(ns)
        assert got[1] == np.float32(norm) and got[2] == np.float32(clip / norm if 0 < clip < norm else 1.0)


@pytest.mark.parametrize("apply,scale", [(1, 0.37), (1, 1.0), (0, 0.5)])
def test_adamw_update_reads_the_guard(backend, rng, apply, scale):
    """With a guard, AdamW takes the scale from the device buffer, and apply == 0 leaves everything as it was;
    with scale s it matches the host-scale update to the last bit."""
    shape = (3, 1031)
    beta1, beta2, eps, wd = 0.9, 0.95, 1e-8, 0.1
    p_h, g_h = randn(rng, *shape), randn(rng, *shape, scale=0.1)
    m_h, v_h = randn(rng, *shape, scale=0.01), np.abs(randn(rng, *shape, scale=0.01))
    guard, _ = to_device(backend, np.array([2.0, 0.5, scale, apply], np.float32), FLOAT32)
    out = []
    for use_guard in (True, False):
        param, _ = to_device(backend, p_h, FLOAT32)
        grad, _ = to_device(backend, g_h, FLOAT32)
        m, _ = to_device(backend, m_h, FLOAT32)
        v, _ = to_device(backend, v_h, FLOAT32)
        backend.adamw_update(param, grad, m, v, None, lr=1e-3, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                             step=3, grad_scale=1.0 if use_guard else float(np.float32(scale)), seed=9,
                             guard=guard if use_guard else None)
        out.append([from_device(backend, b) for b in (param, m, v)])
    if apply:
        for got, want, what in zip(out[0], out[1], ("param", "m", "v")):
            np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        for got, want, what in zip(out[0], (p_h, m_h, v_h), ("param", "m", "v")):
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=f"skipped step changed {what}")


@pytest.mark.parametrize("shape,factor", [((7, 13), 0.37), ((1000,), 1.0 / 3.0), ((3, 4099), -2.0)])
def test_scale(backend, rng, shape, factor):
    buf, x = to_device(backend, randn(rng, *shape))
    backend.scale(buf, factor)
    assert_close(from_device(backend, buf), x * factor, tol(backend), "buf * factor")
    fbuf, fx = to_device(backend, randn(rng, *shape), FLOAT32)
    backend.scale(fbuf, factor)
    assert_close(from_device(backend, fbuf), fx * factor, 1e-6, "float32 buf * factor")


# =============================================================================================================
# determinism of the kernels that reduce across rows (the engine promises bit-identical runs)

def test_backward_kernels_are_deterministic(backend, rng):
    B, T, C, OC, NH, NKV, hd = 2, 33, 64, 96, 4, 2, 16

    def twice(run, outs_shapes):
        results = []
        for _ in range(2):
            outs = [to_device(backend, v)[0] for v in outs_shapes]
            run(*outs)
            results.append([from_device(backend, o) for o in outs])
        for a, b in zip(*results):
            np.testing.assert_array_equal(a, b)

    inp, x = to_device(backend, randn(rng, B, T, C))
    dout, _ = to_device(backend, randn(rng, B, T, C))
    w, _ = to_device(backend, randn(rng, C, shift=1.0))
    _, rm, rr = _ln_ref(x, np.ones(C), np.zeros(C))
    mean, _ = to_device(backend, rm, FLOAT32)
    rstd, _ = to_device(backend, rr, FLOAT32)
    pre = [randn(rng, B, T, C), randn(rng, C), randn(rng, C)]
    twice(lambda di, dw, db: backend.layernorm_backward(di, dw, db, dout, inp, w, mean, rstd), pre)
    twice(lambda di, dw: backend.rmsnorm_backward(di, dw, dout, inp, w, rstd), pre[:2])
    mw, _ = to_device(backend, randn(rng, OC, C, scale=0.1))
    mdout, _ = to_device(backend, randn(rng, B, T, OC))
    twice(lambda di, dw, db: backend.matmul_backward(di, dw, db, mdout, inp, mw),
          [randn(rng, B, T, C), randn(rng, OC, C), randn(rng, OC)])
    W = (NH + 2 * NKV) * hd
    qkv, q = to_device(backend, randn(rng, B, T, W))
    ref, ref_lse, _ = attention_ref(t64(q), NH, NKV)
    out, _ = to_device(backend, np64(ref))
    lse, _ = to_device(backend, np64(ref_lse), FLOAT32)
    adout, _ = to_device(backend, randn(rng, B, T, NH * hd))
    twice(lambda dq: backend.attention_backward(dq, adout, qkv, out, lse, NH, NKV), [randn(rng, B, T, W)])
