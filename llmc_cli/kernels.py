"""The kernel interface: the one contract every llmc backend implements.

The engine (model specs, training loop, optimizer driver, sampler) calls only what is declared here, so the
same GPT-2 / Llama 3 code runs on numpy, CUDA and OpenCL. The conventions follow llm.c's layer functions:

* Every kernel writes into buffers the caller passed in; nothing in the hot path allocates. Buffers come from
  `alloc` (planned once by the engine) or are `view`s into such an allocation.
* A buffer is the backend's own array type (numpy.ndarray on the host, a device library's array elsewhere); the engine only
  reads `.shape`, `.size` and `.dtype` from it and moves data with `upload` / `download`.
* Forward and backward of a layer stand next to each other. Gradients of *parameters* always accumulate
  (``+=``) so that gradient accumulation over micro-steps is free; the engine zeroes them once per step.
  Whether a gradient of an *activation* is overwritten or accumulated is stated per kernel.
* Shapes are written as in llm.c: B batch, T time, C channels, OC output channels, NH query heads, NKV key/value
  heads, hd head size, N = B*T rows, V real vocabulary, Vp padded vocabulary. "(N,C)" accepts any buffer whose
  last dimension is C (the engine passes (B,T,C)); a `view` may start at any element offset.
* Aliasing: an elementwise kernel's output may alias one of its inputs (residual_forward, gelu_forward,
  gelu_backward, scale); nothing else may alias.
* Token ids and targets must lie in [0, V): the engine checks them on the host (the data loader checks every
  shard against the model's vocabulary); a backend may raise ValueError on a bad id, or leave the output undefined.
* "act" is the backend's compute dtype (`Backend.dtype`: float32, or bfloat16 on GPUs); normalisation statistics,
  log-sum-exp, losses and optimizer state are always float32; token ids are int32.

A backend subclasses `Backend` and registers a `BackendPlugin` under the entry-point group ``llmc.backends``
(see `llmc_cli.registry` and docs/writing-a-backend.md). Abstract methods are exactly what the engine calls;
optional ones have host defaults (slow but correct) a backend overrides to go fast; a capability is announced in
`Backend.capabilities` only when implemented, and the engine asks for capabilities, never for a backend's name.

Determinism, per kernel. "Deterministic" means identical inputs give bit-identical outputs on the same backend
and device, run after run, whatever the scheduling: the engine promises bit-identical losses for the same seed,
data and backend, so every kernel it calls is deterministic, including those that reduce across rows
(encoder_backward's dwte/dwpe, layernorm/rmsnorm_backward's dweight, matmul_backward's dweight/dbias,
attention_backward's dqkv, global_norm_squared, loss_sum). The conformance kit (`llmc_cli.testing`) checks it.

    kernel                              writes                                   deterministic
    encoder_forward / _backward         overwrite / accumulate (dwte, dwpe)      yes / yes
    layernorm_forward / _backward       overwrite / accumulate (dinp, dw, db)    yes / yes
    fused_residual_layernorm_forward    overwrite                                yes
    residual_forward                    overwrite (may alias inp1)               yes
    rmsnorm_forward / _backward         overwrite / accumulate (dinp, dw)        yes / yes
    matmul_forward / _backward          overwrite / dinp overwrite, dw db +=     yes / yes
    gelu_forward / gelu_backward*       overwrite (may alias)                    yes / yes
    swiglu_forward / _backward          overwrite                                yes / yes
    rope_forward / _backward            in place                                 yes / yes
    attention_forward / _backward       overwrite                                yes / yes
    attention_decode*                   overwrite out; writes the caches         yes
    sample_token*                       overwrite out (2 int32)                  yes
    classifier_forward_backward         overwrite losses; logits -> dlogits      yes
    global_norm_squared                 overwrite (fixed summation order)        yes
    adamw_update                        in place (seeded stochastic rounding)    yes
    loss_sum*, step_guard*              overwrite                                yes
    scale*                              in place                                 yes
    overlap_layernorm*                  overwrite (host arrays out)              yes
    (* optional: host default, or a capability)

Variants and self-tuning (both optional). A backend may hold several implementations of a kernel (other
algorithms, other launch configurations, as llm.c's dev/cuda files do): `variants(kernel)` names them and
`with backend.variant(kernel, name):` runs calls of that kernel with one, for `llmc bench kernels --variants`; the
engine never picks one, so the default is what trains. A backend that tunes itself on real calls (the CUDA
backend races its matmul algorithms) ends that tuning in `settle()`, which the bench calls before it times.
"""

from __future__ import annotations

import abc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:  # (the cache helpers import pathlib when called: the contract module stays light)
    from pathlib import Path

Buffer = Any  # the backend's array type

_GELU_C = float(np.sqrt(2.0 / np.pi))

# Names the engine uses for dtypes; each backend maps them to its own array dtype.
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
INT32 = "int32"
# Not a buffer dtype: `create(dtype=FP8)` asks for a CAP_FP8 backend, whose `dtype` is BFLOAT16 (every buffer the
# engine sees) and whose `matmul_dtype` is FP8.
FP8 = "fp8"
# Not a buffer dtype either: a float32 backend whose matmuls round their operands to TF32 (10-bit mantissa) on
# tensor cores says so with `matmul_dtype == TF32` (what llm.c's fp32 CUDA build does by default)
TF32 = "tf32"

# Capabilities a backend may announce.
CAP_BF16 = "bf16"                      # Backend can run with dtype=bfloat16
CAP_REFERENCE = "reference"            # float32 on the host: the backend others are checked against (bench errors)
CAP_DEVICE_EVENTS = "device_events"    # timer() measures device time rather than host time
CAP_KV_CACHE = "kv_cache"              # attention_decode works (incremental decoding over a key/value cache)
CAP_GRAPHS = "graphs"                  # capture() records a run of kernel calls once and replays it cheaply
CAP_FP8 = "fp8"                        # matmuls in 8-bit floats with per-tensor scales (matmul_dtype == FP8)
CAP_ASYNC_INPUTS = "async_inputs"      # input_queue() copies the next batch on a side stream during the current step
CAP_COPY_OVERLAP = "copy_overlap"      # host_alloc(pinned=True) and overlap_layernorm (`llmc bench overlap`)
CAP_SAMPLING = "sampling"              # sample_token draws the next token where the logits are (no logits download)

# overlap_layernorm's modes: the fast kernel between one copy in and the copies out, all in order on one queue;
# or llm.c's naive thread-per-row kernel over the rows in chunks, each chunk's copy in, kernel and copies out on
# its own queue, so that one chunk's copies run while another chunk's kernel does
OVERLAP_SYNC, OVERLAP_CHUNKED = "sync", "chunked"
OVERLAP_MODES = (OVERLAP_SYNC, OVERLAP_CHUNKED)


@dataclass
class MemoryReport:
    """What the backend holds, in bytes; `device_total`/`device_free` where the device reports them."""

    allocated: int
    by_tag: dict[str, int] = field(default_factory=dict)
    device_total: int | None = None
    device_free: int | None = None
    cached: int | None = None  # freed memory the backend's allocator keeps for reuse (still in use to the device)


class Backend(abc.ABC):
    """One device (or the host) and the kernels that run on it."""

    name: str = "?"
    dtype: str = FLOAT32
    # What matmul_forward/_backward compute in, when not `dtype`: FP8 on a CAP_FP8 backend (inputs cast to e4m3,
    # gradients to e5m2, each tensor with its own scale; outputs, accumulations and everything else in `dtype`).
    matmul_dtype: str | None = None
    capabilities: frozenset[str] = frozenset()

    # ---- memory --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, shape: Sequence[int] | int, dtype: str = FLOAT32, tag: str = "other") -> Buffer:
        """A new uninitialised buffer; `tag` groups it in the memory report (params, grads, acts, optim...)."""

    def view(self, buf: Buffer, offset: int, shape: Sequence[int] | int) -> Buffer:
        """A buffer sharing memory with `buf`: `prod(shape)` elements starting at element `offset`. This default
        serves buffers that slice and reshape like numpy arrays (as numpy's and the common GPU array types do)."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        n = int(np.prod(shape))
        flat = buf.reshape(-1)
        if offset < 0 or offset + n > flat.size:
            raise ValueError(f"view of {n} elements at {offset} overruns a buffer of {flat.size}")
        return flat[offset:offset + n].reshape(shape)

    @abc.abstractmethod
    def upload(self, dst: Buffer, host: np.ndarray) -> None:
        """Copy a host array into `dst`, converting to `dst`'s dtype (float32 -> bfloat16 rounds to nearest)."""

    @abc.abstractmethod
    def download(self, src: Buffer) -> np.ndarray:
        """A host copy of `src` (bfloat16 comes back as float32)."""

    @abc.abstractmethod
    def fill(self, buf: Buffer, value: float) -> None:
        """Set every element of `buf` to `value`."""

    @abc.abstractmethod
    def copy(self, dst: Buffer, src: Buffer) -> None:
        """dst = src, same number of elements; casts when the dtypes differ (to bfloat16: round to nearest)."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    @abc.abstractmethod
    def memory_report(self) -> MemoryReport:
        """Bytes allocated through `alloc`, by tag (they sum to `allocated`), and the device's own total / free
        where known."""

    def describe(self) -> str:
        """One line naming the device, for logs and `llmc backends`."""
        return self.name

    def is_out_of_memory(self, e: BaseException) -> bool:
        """Whether `e` (raised while allocating or running) means the device ran out of memory, so the engine
        can say what the plan needed and what to lower. The default knows MemoryError; a device backend adds
        its own allocation failures."""
        return isinstance(e, MemoryError)

    def peak_flops(self, dtype: str | None = None) -> float | None:
        """The device's peak dense FLOP/s for matmuls in `dtype` (None = what this backend's matmuls compute in:
        `matmul_dtype`, else `dtype`), used for MFU by `llmc bench train`; None (the default) when unknown. A
        backend that knows its device overrides this."""
        return None

    # ---- encoder: token + position embedding --------------------------------------------------------------
    @abc.abstractmethod
    def encoder_forward(self, out: Buffer, inp: Buffer, wte: Buffer, wpe: Buffer | None) -> None:
        """out (B,T,C) act = wte[inp[b,t]] + wpe[t]; inp (B,T) int32; wte (Vp,C); wpe (maxT,C), or None for
        models without learned positions (Llama: out = wte[inp])."""

    @abc.abstractmethod
    def encoder_backward(self, dwte: Buffer, dwpe: Buffer | None, dout: Buffer, inp: Buffer) -> None:
        """dwte[inp[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t] (skipped when dwpe is None, for Llama).
        Deterministic: the order of summation does not depend on scheduling."""

    # ---- layernorm (GPT-2) --------------------------------------------------------------------------------
    @abc.abstractmethod
    def layernorm_forward(self, out: Buffer, mean: Buffer, rstd: Buffer, inp: Buffer, weight: Buffer,
                          bias: Buffer) -> None:
        """out (N,C) = (inp - mean) * rstd * weight + bias; mean, rstd (N,) float32; eps 1e-5."""

    @abc.abstractmethod
    def layernorm_backward(self, dinp: Buffer, dweight: Buffer, dbias: Buffer, dout: Buffer, inp: Buffer,
                           weight: Buffer, mean: Buffer, rstd: Buffer) -> None:
        """dinp (N,C) += d/dinp (accumulates: dinp is the residual stream's gradient); dweight, dbias (C,) +=."""

    def fused_residual_layernorm_forward(self, residual: Buffer, out: Buffer, mean: Buffer, rstd: Buffer,
                                         inp1: Buffer, inp2: Buffer, weight: Buffer, bias: Buffer,
                                         **fp8_next) -> None:
        """residual (N,C) = inp1 + inp2, then out = layernorm(residual). Backends override to fuse. (`fp8_next`, a
        CAP_FP8 backend's: see matmul_forward, goes on to its layernorm_forward.)"""
        self.residual_forward(residual, inp1, inp2)
        self.layernorm_forward(out, mean, rstd, residual, weight, bias, **fp8_next)

    @abc.abstractmethod
    def residual_forward(self, out: Buffer, inp1: Buffer, inp2: Buffer) -> None:
        """out = inp1 + inp2, any shape (out may alias inp1)."""

    # ---- rmsnorm (Llama 3) ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def rmsnorm_forward(self, out: Buffer, rstd: Buffer, inp: Buffer, weight: Buffer, eps: float) -> None:
        """out (N,C) = inp * rstd * weight, rstd (N,) float32 = 1/sqrt(mean(inp^2) + eps)."""

    @abc.abstractmethod
    def rmsnorm_backward(self, dinp: Buffer, dweight: Buffer, dout: Buffer, inp: Buffer, weight: Buffer,
                         rstd: Buffer) -> None:
        """dinp (N,C) += (accumulates, like layernorm_backward); dweight (C,) +=."""

    # ---- matmul with optional bias and fused GELU ----------------------------------------------------------
    @abc.abstractmethod
    def matmul_forward(self, out: Buffer, inp: Buffer, weight: Buffer, bias: Buffer | None = None,
                       pre_gelu: Buffer | None = None) -> None:
        """inp (N,C) @ weight(OC,C)^T + bias(OC) -> (N,OC). Without `pre_gelu` that is `out`; with it, the
        product goes to `pre_gelu` and `out` = gelu(pre_gelu) (the fused GELU epilogue).
        A CAP_FP8 backend also takes `precise: bool = False` here and in matmul_backward: True (the engine passes
        it for the classifier, whose logits feed the loss directly) keeps that product in `dtype` unless the
        backend's own options say otherwise.
        FP8 producers: a CAP_FP8 backend also takes `fp8_next: Buffer | None = None` in layernorm_forward,
        fused_residual_layernorm_forward, rmsnorm_forward, swiglu_forward, gelu_forward and matmul_forward with
        `pre_gelu` (the weight of the product that reads `out` next as its `inp`), and in swiglu_backward and
        classifier_forward_backward with `dloss` (the weight of the product, without bias, that reads `dinp`,
        or the dlogits in `logits`, next as its `dout`). The kernel may then write that product's FP8 operand
        instead of act, over that buffer or where the backend keeps it, so the product does not cast that operand.
        The engine then passes that same buffer only to the products with that weight (matmul_forward and
        matmul_backward, whose backward may use the rest of its bytes), and no other kernel reads or writes it
        until a producer writes it again. Once those products have read it, the engine may place another buffer over
        the same memory (GPT-2's shared GELU output lies in the logits): that one holds act, so a backend keeps its
        record of FP8 bytes by buffer, not by address."""

    @abc.abstractmethod
    def matmul_backward(self, dinp: Buffer | None, dweight: Buffer, dbias: Buffer | None, dout: Buffer,
                        inp: Buffer, weight: Buffer, pre_gelu: Buffer | None = None) -> None:
        """dinp (N,C) = dout (N,OC) @ weight (overwritten; skipped when None), then, with `pre_gelu` (N,C),
        dinp *= gelu'(pre_gelu) (the input was gelu(pre_gelu)); dweight (OC,C) += dout^T @ inp;
        dbias (OC,) += column sums of dout."""

    # ---- elementwise nonlinearities ------------------------------------------------------------------------
    @abc.abstractmethod
    def gelu_forward(self, out: Buffer, inp: Buffer) -> None:
        """out = gelu(inp), the tanh approximation GPT-2 uses; any shape."""

    def gelu_backward(self, dinp: Buffer, inp: Buffer, dout: Buffer) -> None:
        """Optional: dinp = gelu'(inp) * dout (overwritten; dinp may alias dout). The engine reaches GELU's
        backward through matmul_backward's `pre_gelu`; this standalone form is for backends that build that
        fusion from parts, and for `llmc bench kernels`. The default goes through the host."""
        x = self.download(inp).astype(np.float64)
        t = np.tanh(_GELU_C * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x * x)
        self.upload(dinp, (d * self.download(dout).astype(np.float64)).astype(np.float32))

    @abc.abstractmethod
    def swiglu_forward(self, out: Buffer, inp: Buffer) -> None:
        """inp (N,2H) holds [gate | up] halves; out (N,H) = silu(gate) * up."""

    @abc.abstractmethod
    def swiglu_backward(self, dinp: Buffer, dout: Buffer, inp: Buffer) -> None:
        """dinp (N,2H) = [dgate | dup] (overwritten)."""

    # ---- rotary position embedding (Llama 3) ---------------------------------------------------------------
    @abc.abstractmethod
    def rope_forward(self, qkv: Buffer, freqs_cis: Buffer, n_head: int, n_kv_head: int) -> None:
        """Rotates q and k inside qkv (B,T,(NH+2*NKV)*hd) in place; v untouched. freqs_cis (maxT, hd/2, 2)
        float32 holds (cos, sin); pairs are interleaved (x[2i], x[2i+1]) as in Meta's reference code."""

    @abc.abstractmethod
    def rope_backward(self, dqkv: Buffer, freqs_cis: Buffer, n_head: int, n_kv_head: int) -> None:
        """The inverse rotation applied to dq and dk inside dqkv, in place."""

    # ---- causal self-attention (multi-head and grouped-query) ----------------------------------------------
    @abc.abstractmethod
    def attention_forward(self, out: Buffer, lse: Buffer, qkv: Buffer, n_head: int, n_kv_head: int) -> None:
        """qkv (B,T,(NH+2*NKV)*hd) = [q heads | k heads | v heads]; out (B,T,NH*hd); lse (B,NH,T) float32 is
        the log-sum-exp of each row of scaled scores, kept for the backward pass (flash-attention style).
        Query head h uses key/value head h // (NH/NKV). Scale 1/sqrt(hd), causal mask."""

    @abc.abstractmethod
    def attention_backward(self, dqkv: Buffer, dout: Buffer, qkv: Buffer, out: Buffer, lse: Buffer,
                           n_head: int, n_kv_head: int) -> None:
        """dqkv (B,T,(NH+2*NKV)*hd) overwritten from dout (B,T,NH*hd)."""

    def attention_decode(self, out: Buffer, qkv: Buffer, k_cache: Buffer, v_cache: Buffer, pos: int,
                         n_head: int, n_kv_head: int) -> None:
        """Optional (CAP_KV_CACHE): attention for Tn new tokens at positions pos..pos+Tn-1 over a key/value cache.
        qkv (B,Tn,(NH+2*NKV)*hd) as in attention_forward; k_cache, v_cache (B,NKV,S,hd) act are rings of S slots:
        position p lives in slot p % S, so a cache slides over a sequence longer than S without moving anything.
        First the new tokens' k and v are written to their slots, then query i (position pos+i) attends to the
        positions max(0, pos+i-S+1) .. pos+i (causal, scale 1/sqrt(hd), head h uses kv head h // (NH/NKV)); out
        (B,Tn,NH*hd) overwritten. Other slots are neither read nor written; no lse is kept (inference). A chunk that
        wraps around the ring would overwrite slots its own earlier queries still read, so Tn > 1 needs
        pos + Tn <= S (check_decode_chunk). `pos` is an int, or a (1,) int32 buffer holding it for one new token
        (Tn == 1), read where the kernels run: what a captured decode step (CAP_GRAPHS) needs, whose position changes
        from one replay to the next."""
        raise NotImplementedError(f"backend '{self.name}' has no attention_decode (capability {CAP_KV_CACHE!r})")

    def sample_token(self, out: Buffer, logits: Buffer, u: float, temperature: float, vocab_size: int) -> None:
        """Optional (CAP_SAMPLING): the next token from one row of logits (Vp,) act, drawn by
        inference.sampling.choose_token's rule with top_k 0 and top_p 1 over the first `vocab_size` ids: at
        temperature 0 the first of the largest, else the first id whose running sum of exp(x / temperature - max)
        exceeds u (a uniform draw in [0, 1) from the caller's generator) times the whole sum, in float64. out (2,)
        int32 overwritten: [id, bad], bad counting the NaN and +inf logits (vocab_size when every one is -inf; the
        id is then undefined). The token stays where the logits are until the caller downloads `out`: a decoded
        token costs 8 bytes of copy instead of the vocabulary's logits and the host's pass over them."""
        raise NotImplementedError(f"backend '{self.name}' has no sample_token (capability {CAP_SAMPLING!r})")

    # ---- graphs (optional) ------------------------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Optional (CAP_GRAPHS): records the device work `fn` enqueues (kernel calls only: no upload, download,
        alloc or synchronize inside) without running it, and returns a function that enqueues all of it again, with
        the same buffers and scalar arguments, for far less host time than the calls themselves. Whatever changes
        between replays must live in buffers written before each replay (tokens, a position: see
        attention_decode). Run `fn` once uncaptured first, so that anything it allocates or tunes on first use is
        in place. Memory a kernel takes for itself while recorded (a sort's temporaries) must stay the graph's for
        as long as the replay function lives. The trainer replays each micro-step this way (training.trainer)."""
        raise NotImplementedError(f"backend '{self.name}' cannot capture graphs (capability {CAP_GRAPHS!r})")

    # ---- batches copied ahead (optional) ----------------------------------------------------------------------
    def input_queue(self, dsts: Sequence[Buffer], depth: int = 2) -> InputQueue:
        """A queue of batches for the fixed buffers `dsts` (a model's inputs and targets): `put(hosts)` hands over
        the next batch (one host array per buffer, of its shape) and returns at once; `take()` makes the oldest
        batch put, and not yet taken, the contents of `dsts` for all work enqueued after it. At most `depth`
        batches wait between put and take (ValueError past that, or on a take with none). This default keeps the
        host arrays (the caller hands them over and leaves them alone) and uploads them at take(), where a step
        uploaded its batch without a queue. With CAP_ASYNC_INPUTS, put() copies the arrays to pinned memory and
        starts their host-to-device copy on a side stream into staging buffers of the queue's own (`depth` of
        them, one per batch in flight), so the copy overlaps the work already enqueued; take() makes the compute
        stream wait for that copy and copies the staging buffers into `dsts` on the device. `dsts` keep their
        addresses, as a captured graph (CAP_GRAPHS) that reads them needs, and no copy may overwrite a staging
        buffer before the compute stream has read it."""
        return HostInputQueue(self, dsts, depth)

    # ---- fused classifier: softmax + cross-entropy + dlogits -----------------------------------------------
    @abc.abstractmethod
    def classifier_forward_backward(self, logits: Buffer, losses: Buffer, targets: Buffer, vocab_size: int,
                                    dloss: float | None) -> None:
        """logits (N,Vp); losses (N,) float32 = -log softmax(logits[:, :V])[target]; targets (N,) int32.
        With `dloss`, logits is overwritten in place by dlogits = (softmax - onehot) * dloss, zero in the
        padded columns, so the full-vocabulary softmax is never stored twice. Without it, logits is kept."""

    # ---- optimizer ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def global_norm_squared(self, out: Buffer, grads: Sequence[Buffer]) -> None:
        """out (1,) float32 = sum of squares over all `grads`, summed in a fixed order (deterministic) with at
        least float32 accumulation."""

    @abc.abstractmethod
    def adamw_update(self, param: Buffer, grad: Buffer, m: Buffer, v: Buffer, master: Buffer | None, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                     grad_scale: float, seed: int, guard: Buffer | None = None) -> None:
        """One AdamW step on a tensor (any shape, all buffers the same size; grad in the compute dtype, like
        param). g = grad * grad_scale;
        m, v float32 moments; decoupled weight decay p -= lr * wd * p; bias correction with `step` (1-based).
        With `master` (float32), the update is done on master and rounded into `param` (bfloat16) with
        stochastic rounding seeded by `seed`; without it, `param` itself is float32 and updated in place.
        With `guard` (the (4,) float32 buffer `step_guard` wrote), `grad_scale` is ignored: the scale is guard[2]
        as the device holds it when the update runs, and guard[3] == 0 leaves every buffer untouched (a skipped
        step), so the host need not read the norm or the loss before queuing the update. The moments' factors are
        then float32((1 - beta1) * s) and float32((1 - beta2) * s * s), s = guard[2], products in float64."""

    # ---- the step's loss and its guard, kept on the device ---------------------------------------------------
    def loss_sum(self, out: Buffer, losses: Buffer, weight: float, accumulate: bool) -> None:
        """out (1,) float32 = weight * sum(losses) (+ out when `accumulate`), summed in float64 in a fixed order
        (deterministic), rounded to float32 once: the step's mean loss without a host round trip. This default
        reads the buffers back to the host; a device backend overrides it."""
        total = float(np.sum(self.download(losses).astype(np.float64))) * weight
        if accumulate:
            total += float(self.download(out)[0])
        self.upload(out, np.array([total], np.float32))

    def step_guard(self, guard: Buffer, loss: Buffer, norm_squared: Buffer, grad_clip: float, max_loss: float,
                   max_norm: float) -> None:
        """guard (4,) float32 = [loss, norm, scale, apply] from loss (1,) and norm_squared (1,) float32:
        norm = sqrt(norm_squared) (in float64, then rounded); scale = grad_clip / norm (float64) when grad_clip > 0
        and norm > grad_clip, else 1; apply = 1 when loss and norm are finite, loss <= max_loss and
        norm <= max_norm (bounds rounded to float32, compared in float32; inf disables one), else 0. AdamW reads
        scale and apply from here (adamw_update's `guard`). This default goes through the host."""
        self.upload(guard, guard_values(float(self.download(loss)[0]), float(self.download(norm_squared)[0]),
                                        grad_clip, max_loss, max_norm))

    def scale(self, buf: Buffer, factor: float) -> None:
        """Optional: buf *= factor, any shape and dtype (a communicator may use it to average). The default goes
        through the host."""
        self.upload(buf, (self.download(buf).astype(np.float64) * factor).astype(np.float32))

    # ---- variants and self-tuning (optional) -----------------------------------------------------------------
    def variants(self, kernel: str) -> list[str]:
        """Optional: names of this backend's other implementations of `kernel` (one of this class's kernel
        methods, e.g. "layernorm_forward"): other algorithms or launch configurations, each honouring the kernel's
        contract (its outputs within the dtype's tolerance of the default's, deterministic on its own).
        `llmc bench kernels --variants` times and checks each beside the default. [] (this default): one."""
        return []

    @contextmanager
    def variant(self, kernel: str, name: str | None) -> Iterator[None]:
        """Optional: inside the `with` block, calls of `kernel` run its variant `name` (one of
        `variants(kernel)`; None: the default, as outside the block). ValueError for a name the backend does not
        have; a call the variant cannot take (a shape, an alignment or a resource it needs) raises
        VariantUnsupported. This default has no variants."""
        if name is not None:
            raise ValueError(f"backend '{self.name}' has no variant {name!r} of {kernel}")
        yield

    def settle(self, rerun: Callable[[], None] | None = None) -> None:
        """Optional: finish any self-tuning now, so that every later call runs the implementation chosen
        (`llmc bench kernels` calls it after its warm-up calls, so that no tuning lands in a timed call).
        `rerun`, when given, enqueues the calls just made once more (with their effects: accumulated outputs
        accumulate again); a backend that tunes on real calls may call it as often as its tuning needs, a bounded
        number of times. Without it, tuning ends with what was measured so far. The default has nothing to
        tune."""

    # ---- state carried from one training step to the next (optional) ------------------------------------------
    # A backend whose kernels keep statistics across steps (FP8's delayed scaling: each cast tensor's amax over the
    # last steps) hears where steps begin and end. The trainer calls begin_step before a step's first kernel, then
    # (data parallel) all-reduces step_observations with MAX, then end_step after its update is queued; a
    # checkpoint keeps carried_state and a resumed run hands it to load_carried_state before its first step. Kernel
    # calls outside steps (evaluation, sampling) may read the state but leave it as it was.
    def begin_step(self) -> None:
        """A training step's kernels follow: what was observed since the last end_step is dropped."""

    def step_observations(self) -> Buffer | None:
        """A float32 buffer (values >= 0) of what this step's kernels observed, that end_step folds into the state
        it carries; None when the backend carries none. Ranks combine theirs with MAX so that all carry the same."""
        return None

    def end_step(self) -> None:
        """The step's update is queued: fold its observations into the carried state (on the device, no sync)."""

    def carried_state(self) -> dict:
        """What end_step carried so far, JSON-able (floats exact), for a checkpoint; {} when nothing."""
        return {}

    def load_carried_state(self, state: dict) -> None:
        """Takes carried_state of an earlier run before the first step. A backend that carries no such state
        ignores it (an FP8 run can continue in bf16); ValueError, saying what is wrong, on a damaged one."""

    # ---- timing ---------------------------------------------------------------------------------------------
    def timer(self) -> "Timer":
        """A stopwatch over device work (host clock after a synchronize unless CAP_DEVICE_EVENTS)."""
        return HostTimer(self)

    # ---- copy/compute overlap (optional: the diary's experiment, `llmc bench overlap`) -----------------------
    def host_alloc(self, shape: Sequence[int] | int, pinned: bool = False) -> np.ndarray:
        """A float32 host array for overlap_layernorm. pinned=True (CAP_COPY_OVERLAP): page-locked memory that the
        device's copy engines read and write directly, so a copy from or to it runs while the host and the device's
        other queues go on; otherwise ordinary (pageable) numpy memory, which the driver stages through its own
        pinned buffer, one piece at a time, with the host waiting. The array owns its memory."""
        if pinned:
            raise NotImplementedError(f"backend '{self.name}' has no pinned host memory "
                                      f"(capability {CAP_COPY_OVERLAP!r})")
        return np.empty(shape, np.float32)

    def overlap_layernorm(self, out: np.ndarray, mean: np.ndarray, rstd: np.ndarray, inp: np.ndarray,
                          d_out: Buffer, d_mean: Buffer, d_rstd: Buffer, d_inp: Buffer, d_weight: Buffer,
                          d_bias: Buffer, *, mode: str, streams: int, block: int) -> float:
        """Optional (CAP_COPY_OVERLAP): one float32 layernorm forward with its copies, timed end to end, whatever
        `dtype` is. Host arrays from `host_alloc` (pinned or not): inp (N,C) in; out (N,C), mean, rstd (N,) out.
        Device float32 buffers of the same shapes, d_inp, d_out, d_mean, d_rstd, and d_weight, d_bias (C,)
        already there. Waits for all queued work first, then returns the seconds from the first copy in to the
        moment the last copy out is in host memory. `mode`: OVERLAP_SYNC copies inp to d_inp, runs the backend's
        fast layernorm (a row per `block`/32 group of threads, or its nearest equivalent) and copies d_out,
        d_mean, d_rstd back, all in order on one queue (`streams` is ignored); OVERLAP_CHUNKED splits the N
        rows into `streams` chunks (chunk i: rows i*N//streams up to (i+1)*N//streams) and gives each its own
        queue for its copy in, the naive one-thread-per-row kernel (llm.c's dev/cuda layernorm kernel 1) and its
        copies out. `block`: threads per block (work-group), a power of two in 32..1024. Every element of every
        output is written (the bench poisons them with NaN before each call); eps 1e-5 as layernorm_forward."""
        raise NotImplementedError(f"backend '{self.name}' has no overlap_layernorm (capability {CAP_COPY_OVERLAP!r})")


def guard_values(loss: float, norm_squared: float, grad_clip: float, max_loss: float,
                 max_norm: float) -> np.ndarray:
    """What `step_guard` writes, computed on the host (the reference for every backend)."""
    ns = np.float64(np.float32(norm_squared))
    with np.errstate(invalid="ignore", over="ignore"):
        norm = np.sqrt(ns)
        scale = clip_scale(norm, grad_clip)
    ok = update_applies(loss, norm, max_loss, max_norm)
    return np.array([np.float32(loss), np.float32(norm), scale, 1.0 if ok else 0.0], np.float32)


def check_decode_chunk(pos: int, Tn: int, slots: int) -> None:
    """attention_decode's precondition (see there): raises ValueError naming what is wrong."""
    if pos < 0 or Tn < 1 or Tn > slots:
        raise ValueError(f"attention_decode: {Tn} new tokens at position {pos} do not fit a cache of {slots} slots")
    if Tn > 1 and pos + Tn > slots:
        raise ValueError(f"attention_decode: a chunk of {Tn} tokens at position {pos} wraps around a cache of {slots} "
                         "slots; feed tokens past the end of the ring one at a time")


def clip_scale(norm: float, grad_clip: float) -> float:
    """llm.c's global-norm clipping: gradients are multiplied by grad_clip / norm when the norm exceeds the clip
    (grad_clip > 0), else by 1. The one statement of the rule: host optimizers and step_guard use it."""
    return grad_clip / norm if (grad_clip > 0 and norm > grad_clip) else 1.0


def update_applies(loss: float, norm: float, max_loss: float, max_norm: float) -> bool:
    """The skip rule `step_guard` evaluates: loss and norm finite and not above their bounds, all compared in
    float32 (inf disables a bound). Host-side callers use it too, so host and device decide alike."""
    with np.errstate(invalid="ignore", over="ignore"):
        loss32, norm32 = np.float32(loss), np.float32(norm)
        return bool(np.isfinite(loss32) and np.isfinite(norm32) and not loss32 > np.float32(max_loss)
                    and not norm32 > np.float32(max_norm))


def guard_scale(host_guard: np.ndarray) -> tuple[bool, float]:
    """(apply, scale) of a guard buffer read back to the host (for backends that launch from the host)."""
    return bool(host_guard[3] != 0.0), float(host_guard[2])


class InputQueue(Protocol):
    """What `Backend.input_queue` returns (see there)."""

    def put(self, hosts: Sequence[np.ndarray]) -> None: ...
    def take(self) -> None: ...


def check_input_batch(dsts: Sequence[Buffer], hosts: Sequence[np.ndarray]) -> None:
    """ValueError unless `hosts` holds one array per buffer of `dsts`, each with that buffer's element count."""
    if len(hosts) != len(dsts):
        raise ValueError(f"input_queue.put: {len(hosts)} arrays for {len(dsts)} buffers")
    for i, (d, h) in enumerate(zip(dsts, hosts)):
        if np.asarray(h).size != d.size:
            raise ValueError(f"input_queue.put: array {i} has {np.asarray(h).size} elements, its buffer {d.size}")


class HostInputQueue:
    """Backend.input_queue's default: the host arrays wait in a list and are uploaded at take()."""

    def __init__(self, backend: Backend, dsts: Sequence[Buffer], depth: int = 2):
        if depth < 1:
            raise ValueError(f"input_queue: depth must be >= 1 (got {depth})")
        self.backend, self.dsts, self.depth = backend, list(dsts), depth
        self.pending: list[Sequence[np.ndarray]] = []

    def put(self, hosts: Sequence[np.ndarray]) -> None:
        check_input_batch(self.dsts, hosts)
        if len(self.pending) >= self.depth:
            raise ValueError(f"input_queue.put: {self.depth} batches already wait to be taken")
        self.pending.append(hosts)

    def take(self) -> None:
        if not self.pending:
            raise ValueError("input_queue.take: no batch was put")
        for dst, host in zip(self.dsts, self.pending.pop(0)):
            self.backend.upload(dst, host)


class Timer(Protocol):
    def start(self) -> None: ...
    def stop(self) -> float: ...  # seconds since start, after the device finished the work queued in between
    def mark(self) -> None: ...   # a point in the work queued since start (for marks())
    def marks(self) -> list[float]: ...  # after stop: seconds from start to each mark, in order


class HostTimer:
    """Host clock around synchronizes: each mark() waits for the device too, so marks perturb what they time."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.t0 = 0.0
        self._marks: list[float] = []

    def start(self) -> None:
        import time
        self.backend.synchronize()
        self._marks = []
        self.t0 = time.perf_counter()

    def mark(self) -> None:
        import time
        self.backend.synchronize()
        self._marks.append(time.perf_counter() - self.t0)

    def marks(self) -> list[float]:
        return list(self._marks)

    def stop(self) -> float:
        import time
        self.backend.synchronize()
        return time.perf_counter() - self.t0


# ---- collectives: how data-parallel ranks move gradients -------------------------------------------------------
# The engine falls back on MPI through host memory for any backend; a plugin whose device has its own fabric
# (the cuda plugin's, for one) returns a Communicator from `BackendPlugin.communicator`, and the engine uses that.

SUM, AVG, MAX = "sum", "avg", "max"
REDUCE_OPS = (SUM, AVG, MAX)


class CommError(RuntimeError):
    """Ranks cannot be set up or cannot talk; the message says what to change."""


def check_reduce_op(op: str) -> None:
    """ValueError unless `op` is one of REDUCE_OPS (every communicator checks before it moves data)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r} (one of {', '.join(REDUCE_OPS)})")


def chunk_elements(buf: Buffer, world: int) -> int:
    """Elements per rank of a buffer that reduce_scatter / all_gather split into `world` equal chunks."""
    n = int(buf.size)
    if n % world:
        raise ValueError(f"a buffer of {n} elements does not split into {world} equal chunks")
    return n // world


@dataclass(frozen=True)
class RankInfo:
    """This process's place among the ranks, read from the launcher's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0           # rank on this node: picks the device
    source: str = "single process"  # which launcher's variables said so


class Rendezvous(Protocol):
    """How rank 0 hands a few bytes (a communicator's unique id) to every rank before any communicator exists:
    through MPI, a shared file or a TCP socket (llm.c's three ways), as the user chose."""

    how: str  # "mpi", "file" or "tcp"

    def share(self, data: bytes | None, nbytes: int) -> bytes:
        """Rank 0 passes `nbytes` bytes, the others None; every rank gets rank 0's bytes back."""

    def abort(self, code: int) -> None:
        """Take every rank down (MPI_Abort under MPI; this process otherwise)."""


class Communicator(Protocol):
    """Collectives over *backend buffers*, all in place and enqueued in order with the kernels around them:

    * ``all_reduce(buf, op)``: every rank ends with the sum (or average / max) of all ranks' ``buf``.
    * ``reduce_scatter(buf, op)``: ``buf`` holds ``world_size`` equal chunks; afterwards chunk ``rank`` holds the
      reduction of that chunk over all ranks (the other chunks are undefined).
    * ``all_gather(buf)``: chunk ``rank`` of ``buf`` is this rank's contribution; afterwards every chunk is filled.
    * ``reduce(buf, root, op)``: rank ``root``'s ``buf`` ends with the reduction over all ranks (the others' are
      left as they were).
    * ``broadcast(buf, root)``; ``all_reduce_value(x, op)`` for one host float (returns at once with the result);
      ``barrier()``; ``abort(code)`` takes every rank down after a fatal error on one.

    Optional, for gradients reduced while the backward pass goes on: ``overlapped()``, a context manager inside
    which the buffer collectives are queued on the communicator's own stream behind the work already queued on the
    backend's (so they run beside the kernels queued after them), and ``join()``, which queues the backend's next
    work behind them. A communicator without them runs each collective where it is called.

    Optional, for ranks whose kernels reach each other's memory (GPUs with peer access): ``peer_copies(buf)``,
    collective, maps every rank's copy of ``buf`` into this process and returns a handle (None where it cannot);
    the backend's ``adamw_update`` then takes ``mirrors=handle.others(offset)`` to write the other ranks' copies of
    what it updates. ``device_barrier()`` queues a point no rank's stream passes before every rank's stream reached
    it. ``reduce_scatter_pieces(buf)``, collective, returns a handle (None where it cannot) that reduce-scatters
    ``buf`` piece by piece: ``send(ranges)`` queues the ``(lo, hi)`` element ranges, each inside one rank's chunk and
    final once the work queued so far has run, to travel to their owner beside the work queued after them;
    ``finish()``, once every range of every rank was sent, queues what leaves chunk ``rank`` averaged as
    ``reduce_scatter(buf, AVG)`` would.

    Reductions run in the buffer's dtype (bf16 gradients are reduced in bf16, as llm.c does) and must be
    deterministic for a fixed world size: the same inputs give bit-identical results."""

    rank: int
    world_size: int
    local_rank: int
    name: str

    def all_reduce(self, buf: Buffer, op: str = AVG) -> None: ...
    def reduce_scatter(self, buf: Buffer, op: str = AVG) -> None: ...
    def reduce(self, buf: Buffer, root: int, op: str = AVG) -> None: ...
    def all_gather(self, buf: Buffer) -> None: ...
    def broadcast(self, buf: Buffer, root: int = 0) -> None: ...
    def all_reduce_value(self, x: float, op: str = AVG) -> float: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...
    def close(self) -> None: ...


class VariantUnsupported(ValueError):
    """A kernel call inside `Backend.variant` that the variant cannot take (a shape, an alignment or a resource
    it needs); the message says why. `llmc bench kernels --variants` lists it as not applicable."""


class BackendUnavailable(RuntimeError):
    """Raised by a plugin's `create` (or `probe`) when it cannot run here; the message says why."""


def _option_raw(options: dict[str, str] | None, name: str, env: str | None) -> tuple[str | None, str]:
    """A backend option's text: `options[name]` if given, else the environment variable `env`, else None; and
    where it came from, as an error names it (`--backend-opt NAME`, or the variable `ENV`)."""
    import os
    raw = (options or {}).get(name)
    if raw is None and env:
        raw = os.environ.get(env) or None  # an empty variable (`export LLMC_X=`) is an unset one
        if raw is not None:
            return raw, env
    return raw, f"--backend-opt {name}"


def _option_error(where: str, name: str, raw, expected: str) -> BackendUnavailable:
    if where.startswith("--backend-opt"):
        return BackendUnavailable(f"{where}={raw}: expected {expected}")
    return BackendUnavailable(f"{where}={raw} (the environment variable for --backend-opt {name}): expected {expected}")


# the spellings of on and off an on/off option takes; a choice option that also means on/off takes them as aliases
ON_OFF = {"1": "on", "on": "on", "true": "on", "yes": "on", "0": "off", "off": "off", "false": "off", "no": "off"}


def option_flag(options: dict[str, str] | None, name: str, default: bool | None,
                env: str | None = None) -> bool | None:
    """An on/off backend option: `options[name]` if given, else the environment variable `env` (the older way
    to set it), else `default`. BackendUnavailable names the option (or the variable) on anything but on/off
    (1/0, true/false, yes/no)."""
    raw, where = _option_raw(options, name, env)
    if raw is None:
        return default
    v = ON_OFF.get(str(raw).strip().lower())
    if v is None:
        raise _option_error(where, name, raw, "on or off")
    return v == "on"


def option_choice(options: dict[str, str] | None, name: str, choices: Sequence[str], default: str,
                  env: str | None = None, aliases: dict[str, str] | None = None) -> str:
    """A backend option with named values: `options[name]` if given, else the environment variable `env`, else
    `default`; `aliases` maps other spellings to a choice (e.g. "1" -> "on"). BackendUnavailable names the option
    (or the variable) and its choices on anything else."""
    raw, where = _option_raw(options, name, env)
    if raw is None:
        return default
    v = str(raw).strip().lower()
    v = (aliases or {}).get(v, v)
    if v not in choices:
        raise _option_error(where, name, raw, f"one of {', '.join(choices)}")
    return v


def option_int(options: dict[str, str] | None, name: str, default: int | None, env: str | None = None, *,
               min: int = 0, max: int | None = None, off: int | None = None, power_of_two: bool = False) -> int | None:
    """An integer backend option in [min, max] (`off`: one more value outside it that turns the setting off, e.g.
    0; `power_of_two`: only powers of two): `options[name]` if given, else the environment variable `env`, else
    `default`. BackendUnavailable names the option (or the variable) and the range on anything else: every
    numeric option of every backend is checked here, so a NaN, a negative or a huge value never reaches a kernel
    launch, an allocation or a thread pool."""
    raw, where = _option_raw(options, name, env)
    if raw is None:
        return default
    if power_of_two:
        expected = f"a power of two in [{min}, {max}]"
    elif max is not None:
        expected = f"an integer in [{min}, {max}]"
    else:
        expected = f"an integer >= {min}"
    if off is not None:
        expected = f"{off} (off) or {expected}"
    try:
        v = int(str(raw).strip(), 10)
    except ValueError:
        raise _option_error(where, name, raw, expected) from None
    if v == off:
        return v
    if v < min or (max is not None and v > max) or (power_of_two and v & (v - 1)):
        raise _option_error(where, name, raw, expected)
    return v


def cache_root() -> "Path":
    """Where backends keep what they compiled or tuned, so the next run starts at once: $LLMC_CACHE_DIR, else
    $XDG_CACHE_HOME/llmc, else ~/.cache/llmc. Everything in it can be deleted at any time; it is rebuilt."""
    import os
    from pathlib import Path
    env = os.environ.get("LLMC_CACHE_DIR")
    if env:
        return Path(env)
    # without a home, no cache: under os.devnull reads find nothing and writes fail (a missing cache costs time)
    return user_dir("XDG_CACHE_HOME", ".cache") or Path(os.devnull) / "llmc"


def user_dir(xdg_var: str, under_home: str) -> "Path | None":
    """llmc's folder in one of the user's base directories: $<xdg_var>/llmc, else ~/<under_home>/llmc; None where
    the user has no home (HOME unset and no password entry, or HOME empty, which Python would read as /)."""
    import os
    from pathlib import Path
    xdg = os.environ.get(xdg_var)
    if xdg and os.path.isabs(xdg):  # (a relative one is to be ignored, says the XDG spec)
        return Path(xdg) / "llmc"
    home = os.environ.get("HOME")
    if home is None:
        try:
            home = str(Path.home())  # (from the password database)
        except RuntimeError:  # no HOME and no entry for this uid (a container's arbitrary user)
            home = ""
    return Path(home) / under_home / "llmc" if home else None


def cache_dir(backend: str) -> "Path":
    """One backend's folder in the cache (created by whoever writes there first)."""
    return cache_root() / backend


CACHE_FILE_MAX = 64 << 20  # a cache file larger than this is not one llmc wrote: it is passed over, not read


def read_cache_json(path: "Path") -> dict:
    """A JSON object from a cache file; {} when there is none yet or it is damaged (it is only a cache). Only a
    regular file is read: a FIFO where the cache belongs would block the read for ever, a device never ends."""
    import json
    import os
    import stat
    try:  # (non-blocking: opening a FIFO for reading would wait for a writer)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):  # (ValueError: a NUL in a variable's path)
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CACHE_FILE_MAX:
            return {}
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = json.loads(f.read())
    except (OSError, ValueError, RecursionError):  # (a damaged file: bytes that are not UTF-8, "[[[[..." nested)
        return {}
    finally:
        if fd >= 0:
            os.close(fd)
    return data if isinstance(data, dict) else {}


def _replaceable_cache(path: "Path") -> bool:
    """May a cache write replace the regular file at `path`? Inside llmc's cache folder, yes (anything there is a
    cache, damaged or not); elsewhere (a variable naming the file) only an empty file or one that starts as a JSON
    object (a cache, whole or damaged): a variable that names a user's file by mistake must not cost the user it."""
    import os
    from pathlib import Path
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(cache_root()))
        return True
    except ValueError:
        pass
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError:
        return False
    return not head or head.startswith(b"{")


def write_cache_file(path: "Path", data: str | bytes) -> None:
    """Write a cache file atomically (a temporary name, then rename: a reader never sees half of it); a failure
    (a read-only home, a full disk, a directory or a FIFO where the file belongs) is ignored and leaves no
    temporary, as a missing cache only costs time. Only a regular file (or nothing) is replaced, and outside llmc's
    cache folder only one that holds a cache (see _replaceable_cache)."""
    import os
    import secrets
    import stat
    from pathlib import Path
    tmp = None
    try:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode) or not _replaceable_cache(path):  # not a cache: left as it is
                return
        except FileNotFoundError:
            pass
        dest = Path(os.path.realpath(path))  # through a symbolic link: the link stays, the file it names is replaced
        dest.parent.mkdir(parents=True, exist_ok=True)
        # a name of this writer's own (two processes, or two threads, write the same cache), beside the file so
        # the rename is atomic
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, dest)
        tmp = None
    except (OSError, ValueError):
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


class BackendPlugin(abc.ABC):
    """What an entry point in group ``llmc.backends`` resolves to (a class or instance of this)."""

    name: str = "?"
    priority: int = 0  # `--backend auto` picks the usable plugin with the highest priority
    default_dtype: str = FLOAT32  # what `create(dtype=None)` gives (also what `--dry-run` plans with)
    reference: bool = False  # create(dtype=FLOAT32) gives a CAP_REFERENCE backend (bench checks the others on it)
    # settings a user may pass (`--backend-opt KEY=VALUE`), name -> one line: values, default, what it changes
    options: dict[str, str] = {}

    @abc.abstractmethod
    def probe(self) -> tuple[bool, str]:
        """(usable, one line: the device found, or why the backend cannot run here). Must not raise."""

    def devices(self) -> list[str]:
        """Human-readable names of the devices this backend can use (for `llmc backends`)."""
        return []

    @abc.abstractmethod
    def create(self, device: str | None = None, dtype: str | None = None,
               options: dict[str, str] | None = None) -> Backend:
        """A ready backend on `device` (plugin-specific selector, None = default) computing in `dtype`
        (None = `default_dtype`), with `options` (names from `self.options`, values as the user typed them; only
        passed when given). Raises BackendUnavailable with a one-line reason, a bad option value included."""

    def prepare(self) -> str:
        """Optional: do now, once, the slow work a first run would do (compile kernels into a persistent cache,
        for every dtype and device here), so that runs start at once. Called by `llmc backends --prepare` (and
        by install.sh) only when `probe()` says usable; returns one line saying what was done. Must be safe to
        call again (a warm cache makes it quick)."""
        return "nothing to prepare"

    def planned_scratch(self, dtype: str, options: dict[str, str] | None = None,
                        attention: tuple[int, int, int, int, int] | None = None) -> dict[str, int]:
        """Optional: the bytes a backend created with `dtype` and `options` allocates beside the engine's buffers
        (libraries' workspaces), by component: upper bounds, for `llmc train --dry-run`. `attention`: the model's
        (B, T, n_head, n_kv_head, head_dim), for workspaces that grow with it. Must not touch a device;
        BackendUnavailable on a bad option value, as `create` would say it."""
        return {}

    def communicator(self, backend: Backend, info: RankInfo, rendezvous: Rendezvous) -> "Communicator | None":
        """Optional: a Communicator over the device's own fabric for `info.world_size` ranks (every rank calls
        this collectively), using `rendezvous` to share its unique id; raise CommError with a one-line reason.
        None (the default) leaves the engine's MPI communicator, which stages buffers through host memory."""
        return None
