"""What every model spec (GPT-2, Llama 3) shares: named views into one flat parameter buffer, and the
parameter/gradient bookkeeping around the spec's own forward and backward."""

from __future__ import annotations

import math
import os
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Callable

import numpy as np

from llmc_cli.kernels import CAP_FP8, CAP_GRAPHS, CAP_KV_CACHE, Backend
from llmc_cli.naming import arg


def check_config_fields(cfg) -> None:
    """Every field of a model config (a dataclass) holds its annotated type, nothing merely convertible to it:
    an int is an int (not True, "2" or 2.0) and positive; a float is a finite positive number; a bool is a bool.
    Configs come from files (config.json, a safetensors header, state.json): a wrong type there must be
    refused, not turned into a different model."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        v, hint = getattr(cfg, f.name), hints[f.name]
        args = set(typing.get_args(hint)) or {hint}
        if v is None and type(None) in args:
            continue
        if bool in args:
            ok = type(v) is bool
        elif int in args and float not in args:
            ok = type(v) is int and v > 0
        else:  # a float (ints allowed, as JSON writes 10000.0 as 10000)
            ok = type(v) in (int, float) and math.isfinite(v) and v > 0
        if not ok:
            want = {bool: "true or false", int: "a positive integer"}.get(hint, "a finite positive number")
            raise ValueError(f"{f.name} must be {want} (got {v!r})")


INT32_MAX = 2**31 - 1  # the most tokens, rows or elements the kernels index, and what the model files' headers hold


def check_seq_len(T: int, block_size: int, name: str = "T") -> None:
    """The model's one limit on a sequence: at most `block_size` positions (the rows of GPT-2's position table,
    the positions Llama's RoPE frequencies are planned for). `name` is how the caller spells T (a command's "-t")."""
    if T > block_size:
        raise ValueError(f"{name} {T} is longer than the model's block size {block_size}")

# a capability and the Backend method it promises (kernels.py: the base class's own raises NotImplementedError)
CAPABILITY_KERNELS = {CAP_KV_CACHE: "attention_decode", CAP_GRAPHS: "capture"}


def backend_name(backend) -> str:
    name = getattr(backend, "name", None)
    return name if isinstance(name, str) and name else type(backend).__name__


def check_backend(backend, who: str = "backend") -> None:
    """A ValueError of one line for something that is not a backend (None, a name: create_backend makes one)."""
    if backend is None or isinstance(backend, str) or not all(
            callable(getattr(backend, m, None)) for m in ("alloc", "upload", "download", "fill")):
        raise ValueError(f"{who} must be a Backend, e.g. llmc.create_backend('cpu') (got {backend!r:.80})")


def backend_capabilities(backend) -> frozenset[str]:
    """`backend.capabilities`, checked: a set (or frozenset) of names, each of whose kernels (CAPABILITY_KERNELS)
    the backend has. Anything else is a ValueError of one line naming the backend: None or a list made `in` fail
    with a TypeError deep in a run, and a string ("kv_cache,graphs") answered `in` by substring; a capability
    announced without its kernel failed with NotImplementedError at its first use."""
    caps = getattr(backend, "capabilities", None)
    if not isinstance(caps, (set, frozenset)) or not all(isinstance(c, str) for c in caps):
        raise ValueError(f"the {backend_name(backend)} backend's capabilities must be a set of names such as "
                         f"frozenset({{{CAP_KV_CACHE!r}}}) (got {caps!r:.80})")
    for cap, kernel in CAPABILITY_KERNELS.items():
        method = getattr(backend, kernel, None)
        if cap in caps and (method is None or getattr(method, "__func__", None) is getattr(Backend, kernel)):
            raise ValueError(f"the {backend_name(backend)} backend announces the {cap!r} capability but has no "
                             f"{kernel} of its own (the Backend default raises); implement it or leave {cap!r} out")
    return frozenset(caps)


def unimplemented_kernel(backend, e: NotImplementedError) -> str:
    """One line for a NotImplementedError a kernel raised: the backend, and the kernel (the innermost frame of the
    traceback that is a method of the kernel interface, else the innermost) with what it said."""
    tb, kernel = e.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_name
        if callable(getattr(Backend, name, None)) or tb.tb_next is None and kernel is None:
            kernel = name
        tb = tb.tb_next
    kernel = kernel or "a kernel"
    said = str(e).splitlines()[0] if str(e) else ""
    return (f"the {backend_name(backend)} backend's {kernel} is not implemented"
            + (f" ({said})" if said else "") + "; a backend announces a capability only when it implements its "
            "kernels")


def check_plan(B, T) -> tuple[int, int]:
    """(B, T) as Python ints (numpy's integers are integers: np.uint8(255) overflowed comparisons later), each an
    integer >= 1 and B*T at most what the kernels index; else a ValueError of one line."""
    for name, v in (("B", B), ("T", T)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
    B, T = int(B), int(T)
    if B * T > INT32_MAX:
        raise ValueError(f"B {B} x T {T}: {B * T:,} tokens, more than the kernels index (2**31 - 1)")
    return B, T


def check_ids(ids, vocab_size: int, shape: tuple[int, ...], what: str) -> np.ndarray:
    """`ids` as int32 when it is an integer array of `shape` whose every id is in 0..vocab_size-1, else a ValueError
    of one line naming `what`: an id outside the vocabulary read another row of the embedding, or memory past it on
    a device (a segfault), and one past 2**31 wrapped around in the int32 the kernels take."""
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: {a.dtype} values, expected integer token ids 0..{vocab_size - 1}")
    if a.shape != tuple(shape):
        raise ValueError(f"{what}: an array of shape {a.shape}, expected (B, T) = {tuple(shape)}, the shape the "
                         "model was planned for")
    if a.size:
        lo, hi = a.min(), a.max()
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{what}: token id {lo if lo < 0 else hi} is outside the model's vocabulary "
                             f"0..{vocab_size - 1}")
    return a.astype(np.int32, copy=False)


INIT_BLOCK = 1 << 20  # elements of one independently seeded block of an initialised tensor


def init_normal(tensors: list[tuple[np.ndarray, float]], seed: int) -> None:
    """Fill each (tensor, std) with N(0, std^2) float32 values, in blocks of INIT_BLOCK elements drawn on threads:
    block j of tensor i has its own generator seeded (seed, i, j), so the values depend on the seed alone, never
    on the number of threads (a 124M model initialises in a fraction of a second rather than seconds)."""

    def fill(job):
        i, j, flat, std = job
        block = flat[j * INIT_BLOCK:(j + 1) * INIT_BLOCK]
        np.random.default_rng([seed, i, j]).standard_normal(block.size, dtype=np.float32, out=block)
        block *= np.float32(std)  # (numpy releases the GIL for both)

    jobs = []
    for i, (t, std) in enumerate(tensors):
        flat = t.reshape(-1)  # a view: the tensors are contiguous views into the flat parameter buffer
        jobs += [(i, j, flat, std) for j in range(-(-flat.size // INIT_BLOCK))]
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        list(pool.map(fill, jobs))


# ---- what both families plan the same way -----------------------------------------------------------------------
# --recompute: which activations backward recomputes instead of forward keeping one per layer. The names are
# GPT-2's (llm.c's); in Llama "gelu" is the SwiGLU output (recomputed from the gate/up product h13) and
# "layernorm" the RMSNorm outputs ln1/ln2 (recomputed from the residual stream). Each family's backward runs the
# same forward kernel on the same inputs again, so the gradients are those of keeping the activations.
RECOMPUTE = ("none", "gelu", "layernorm", "gelu+layernorm")


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"{arg('recompute')} must be one of {', '.join(RECOMPUTE)} (got '{recompute}')")


# A training forward runs the lm-head product, the fused classifier and the lm-head backward chunk by chunk, so
# only one chunk's logits buffer exists (GPT-2 d12 at B=64, T=1024: 6.1 GiB whole in bf16; Llama 3.1 8B at B=1,
# T=8192: 2.1 GB for its single sequence). Chunks are at most CLASSIFIER_CHUNK_BYTES, and at least
# CLASSIFIER_CHUNK_MIN_BYTES unless the whole logits are smaller, so that the lm-head products stay large enough
# to run at full speed and the re-read of the head's gradient per chunk stays a small cost.
CLASSIFIER_CHUNK_BYTES = 1 << 30
CLASSIFIER_CHUNK_MIN_BYTES = 256 << 20


def pick_classifier_chunks(units: int, unit_bytes: int, cost: Callable[[int], int], ragged: bool) -> int:
    """How many chunks the training classifier runs in, over `units` (GPT-2: sequences; Llama: rows of B*T) of
    `unit_bytes` logits each; a chunk holds ceil(units/n) of them. Among the counts whose chunk lies within
    [CLASSIFIER_CHUNK_MIN_BYTES, CLASSIFIER_CHUNK_BYTES] (or is the whole under the maximum; one unit a chunk
    when even one is over it), the one of least `cost(n)` (the memory the family plans for n chunks), the
    fewest chunks on a tie. Without `ragged` the count must divide `units` (every chunk the same size); with it
    the last chunk may be smaller."""
    fits, n = [], 1
    while n <= units:
        size = -(-units // n) * unit_bytes
        if n > 1 and size < CLASSIFIER_CHUNK_MIN_BYTES:
            break  # the chunk only shrinks as n grows
        if size <= CLASSIFIER_CHUNK_BYTES and (ragged or units % n == 0):
            fits.append(n)
        n += 1
    return min(fits or [units], key=lambda c: (cost(c), c))


def split_flat(flat, shapes: list[tuple[str, tuple[int, ...]]]) -> dict:
    """Named views of a flat parameter vector (numpy array or torch tensor) laid out as `shapes` says."""
    out, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        out[name] = flat[off:off + n].reshape(shape)
        off += n
    return out


class Tensors:
    """Named views into one flat backend buffer; `per_layer[name][l]` is layer l of a stacked tensor."""

    def __init__(self, backend: Backend, buf, shapes: list[tuple[str, tuple[int, ...]]], stacked: set[str]):
        self.buf = buf
        self.full: dict[str, object] = {}
        self.per_layer: dict[str, list] = {}
        # (offset, elements) of each layer's pieces of the stacked tensors, and of the tensors stacked over nothing
        self.layer_ranges: list[list[tuple[int, int]]] = []
        self.other_ranges: list[tuple[int, int]] = []
        off = 0
        for name, shape in shapes:
            n = int(np.prod(shape))
            self.full[name] = backend.view(buf, off, shape)
            if name in stacked:
                step = n // shape[0]
                self.per_layer[name] = [backend.view(buf, off + l * step, shape[1:]) for l in range(shape[0])]
                self.layer_ranges += [[] for _ in range(shape[0] - len(self.layer_ranges))]
                for l in range(shape[0]):
                    self.layer_ranges[l].append((off + l * step, step))
            else:
                self.other_ranges.append((off, n))
            off += n
        self.size = off

    def __getattr__(self, name):
        try:
            return self.full[name]
        except KeyError:
            raise AttributeError(name) from None

    def layer(self, name: str, l: int):
        return self.per_layer[name][l]

    def buffers(self) -> list:
        """What zeroing these tensors fills."""
        return [self.buf]


class LayerSlotGrads:
    """Gradients as ZeRO-2 keeps them: every layer's slices of the stacked tensors in one slot, reused layer after
    layer (`layer(name, l)` is a view into it whatever l), and the tensors stacked over nothing (embeddings, final
    norm) in a buffer of their own that accumulates over the micro-steps. Once layer l's backward is done its slot is
    reduced into the ranks' gradient shards and zeroed for layer l-1 (parallel.zero.LayerShardedReduction), so a
    rank never holds the whole gradient. `layer_pieces(l)` / `other_pieces()` pair each piece's offset in the flat
    parameter vector with where it is kept here; `shard` is the rank's shard, registered by the optimizer, zeroed with the
    rest at a step's start."""
    # (pieces are (flat offset, buffer, offset in it, elements): views are cut from the buffers themselves, since
    # a backend's view of a view need not exist (OpenCL has no sub-buffer of a sub-buffer))

    def __init__(self, backend: Backend, shapes: list[tuple[str, tuple[int, ...]]], stacked: set[str], dtype: str):
        self.backend, self.full, self.per_layer_shape = backend, {}, {}
        slot_n = sum(int(np.prod(s[1:])) for n, s in shapes if n in stacked)
        other_n = sum(int(np.prod(s)) for n, s in shapes if n not in stacked)
        self.slot = backend.alloc(max(slot_n, 1), dtype, tag="grads")
        self.others = backend.alloc(max(other_n, 1), dtype, tag="grads")
        self.shard = None
        self._slot_views: dict[str, object] = {}
        self._layer_pieces: list[list[tuple[int, object, int, int]]] = []
        self._other_pieces: list[tuple[int, object, int, int]] = []
        off = s_off = o_off = 0
        for name, shape in shapes:
            n = int(np.prod(shape))
            if name in stacked:
                step = n // shape[0]
                view = backend.view(self.slot, s_off, shape[1:])
                self._slot_views[name] = view
                self._layer_pieces += [[] for _ in range(shape[0] - len(self._layer_pieces))]
                for l in range(shape[0]):
                    self._layer_pieces[l].append((off + l * step, self.slot, s_off, step))
                s_off += step
            else:
                self.full[name] = backend.view(self.others, o_off, shape)
                self._other_pieces.append((off, self.others, o_off, n))
                o_off += n
            off += n
        self.size = off

    def __getattr__(self, name):
        try:
            return self.__dict__["full"][name]
        except KeyError:
            raise AttributeError(name) from None

    def layer(self, name: str, l: int):
        return self._slot_views[name]

    def layer_pieces(self, l: int) -> list[tuple[int, object, int, int]]:
        return self._layer_pieces[l]

    def other_pieces(self) -> list[tuple[int, object, int, int]]:
        return self._other_pieces

    def buffers(self) -> list:
        return [self.slot, self.others] + ([self.shard] if self.shard is not None else [])


# forward(STAGED, STAGED, ...): the batch is already in acts["inputs"] / acts["targets"] (Model.stage), so the call
# enqueues kernels only: what a captured graph of the step (CAP_GRAPHS) may hold.
STAGED = object()


class Model:
    """Base of a model spec. The subclass plans its activations and writes forward/backward; it sets
    `param_shapes(cfg)` and `DECAYED` (the tensors that get weight decay) as class attributes."""

    param_shapes = None
    DECAYED: frozenset[str] = frozenset()
    # called by backward() with l once layer l's parameter gradients are final in this backward pass (its pieces of
    # grads.layer_ranges): data parallel reduces them then, beside the layers still to come
    on_layer_grads: Callable[[int], None] | None = None
    # whose ids the weights were trained on ("gpt2", "llama3"), when known: load_model and the trainer set it, so
    # that an eval on data of another vocabulary is refused (None: unknown, only the vocab size is checked)
    tokenizer: str | None = None

    @property
    def head_kw(self) -> dict:
        """Keywords of the classifier's matmuls: on a CAP_FP8 backend they are `precise` (the logits feed the loss
        directly), which keeps them in bf16 unless the backend is told otherwise."""
        return {"precise": True} if CAP_FP8 in backend_capabilities(self.backend) else {}

    def fp8_next(self, weight) -> dict:
        """Keywords of a kernel whose output the product with `weight` reads next (kernels.Backend's producers): on
        a CAP_FP8 backend `fp8_next`, so the kernel may write that product's FP8 operand itself."""
        return {"fp8_next": weight} if CAP_FP8 in backend_capabilities(self.backend) else {}

    def _alloc_parameters(self, stacked: set[str], training: bool, share_params: "Model | None",
                          layer_grads: bool = False) -> None:
        """`layer_grads`: gradients in one layer-sized slot plus the unstacked tensors (LayerSlotGrads, ZeRO-2)
        instead of a whole flat buffer."""
        dt, backend = self.backend.dtype, self.backend
        shapes = type(self).param_shapes(self.cfg)
        self.num_params = sum(int(np.prod(s)) for _, s in shapes)
        if share_params is not None:
            self.params = share_params.params
        else:
            self.params = Tensors(backend, backend.alloc(self.num_params, dt, tag="params"), shapes, stacked)
        self.grads = None
        if training and layer_grads:
            self.grads = LayerSlotGrads(backend, shapes, stacked, dt)
        elif training:
            self.grads = Tensors(backend, backend.alloc(self.num_params, dt, tag="grads"), shapes, stacked)

    # parameters in and out, always as float32 on the host
    def load_parameters(self, flat: np.ndarray) -> None:
        if flat.size != self.num_params:
            raise ValueError(f"expected {self.num_params} parameters, got {flat.size}")
        self.backend.upload(self.params.buf, flat)

    def parameters_host(self) -> np.ndarray:
        return self.backend.download(self.params.buf).astype(np.float32, copy=False)

    def stage(self, inputs: np.ndarray, targets: np.ndarray | None) -> None:
        """Upload a batch for a following forward(STAGED, STAGED or None, ...): (B, T) integer ids of the model's
        vocabulary each (a ValueError otherwise, before anything is uploaded: see check_ids)."""
        shape, V = (self.B, self.T), self.cfg.vocab_size
        inputs = check_ids(inputs, V, shape, "inputs")
        if targets is not None:
            targets = check_ids(targets, V, shape, "targets")
        self.backend.upload(self.acts["inputs"], inputs)
        if targets is not None:
            self.backend.upload(self.acts["targets"], targets)

    def zero_grad(self) -> None:
        for buf in self.grads.buffers():
            self.backend.fill(buf, 0.0)

    def mean_loss(self) -> float:
        return float(self.backend.download(self.acts["losses"]).astype(np.float64).mean())

    def logits_host(self, t: int) -> np.ndarray:
        """Float32 logits (B, V) at position t, for sampling (only after a forward without dloss)."""
        logits = self.backend.download(self.acts["logits"])
        return logits[:, t, :self.cfg.vocab_size].astype(np.float32)

    def tensor_names(self) -> list[tuple[str, bool]]:
        """(name, gets weight decay) for every parameter tensor, in order."""
        return [(n, n in self.DECAYED) for n, _ in type(self).param_shapes(self.cfg)]
