"""The ranks' votes: every data-parallel rank stops after the same step and checkpoints at the same ones, with no
host collective between two steps where it can be helped.

A rank's stop request, rank 0's checkpoint clock and its last step's seconds travel with the optimizer's own
collectives (its step reduces them, max, and returns them in the step's one read): a host round trip between steps
left every GPU idle outside any step's time (about 0.2 ms a step on two H100s). The host queues a step long before
the device runs it, so a request made during the step is voted on at the next; where steps take SLOW_STEP_S or
more, or the next iteration validates, samples or checkpoints first, the ranks vote once more after the step (a
scheduler's grace before SIGKILL must not be spent on a second long wait). One rank votes on nothing."""

from __future__ import annotations

import time
from typing import Callable

from llmc_cli.kernels import MAX

# data parallel steps this long (seconds, the slowest rank's) also vote on a stop request after each step: its host
# round trip (0.2 ms) is then under 0.02 % of the step
SLOW_STEP_S = 1.0
OTHER_RANK = "a stop request on another rank"


class RankVotes:
    """What run() decides between steps, the same on every rank: whether an iteration validates, evaluates, samples
    or checkpoints before it trains, and whether the run stops after a step. `clock` (seconds; time.monotonic) and
    `slow_step_s` are attributes so that a test decides them instead of the wall clock."""

    def __init__(self, a, comm, validates: bool, clock: Callable[[], float] = time.monotonic):
        self.a, self.comm, self.validates = a, comm, validates
        self.clock = clock
        self.slow_step_s = SLOW_STEP_S
        self.last_checkpoint = clock()  # (run() restarts the clock)
        self.last_step_s = 0.0          # this rank's last step time, which its next vote sends
        # what the last step's vote said
        self.stop: str | None = None
        self.due = False
        self.slow = False

    def restart_clock(self) -> None:
        self.last_checkpoint = self.clock()

    def clock_due(self, ahead: float = 0.0) -> bool:
        """Whether --checkpoint-minutes will have passed `ahead` seconds from now."""
        a = self.a
        return bool(a.out) and a.checkpoint_minutes > 0 and \
            self.clock() + ahead - self.last_checkpoint >= a.checkpoint_minutes * 60

    def evals_before(self, step: int, last: bool) -> tuple[bool, bool, bool]:
        """Whether run()'s iteration `step` validates, evaluates HellaSwag and samples before it trains (rank 0 does
        them; every rank computes the same answer)."""
        a = self.a
        at = lambda every: every > 0 and (step % every == 0 or last)  # noqa: E731
        return self.validates and at(a.val_every), bool(a.hellaswag) and at(a.hellaswag_every), \
            step > 0 and at(a.sample_every)

    def busy_before(self, step: int) -> bool:
        """Whether run()'s iteration `step` validates, evaluates, samples or checkpoints before it trains: the same
        answer on every rank (the options', and for the checkpoint clock the last step's vote)."""
        return any(self.evals_before(step, False)) or (bool(self.a.out) and self.checkpoint_due(step))

    def checkpoint_due(self, step: int) -> bool:
        """Every --checkpoint-every steps, and whenever --checkpoint-minutes have passed since the last one (or
        the start). Under data parallel rank 0's clock decides for all ranks, as the last step's vote carried it:
        a checkpoint is a collective under ZeRO."""
        a = self.a
        if a.checkpoint_every > 0 and step % a.checkpoint_every == 0:
            return True
        return self.due if self.comm.world_size > 1 else self.clock_due()

    def cast(self, stop_requested: Callable[[], str | None]) -> tuple[str | None, tuple[float, ...]]:
        """This rank's stop request, and its votes for the optimizer's step to reduce: that request, rank 0's
        checkpoint clock, its last step's seconds. One rank: no votes."""
        if self.comm.world_size == 1:
            return None, ()
        stop = stop_requested()
        # (the clock is read as the host queues the step, before the device runs it: asked a step ahead, so that
        # the checkpoint is not one step late)
        due = self.comm.rank == 0 and self.clock_due(self.last_step_s)
        return stop, (1.0 if stop else 0.0, 1.0 if due else 0.0, self.last_step_s)

    def count(self, stop: str | None, flags: tuple[float, ...]) -> None:
        """The step's votes, the largest over the ranks (`flags`), with this rank's own request `stop`."""
        any_stop, due, slowest = flags
        self.stop = stop or (OTHER_RANK if any_stop > 0 else None)
        self.due = due > 0
        self.slow = slowest >= self.slow_step_s

    def stop_after(self, step: int, stop_requested: Callable[[], str | None]) -> str | None:
        """Why every rank stops after `step` (None: none does). Data parallel ranks go by the step's vote, and by
        one more after the step where waiting for the next step's could be long: slow steps (every rank knows it
        from the vote), or a next iteration that validates, evaluates, samples or checkpoints first."""
        if self.comm.world_size == 1:
            return stop_requested()
        if self.stop is not None or not (self.slow or self.busy_before(step + 1)):
            return self.stop
        local = stop_requested()
        if self.comm.all_reduce_value(1.0 if local else 0.0, MAX) > 0:
            return local or OTHER_RANK
        return None
