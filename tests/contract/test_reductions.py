"""Long reductions on every installed backend, against float64: the global gradient norm over many tensors of
mixed sizes and magnitudes (one of them 20M elements, more than any one work-item or BLAS call should sum
plainly in float32), the step's loss sum, and the classifier's log-sum-exp over GPT-2's whole vocabulary.
The bar is 1e-5 relative whatever the device (a plain float32 running sum of 100M squares is off by ~1e-3)."""

import numpy as np
from llmc_test_support import empty, from_device, to_device

RTOL = 1e-5


def test_global_norm_squared_is_accurate(backend, rng):
    sizes = [1, 3, 1000, 4097, 65536, 1_000_003, 20_000_000, 777]
    scales = [1e-4, 3e-3, 0.02, 1e-6, 0.05, 0.02, 0.02, 1e-2]  # the 20M tensor carries most of the norm
    bufs, ref = [], 0.0
    for n, s in zip(sizes, scales):
        host = (rng.standard_normal(n) * s).astype(np.float32)
        buf, held = to_device(backend, host)  # held: the values as the backend holds them (bf16 rounds)
        bufs.append(buf)
        ref += float(np.sum(held * held))
    out = empty(backend, (1,), "float32")
    backend.global_norm_squared(out, bufs)
    got = float(from_device(backend, out)[0])
    assert abs(got - ref) <= RTOL * ref, f"{backend.name}: {got!r} vs float64 {ref!r} ({abs(got - ref) / ref:.2e})"


def test_loss_sum_is_accurate(backend, rng):
    losses = (10.0 + rng.standard_normal(2_000_000)).astype(np.float32)
    buf, held = to_device(backend, losses, "float32")
    out = empty(backend, (1,), "float32")
    w = 1.0 / losses.size
    backend.loss_sum(out, buf, w, accumulate=False)
    backend.loss_sum(out, buf, w, accumulate=True)
    got, ref = float(from_device(backend, out)[0]), 2 * float(np.sum(held)) * w
    assert abs(got - ref) <= RTOL * abs(ref), (got, ref)


def test_classifier_logsumexp_over_the_whole_vocabulary(backend, rng):
    N, V, Vp = 4, 50257, 50304
    logits = (rng.standard_normal((N, Vp)) * 2.0).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    lbuf, held = to_device(backend, logits)
    tbuf, _ = to_device(backend, targets)
    losses = empty(backend, (N,), "float32")
    backend.classifier_forward_backward(lbuf, losses, tbuf, V, None)
    x = held[:, :V]
    m = x.max(axis=1, keepdims=True)
    ref = (np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]) - x[np.arange(N), targets]
    got = from_device(backend, losses)
    assert np.all(np.abs(got - ref) <= RTOL * np.abs(ref)), (got, ref)
