"""Data-parallel training on top of a communicator (llmc_cli.parallel.comm): gradient averaging, ZeRO-1, and the helpers
the Trainer needs to run as one rank of many.

* ``DataParallelAdamW`` (``--zero 0``): every rank keeps the whole optimizer state; once per optimizer step,
  after the last micro-step, the gradients are all-reduced (averaged) and every rank takes the same step.
* ``ShardedAdamW`` (``--zero 1``): the flat parameter vector is cut into ``world_size`` equal element ranges
  (plus a tail of fewer than ``world_size`` elements that every rank updates redundantly). Rank r owns range
  r: its fp32 moments (and fp32 master weights for bf16 runs) exist only there. A step is reduce-scatter of the
  gradients, AdamW on the owned range (a range cuts through tensors, so each tensor's piece is updated with that
  tensor's weight decay), then all-gather of the parameters.

Both keep the optimizer interface the Trainer uses (`grad_norm`, `step`, `state_host`, `load_state`,
`sync_master_from_params`, `step_count`) plus `reduce_grads()`. `state_host()` is collective and always returns
the WHOLE state (on rank 0; other ranks get None), so checkpoints are the same file whatever the number of ranks
or the ZeRO stage, and resume on any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np

from llmc_cli.kernels import AVG, BFLOAT16, FLOAT32, SUM, Backend, Communicator, clip_scale
from llmc_cli.naming import arg
from llmc_cli.optim import AdamW, AdamWConfig, StepResult
from llmc_cli.parallel.comm import SingleProcess

ZERO_STAGES = (0, 1, 2)


class DataParallelAdamW(AdamW):
    """AdamW with whole-state replicas: gradients are averaged over the ranks before the step."""

    def __init__(self, backend: Backend, params, grads, tensors, cfg: AdamWConfig, comm: Communicator):
        super().__init__(backend, params, grads, tensors, cfg)
        self.comm = self.result.comm = comm  # (the step's flags are reduced over the ranks too)

    def reduce_grads(self) -> None:
        if self.comm.world_size > 1:
            self.comm.all_reduce(self.grads.buf, AVG)

    def guarded_step(self, lr: float, seed: int, max_loss: float, max_norm: float,
                     flags=()) -> tuple[float, float, bool]:
        """AdamW's guarded step over the ranks' mean loss (averaged on the device; the gradients, already averaged,
        give every rank the same norm): every rank reaches the same verdict with no host read before the end."""
        if self.comm.world_size > 1:
            self.comm.all_reduce(self.loss_buf, AVG)
        return super().guarded_step(lr, seed, max_loss, max_norm, flags)

    def state_host(self):
        return super().state_host() if self.comm.rank == 0 else None


class ShardedAdamW:
    """ZeRO stage 1: optimizer state sharded over the ranks (see the module docstring)."""

    stage = 1
    mark: Callable[[str], None] | None = None  # told the update's phases as they are queued (training.phases)

    def __init__(self, backend: Backend, params, grads, tensors: list[tuple[str, bool]], cfg: AdamWConfig,
                 comm: Communicator):
        self.backend, self.params, self.grads, self.cfg, self.comm = backend, params, grads, cfg, comm
        self.tensors = tensors
        W, r = comm.world_size, comm.rank
        n = int(params.size)
        self.n = n
        self.chunk = n // W
        self.main = self.chunk * W            # reduce-scattered / all-gathered part
        self.tail = n - self.main             # < W elements every rank updates (its grads are all-reduced)
        if self.chunk == 0:
            raise ValueError(f"{arg('zero', 1)}: {n} parameters cannot be split over {W} ranks")
        # this rank's element ranges of the flat parameter vector, and where they sit in the local state
        self.ranges = [(r * self.chunk, (r + 1) * self.chunk)] + ([(self.main, n)] if self.tail else [])
        local = self.local_size = self.chunk + self.tail
        self._alloc_moments(local)
        # where this rank's reduced gradients are read: the whole gradient buffer (ZeRO-1), or a shard of
        # `local` elements laid out like m and v (ZeRO-2)
        shard = self._gradient_shard(local)
        self.norm_buf = backend.alloc(1, FLOAT32, tag="optimizer")
        self.loss_buf = backend.alloc(1, FLOAT32, tag="optimizer")   # the step's mean loss (loss_sum)
        self.result = StepResult(backend, comm)
        self.guard = self.result.guard  # [loss, norm, scale, apply] (step_guard)
        self.flags: tuple[float, ...] = ()  # the last guarded step's flags, the largest over the ranks
        self.step_count = 0
        self._plan_segments(tensors, shard)
        self._main_params = backend.view(params.buf, 0, self.main)
        self._find_peer_copies(shard)
        if shard is None:
            self._main_grads = backend.view(grads.buf, 0, self.main)
            self._tail_grads = backend.view(grads.buf, self.main, self.tail) if self.tail else None
            self._own_grads = backend.view(grads.buf, r * self.chunk, self.chunk)
        else:
            self._tail_grads = backend.view(shard, self.chunk, self.tail) if self.tail else None
            self._own_grads = backend.view(shard, 0, self.chunk)

    def _alloc_moments(self, local: int) -> None:
        """AdamW's fp32 moments of this rank's `local` elements, zeroed, and its fp32 master weights (bf16)."""
        backend = self.backend
        self.m = backend.alloc(local, FLOAT32, tag="optimizer")
        self.v = backend.alloc(local, FLOAT32, tag="optimizer")
        backend.fill(self.m, 0.0)
        backend.fill(self.v, 0.0)
        self.master = backend.alloc(local, FLOAT32, tag="optimizer") if backend.dtype == BFLOAT16 else None

    def _plan_segments(self, tensors: list[tuple[str, bool]], shard) -> None:
        """One segment per (tensor, owned range) overlap, weight decay being a property of the tensor: views of
        the parameters, reduced gradients (in the gradient buffer, or in `shard`), moments and master weights."""
        backend, params = self.backend, self.params
        if shard is None:
            def grad_at(lo, l0, n):
                return backend.view(self.grads.buf, lo, n)
        else:
            def grad_at(lo, l0, n):
                return backend.view(shard, l0, n)
        self._segments = []
        self._segment_at = []  # each segment's start in the flat parameter vector
        self._local_of = []  # (global start, local start, length) per range
        loc = 0
        for lo, hi in self.ranges:
            self._local_of.append((lo, loc, hi - lo))
            loc += hi - lo
        off = 0
        for i, (name, decay) in enumerate(tensors):
            size = int(np.prod(params.full[name].shape))
            for lo, lstart, length in self._local_of:
                a, b = max(off, lo), min(off + size, lo + length)
                if a >= b:
                    continue
                l0 = lstart + (a - lo)
                self._segment_at.append(a)
                self._segments.append((i, decay,
                                       backend.view(params.buf, a, b - a), grad_at(a, l0, b - a),
                                       backend.view(self.m, l0, b - a), backend.view(self.v, l0, b - a),
                                       None if self.master is None else backend.view(self.master, l0, b - a)))
            off += size
        if off != self.n:
            raise ValueError(f"tensor table covers {off} of {self.n} parameters")

    def _find_peer_copies(self, shard) -> None:
        """Where the communicator maps every rank's copy of the parameters into this process (peer_copies: GPUs
        that reach each other's memory), the update of this rank's chunk writes every copy of it, and no
        all-gather follows (the tail, which every rank updates alike, is not mirrored)."""
        self._mirrors = None
        self.peer_reduce = False
        peer_copies = getattr(self.comm, "peer_copies", None)
        copies = peer_copies(self.params.buf) if peer_copies is not None and self.comm.world_size > 1 else None
        if copies is not None:
            self._mirrors = [copies.others(a) if a < self.main else None for a in self._segment_at]
            # (with peer_reduce, the reduce-scatter loads the peers' chunks from their memory)
            if shard is None and getattr(self.comm, "peer_reduce", False):
                self.peer_reduce = peer_copies(self.grads.buf) is not None

    @property
    def peer_memory(self) -> bool:
        """Whether the updates write every rank's copy of the parameters (said in the run's data-parallel line,
        with peer_reduce)."""
        return self._mirrors is not None

    def _gradient_shard(self, local: int):
        return None

    def owner_pieces(self, off: int, n: int) -> list[tuple[int, int, int | None]]:
        """(lo, hi, owner) covering [off, off + n) of the flat vector, cut at the owners' boundaries; owner None
        for the tail every rank updates (all-reduced)."""
        chunk, main, out = self.chunk, self.main, []
        lo, end = off, off + n
        while lo < end:
            if lo >= main:
                out.append((lo, end, None))
                break
            owner = lo // chunk
            hi = min(end, (owner + 1) * chunk)
            out.append((lo, hi, owner))
            lo = hi
        return out

    # --- the step ---------------------------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Average the gradients: this rank's chunk by reduce-scatter, the short tail by all-reduce."""
        self.comm.reduce_scatter(self._main_grads, AVG)
        if self._tail_grads is not None:
            self.comm.all_reduce(self._tail_grads, AVG)

    def _norm_parts(self) -> list:
        """What this rank adds to the global norm: its owned chunk, and the tail on rank 0 (counted once)."""
        return [self._own_grads] + ([self._tail_grads] if self._tail_grads is not None and self.comm.rank == 0
                                    else [])

    def grad_norm(self) -> float:
        """Global norm of the averaged gradient: each rank's owned chunk, the tail counted once (on rank 0)."""
        self.backend.global_norm_squared(self.norm_buf, self._norm_parts())
        local = float(self.backend.download(self.norm_buf)[0])
        return math.sqrt(max(self.comm.all_reduce_value(local, SUM), 0.0))

    def step(self, lr: float, grad_norm: float, seed: int) -> None:
        self.step_count += 1
        self._updates(lr, self.step_count, clip_scale(grad_norm, self.cfg.grad_clip), seed, None)
        self._share_params()

    def guarded_step(self, lr: float, seed: int, max_loss: float, max_norm: float,
                     flags=()) -> tuple[float, float, bool]:
        """The step with no host read before its end, as AdamW.guarded_step: the squared norm summed and the loss
        averaged over the ranks on the device, so every rank's step_guard reaches the same verdict; the update
        and the all-gather queued behind it (a skipped step gathers the parameters unchanged). `flags` come back
        in `self.flags`, the largest over the ranks, from the same read."""
        b = self.backend
        if flags:
            self.result.set_flags(flags)
        b.global_norm_squared(self.norm_buf, self._norm_parts())
        if self.comm.world_size > 1:
            self.comm.all_reduce(self.norm_buf, SUM)
            self.comm.all_reduce(self.loss_buf, AVG)
        b.step_guard(self.guard, self.loss_buf, self.norm_buf, self.cfg.grad_clip, max_loss, max_norm)
        if self.mark:
            self.mark("guard")
        self._updates(lr, self.step_count + 1, 1.0, seed, self.guard)
        if self.mark:
            self.mark("adamw")
        self._share_params()
        loss, norm, apply, got = self.result.read()
        self.flags = got[:len(flags)]
        if apply:
            self.step_count += 1
        return loss, norm, apply

    def _updates(self, lr: float, step: int, scale: float, seed: int, guard) -> None:
        c = self.cfg
        for k, (i, decay, p, g, m, v, master) in enumerate(self._segments):
            mirror = {} if self._mirrors is None or self._mirrors[k] is None else {"mirrors": self._mirrors[k]}
            self.backend.adamw_update(
                p, g, m, v, master, lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                weight_decay=c.weight_decay if decay else 0.0, step=step, grad_scale=scale,
                seed=(seed * 1000003 + step * 64 + i) & 0x7FFFFFFF, guard=guard, **mirror)

    def _share_params(self) -> None:
        """Every rank's parameters made whole after the updates: all-gathered, or (mirrored updates) every copy
        written by its owner already, so the ranks only wait for each other before reading any."""
        if self._mirrors is not None:
            self.comm.device_barrier()
        else:
            self.comm.all_gather(self._main_params)

    def sync_master_from_params(self) -> None:
        if self.master is None:
            return
        for lo, lstart, length in self._local_of:
            self.backend.copy(self.backend.view(self.master, lstart, length),
                              self.backend.view(self.params.buf, lo, length))

    # --- whole state in and out (checkpoints) -----------------------------------------------------------------
    def _gather(self, local) -> np.ndarray | None:
        """The full-length host array of a sharded state buffer, on rank 0 (None elsewhere). Collective: chunk q
        is broadcast from rank q into a chunk-sized scratch buffer, so no rank ever holds the whole state on
        the device."""
        W, r = self.comm.world_size, self.comm.rank
        out = np.empty(self.n, dtype=np.float32) if r == 0 else None
        scratch = self.backend.alloc(self.chunk, FLOAT32, tag="optimizer-scratch") if W > 1 else None
        for q in range(W):
            if W == 1:
                part = self.backend.download(self.backend.view(local, 0, self.chunk))
            else:
                if q == r:
                    self.backend.copy(scratch, self.backend.view(local, 0, self.chunk))
                self.comm.broadcast(scratch, root=q)
                part = self.backend.download(scratch) if r == 0 else None
            if r == 0:
                out[q * self.chunk:(q + 1) * self.chunk] = part
        if r == 0 and self.tail:
            out[self.main:] = self.backend.download(self.backend.view(local, self.chunk, self.tail))
        return out

    def state_host(self) -> dict[str, np.ndarray] | None:
        """The whole optimizer state (as a single-process AdamW would hold it) on rank 0; None on the others.
        Every rank must call it."""
        out = {"m": self._gather(self.m), "v": self._gather(self.v)}
        if self.master is not None:
            out["master"] = self._gather(self.master)
        return out if self.comm.rank == 0 else None

    def _upload_owned(self, local, full: np.ndarray) -> None:
        full = np.asarray(full, dtype=np.float32).reshape(-1)
        if full.size != self.n:
            raise ValueError(f"optimizer state has {full.size} values, the model {self.n}")
        host = np.concatenate([full[lo:hi] for lo, hi in self.ranges])
        self.backend.upload(local, host)

    def load_state(self, state: dict[str, np.ndarray], step: int) -> None:
        """Take this rank's ranges of a whole optimizer state (from any number of ranks, any ZeRO stage)."""
        self._upload_owned(self.m, state["m"])
        self._upload_owned(self.v, state["v"])
        if self.master is not None:
            if "master" in state:
                self._upload_owned(self.master, state["master"])
            else:
                self.sync_master_from_params()
        self.step_count = step


class OverlappedReduction:
    """The gradient reduction of `opt` (DataParallelAdamW or ShardedAdamW) in pieces, each queued as soon as the
    backward pass has made it final (`layer_done(l)`, wired to Model.on_layer_grads on the last micro-step), so
    the reduction of layer l runs beside the backward of layers l-1 .. 0; `finish()` queues the rest (embeddings,
    final norm: final only at the end) and makes the backend's stream wait for all of it. Then the optimizer step
    runs as after `opt.reduce_grads()`: the buffers hold what the single reduction would have left in them.

    --zero 0 all-reduces each piece. --zero 1 reduces each piece to the rank that owns it (a piece crossing an
    owner's boundary is cut there; the tail every rank updates is all-reduced): each rank ends with its own chunk
    reduced, as reduce-scatter leaves it, and the communication is the same amount. Each element is reduced over
    the same ranks as before: with two ranks bit for bit what one call computes (a + b has one order); with more,
    the order of the additions is whatever the communicator picks for a message of that size (fixed run to
    run)."""

    def __init__(self, opt, grads, comm: Communicator):
        self.opt, self.grads, self.comm, self.backend = opt, grads, comm, opt.backend
        self.sharded = isinstance(opt, ShardedAdamW)
        self.overlapped = getattr(comm, "overlapped", None)
        # ZeRO-1 on ranks that reach each other's memory: the owners' pieces moved by copies, not collectives
        # (Communicator.reduce_scatter_pieces); the tail every rank updates is all-reduced at the end
        pieces = getattr(comm, "reduce_scatter_pieces", None) if self.sharded and opt.stage == 1 else None
        self.pushed = pieces(opt._main_grads) if pieces is not None else None
        self._tail: list[tuple[int, int]] = []

    @property
    def by_copies(self) -> bool:
        """Whether the pieces travel as copies to their owners (said in the run's data-parallel line)."""
        return self.pushed is not None

    def _queue(self, ranges) -> None:
        if self.pushed is not None:
            owned = []
            for off, n in ranges:
                for lo, hi, owner in self._pieces(off, n):
                    (self._tail if owner is None else owned).append((lo, hi))
            self.pushed.send(owned)
            return
        with (self.overlapped() if self.overlapped is not None else nullcontext()):
            for off, n in ranges:
                for lo, hi, owner in self._pieces(off, n):
                    view = self.backend.view(self.grads.buf, lo, hi - lo)
                    if owner is None:
                        self.comm.all_reduce(view, AVG)
                    else:
                        self.comm.reduce(view, owner, AVG)

    def _pieces(self, off: int, n: int):
        """(lo, hi, owner) covering [off, off + n): owner None = all-reduce (--zero 0, or ZeRO-1's tail)."""
        return self.opt.owner_pieces(off, n) if self.sharded else [(off, off + n, None)]

    def layer_done(self, l: int) -> None:
        self._queue(self.grads.layer_ranges[l])

    def finish(self) -> None:
        self._queue(self.grads.other_ranges)
        if self.pushed is not None:
            self.pushed.finish()
            for lo, hi in self._tail:
                self.comm.all_reduce(self.backend.view(self.grads.buf, lo, hi - lo), AVG)
            self._tail = []
            return
        join = getattr(self.comm, "join", None)
        if join is not None:
            join()


class Zero2AdamW(ShardedAdamW):
    """ZeRO stage 2: ShardedAdamW's ownership and step, and the gradients sharded too. The model keeps its
    gradients as LayerSlotGrads (one layer's slot and the unstacked tensors); LayerShardedReduction reduces each
    layer's slot into the owners' shards as the backward pass goes, so a rank holds n / W reduced gradients plus one
    layer's, not n."""

    stage = 2

    def _gradient_shard(self, local: int):
        if not hasattr(self.grads, "layer_pieces"):
            raise ValueError(f"{arg('zero', 2)} needs the model built with layer_grads=True (LayerSlotGrads)")
        self.grads.shard = self.backend.alloc(local, self.backend.dtype, tag="grads")
        self.backend.fill(self.grads.shard, 0.0)
        return self.grads.shard

    def reduce_grads(self) -> None:
        raise RuntimeError(f"{arg('zero', 2)} reduces as the backward pass goes (LayerShardedReduction), not after it")


class LayerShardedReduction:
    """ZeRO-2's gradient path. After layer l's backward, on every micro-step (the slot is reused by layer l-1), each
    piece of the slot is reduced to its owner (cut at the owners' boundaries; the tail all-reduced), the owner adds
    it into its shard, and the slot is zeroed; `finish()` (after the last micro-step) does the same for the
    unstacked tensors, which accumulated in their own buffer. Everything runs in order on the backend's stream:
    the slot's reuse needs no event, and on two NVLink GPUs collectives beside the matmuls did not pay (--overlap).
    The shard ends with what ZeRO-1's reduce-scatter leaves in the owned chunk, each micro-step's reduction added
    in turn (bf16 gradients: the rounding of that sum differs from accumulating before reducing)."""

    every_micro_step = True

    def __init__(self, opt: Zero2AdamW, grads, comm: Communicator):
        self.opt, self.grads, self.comm, self.backend = opt, grads, comm, opt.backend
        self.rank = comm.rank

    def _into_shard(self, off: int, buf, at: int, n: int) -> None:
        b, opt = self.backend, self.opt
        for lo, hi, owner in opt.owner_pieces(off, n):
            piece = b.view(buf, at + lo - off, hi - lo)
            if owner is None:
                self.comm.all_reduce(piece, AVG)
                dst = b.view(self.grads.shard, opt.chunk + (lo - opt.main), hi - lo)
            else:
                self.comm.reduce(piece, owner, AVG)
                if owner != self.rank:
                    continue
                dst = b.view(self.grads.shard, lo - owner * opt.chunk, hi - lo)
            b.residual_forward(dst, dst, piece)

    def layer_done(self, l: int) -> None:
        for piece in self.grads.layer_pieces(l):
            self._into_shard(*piece)
        self.backend.fill(self.grads.slot, 0.0)

    def finish(self) -> None:
        for piece in self.grads.other_pieces():
            self._into_shard(*piece)


def make_optimizer(backend: Backend, model, cfg: AdamWConfig, comm: Communicator | None = None, zero: int = 0):
    """The optimizer for `model` on this rank: whole-state AdamW (gradients all-reduced), ZeRO-1, or ZeRO-2 (the
    model built with layer_grads=True)."""
    comm = comm or SingleProcess()
    if zero not in ZERO_STAGES:
        raise ValueError(f"{arg('zero', zero)}: llmc has ZeRO stages {', '.join(map(str, ZERO_STAGES))}")
    cls = {0: DataParallelAdamW, 1: ShardedAdamW, 2: Zero2AdamW}[zero]
    return cls(backend, model.params, model.grads, model.tensor_names(), cfg, comm)


def reshard_loader_state(state: dict, world_size: int) -> dict:
    """A data loader position saved by `W_old` ranks, as `world_size` ranks with the same B and T see it: the
    same tokens consumed, so the continuation reads the same data (llm.c's window of W*B*T tokens per sample). A
    position that cannot move is a ValueError, which the caller prefixes with the run it resumes."""
    old = int(state.get("world_size", 1))
    if old == world_size:
        return state
    if state.get("shuffle"):
        raise ValueError(f"the run was shuffled over {old} ranks; shuffled positions cannot move to "
                         f"{world_size} ranks (resume on {old} ranks, or train without {arg('shuffle', True)})")
    tokens = int(state["sample"]) * old
    if tokens % world_size:
        raise ValueError(f"the data position (sample {state['sample']} of {old}-rank windows) does not "
                         f"fall on a {world_size}-rank window")
    return dict(state, sample=tokens // world_size, world_size=world_size)
