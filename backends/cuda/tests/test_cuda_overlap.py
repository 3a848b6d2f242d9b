"""The CUDA backend's side of `llmc bench overlap` (CAP_COPY_OVERLAP): pinned host arrays really page-locked,
overlap_layernorm in both modes (the warp-per-row kernel on the backend's stream; the naive kernel in chunks on
several streams) against a float64 numpy layernorm, every output in full, from pinned and pageable memory, on
the bf16 and fp32 backends alike (the experiment is float32 whatever the backend computes in).

Everything skips, with the plugin's own reason, where the CUDA backend cannot run."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_support import cuda_backend

from llmc_cli.bench.overlap import run_overlap
from llmc_cli.kernels import BFLOAT16, CAP_COPY_OVERLAP, FLOAT32, OVERLAP_CHUNKED, OVERLAP_SYNC

pytestmark = pytest.mark.cuda


def cuda(dtype=BFLOAT16):
    return cuda_backend(dtype)


def _case(be, N, C, pinned, seed=7):
    rng = np.random.default_rng(seed)
    inp, out = be.host_alloc((N, C), pinned), be.host_alloc((N, C), pinned)
    mean, rstd = be.host_alloc((N,), pinned), be.host_alloc((N,), pinned)
    inp[:] = rng.standard_normal((N, C), dtype=np.float32)
    for a in (out, mean, rstd):
        a.fill(np.nan)
    # device buffers as views at an offset into larger allocations, as the bench's smaller batches are
    dev = [be.view(be.alloc(N * C + 7, FLOAT32), 7, (N, C)), be.view(be.alloc(N + 3, FLOAT32), 3, (N,)),
           be.view(be.alloc(N + 3, FLOAT32), 3, (N,)), be.view(be.alloc(N * C + 4, FLOAT32), 4, (N, C))]
    for d in dev[:3]:
        be.fill(d, float("nan"))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    d_w, d_b = be.alloc(C, FLOAT32), be.alloc(C, FLOAT32)
    be.upload(d_w, w)
    be.upload(d_b, b)
    return (out, mean, rstd, inp), dev, (d_w, d_b), (w, b)


def _check(out, mean, rstd, inp, w, b):
    x = inp.astype(np.float64)
    m = x.mean(1)
    r = 1 / np.sqrt(x.var(1) + 1e-5)
    np.testing.assert_allclose(mean, m, atol=1e-5)
    np.testing.assert_allclose(rstd, r, rtol=1e-5)
    np.testing.assert_allclose(out, (x - m[:, None]) * r[:, None] * w + b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("mode, streams, block", [(OVERLAP_SYNC, 1, 32), (OVERLAP_SYNC, 1, 1024),
                                                  (OVERLAP_CHUNKED, 1, 64), (OVERLAP_CHUNKED, 3, 32),
                                                  (OVERLAP_CHUNKED, 8, 1024), (OVERLAP_CHUNKED, 16, 256)])
def test_overlap_layernorm_matches_numpy_in_full(dtype, pinned, mode, streams, block):
    be = cuda(dtype)
    assert CAP_COPY_OVERLAP in be.capabilities
    # rows not a multiple of any block's rows, C not of 32; then GPT-2's width over more rows than a chunk's grid
    for N, C in ((37, 70), (4099, 768)):
        host, dev, (d_w, d_b), (w, b) = _case(be, N, C, pinned)
        t = be.overlap_layernorm(*host, *dev, d_w, d_b, mode=mode, streams=streams, block=block)
        assert t > 0
        _check(*host, w, b)
        np.testing.assert_array_equal(be.download(dev[3]), host[3])


def test_pinned_host_arrays_are_page_locked_and_pageable_ones_are_not():
    import cupy as cp
    be = cuda()
    pinned, pageable = be.host_alloc((64, 8), pinned=True), be.host_alloc((64, 8), pinned=False)
    assert pinned.dtype == pageable.dtype == np.float32 and pinned.shape == (64, 8)
    host = 1  # cudaMemoryTypeHost: page-locked (pageable memory reads 0, cudaMemoryTypeUnregistered)
    assert cp.cuda.runtime.pointerGetAttributes(pinned.ctypes.data).type == host
    assert cp.cuda.runtime.pointerGetAttributes(pageable.ctypes.data).type != host


def test_every_call_writes_again():
    """The second call of a case overwrites what the first left: the poison filled in between never survives."""
    be = cuda()
    host, dev, (d_w, d_b), (w, b) = _case(be, 300, 96, True)
    for mode, s in ((OVERLAP_SYNC, 1), (OVERLAP_CHUNKED, 4), (OVERLAP_SYNC, 1)):
        for a in host[:3]:
            a.fill(np.nan)
        for d in dev[:3]:
            be.fill(d, float("nan"))
        be.overlap_layernorm(*host, *dev, d_w, d_b, mode=mode, streams=s, block=128)
        _check(*host, w, b)


def test_bad_arguments_are_refused():
    be = cuda()
    host, dev, (d_w, d_b), _ = _case(be, 4, 8, False)
    with pytest.raises(ValueError, match="block 48"):
        be.overlap_layernorm(*host, *dev, d_w, d_b, mode=OVERLAP_SYNC, streams=1, block=48)
    with pytest.raises(ValueError, match="unknown mode"):
        be.overlap_layernorm(*host, *dev, d_w, d_b, mode="async", streams=1, block=32)
    with pytest.raises(ValueError, match="5 streams for 4 rows"):
        be.overlap_layernorm(*host, *dev, d_w, d_b, mode=OVERLAP_CHUNKED, streams=5, block=32)
    out, mean, rstd, inp = host
    with pytest.raises(ValueError, match="host mean must be 4 contiguous float32"):
        be.overlap_layernorm(out, mean.astype(np.float64), rstd, inp, *dev, d_w, d_b, mode=OVERLAP_SYNC,
                             streams=1, block=32)


def test_the_bench_checks_every_case_on_this_device():
    res = run_overlap([("cuda", cuda())], T=64, C=96, batches=(1, 8), streams=(1, 4, 16), blocks=(32, 1024),
                      repeat=1, warmup=1)
    assert len(res["results"]) == 2 * 2 * (2 + 3 * 2)
    assert res["mismatches"] == [], res["mismatches"]
    assert all(r["gb_s"] > 0 for r in res["results"])
