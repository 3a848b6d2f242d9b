"""GPT-2 as a spec: its parameter table (llm.c's order), its activation plan for (B, T), and forward/backward as
straight-line calls into the kernel interface. Nothing here knows which backend runs it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from llmc_cli.kernels import FLOAT32, INT32, Backend
from llmc_cli.models.base import (STAGED, Model, check_backend, check_config_fields, check_plan, check_recompute,
                                   check_seq_len, init_normal, pick_classifier_chunks, split_flat)
from llmc_cli.naming import arg


@dataclass(frozen=True)
class GPT2Config:
    family: ClassVar[str] = "gpt2"  # names its Family (models.families)
    block_size: int = 1024        # max sequence length (T at most this)
    vocab_size: int = 50257       # real vocabulary
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to a multiple of 128, as llm.c pads wte for faster matmuls."""
        return (self.vocab_size + 127) // 128 * 128

    def validate(self) -> None:
        check_config_fields(self)
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd) <= 0:
            raise ValueError(f"model shape must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"{arg('n_embd')} {self.n_embd} is not a multiple of {arg('n_head')} {self.n_head}")


# llm.c's depth presets (d12 is GPT-2 124M, d48 is GPT-2 1.5B); d2 is a tiny one for tests and demos
PRESETS: dict[str, tuple[int, int, int]] = {  # name -> (n_layer, n_head, n_embd)
    "d2": (2, 2, 128), "d6": (6, 6, 384), "d12": (12, 12, 768), "d24": (24, 16, 1024),
    "d36": (36, 20, 1280), "d48": (48, 25, 1600),
    "bytes-d4": (4, 4, 128),  # a character-level model for byte shards (nanoGPT's shakespeare-char CPU shape)
}
# presets with a context of their own (the rest: 1024): the byte model's, what its recipe trains on (a position
# past the trained ones has an embedding no step updated)
PRESET_BLOCK_SIZE = {"bytes-d4": 64}


def preset(name: str, **overrides) -> GPT2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model '{name}' (presets: {', '.join(PRESETS)})")
    L, NH, C = PRESETS[name]
    return replace(GPT2Config(n_layer=L, n_head=NH, n_embd=C, block_size=PRESET_BLOCK_SIZE.get(name, 1024)),
                   **overrides)


def parameter_shapes(cfg: GPT2Config) -> list[tuple[str, tuple[int, ...]]]:
    """The 16 parameter tensors in llm.c's order; per-layer tensors are stacked over layers."""
    Vp, C, L, maxT = cfg.padded_vocab_size, cfg.n_embd, cfg.n_layer, cfg.block_size
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


# weights that get weight decay: matrices (llm.c decays wte, wpe, qkvw, attprojw, fcw, fcprojw)
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


def num_parameters(cfg: GPT2Config) -> int:
    return sum(int(np.prod(s)) for _, s in parameter_shapes(cfg))


def init_parameters(cfg: GPT2Config, seed: int) -> np.ndarray:
    """GPT-2 initialisation on the host (so every backend starts identical): N(0, 0.02) weights, residual
    projections scaled by 1/sqrt(2L), layernorm weights 1, biases 0, padded vocabulary rows 0."""
    out = np.zeros(num_parameters(cfg), dtype=np.float32)
    normal = []
    for name, t in split_flat(out, parameter_shapes(cfg)).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            t[...] = 1.0
        elif name == "wte":
            normal.append((t[:cfg.vocab_size], 0.02))
        elif name in DECAYED:
            normal.append((t, 0.02 / math.sqrt(2 * cfg.n_layer) if name in ("attprojw", "fcprojw") else 0.02))
    init_normal(normal, seed)
    return out


def auto_classifier_chunks(cfg: GPT2Config, B: int, T: int, training: bool, act_bytes: int = 2,
                           recompute: str = "none") -> int:
    """How many chunks (each of B/chunks whole sequences) the training classifier runs in (models.base:
    pick_classifier_chunks over the sequences, the least memory for the logits chunk plus the scratch that does
    not fit inside it). Inference keeps the whole logits (sampling reads them back), so it is 1 there."""
    if not training:
        return 1
    return pick_classifier_chunks(B, T * cfg.padded_vocab_size * act_bytes,
                                  lambda n: _logits_and_scratch(cfg, B, T, training, recompute, n), ragged=False)


def _logits_and_scratch(cfg, B, T, training, recompute, chunks) -> int:
    """Elements of the logits buffer plus the IN_LOGITS scratch that gets memory of its own."""
    placed = in_logits(cfg, B, T, training, recompute, chunks)
    own = sum(int(np.prod(shape)) for name, shape, kind, per_layer in
              activation_shapes(cfg, B, T, training, recompute, chunks)
              if name in IN_LOGITS and name not in placed and name not in SCRATCH_PARTNER and not per_layer)
    return (B // chunks) * T * cfg.padded_vocab_size + own


def activation_shapes(cfg: GPT2Config, B: int, T: int, training: bool,
                      recompute: str = "none", chunks: int = 1) -> list[tuple[str, tuple, str, bool]]:
    """Everything forward keeps for backward, planned once for (B, T): (name, shape, dtype, one per layer).
    "act" is the backend's compute dtype. Without training nothing is kept per layer (one buffer serves every
    layer); `recompute` keeps one shared GELU output ("gelu") and/or shared layernorm outputs ("layernorm")
    that the backward pass recomputes, trading compute for activation memory. The logits buffer holds one of
    `chunks` batch chunks (see auto_classifier_chunks)."""
    check_recompute(recompute)
    if chunks < 1 or B % chunks:
        raise ValueError(f"classifier chunks {chunks} must divide the batch size {B}")
    shared = set() if training else {"all"}
    if "gelu" in recompute:
        shared.add("fch_gelu")
    if "layernorm" in recompute:
        shared |= {"ln1", "ln2"}
    C, NH, Vp = cfg.n_embd, cfg.n_head, cfg.padded_vocab_size
    act = "act"
    plan = [
        ("encoded", (B, T, C), act, False),
        ("ln1", (B, T, C), act, True), ("ln1_mean", (B, T), FLOAT32, True), ("ln1_rstd", (B, T), FLOAT32, True),
        ("qkv", (B, T, 3 * C), act, True), ("atty", (B, T, C), act, True), ("att_lse", (B, NH, T), FLOAT32, True),
        ("residual2", (B, T, C), act, True),
        ("ln2", (B, T, C), act, True), ("ln2_mean", (B, T), FLOAT32, True), ("ln2_rstd", (B, T), FLOAT32, True),
        ("fch", (B, T, 4 * C), act, True), ("fch_gelu", (B, T, 4 * C), act, True),
        ("residual3", (B, T, C), act, True),
        ("lnf", (B, T, C), act, False), ("lnf_mean", (B, T), FLOAT32, False), ("lnf_rstd", (B, T), FLOAT32, False),
        ("logits", (B // chunks, T, Vp), act, False), ("losses", (B, T), FLOAT32, False),
        ("inputs", (B, T), INT32, False), ("targets", (B, T), INT32, False),
        ("btc", (B, T, C), act, False),  # scratch reused by every layer
    ]
    if training:  # gradient scratch, reused by every layer
        plan += [("dresidual", (B, T, C), act, False), ("dbtc", (B, T, C), act, False),
                 ("dfch", (B, T, 4 * C), act, False), ("dqkv", (B, T, 3 * C), act, False)]
    return [(n, s, k, per and "all" not in shared and n not in shared) for n, s, k, per in plan]


# scratch buffers that are dead whenever the logits are live: the forward pass uses them before the logits are
# computed and the backward pass after the classifier chunks were consumed (the lm-head backward runs inside the
# training forward), so they are placed inside the logits buffer instead of beside it where they fit (when shared,
# not one per layer). dbtc is not among them: the lm-head backward writes its rows while the logits are live.
IN_LOGITS = ("btc", "fch_gelu", "dresidual", "dfch", "dqkv")

# scratch that is never live at the same time as its partner, so it is a view of the partner's memory: the
# residual gradient lives in backward only, the forward scratch btc in forward only; dqkv is used in a layer's
# attention part, dfch in its MLP part (dqkv is the smaller of the two)
SCRATCH_PARTNER = {"dresidual": "btc", "dqkv": "dfch"}


def in_logits(cfg: GPT2Config, B: int, T: int, training: bool, recompute: str = "none",
              chunks: int = 1) -> dict[str, int]:
    """name -> element offset inside the logits buffer for the IN_LOGITS buffers of this plan that fit there,
    largest first (a chunked logits buffer has room for only some of them; the rest get their own memory).
    A SCRATCH_PARTNER buffer goes wherever its partner goes, so it is never listed here."""
    room = (B // chunks) * T * cfg.padded_vocab_size
    cand = [(int(np.prod(shape)), IN_LOGITS.index(name), name)
            for name, shape, kind, per_layer in activation_shapes(cfg, B, T, training, recompute, chunks)
            if name in IN_LOGITS and name not in SCRATCH_PARTNER and not per_layer and kind == "act"]
    out, off = {}, 0
    for n, _, name in sorted(cand, key=lambda c: (-c[0], c[1])):
        if off + n <= room:
            out[name] = off
            off += n
    return out


def activation_bytes(cfg: GPT2Config, B: int, T: int, training: bool, act_bytes: int,
                     recompute: str = "none") -> int:
    """Bytes of the activations GPT2.__init__ allocates for (B, T), without allocating: the same classifier
    chunking, and nothing for the buffers placed inside the logits or in their partner's memory."""
    chunks = auto_classifier_chunks(cfg, B, T, training, act_bytes, recompute)
    aliased = in_logits(cfg, B, T, training, recompute, chunks)
    total = 0
    for name, shape, kind, per_layer in activation_shapes(cfg, B, T, training, recompute, chunks):
        if name in aliased or (training and name in SCRATCH_PARTNER):
            continue
        total += int(np.prod(shape)) * (cfg.n_layer if per_layer else 1) * (act_bytes if kind == "act" else 4)
    return total


class GPT2(Model):
    """Parameters, gradients and activations of one GPT-2, planned once for batch (B, T)."""

    param_shapes = staticmethod(parameter_shapes)
    DECAYED = frozenset(DECAYED)

    @staticmethod
    def stacked_tensors(cfg) -> set[str]:
        """The parameter tensors stacked over the layers (one slice per layer)."""
        return {n for n, s in parameter_shapes(cfg) if len(s) >= 2 and n not in ("wte", "wpe")}

    def __init__(self, cfg: GPT2Config, backend: Backend, B: int, T: int, training: bool = True,
                 share_params: "GPT2 | None" = None, recompute: str = "none", classifier_chunks: int | None = None,
                 layer_grads: bool = False):
        """`share_params`: use another instance's parameters (an inference copy for sampling during training).
        `classifier_chunks`: batch chunks of the training classifier (None = auto_classifier_chunks)."""
        cfg.validate()
        check_backend(backend)
        B, T = check_plan(B, T)  # (numpy's integers as ints: np.uint8(255) overflowed the comparisons below)
        check_seq_len(T, cfg.block_size)
        self.cfg, self.backend, self.B, self.T = cfg, backend, B, T
        dt = backend.dtype
        self._alloc_parameters(self.stacked_tensors(cfg), training, share_params, layer_grads)
        self.recompute = recompute
        if classifier_chunks is None:
            classifier_chunks = auto_classifier_chunks(cfg, B, T, training, 4 if dt == FLOAT32 else 2, recompute)
        if not training and classifier_chunks != 1:
            raise ValueError("an inference model keeps the whole logits (classifier_chunks must be 1)")
        self.chunks = classifier_chunks
        self.acts = {}        # name -> whole buffer
        self.acts_layer = {}  # name -> [layer 0 view, layer 1 view, ...] (the same buffer L times if shared)
        L = cfg.n_layer
        aliased = in_logits(cfg, B, T, training, recompute, self.chunks)
        plan = activation_shapes(cfg, B, T, training, recompute, self.chunks)
        # the logits buffer exists before the buffers placed inside it, and a partner before the one sharing it
        plan.sort(key=lambda e: (e[0] in SCRATCH_PARTNER, e[0] in aliased))
        for name, shape, kind, per_layer in plan:
            full = (L,) + shape if per_layer else shape
            if name in SCRATCH_PARTNER and training:
                buf = backend.view(self.acts[SCRATCH_PARTNER[name]], 0, full)
            elif name in aliased:
                buf = backend.view(self.acts["logits"], aliased[name], full)
            else:
                buf = backend.alloc(full, dt if kind == "act" else kind, tag="activations")
            self.acts[name] = buf
            step = int(np.prod(shape))
            self.acts_layer[name] = [backend.view(buf, l * step, shape) if per_layer else buf for l in range(L)]
        # per chunk: (lnf rows, dlnf rows, losses rows, targets rows), contiguous views of whole sequences
        Bc, C, a = B // self.chunks, cfg.n_embd, self.acts
        self.chunk_views = [
            (backend.view(a["lnf"], c * Bc * T * C, (Bc, T, C)),
             backend.view(a["dbtc"], c * Bc * T * C, (Bc, T, C)) if training else None,
             backend.view(a["losses"], c * Bc * T, (Bc, T)), backend.view(a["targets"], c * Bc * T, (Bc, T)))
            for c in range(self.chunks)]

    def forward(self, inputs: np.ndarray, targets: np.ndarray | None = None, dloss: float | None = None) -> None:
        """Runs the model on `inputs` (B,T) int32. With `targets`, per-token losses land in acts['losses'];
        with `dloss` too, the lm-head's backward runs here as well, chunk by chunk (the fused classifier turns each
        logits chunk into dlogits, which the lm-head backward consumes at once): dlnf lands in acts['dbtc'] and
        wte's gradient accumulates, for `backward` to continue from. Without targets (a model planned with
        classifier chunks cannot do that) the logits buffer keeps the logits. `inputs` STAGED (models.base): the
        batch `stage` uploaded (targets STAGED too, or None), so only kernels are enqueued."""
        k, p, a, cfg = self.backend, self.params, self.acts, self.cfg
        NH = cfg.n_head
        al = self.acts_layer
        if targets is None and self.chunks > 1:
            raise ValueError(f"this model computes its logits in {self.chunks} chunks of the batch (a training "
                             f"plan); a forward without targets needs an inference model (training=False)")
        if inputs is not STAGED:  # both uploads first: none waits behind the forward pass queued after it
            self.stage(inputs, targets)
        k.encoder_forward(a["encoded"], a["inputs"], p.wte, p.wpe)
        k.layernorm_forward(al["ln1"][0], al["ln1_mean"][0], al["ln1_rstd"][0], a["encoded"],
                            p.layer("ln1w", 0), p.layer("ln1b", 0), **self.fp8_next(p.layer("qkvw", 0)))
        self._layers(a["encoded"], lambda name, l: al[name][l],
                     lambda l, atty, qkv: k.attention_forward(atty, al["att_lse"][l], qkv, NH, NH))
        if targets is None:
            k.matmul_forward(a["logits"], a["lnf"], p.wte, **self.head_kw)
            return
        head_next = self.fp8_next(p.wte) if dloss is not None else {}  # (the gradient's reader: the head's backward)
        for lnf, dlnf, losses, tgt in self.chunk_views:
            k.matmul_forward(a["logits"], lnf, p.wte, **self.head_kw)
            k.classifier_forward_backward(a["logits"], losses, tgt, cfg.vocab_size, dloss, **head_next)
            if dloss is not None:  # dwte accumulates over the chunks (the interface's += on dweight)
                k.matmul_backward(dlnf, self.grads.wte, None, a["logits"], lnf, p.wte, **self.head_kw)

    def _layers(self, encoded, act, attend) -> None:
        """The layer loop, written once for the forward pass and for decoding: `act(name, l)` is layer l's buffer
        (forward: its own, kept for backward; decode: scratch shared by every layer) and `attend(l, atty, qkv)`
        runs the attention (forward: attention_forward, keeping lse; decode: attention_decode over the cache).
        Layer 0's ln1 is done on entry; the final layernorm's output is in act("lnf", L - 1) on exit."""
        k, p, L = self.backend, self.params, self.cfg.n_layer
        for l in range(L):
            residual = encoded if l == 0 else act("residual3", l - 1)
            # attention block: ln1 -> qkv -> attention -> projection, then residual + ln2 fused
            k.matmul_forward(act("qkv", l), act("ln1", l), p.layer("qkvw", l), p.layer("qkvb", l))
            attend(l, act("atty", l), act("qkv", l))
            k.matmul_forward(act("btc", l), act("atty", l), p.layer("attprojw", l), p.layer("attprojb", l))
            k.fused_residual_layernorm_forward(act("residual2", l), act("ln2", l), act("ln2_mean", l),
                                               act("ln2_rstd", l), residual, act("btc", l),
                                               p.layer("ln2w", l), p.layer("ln2b", l),
                                               **self.fp8_next(p.layer("fcw", l)))
            # MLP block: fc with GELU fused, projection, then residual + next layer's ln1 (or lnf) fused
            k.matmul_forward(act("fch_gelu", l), act("ln2", l), p.layer("fcw", l), p.layer("fcb", l),
                             pre_gelu=act("fch", l), **self.fp8_next(p.layer("fcprojw", l)))
            k.matmul_forward(act("btc", l), act("fch_gelu", l), p.layer("fcprojw", l), p.layer("fcprojb", l))
            if l + 1 < L:
                out, mean, rstd = act("ln1", l + 1), act("ln1_mean", l + 1), act("ln1_rstd", l + 1)
                w, b, kw = p.layer("ln1w", l + 1), p.layer("ln1b", l + 1), self.fp8_next(p.layer("qkvw", l + 1))
            else:  # (the classifier's product stays in bf16: `precise`)
                out, mean, rstd, w, b = act("lnf", l), act("lnf_mean", l), act("lnf_rstd", l), p.lnfw, p.lnfb
                kw = {}
            k.fused_residual_layernorm_forward(act("residual3", l), out, mean, rstd, act("residual2", l),
                                               act("btc", l), w, b, **kw)

    # ---- decoding over a key/value cache (inference.decode.KVDecoder drives it) -----------------------------
    # decode runs the same layer loop on (B, Tn) scratch: one buffer per role, shared by every layer
    _DECODE_SHARED = {"residual2": "r2", "residual3": "r3", "ln1": "ln", "ln2": "ln", "lnf": "ln",
                      "ln1_mean": "mean", "ln2_mean": "mean", "lnf_mean": "mean",
                      "ln1_rstd": "rstd", "ln2_rstd": "rstd", "lnf_rstd": "rstd"}

    def decode_plan(self, B: int, S: int, dt: str) -> dict[str, tuple[tuple[int, ...], str]]:
        C, Vp = self.cfg.n_embd, self.cfg.padded_vocab_size
        return {
            "inputs": ((B, S), INT32), "x": ((B, S, C), dt), "r2": ((B, S, C), dt), "r3": ((B, S, C), dt),
            "ln": ((B, S, C), dt), "mean": ((B, S), FLOAT32), "rstd": ((B, S), FLOAT32),
            "qkv": ((B, S, 3 * C), dt), "atty": ((B, S, C), dt), "btc": ((B, S, C), dt),
            "fch": ((B, S, 4 * C), dt), "fch_gelu": ((B, S, 4 * C), dt), "logits": ((B, S, Vp), dt),
            "pe": ((1, S, C), dt),  # the wpe rows of the new positions (decode_inputs)
        }

    def decode_heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size): the shape of the key/value cache."""
        return self.cfg.n_head, self.cfg.n_head, self.cfg.n_embd // self.cfg.n_head

    def decode_max_len(self) -> int:
        return self.cfg.block_size  # wpe has a row for every position up to the block size

    def decode_slides(self) -> bool:
        return False  # learned absolute positions: a full cache refills from position 0 (inference.decode)

    def decode_inputs(self, v: dict, pos: int) -> None:
        """What the new tokens' positions pos.. change, staged into v (wpe's rows, into v["pe"]), so that
        decode_forward itself is the same work at every position (a graph replays it)."""
        k, C, Tn = self.backend, self.cfg.n_embd, v["inputs"].shape[1]
        k.copy(k.view(v["pe"], 0, (Tn, C)), k.view(self.params.wpe, pos * C, (Tn, C)))

    def decode_forward(self, v: dict, pos, k_cache: list, v_cache: list) -> None:
        """The new tokens in v["inputs"] (B, Tn) at positions pos.. (an int, or a (1,) int32 buffer holding it for one
        token), after decode_inputs: logits for each in v["logits"]."""
        k, p, cfg = self.backend, self.params, self.cfg
        C, NH, Tn = cfg.n_embd, cfg.n_head, v["inputs"].shape[1]
        k.encoder_forward(v["x"], v["inputs"], p.wte, k.view(v["pe"], 0, (Tn, C)))
        k.layernorm_forward(v["ln"], v["mean"], v["rstd"], v["x"], p.layer("ln1w", 0), p.layer("ln1b", 0),
                            **self.fp8_next(p.layer("qkvw", 0)))
        shared = self._DECODE_SHARED
        self._layers(v["x"], lambda name, l: v[shared.get(name, name)],
                     lambda l, atty, qkv: k.attention_decode(atty, qkv, k_cache[l], v_cache[l], pos, NH, NH))
        k.matmul_forward(v["logits"], v["ln"], p.wte, **self.head_kw)

    def backward(self) -> None:
        """Accumulates every parameter gradient; needs forward(..., dloss=...) first, which already ran the lm-head's
        backward (dlnf in acts['dbtc'], wte's share of the gradient accumulated)."""
        k, p, g, a, al, cfg = self.backend, self.params, self.grads, self.acts, self.acts_layer, self.cfg
        L, NH = cfg.n_layer, cfg.n_head
        dres, dbtc = a["dresidual"], a["dbtc"]
        k.fill(dres, 0.0)
        k.layernorm_backward(dres, g.lnfw, g.lnfb, dbtc, al["residual3"][L - 1], p.lnfw, a["lnf_mean"],
                             a["lnf_rstd"])
        recompute_ln, recompute_gelu = "layernorm" in self.recompute, "gelu" in self.recompute
        for l in reversed(range(L)):
            residual = a["encoded"] if l == 0 else al["residual3"][l - 1]
            if recompute_gelu:  # the GELU output (and/or the layernorm outputs) were not kept: recompute them
                k.gelu_forward(al["fch_gelu"][l], al["fch"][l], **self.fp8_next(p.layer("fcprojw", l)))
            if recompute_ln:
                k.layernorm_forward(al["ln2"][l], al["ln2_mean"][l], al["ln2_rstd"][l], al["residual2"][l],
                                    p.layer("ln2w", l), p.layer("ln2b", l), **self.fp8_next(p.layer("fcw", l)))
            # MLP block: dresidual flows into the projection; GELU's backward is fused into its dinp
            k.matmul_backward(a["dfch"], g.layer("fcprojw", l), g.layer("fcprojb", l), dres, al["fch_gelu"][l],
                              p.layer("fcprojw", l), pre_gelu=al["fch"][l])
            k.matmul_backward(dbtc, g.layer("fcw", l), g.layer("fcb", l), a["dfch"], al["ln2"][l], p.layer("fcw", l))
            k.layernorm_backward(dres, g.layer("ln2w", l), g.layer("ln2b", l), dbtc, al["residual2"][l],
                                 p.layer("ln2w", l), al["ln2_mean"][l], al["ln2_rstd"][l])
            # attention block
            k.matmul_backward(dbtc, g.layer("attprojw", l), g.layer("attprojb", l), dres, al["atty"][l],
                              p.layer("attprojw", l))
            k.attention_backward(a["dqkv"], dbtc, al["qkv"][l], al["atty"][l], al["att_lse"][l], NH, NH)
            if recompute_ln:
                k.layernorm_forward(al["ln1"][l], al["ln1_mean"][l], al["ln1_rstd"][l], residual,
                                    p.layer("ln1w", l), p.layer("ln1b", l), **self.fp8_next(p.layer("qkvw", l)))
            k.matmul_backward(dbtc, g.layer("qkvw", l), g.layer("qkvb", l), a["dqkv"], al["ln1"][l],
                              p.layer("qkvw", l))
            k.layernorm_backward(dres, g.layer("ln1w", l), g.layer("ln1b", l), dbtc, residual,
                                 p.layer("ln1w", l), al["ln1_mean"][l], al["ln1_rstd"][l])
            if self.on_layer_grads is not None:
                self.on_layer_grads(l)
        k.encoder_backward(g.wte, g.wpe, dres, a["inputs"])
