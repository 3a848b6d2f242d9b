"""GPT-2 in PyTorch over llmc's flat parameters: the comparison `llmc bench train --compare torch` runs.
torch is imported by the caller; llmc never needs it."""

from __future__ import annotations

import numpy as np

from llmc_cli.models.base import split_flat
from llmc_cli.models.gpt2 import DECAYED, GPT2Config


def build_torch_gpt2(cfg: GPT2Config, flat: np.ndarray, shapes):
    """GPT-2 as a torch.nn.Module (SDPA attention, tanh GELU, tied wte) holding llmc's flat parameters.
    `model.attention` says which attention runs; `model.decayed` names the parameters AdamW decays (llmc's)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, C, NH):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
            self.NH = NH

        def forward(self, x):
            Bx, Tx, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(Bx, Tx, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(Bx, Tx, C)
            x = x + self.proj(y)
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            C = cfg.n_embd
            self.wte = nn.Embedding(cfg.padded_vocab_size, C)
            self.wpe = nn.Embedding(cfg.block_size, C)
            self.blocks = nn.ModuleList(Block(C, cfg.n_head) for _ in range(cfg.n_layer))
            self.lnf = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.lnf(x) @ self.wte.weight.T
            V = cfg.vocab_size
            return F.cross_entropy(logits[..., :V].reshape(-1, V).float(), targets.reshape(-1))

    model = GPT()
    t = split_flat(flat, shapes)
    names = {"ln1w": "ln1.weight", "ln1b": "ln1.bias", "qkvw": "qkv.weight", "qkvb": "qkv.bias",
             "attprojw": "proj.weight", "attprojb": "proj.bias", "ln2w": "ln2.weight", "ln2b": "ln2.bias",
             "fcw": "fc.weight", "fcb": "fc.bias", "fcprojw": "fcproj.weight", "fcprojb": "fcproj.bias"}
    state = {"wte.weight": t["wte"], "wpe.weight": t["wpe"], "lnf.weight": t["lnfw"], "lnf.bias": t["lnfb"]}
    llmc_name = {"wte.weight": "wte", "wpe.weight": "wpe", "lnf.weight": "lnfw", "lnf.bias": "lnfb"}
    for l in range(cfg.n_layer):
        for ours, theirs in names.items():
            state[f"blocks.{l}.{theirs}"] = t[ours][l]
            llmc_name[f"blocks.{l}.{theirs}"] = ours
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in state.items()})
    model.attention = "SDPA"
    model.decayed = {n for n, ours in llmc_name.items() if ours in DECAYED}
    return model
