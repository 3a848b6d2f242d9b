"""A PyTorch Llama 3 (Meta's reference formulation, autograd) over llmc's flat parameter layout: the test oracle.
Test-only: torch is never imported by llmc itself."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmc_cli.models.llama3 import Llama3Config, parameter_shapes, rope_frequencies
from llmc_cli.models.base import split_flat


def split_params(flat: torch.Tensor, cfg: Llama3Config) -> dict[str, torch.Tensor]:
    return split_flat(flat, parameter_shapes(cfg))


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def apply_rotary(x, freqs_cis):
    """Meta's apply_rotary_emb: view adjacent pairs as complex numbers and multiply by e^{i pos freq}."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :])
    return out.flatten(3)


def forward(flat: torch.Tensor, cfg: Llama3Config, idx: torch.Tensor, targets: torch.Tensor | None = None,
            window: int | None = None):
    """Logits (and the mean loss with targets); `window` limits each query to the last `window` positions (sliding
    window attention: what decoding over a sliding key/value cache of that many slots computes)."""
    p = split_params(flat, cfg)
    B, T = idx.shape
    NH, NKV, hd, H = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.hidden_dim
    ang = torch.outer(torch.arange(T, dtype=torch.float64), torch.tensor(rope_frequencies(cfg)))
    freqs_cis = torch.polar(torch.ones_like(ang), ang).to(torch.complex128 if flat.dtype == torch.float64
                                                           else torch.complex64)
    x = p["wte"][idx]
    for l in range(cfg.n_layer):
        h = rms_norm(x, p["attn_norm"][l], cfg.norm_eps)
        qkv = h @ p["wqkv"][l].T
        q, k, v = qkv.split([NH * hd, NKV * hd, NKV * hd], dim=-1)
        q = apply_rotary(q.view(B, T, NH, hd), freqs_cis)
        k = apply_rotary(k.view(B, T, NKV, hd), freqs_cis)
        v = v.view(B, T, NKV, hd)
        rep = NH // NKV
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        if window is not None:
            mask |= torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-window)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, NH * hd)
        x = x + y @ p["wo"][l].T
        h = rms_norm(x, p["ffn_norm"][l], cfg.norm_eps)
        g13 = h @ p["w13"][l].T
        gate, up = g13[..., :H], g13[..., H:]
        x = x + (F.silu(gate) * up) @ p["w2"][l].T
    x = rms_norm(x, p["norm"], cfg.norm_eps)
    head = p["wte"] if cfg.tie_embeddings else p["lm_head"]
    logits = x @ head.T
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    return logits, loss
