"""The OpenCL backend's side of `llmc bench overlap` (CAP_COPY_OVERLAP): mapped ALLOC_HOST_PTR host arrays, and
overlap_layernorm in both modes, over several command queues, against a float64 numpy layernorm, every output in
full. Runs wherever an OpenCL device builds and runs kernels (skipped elsewhere with the probe's reason)."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.bench.overlap import run_overlap
from llmc_cli.kernels import CAP_COPY_OVERLAP, FLOAT32, OVERLAP_CHUNKED, OVERLAP_SYNC

llmc_opencl = pytest.importorskip("llmc_opencl", reason="llmc-opencl is not installed")

pytestmark = pytest.mark.opencl
_BE = {}


def backend():
    if "be" not in _BE:
        _BE["be"] = llmc_opencl.OpenCLPlugin().create()
    return _BE["be"]


def _reference(x):
    x = x.astype(np.float64)
    m = x.mean(1)
    r = 1 / np.sqrt(x.var(1) + 1e-5)
    return m, r


def _buffers(be, N, C, pinned, rng):
    h = [be.host_alloc((N, C), pinned), be.host_alloc((N, C), pinned), be.host_alloc((N,), pinned),
         be.host_alloc((N,), pinned)]
    h[0][:] = rng.standard_normal((N, C), dtype=np.float32)
    for a in h[1:]:
        a.fill(np.nan)
    # device buffers as views at an offset into larger allocations, as the bench's smaller batches are
    d = [be.view(be.alloc(N * C + 7, FLOAT32), 7, (N, C)), be.view(be.alloc(N + 3, FLOAT32), 3, (N,)),
         be.view(be.alloc(N + 3, FLOAT32), 3, (N,)), be.view(be.alloc(N * C + 5, FLOAT32), 5, (N, C))]
    for x in d[:3]:
        be.fill(x, float("nan"))
    return h, d


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("mode, streams, block", [(OVERLAP_SYNC, 1, 32), (OVERLAP_SYNC, 1, 128),
                                                  (OVERLAP_CHUNKED, 1, 64), (OVERLAP_CHUNKED, 3, 32),
                                                  (OVERLAP_CHUNKED, 5, 256)])
def test_overlap_layernorm_matches_numpy_in_full(pinned, mode, streams, block):
    be = backend()
    assert CAP_COPY_OVERLAP in be.capabilities
    rng = np.random.default_rng(7)
    N, C = 37, 70  # rows not a multiple of the rows per group, C not of 32
    (inp, out, mean, rstd), (d_out, d_mean, d_rstd, d_inp) = _buffers(be, N, C, pinned, rng)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    d_w, d_b = be.alloc(C, FLOAT32), be.alloc(C, FLOAT32)
    be.upload(d_w, w)
    be.upload(d_b, b)
    t = be.overlap_layernorm(out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_w, d_b, mode=mode,
                             streams=streams, block=block)
    assert t > 0
    m, r = _reference(inp)
    ref = (inp - m[:, None]) * r[:, None] * w + b
    np.testing.assert_allclose(mean, m, atol=1e-5)
    np.testing.assert_allclose(rstd, r, rtol=1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(be.download(d_inp), inp)


def test_pinned_arrays_keep_their_buffer_alive():
    import gc
    be = backend()
    a = be.host_alloc((4, 8), pinned=True)
    gc.collect()  # host_alloc's own reference to the buffer is gone: the mapped array holds it
    assert a.shape == (4, 8) and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    a[:] = 3.0
    d = be.alloc((4, 8), FLOAT32)
    be.upload(d, a)
    assert np.all(be.download(d) == 3.0)


def test_bad_arguments_are_refused():
    be = backend()
    h = be.host_alloc((4, 8))
    d = be.alloc((4, 8), FLOAT32)
    v = be.alloc(4, FLOAT32)
    w = be.alloc(8, FLOAT32)
    args = (h, h[:, 0].copy(), h[:, 0].copy(), h, d, v, v, d, w, w)
    with pytest.raises(ValueError, match="block 48"):
        be.overlap_layernorm(*args, mode=OVERLAP_SYNC, streams=1, block=48)
    with pytest.raises(ValueError, match="unknown mode"):
        be.overlap_layernorm(*args, mode="async", streams=1, block=32)
    with pytest.raises(ValueError, match="5 queues for 4 rows"):
        be.overlap_layernorm(*args, mode=OVERLAP_CHUNKED, streams=5, block=32)
    with pytest.raises(ValueError, match="mean must be 4 contiguous float32"):
        be.overlap_layernorm(h, h[:, 0], h[:, 0], h, d, v, v, d, w, w, mode=OVERLAP_SYNC, streams=1, block=32)


def test_the_bench_checks_every_case_on_this_device():
    res = run_overlap([("opencl", backend())], T=8, C=40, batches=(1, 3), streams=(1, 4), blocks=(32, 64),
                      repeat=1, warmup=1)
    assert len(res["results"]) == 2 * 2 * (2 + 2 * 2)
    assert res["mismatches"] == [], res["mismatches"]
    assert all(r["gb_s"] > 0 for r in res["results"])
