"""Llama 3 in PyTorch over llmc's flat parameters: the comparison `llmc bench train --compare torch` runs for
Llama models. torch is imported by the caller; llmc never needs it.

It keeps llmc's fused layouts (one wqkv matrix: q rows, k rows, v rows; one w13: gate rows, up rows) so the flat
vector loads without reshuffling and torch runs the same matmul shapes llmc does. The oracle the tests check
llmc against (tests/torch_llama3.py) is written separately, on purpose: this module is checked against it, and
against llmc, rather than sharing its code and its mistakes.
"""

from __future__ import annotations

import numpy as np

from llmc_cli.models.base import split_flat
from llmc_cli.models.llama3 import DECAYED, Llama3Config, parameter_shapes, rope_frequencies


def sdpa_enable_gqa(device: str, half: bool) -> bool:
    """Whether SDPA should get the kv heads as they are (enable_gqa, PyTorch 2.5 on) rather than repeated:
    where a fused kernel takes grouped heads. On CUDA those are the flash kernels, bf16/fp16 only; the fp32 path
    there is the memory-efficient kernel, which refuses them, and enable_gqa would fall back to the math path
    (a (T, T) matrix per head kept for backward): in fp32 k and v are repeated instead. On the CPU the flash
    kernel takes them (PyTorch 2.13's dispatcher picks it for grouped heads; a test checks)."""
    import torch  # (optional and heavy: only for --compare)
    return torch.__version__ >= "2.5" and (half or device != "cuda")


def build_torch_llama3(cfg: Llama3Config, flat: np.ndarray, seq_len: int, *, gqa: bool = False):
    """Llama 3 as a torch.nn.Module holding llmc's flat parameters; model(idx, targets) returns the mean loss.

    RMSNorm, RoPE with llmc's pair layout (adjacent elements 2i, 2i+1 rotate together, Meta's layout) and Llama
    3.1 frequency scaling, SDPA attention (grouped-query: `gqa` passes the kv heads with enable_gqa, else they
    are repeated; sdpa_enable_gqa says which suits a device), SwiGLU, tied or untied head. The rotary table
    covers `seq_len` positions (the T being timed), not the preset's whole context (131072 for Llama 3.2).
    `model.attention` says which attention ran; `model.decayed` names the parameters AdamW decays (llmc's)."""
    model = _llama_class(cfg, seq_len, gqa)()
    names = _load_flat(model, cfg, flat)
    model.attention = "SDPA enable_gqa" if gqa else "SDPA, kv heads repeated"
    model.decayed = {n for n, ours in names.items() if ours in DECAYED}
    return model


def _ops(cfg: Llama3Config):
    """(wide, rms_norm, rope): the computations the blocks share, in float32 at least."""
    import torch  # (optional and heavy: only for --compare)
    eps, hd = cfg.norm_eps, cfg.head_dim

    def wide(x):
        # float32 at least, whatever autocast chose for x (as Meta's reference and llmc's kernels compute norms
        # and rotations); float64 stays float64, so the tests can hold the twin to an exact reference
        return x.to(torch.promote_types(x.dtype, torch.float32))

    def rms_norm(x, w):
        xf = wide(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w

    def rope(x, cos, sin):
        # x (B, T, heads, hd): pairs (2i, 2i+1) rotated by position * freq_i, in float32 like the kernel
        xf = wide(x).unflatten(-1, (hd // 2, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        return out.flatten(-2).type_as(x)

    return wide, rms_norm, rope


def _block_class(cfg: Llama3Config, gqa: bool, rms_norm, rope):
    """One transformer block: attention over fused qkv (grouped-query heads), then SwiGLU over fused w13."""
    import torch  # (optional and heavy: only for --compare)
    import torch.nn as nn
    import torch.nn.functional as F
    NH, NKV, hd, C, H = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd, cfg.hidden_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.ffn_norm = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
            self.wqkv = nn.Linear(C, (NH + 2 * NKV) * hd, bias=False)
            self.wo = nn.Linear(NH * hd, C, bias=False)
            self.w13 = nn.Linear(C, 2 * H, bias=False)
            self.w2 = nn.Linear(H, C, bias=False)

        def forward(self, x, cos, sin):
            Bx, Tx, _ = x.shape
            q, k, v = self.wqkv(rms_norm(x, self.attn_norm)).split([NH * hd, NKV * hd, NKV * hd], dim=-1)
            q = rope(q.view(Bx, Tx, NH, hd), cos, sin).transpose(1, 2)
            k = rope(k.view(Bx, Tx, NKV, hd), cos, sin).transpose(1, 2)
            v = v.view(Bx, Tx, NKV, hd).transpose(1, 2)
            if gqa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=NKV != NH)
            else:  # kv head j serves query heads j*g .. j*g+g-1, as llmc's attention (and enable_gqa) groups them
                g = NH // NKV
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(y.transpose(1, 2).reshape(Bx, Tx, NH * hd))
            gate, up = self.w13(rms_norm(x, self.ffn_norm)).chunk(2, dim=-1)
            return x + self.w2(F.silu(gate) * up)

    return Block


def _llama_class(cfg: Llama3Config, seq_len: int, gqa: bool):
    import torch  # (optional and heavy: only for --compare)
    import torch.nn as nn
    import torch.nn.functional as F
    C = cfg.n_embd
    wide, rms_norm, rope = _ops(cfg)
    Block = _block_class(cfg, gqa, rms_norm, rope)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, C)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.norm = nn.Parameter(torch.ones(C))
            self.lm_head = None if cfg.tie_embeddings else nn.Linear(C, cfg.vocab_size, bias=False)
            ang = np.outer(np.arange(seq_len, dtype=np.float64), rope_frequencies(cfg))
            # (T, 1, hd/2): broadcast over heads; float64 here (model.float() / .double() leave a buffer's dtype to
            # the call below) and not in the state dict: rebuilt from the config
            self.register_buffer("cos64", torch.from_numpy(np.cos(ang))[:, None], persistent=False)
            self.register_buffer("sin64", torch.from_numpy(np.sin(ang))[:, None], persistent=False)

        def forward(self, idx, targets):
            Tx = idx.shape[1]
            dt = torch.promote_types(self.norm.dtype, torch.float32)  # the rotation's dtype, as in wide()
            cos, sin = self.cos64[:Tx].to(dt), self.sin64[:Tx].to(dt)
            x = self.wte(idx)
            for b in self.blocks:
                x = b(x, cos, sin)
            x = rms_norm(x, self.norm)
            logits = x @ self.wte.weight.T if self.lm_head is None else self.lm_head(x)
            return F.cross_entropy(wide(logits).reshape(-1, cfg.vocab_size), targets.reshape(-1))

    return Llama


def _load_flat(model, cfg: Llama3Config, flat: np.ndarray) -> dict[str, str]:
    """llmc's flat parameters into `model`; returns {torch name: llmc tensor name}."""
    import torch  # (optional and heavy: only for --compare)
    t = split_flat(flat, parameter_shapes(cfg))
    theirs = {"wte": "wte.weight", "norm": "norm", "lm_head": "lm_head.weight"}
    per_layer = {"attn_norm": "attn_norm", "wqkv": "wqkv.weight", "wo": "wo.weight", "ffn_norm": "ffn_norm",
                 "w13": "w13.weight", "w2": "w2.weight"}
    state, names = {}, {}  # torch name -> array; torch name -> llmc tensor name
    for ours, arr in t.items():
        if ours in per_layer:
            for l in range(cfg.n_layer):
                state[f"blocks.{l}.{per_layer[ours]}"], names[f"blocks.{l}.{per_layer[ours]}"] = arr[l], ours
        else:
            state[theirs[ours]], names[theirs[ours]] = arr, ours
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in state.items()})
    return names
