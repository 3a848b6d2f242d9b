"""AdamW driven tensor by tensor through the kernel interface, global-norm clipping, and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real

import numpy as np

from llmc_cli.kernels import BFLOAT16, FLOAT32, MAX, Backend, clip_scale

# host values a step carries to every rank in its one read (the Trainer's: a stop request, a checkpoint due, the
# rank's previous step's seconds)
FLAGS = 3


class StepResult:
    """What a guarded step's one read at its end returns: step_guard's [loss, norm, scale, apply] (`guard`, which
    AdamW reads on the device), then FLAGS host values every rank set before the read (`flags`), each the largest
    over the ranks of `comm` (a data-parallel optimizer's communicator; None for one process)."""

    def __init__(self, backend: Backend, comm=None):
        self.backend, self.comm = backend, comm
        self.buf = backend.alloc(4 + FLAGS, FLOAT32, tag="optimizer")
        self.guard = backend.view(self.buf, 0, 4)
        self.flags = backend.view(self.buf, 4, FLAGS)

    def set_flags(self, flags) -> None:
        """Queues this rank's flags and their reduction (max) over the ranks, behind the work queued before."""
        for i, f in enumerate(flags):  # (fill queues on the device's order: no wait for the work queued before)
            self.backend.fill(self.backend.view(self.flags, i, 1), float(f))
        if self.comm is not None and self.comm.world_size > 1:
            self.comm.all_reduce(self.flags, MAX)

    def read(self) -> tuple[float, float, bool, tuple[float, ...]]:
        """(loss, norm, applied, flags): waits for everything queued."""
        v = [float(x) for x in self.backend.download(self.buf)]
        return v[0], v[1], bool(v[3]), tuple(v[4:])


@dataclass
class AdamWConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def validate(self) -> None:
        """Each value a real number (not a bool; numpy scalars are numbers), finite and where AdamW is defined:
        beta = 1 divides by zero in the bias correction, and eps = 0 divides by zero wherever a moment is zero
        (every update after the first then holds NaN and is skipped). ValueError naming the field."""
        self.checked()

    def checked(self) -> "AdamWConfig":
        """A copy with every value a Python float, after `validate`'s checks (np.float32(1e-3) is a learning rate;
        True is not)."""
        out = {}
        for name, lo, hi, lo_open in _CHECKS:
            v = getattr(self, name)
            want = (f"in [{lo:g}, {hi:g})" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}")
            where = f"{name} must be a finite number {want} (got {v!r})"
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, Real):
                raise ValueError(where)
            x = float(v)
            if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and (hi is None or x < hi)):
                raise ValueError(where)
            out[name] = x
        return AdamWConfig(**out)


# (field, low bound, high bound (exclusive) or None, low bound exclusive)
_CHECKS = (("lr", 0.0, None, False), ("beta1", 0.0, 1.0, False), ("beta2", 0.0, 1.0, False), ("eps", 0.0, None, True),
           ("weight_decay", 0.0, None, False), ("grad_clip", 0.0, None, False))


def lr_at(step: int, max_lr: float, warmup: int, total_steps: int, final_frac: float) -> float:
    """llm.c's schedule: linear warmup over `warmup` steps, then cosine decay to `final_frac * max_lr` at the
    last step (0-based `step`). final_frac 1.0 means constant after warmup."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if total_steps <= warmup:
        return max_lr
    ratio = min(1.0, (step - warmup) / (total_steps - warmup))
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    min_lr = max_lr * final_frac
    return min_lr + coeff * (max_lr - min_lr)


class AdamW:
    """Optimizer state (fp32 moments, and fp32 master weights when the parameters are bf16) laid out like the
    parameters: one flat buffer each, updated tensor by tensor so weight decay hits only weight matrices."""

    mark: Callable[[str], None] | None = None  # told the update's phases as they are queued (training.phases)

    def __init__(self, backend: Backend, params, grads, tensors: list[tuple[str, bool]], cfg: AdamWConfig):
        self.backend, self.params, self.grads, self.cfg = backend, params, grads, cfg
        self.tensors = tensors
        n = params.size
        self.m = backend.alloc(n, FLOAT32, tag="optimizer")
        self.v = backend.alloc(n, FLOAT32, tag="optimizer")
        backend.fill(self.m, 0.0)
        backend.fill(self.v, 0.0)
        self.master = None
        if backend.dtype == BFLOAT16:
            self.master = backend.alloc(n, FLOAT32, tag="optimizer")
        self.norm_buf = backend.alloc(1, FLOAT32, tag="optimizer")
        self.loss_buf = backend.alloc(1, FLOAT32, tag="optimizer")   # the step's mean loss (loss_sum)
        self.result = StepResult(backend)
        self.guard = self.result.guard  # [loss, norm, scale, apply] (step_guard)
        self.flags: tuple[float, ...] = ()  # the last guarded step's flags, as every rank read them
        self.step_count = 0
        self._views = []
        off = 0
        for name, decay in tensors:
            size = int(np.prod(params.full[name].shape))
            self._views.append((name, decay, backend.view(self.m, off, size), backend.view(self.v, off, size),
                                None if self.master is None else backend.view(self.master, off, size)))
            off += size

    def sync_master_from_params(self) -> None:
        """Master weights start as a float32 copy of the parameters (after init or load)."""
        if self.master is not None:
            self.backend.copy(self.master, self.params.buf)

    def grad_norm(self) -> float:
        self.backend.global_norm_squared(self.norm_buf, [self.grads.buf])
        return math.sqrt(float(self.backend.download(self.norm_buf)[0]))

    def step(self, lr: float, grad_norm: float, seed: int) -> None:
        """One update; gradients are scaled by clip/norm when the norm exceeds the clip (llm.c's rule)."""
        c = self.cfg
        self.step_count += 1
        scale = clip_scale(grad_norm, c.grad_clip)
        self._updates(lr, self.step_count, scale, seed, None)

    def _updates(self, lr: float, step: int, scale: float, seed: int, guard) -> None:
        c = self.cfg
        for i, (name, decay, m, v, master) in enumerate(self._views):
            self.backend.adamw_update(
                self.params.full[name], self.grads.full[name], m, v, master,
                lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps, weight_decay=c.weight_decay if decay else 0.0,
                step=step, grad_scale=scale, seed=(seed * 1000003 + step * 64 + i) & 0x7FFFFFFF, guard=guard)

    def guarded_step(self, lr: float, seed: int, max_loss: float, max_norm: float,
                     flags=()) -> tuple[float, float, bool]:
        """The whole update queued without the host waiting for the device in between: the grad norm, the clip
        scale and the skip verdict (non-finite loss or norm, or one above its bound) are computed on the device
        (`step_guard`) and every AdamW update reads them there. The step's mean loss must be in `loss_buf`
        (`loss_sum`). One read at the end returns (loss, norm, applied); a skipped step changes nothing. `flags`
        (at most FLAGS host values) come back in `self.flags` from that same read, the largest over the ranks."""
        b = self.backend
        if flags:
            self.result.set_flags(flags)
        b.global_norm_squared(self.norm_buf, [self.grads.buf])
        b.step_guard(self.guard, self.loss_buf, self.norm_buf, self.cfg.grad_clip, max_loss, max_norm)
        if self.mark:
            self.mark("guard")
        self._updates(lr, self.step_count + 1, 1.0, seed, self.guard)
        if self.mark:
            self.mark("adamw")
        loss, norm, apply, got = self.result.read()
        self.flags = got[:len(flags)]
        if apply:
            self.step_count += 1
        return loss, norm, apply

    # state in and out as host arrays, for checkpoints
    def state_host(self) -> dict[str, np.ndarray]:
        out = {"m": self.backend.download(self.m), "v": self.backend.download(self.v)}
        if self.master is not None:
            out["master"] = self.backend.download(self.master)
        return out

    def load_state(self, state: dict[str, np.ndarray], step: int) -> None:
        self.backend.upload(self.m, state["m"])
        self.backend.upload(self.v, state["v"])
        if self.master is not None:
            if "master" in state:
                self.backend.upload(self.master, state["master"])
            else:
                self.sync_master_from_params()
        self.step_count = step
