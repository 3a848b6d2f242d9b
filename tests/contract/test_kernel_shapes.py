"""Kernels on shapes and values the conformance kit (llmc_cli.testing.test_kernels) did not reach, run
over every installed backend with the kit's fixtures, references and conventions (outputs poisoned, references
from the values the device holds, dtype-fit bounds).

* attention_decode with a head larger than 256 (a GPT-2 of --n-embd 1056 --n-head 4 samples through it): the
  OpenCL kernel refused it (NotImplementedError, so `llmc sample` stopped with "not implemented" where the cpu
  backend decodes); it now computes the head's output in blocks of 256;
* the fused classifier on logits that are -inf (masked entries of the real vocabulary), 1e4 in scale or all
  equal: the softmax's max and sum must take them as torch does;
* attention (forward, backward, decode) with head sizes that are not powers of two (24, 40, 80, 136, 5) and
  matmuls with C or OC of 1, 3, 65, 97: the kit's head sizes are 8..128 in powers of two and its C at least 48."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import llmc_cli.testing.test_kernels as kit  # noqa: E402
from llmc_cli.kernels import FLOAT32  # noqa: E402
from llmc_test_support import assert_close, empty, from_device, to_device, tol  # noqa: E402

# B, NH, NKV, hd, S, pos, Tn: one token past the end of the ring (GQA), a prompt chunk from 0 (multi-query), a
# token at the last slot of a block-size cache (multi-head), all with heads of more than 256
BIG_HEAD_DECODE = [(2, 4, 2, 264, 6, 9, 1), (1, 2, 1, 520, 8, 0, 5), (1, 2, 2, 260, 5, 4, 1)]


@pytest.mark.parametrize("B,NH,NKV,hd,S,pos,Tn", BIG_HEAD_DECODE,
                         ids=[f"B{b}NH{nh}NKV{nkv}hd{hd}S{s}pos{p}Tn{t}" for b, nh, nkv, hd, s, p, t in BIG_HEAD_DECODE])
def test_attention_decode_heads_larger_than_256(kv_backend, rng, B, NH, NKV, hd, S, pos, Tn):
    try:
        kit.test_attention_decode(kv_backend, rng, B, NH, NKV, hd, S, pos, Tn, "int" if Tn > 1 else "buffer")
    except NotImplementedError as e:  # (the CUDA kernel's shared query row holds 256: reported, not yet lifted)
        if kv_backend.name == "cuda":
            pytest.xfail(f"cuda attention_decode: {e}")
        raise


@pytest.mark.parametrize("kind", ["masked", "scale-1e4", "all-equal"])
def test_classifier_on_masked_huge_and_equal_logits(backend, rng, kind):
    """-inf logits inside the real vocabulary (at the start of the row, where every thread of a GPU block takes its
    first values, and scattered), logits of scale 1e4, and rows of one value: losses and dlogits as torch's."""
    N, V, Vp = 3, 10000, 10112
    L = rng.standard_normal((N, Vp)) * 2.0
    tgt = np.array([V - 1, 8501, 9001])
    if kind == "masked":
        L[:, :8192] = -np.inf
        L[:, 8192:V:7] = -np.inf
        L[:, 100:8192:97] = rng.standard_normal((N, len(range(100, 8192, 97))))  # a few live entries among them
        tgt[2] = 100
    elif kind == "scale-1e4":
        L *= 5e3
    else:
        L[:, :V] = 3.25
    L[:, V:] = 7.0  # padding: never part of the softmax
    assert np.isfinite(L[np.arange(N), tgt]).all()
    for dloss in (None, 0.37):
        logits, Lh = to_device(backend, L)
        targets, _ = to_device(backend, tgt.astype(np.int32))
        losses = empty(backend, (N,), FLOAT32)
        backend.classifier_forward_backward(logits, losses, targets, V, dloss)
        Lt = torch.tensor(Lh, dtype=torch.float64, requires_grad=True)
        loss = F.cross_entropy(Lt[:, :V], torch.tensor(tgt), reduction="none")
        assert_close(from_device(backend, losses), loss.detach().numpy(), tol(backend, "reduction"), f"{kind} losses")
        if dloss is None:
            continue
        (loss.sum() * dloss).backward()
        got = from_device(backend, logits)
        assert_close(got[:, :V], Lt.grad.numpy()[:, :V], tol(backend, "reduction"), f"{kind} dlogits")
        np.testing.assert_array_equal(got[:, V:], 0.0, err_msg="padded dlogits must be 0")


ODD_HEADS = [(1, 17, 3, 1, 24), (2, 5, 2, 2, 40), (1, 9, 4, 2, 80), (1, 33, 2, 1, 136), (2, 3, 3, 3, 5)]


@pytest.mark.parametrize("B,T,NH,NKV,hd", ODD_HEADS, ids=[f"B{b}T{t}NH{nh}NKV{nkv}hd{hd}" for b, t, nh, nkv, hd in
                                                            ODD_HEADS])
def test_attention_with_head_sizes_not_a_power_of_two(backend, rng, B, T, NH, NKV, hd):
    kit.test_attention_forward(backend, rng, B, T, NH, NKV, hd)
    kit.test_attention_backward(backend, rng, B, T, NH, NKV, hd)


@pytest.mark.parametrize("hd", [5, 24, 136])
def test_attention_decode_with_head_sizes_not_a_power_of_two(kv_backend, rng, hd):
    kit.test_attention_decode(kv_backend, rng, 1, 4, 2, hd, 7, 2, 3, "int")
    kit.test_attention_decode(kv_backend, rng, 2, 2, 2, hd, 7, 10, 1, "buffer")


@pytest.mark.parametrize("B,T,C,OC", [(1, 1, 3, 1), (2, 3, 1, 5), (1, 2, 65, 97), (3, 1, 97, 3)])
def test_matmul_with_tiny_and_odd_widths(backend, rng, B, T, C, OC):
    try:
        for bias, gelu in ((True, False), (False, True)):
            kit.test_matmul_forward(backend, rng, B, T, C, OC, bias, gelu)
        for variant in ("full", "gelu"):
            kit.test_matmul_backward(backend, rng, B, T, C, OC, variant)
    except Exception as e:
        # known (2x H100, 2026-11-27): cuBLASLt answers CUBLAS_STATUS_INVALID_VALUE for a backward whose width is 1,
        # and the accumulated weight gradient misses its bound there; widths 3, 65 and 97 pass
        if backend.name == "cuda" and 1 in (C, OC):
            pytest.xfail(f"cuda, a matmul width of 1: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        raise
