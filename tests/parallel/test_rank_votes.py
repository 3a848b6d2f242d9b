"""The ranks' per-step votes (a stop request, rank 0's checkpoint clock) travel with the step's own collectives:
every rank stops after the same step, checkpoints at the same steps by rank 0's clock alone, and no host collective
runs between two steps (one there, a host round trip, left every GPU idle outside any step's time). Two Trainers
on the cpu backend in two threads, joined by a communicator over shared memory. No vote here reads the wall clock:
each test sets the votes' clock and what counts as a slow step (`steady`), so a loaded machine decides nothing."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
from llmc_test_support import phrase_tokens

from llmc_cli.formats.shards import write_shard
from llmc_cli.kernels import AVG, MAX
from llmc_cli.registry import create_backend
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

W = 2


class Shared:
    def __init__(self):
        self.barrier = threading.Barrier(W, timeout=60)
        self.slots: list = [None] * W
        self.host_collectives = 0


class ThreadComm:
    """Rank `rank` of W threads; every collective exchanges host copies through `shared` (in rank order, so
    deterministic). Buffers are the cpu backend's numpy arrays."""

    name = "threads"

    def __init__(self, shared: Shared, rank: int):
        self.s, self.rank, self.world_size, self.local_rank = shared, rank, W, rank

    def _exchange(self, buf) -> list[np.ndarray]:
        self.s.slots[self.rank] = np.array(buf, copy=True)
        self.s.barrier.wait()
        got = list(self.s.slots)
        self.s.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return got

    @staticmethod
    def _reduce(parts, op):
        if op == MAX:
            return np.maximum.reduce(parts)
        total = parts[0].astype(np.float64)
        for p in parts[1:]:
            total = total + p
        return total / W if op == AVG else total

    def all_reduce(self, buf, op=AVG):
        buf[...] = self._reduce(self._exchange(buf), op)

    reduce_scatter = all_reduce  # (the other chunks may hold anything)

    def reduce(self, buf, root, op=AVG):
        out = self._reduce(self._exchange(buf), op)
        if self.rank == root:
            buf[...] = out

    def all_gather(self, buf):
        parts, n = self._exchange(buf), buf.size // W
        for r in range(W):
            buf[r * n:(r + 1) * n] = parts[r][r * n:(r + 1) * n]

    def broadcast(self, buf, root=0):
        buf[...] = self._exchange(buf)[root]

    def all_reduce_value(self, x, op=AVG):
        if self.rank == 0:
            self.s.host_collectives += 1
        return float(self._reduce(self._exchange(np.array([x], dtype=np.float64)), op)[0])

    def barrier(self):
        self.s.barrier.wait()

    def share(self, data, nbytes):
        return self._exchange(np.frombuffer(data if self.rank == 0 else bytes(nbytes), dtype=np.uint8))[0].tobytes()

    def abort(self, code=1):
        self.s.barrier.abort()

    def close(self):
        pass


def steady(tr, slow: bool = False, clock=None):
    """Trainer `tr`'s votes on a clock that stands still (or `clock`), its steps slow or never slow, whatever the
    wall clock says."""
    tr.votes.clock = clock or (lambda: 0.0)
    tr.votes.slow_step_s = 0.0 if slow else math.inf


def run_ranks(make, steps: int, tweak=None, on_step=None):
    """Trainers made by make(rank, comm), tweaked by tweak(rank, trainer), run in W threads (on_step(rank, trainer,
    record) after each step); their trainers."""
    shared = Shared()
    trainers = [make(r, ThreadComm(shared, r)) for r in range(W)]  # (sequential: no collective in __init__)
    errors = []

    def go(rank, tr):
        try:
            tr.run(on_step=None if on_step is None else lambda rec: on_step(rank, tr, rec))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            shared.barrier.abort()
        finally:
            tr.close()

    for r, tr in enumerate(trainers):
        if tweak:
            tweak(r, tr)
    threads = [threading.Thread(target=go, args=(r, tr)) for r, tr in enumerate(trainers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return trainers, shared


def _args(tmp_path, **kw):
    write_shard(tmp_path / "v_train_000001.bin", phrase_tokens(400))
    return dict(data=str(tmp_path / "v_train_*.bin"), model="d2", n_layer=1, n_embd=32, batch_size=2, seq_len=16,
                total_batch_size=2 * W * 16, val_every=0, sample_every=0, zero=1) | kw


def test_a_stop_request_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    run = tmp_path / "run"
    a = _args(tmp_path, steps=50, out=str(run))

    def make(rank, comm):
        return Trainer(TrainArgs(**a), create_backend("cpu"), say=lambda m: None, comm=comm)

    def tweak(rank, tr):
        steady(tr)
        if rank == 1:  # only rank 1 is told to stop, from its third step on
            tr.stop_requested = lambda: "SIGTERM" if tr.steps_run >= 3 else None

    (t0, t1), shared = run_ranks(make, 50, tweak)
    assert t0.stopped and t1.stopped and t0.stopped["step"] == t1.stopped["step"] == 3
    assert t1.stopped["signal"] == "SIGTERM" and t0.stopped["signal"] == "a stop request on another rank"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000003"]
    # the vote went with the steps' collectives; the only host collectives were the checkpoint's own
    before_save = shared.host_collectives
    assert before_save == 0, f"{before_save} host collectives in a run of 3 steps and one checkpoint"


def test_a_request_made_after_the_steps_vote_stops_after_the_next_step_or_this_one_when_steps_are_slow(tmp_path):
    """The host queues a step before the device runs it, so a request made during a step (here: after it, before
    run() looks) is voted on with the next step. Where the steps are slow (SLOW_STEP_S), a second vote after each
    step stops after this one, as one process would: a scheduler's grace before SIGKILL must not wait two long
    steps."""
    for slow, stop_after, host_votes in ((False, 4, 0), (True, 3, 3)):
        run = tmp_path / f"run{slow}"
        a = _args(tmp_path, steps=50, out=str(run))
        told = {}

        def tweak(rank, tr):
            steady(tr, slow)
            tr.stop_requested = lambda: told.get(rank)

        def on_step(rank, tr, rec):  # rank 1 is told to stop once its third step has ended
            if rank == 1 and rec["step"] == 3:
                told[1] = "SIGTERM"

        (t0, t1), shared = run_ranks(
            lambda rank, comm: Trainer(TrainArgs(**a), create_backend("cpu"), say=lambda m: None, comm=comm), 50,
            tweak, on_step)
        assert t0.stopped["step"] == t1.stopped["step"] == stop_after, (slow, t0.stopped, t1.stopped)
        assert t1.stopped["signal"] == "SIGTERM" and t0.stopped["signal"] == "a stop request on another rank"
        # (slow: one vote after each of the three steps; fast: none at all)
        assert shared.host_collectives == host_votes, (slow, shared.host_collectives)


def test_a_request_made_after_the_steps_vote_stops_before_a_checkpoint_or_validation_runs(tmp_path):
    """Steps under SLOW_STEP_S, but the next iteration checkpoints (or validates, samples, evaluates) before it
    trains: waiting for the next step's vote put that work, which may outlast many steps, between the request and
    the stop, and wrote two checkpoints. The ranks vote once more after such a step and stop after it."""
    run = tmp_path / "run"
    a = _args(tmp_path, steps=50, out=str(run), checkpoint_every=4, keep=10)
    told = {}

    def on_step(rank, tr, rec):
        if rank == 1 and rec["step"] == 4:
            told[1] = "SIGTERM"

    (t0, t1), shared = run_ranks(
        lambda rank, comm: Trainer(TrainArgs(**a), create_backend("cpu"), say=lambda m: None, comm=comm), 50,
        lambda rank, tr: (steady(tr), setattr(tr, "stop_requested", lambda: told.get(rank))), on_step)
    assert t0.stopped["step"] == t1.stopped["step"] == 4, (t0.stopped, t1.stopped)
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000004"]
    assert shared.host_collectives == 1  # (only before the iteration that checkpoints)


def test_rank_0s_checkpoint_clock_decides_for_every_rank(tmp_path):
    for clock_of, expect in ((0, ["step_00000001", "step_00000002", "step_00000003"]), (1, ["step_00000003"])):
        run = tmp_path / f"run{clock_of}"
        a = _args(tmp_path, steps=3, out=str(run), keep=5)

        def make(rank, comm):
            return Trainer(TrainArgs(**a), create_backend("cpu"), say=lambda m: None, comm=comm)

        def tweak(rank, tr):  # one rank's clock moves an hour at every reading (a checkpoint always due), the
            # other's stands still
            steady(tr, clock=itertools.count(0.0, 3600.0).__next__ if rank == clock_of else None)

        run_ranks(make, 3, tweak)
        got = sorted(p.name for p in run.glob("step_*"))
        assert got == expect, (clock_of, got)


def test_no_host_collective_between_steps(tmp_path):
    a = _args(tmp_path, steps=6)
    for zero in (0, 1):
        (t0, t1), shared = run_ranks(
            lambda rank, comm: Trainer(TrainArgs(**a | {"zero": zero}), create_backend("cpu"), say=lambda m: None,
                                       comm=comm), 6, lambda rank, tr: steady(tr))
        assert t0.steps_run == t1.steps_run == 6 and shared.host_collectives == 0, (zero, shared.host_collectives)
        np.testing.assert_array_equal(t0.model.parameters_host(), t1.model.parameters_host())



def test_rank_0_votes_the_checkpoint_clock_a_step_ahead(tmp_path):
    """Rank 0 reads its clock for the vote as the host queues the step, before the device runs it (CUDA): asked
    for the time one step later, the checkpoint is not one step late. Rank 1's clock never votes."""
    a = _args(tmp_path, steps=5, out=str(tmp_path / "run"), checkpoint_minutes=1.0)
    shared = Shared()
    tr = [Trainer(TrainArgs(**a), create_backend("cpu"), say=lambda m: None, comm=ThreadComm(shared, r))
          for r in range(W)]
    try:
        for t in tr:
            steady(t, clock=lambda: 1000.0)
            t.votes.last_checkpoint = 1000.0 - 59.5  # half a second to go
            t.votes.last_step_s = 2.0
        assert [t.votes.cast(t.stop_requested)[1][1] for t in tr] == [1.0, 0.0]
        for t in tr:
            t.votes.last_step_s = 0.1
        assert [t.votes.cast(t.stop_requested)[1][1] for t in tr] == [0.0, 0.0]
    finally:
        for t in tr:
            t.close()
