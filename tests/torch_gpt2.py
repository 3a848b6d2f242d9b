"""A PyTorch GPT-2 (nanoGPT-style, autograd) over llmc's flat parameter layout: the test oracle for the engine.
Test-only: torch is never imported by llmc itself."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from llmc_cli.models.gpt2 import GPT2Config, parameter_shapes
from llmc_cli.models.base import split_flat


def split_params(flat: torch.Tensor, cfg: GPT2Config) -> dict[str, torch.Tensor]:
    return split_flat(flat, parameter_shapes(cfg))


def forward(flat: torch.Tensor, cfg: GPT2Config, idx: torch.Tensor, targets: torch.Tensor | None = None):
    """Returns (logits (B,T,Vp), mean loss or None)."""
    p = split_params(flat, cfg)
    B, T = idx.shape
    C, NH = cfg.n_embd, cfg.n_head
    x = p["wte"][idx] + p["wpe"][:T]
    for l in range(cfg.n_layer):
        h = F.layer_norm(x, (C,), p["ln1w"][l], p["ln1b"][l], eps=1e-5)
        qkv = h @ p["qkvw"][l].T + p["qkvb"][l]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p["attprojw"][l].T + p["attprojb"][l]
        h = F.layer_norm(x, (C,), p["ln2w"][l], p["ln2b"][l], eps=1e-5)
        h = F.gelu(h @ p["fcw"][l].T + p["fcb"][l], approximate="tanh")
        x = x + h @ p["fcprojw"][l].T + p["fcprojb"][l]
    x = F.layer_norm(x, (C,), p["lnfw"], p["lnfb"], eps=1e-5)
    logits = x @ p["wte"].T
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size), targets.reshape(-1))
    return logits, loss


def decay_mask(cfg: GPT2Config) -> torch.Tensor:
    from llmc_cli.models.gpt2 import DECAYED
    parts = [torch.full((int(np.prod(s)),), n in DECAYED, dtype=torch.bool) for n, s in parameter_shapes(cfg)]
    return torch.cat(parts)


def train_losses(flat0: np.ndarray, cfg: GPT2Config, batches, steps: int, lr: float, weight_decay: float,
                 grad_clip: float, dtype=torch.float64) -> list[float]:
    """`steps` AdamW steps (betas 0.9/0.95, eps 1e-8, decay on weight matrices, llm.c's clipping rule)."""
    flat = torch.tensor(flat0, dtype=dtype)
    mask = decay_mask(cfg)
    w = torch.nn.Parameter(flat.clone())
    p_decay = torch.nn.Parameter(w.data[mask].clone())
    p_plain = torch.nn.Parameter(w.data[~mask].clone())
    opt = torch.optim.AdamW([{"params": [p_decay], "weight_decay": weight_decay},
                             {"params": [p_plain], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for s in range(steps):
        x, y = batches[s % len(batches)]
        full = torch.empty_like(flat)
        full[mask] = p_decay
        full[~mask] = p_plain
        _, loss = forward(full, cfg, torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        norm = math.sqrt(float(p_decay.grad.pow(2).sum() + p_plain.grad.pow(2).sum()))
        if grad_clip > 0 and norm > grad_clip:
            for t in (p_decay, p_plain):
                t.grad.mul_(grad_clip / norm)
        opt.step()
        losses.append(float(loss.detach()))
    return losses
