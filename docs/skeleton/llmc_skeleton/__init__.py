"""A minimal llmc backend: every kernel the engine calls, in plain float32 numpy on the host, written for reading
rather than speed. Copy it to start a backend of your own (docs/writing-a-backend.md), then replace one kernel at a
time with your device's and keep `pytest --pyargs llmc_cli.testing` green.

Shapes in llm.c notation: B batch, T time, C channels, OC output channels, NH query heads, NKV key/value heads,
hd head size, N = B*T rows, V vocabulary, Vp padded vocabulary.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from llmc_cli.kernels import FLOAT32, INT32, Backend, BackendPlugin, BackendUnavailable, MemoryReport, guard_scale

_DTYPES = {FLOAT32: np.float32, INT32: np.int32}
_GELU = math.sqrt(2.0 / math.pi)


def _rows(x: np.ndarray) -> np.ndarray:
    """(N, C) view of a (..., C) buffer."""
    return x.reshape(-1, x.shape[-1])


def _gelu_grad(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_GELU * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU * (1 + 3 * 0.044715 * x * x)


class SkeletonBackend(Backend):
    name = "skeleton"
    dtype = FLOAT32
    capabilities = frozenset()  # nothing optional is implemented, so nothing is announced

    def __init__(self):
        self._bytes: dict[str, int] = defaultdict(int)

    # ---- memory: buffers are numpy arrays, so `view` is the contract's default -------------------------------
    def alloc(self, shape, dtype=FLOAT32, tag="other"):
        if dtype not in _DTYPES:
            raise BackendUnavailable(f"the skeleton backend computes in float32 only (asked for {dtype})")
        a = np.empty(shape, _DTYPES[dtype])
        self._bytes[tag] += a.nbytes
        return a

    def upload(self, dst, host):
        dst[...] = np.asarray(host).reshape(dst.shape)

    def download(self, src):
        return np.array(src, copy=True)

    def fill(self, buf, value):
        buf.fill(value)

    def copy(self, dst, src):
        dst.reshape(-1)[...] = src.reshape(-1)

    def memory_report(self):
        return MemoryReport(allocated=sum(self._bytes.values()), by_tag=dict(self._bytes))

    def describe(self):
        return f"skeleton: numpy {np.__version__} on the host"

    # ---- encoder: out (B,T,C) = wte[inp] + wpe[t] ------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        out[...] = wte[inp] + (wpe[:inp.shape[1]] if wpe is not None else 0)

    def encoder_backward(self, dwte, dwpe, dout, inp):
        np.add.at(dwte, inp.reshape(-1), _rows(dout))  # sequential: deterministic
        if dwpe is not None:
            dwpe[:inp.shape[1]] += dout.sum(axis=0)

    # ---- layernorm: inp, out (N,C); mean, rstd (N,) -----------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        x = _rows(inp)
        mu = x.mean(axis=1)
        r = 1.0 / np.sqrt(((x - mu[:, None]) ** 2).mean(axis=1) + 1e-5)
        mean.reshape(-1)[...], rstd.reshape(-1)[...] = mu, r
        _rows(out)[...] = (x - mu[:, None]) * r[:, None] * weight + bias

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        x, g, r = _rows(inp), _rows(dout), rstd.reshape(-1, 1)
        xhat = (x - mean.reshape(-1, 1)) * r
        dbias += g.sum(axis=0)
        dweight += (g * xhat).sum(axis=0)
        dn = g * weight
        _rows(dinp)[...] += (dn - dn.mean(axis=1, keepdims=True) - xhat * (dn * xhat).mean(axis=1, keepdims=True)) * r

    def residual_forward(self, out, inp1, inp2):
        np.add(inp1, inp2, out=out)

    # ---- rmsnorm: inp, out (N,C); rstd (N,) -------------------------------------------------------------------
    def rmsnorm_forward(self, out, rstd, inp, weight, eps):
        x = _rows(inp)
        r = 1.0 / np.sqrt((x * x).mean(axis=1) + eps)
        rstd.reshape(-1)[...] = r
        _rows(out)[...] = x * r[:, None] * weight

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd):
        x, g, r = _rows(inp), _rows(dout), rstd.reshape(-1, 1)
        xhat = x * r
        dweight += (g * xhat).sum(axis=0)
        dn = g * weight
        _rows(dinp)[...] += (dn - xhat * (dn * xhat).mean(axis=1, keepdims=True)) * r

    # ---- matmul: inp (N,C) @ weight (OC,C)^T + bias (OC,) -> (N,OC), GELU optionally fused ----------------------
    def matmul_forward(self, out, inp, weight, bias=None, pre_gelu=None):
        y = _rows(inp) @ weight.T + (bias if bias is not None else 0)
        if pre_gelu is None:
            _rows(out)[...] = y
            return
        _rows(pre_gelu)[...] = y
        self.gelu_forward(out, pre_gelu)

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre_gelu=None):
        g = _rows(dout)
        if dinp is not None:
            d = g @ weight
            _rows(dinp)[...] = d * _gelu_grad(_rows(pre_gelu)) if pre_gelu is not None else d
        if dbias is not None:
            dbias += g.sum(axis=0)
        dweight += g.T @ _rows(inp)

    # ---- nonlinearities -----------------------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        out[...] = 0.5 * inp * (1 + np.tanh(_GELU * (inp + 0.044715 * inp ** 3)))

    def swiglu_forward(self, out, inp):  # inp (N,2H) = [gate | up] -> out (N,H)
        H = out.shape[-1]
        gate, up = _rows(inp)[:, :H], _rows(inp)[:, H:]
        _rows(out)[...] = gate / (1 + np.exp(-gate)) * up

    def swiglu_backward(self, dinp, dout, inp):
        H = dout.shape[-1]
        gate, up, g = _rows(inp)[:, :H], _rows(inp)[:, H:], _rows(dout)
        sig = 1 / (1 + np.exp(-gate))
        d = _rows(dinp)
        d[:, :H] = g * up * sig * (1 + gate * (1 - sig))
        d[:, H:] = g * gate * sig

    # ---- rotary embedding: qkv (B,T,(NH+2*NKV)*hd) in place; freqs (maxT, hd/2, 2) = (cos, sin) ---------------
    def _rotate(self, qkv, freqs, nh, nkv, sign):
        B, T, W = qkv.shape
        hd = W // (nh + 2 * nkv)
        qk = qkv[:, :, :(nh + nkv) * hd].reshape(B, T, nh + nkv, hd // 2, 2)
        cos, sin = freqs[:T, None, :, 0], sign * freqs[:T, None, :, 1]
        x0, x1 = qk[..., 0].copy(), qk[..., 1].copy()
        qk[..., 0], qk[..., 1] = x0 * cos - x1 * sin, x0 * sin + x1 * cos

    def rope_forward(self, qkv, freqs_cis, n_head, n_kv_head):
        self._rotate(qkv, freqs_cis, n_head, n_kv_head, 1.0)

    def rope_backward(self, dqkv, freqs_cis, n_head, n_kv_head):
        self._rotate(dqkv, freqs_cis, n_head, n_kv_head, -1.0)

    # ---- causal attention: qkv (B,T,(NH+2*NKV)*hd) -> out (B,T,NH*hd), lse (B,NH,T) ------------------------------
    @staticmethod
    def _heads(qkv, nh, nkv):
        """q, k, v as (B,NH,T,hd), the key/value heads repeated for grouped-query attention."""
        B, T, W = qkv.shape
        hd = W // (nh + 2 * nkv)
        q = qkv[:, :, :nh * hd].reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
        k = qkv[:, :, nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        v = qkv[:, :, (nh + nkv) * hd:].reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        return q, np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1), hd

    @staticmethod
    def _scores(q, k, hd):
        T = q.shape[2]
        s = (q @ k.transpose(0, 1, 3, 2)) / np.float32(math.sqrt(hd))
        return s + np.triu(np.full((T, T), -np.inf, np.float32), k=1)

    def attention_forward(self, out, lse, qkv, n_head, n_kv_head):
        B, T, _ = qkv.shape
        q, k, v, hd = self._heads(qkv, n_head, n_kv_head)
        s = self._scores(q, k, hd)
        m = s.max(axis=-1, keepdims=True)
        l = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
        lse[...] = l[..., 0]
        out.reshape(B, T, n_head, hd)[...] = (np.exp(s - l) @ v).transpose(0, 2, 1, 3)

    def attention_backward(self, dqkv, dout, qkv, out, lse, n_head, n_kv_head):
        B, T, _ = qkv.shape
        q, k, v, hd = self._heads(qkv, n_head, n_kv_head)
        p = np.exp(self._scores(q, k, hd) - lse[..., None])
        do = dout.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
        o = out.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3)
        ds = p * (do @ v.transpose(0, 1, 3, 2) - (do * o).sum(axis=-1, keepdims=True)) / np.float32(math.sqrt(hd))
        dq, dk, dv = ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ do
        g = n_head // n_kv_head  # query heads sharing a key/value head: their gradients sum
        dk = dk.reshape(B, n_kv_head, g, T, hd).sum(axis=2)
        dv = dv.reshape(B, n_kv_head, g, T, hd).sum(axis=2)
        for part, lo, hi, heads in ((dq, 0, n_head, n_head), (dk, n_head, n_head + n_kv_head, n_kv_head),
                                    (dv, n_head + n_kv_head, n_head + 2 * n_kv_head, n_kv_head)):
            dqkv[:, :, lo * hd:hi * hd].reshape(B, T, heads, hd)[...] = part.transpose(0, 2, 1, 3)

    # ---- fused classifier: logits (N,Vp) -> losses (N,), and dlogits in place with dloss -----------------------
    def classifier_forward_backward(self, logits, losses, targets, vocab_size, dloss):
        L, t = _rows(logits), targets.reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"target token id out of range [0, {vocab_size})")
        x = L[:, :vocab_size].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        e = np.exp(x - m)
        s = e.sum(axis=1, keepdims=True)
        rows = np.arange(len(t))
        losses.reshape(-1)[...] = (np.log(s) + m)[:, 0] - x[rows, t]
        if dloss is not None:
            d = e / s
            d[rows, t] -= 1.0
            L[:, :vocab_size] = d * dloss
            L[:, vocab_size:] = 0.0

    # ---- optimizer ----------------------------------------------------------------------------------------------
    def global_norm_squared(self, out, grads):
        out.reshape(-1)[0] = sum(float(np.dot(g.reshape(-1).astype(np.float64), g.reshape(-1).astype(np.float64)))
                                 for g in grads)  # fixed order, float64: deterministic

    def adamw_update(self, param, grad, m, v, master, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     seed, guard=None):
        if guard is not None:  # the device-side skip decision and clip scale (step_guard)
            apply, grad_scale = guard_scale(guard)
            if not apply:
                return
        p = (master if master is not None else param).reshape(-1)
        g, mm, vv = grad.reshape(-1), m.reshape(-1), v.reshape(-1)
        # torch.optim.AdamW's order: decay, moments, then p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
        p *= np.float32(1.0 - lr * weight_decay)
        mm *= np.float32(beta1)
        mm += np.float32((1.0 - beta1) * grad_scale) * g
        vv *= np.float32(beta2)
        vv += np.float32((1.0 - beta2) * grad_scale * grad_scale) * (g * g)
        denom = np.sqrt(vv) * np.float32(1.0 / math.sqrt(1.0 - beta2 ** step)) + np.float32(eps)
        p -= np.float32(lr / (1.0 - beta1 ** step)) * (mm / denom)
        if master is not None:
            param.reshape(-1)[...] = p


class SkeletonPlugin(BackendPlugin):
    name = "skeleton"
    priority = -10  # never what `--backend auto` picks

    def probe(self):
        return True, f"numpy {np.__version__} on the host (float32)"

    def create(self, device=None, dtype=None):
        if device not in (None, ""):
            raise BackendUnavailable(f"the skeleton backend has one device, the host (got --device {device})")
        if dtype not in (None, FLOAT32):
            raise BackendUnavailable(f"the skeleton backend computes in float32 only (asked for {dtype})")
        return SkeletonBackend()
