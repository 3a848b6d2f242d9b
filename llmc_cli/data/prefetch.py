"""Training batches read ahead of the step that uses them, and copied to the device ahead of it.

``ReadAhead`` is a background thread that reads the loader's next batches (``depth`` of them) while the steps
compute, and hands them over in order, each with the loader's position after it; an error it meets (a shard with
an id outside the vocabulary) is handed over in that batch's place. ``Feed`` is what the trainer calls around each
micro-step: ``stage()`` makes the micro-step's batch the contents of the model's input buffers, ``ahead()`` (once
the micro-step's kernels are enqueued) starts the next batch's copy through the backend's ``input_queue``, which
with CAP_ASYNC_INPUTS runs on a side stream during the step. ``Feed.position`` is the loader's position after the
last batch a step *staged*: what a checkpoint records, whatever the thread or the queue have read past it. Without
prefetching (``prefetch=False``) the Feed reads each batch in the step and uploads it, as the trainer always did.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from llmc_cli.data.loader import DataLoader
from llmc_cli.kernels import Backend, Buffer

_POLL_S = 0.05  # how often the main thread, waiting for a batch, looks whether the thread is still alive
THREAD_NAME = "llmc-prefetch"


class Batch(NamedTuple):
    inputs: np.ndarray   # (B,T) int32
    targets: np.ndarray  # (B,T) int32
    position: dict       # the loader's state after this batch (DataLoader.state)


def read_batch(loader: DataLoader, overfit: bool) -> Batch:
    """The loader's next batch (with `overfit`, its first batch again: llm.c -a 1) and its position after it."""
    if overfit:
        loader.reset()
    x, y = loader.next_batch()
    return Batch(x, y, loader.state())


def _read_loop(loader: DataLoader, overfit: bool, out: queue.Queue, stop: threading.Event) -> None:
    """The thread: batches into `out` until `stop`; an exception goes in the place of the batch it stopped, last.
    A full queue blocks it without polling (an idle thread costs nothing); `_stop` makes room to wake it."""
    try:
        while not stop.is_set():
            item = read_batch(loader, overfit)
            out.put(item)
    except BaseException as e:  # noqa: BLE001  (raised in the main thread, at the step that would read the batch)
        out.put(e)


def _stop(stop: threading.Event, out: queue.Queue) -> None:
    """Tells the thread to end, and empties its queue so that a put it is blocked in returns."""
    stop.set()
    try:
        while True:
            out.get_nowait()
    except queue.Empty:
        pass


class ReadAhead:
    """A thread reading `loader`'s batches up to `depth` ahead. The loader is the thread's until `close()`; the
    thread also stops when this object is collected, and never keeps the process alive (a daemon)."""

    def __init__(self, loader: DataLoader, overfit: bool = False, depth: int = 2):
        if depth < 1:
            raise ValueError(f"read-ahead depth must be >= 1 (got {depth})")
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        # the thread holds the queue and the flag, not this object, so collecting it stops the thread
        self.thread = threading.Thread(target=_read_loop, args=(loader, overfit, self.out, self.stop),
                                       name=THREAD_NAME, daemon=True)
        self._finalizer = weakref.finalize(self, _stop, self.stop, self.out)
        self.thread.start()

    def next(self) -> tuple[Batch, float | None]:
        """The next batch, and the seconds waited for it (None: it was ready). Raises what the thread raised
        reading it, and again on every later call."""
        if self.error is not None:
            raise self.error
        waited = None
        try:
            item = self.out.get_nowait()
        except queue.Empty:
            t0 = time.perf_counter()
            while True:
                try:
                    item = self.out.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not self.thread.is_alive() and self.out.empty():
                        item = RuntimeError("the data thread stopped without a batch or an error")
                        break
            waited = time.perf_counter() - t0
        if isinstance(item, BaseException):
            self.error = item
            raise item
        return item, waited

    def close(self) -> None:
        """Stops the thread and waits for it (a read in progress finishes first); safe to call twice."""
        self._finalizer()
        self.thread.join()


class Feed:
    """The batches of the training micro-steps, into `dsts` = [inputs, targets] (the model's fixed buffers).

    Per micro-step: `stage()` before its kernels, `ahead()` after them. With `prefetch`, a ReadAhead thread reads
    the batches and `ahead()` puts the next one into the backend's input queue (on a CAP_ASYNC_INPUTS backend its
    copy starts then, behind nothing the step enqueued), so `stage()` only takes it; an error reading that batch
    is kept and raised by the `stage()` that would have used it. Without, `stage()` reads and uploads in the step.
    `waits` counts the batches the step had to wait for (not ready when asked; without prefetch: all of them),
    `batches` those asked for, `wait_s` the seconds waited."""

    def __init__(self, backend: Backend, dsts: Sequence[Buffer], loader: DataLoader, overfit: bool = False,
                 prefetch: bool = True, depth: int = 2):
        self.backend, self.dsts, self.loader, self.overfit = backend, list(dsts), loader, overfit
        self.prefetch, self.depth = prefetch, depth
        self.position = loader.state()   # after the last batch staged: what a checkpoint records
        self._read_position = self.position  # after the last batch taken from the thread (a restart reads on)
        self.reader: ReadAhead | None = None
        self._restart = False
        self.queue = backend.input_queue(self.dsts, depth) if prefetch else None
        self.pending: deque[dict] = deque()  # positions of the batches put into the queue and not yet taken
        self.error: Exception | None = None  # reading the next batch failed: raised when a step would use it
        self.waits, self.batches, self.wait_s = 0, 0, 0.0

    def start(self) -> None:
        """Starts the thread (if prefetching and not running): at once, so the first batch is ready early."""
        if not self.prefetch or self.reader is not None:
            return
        if self._restart:  # the closed thread read past what was taken: go back to where it was taken
            self.loader.load_state(self._read_position)
        self.reader = ReadAhead(self.loader, self.overfit, self.depth)

    def stage(self) -> None:
        """The next batch into `dsts`, for the kernels enqueued after this call."""
        if not self.prefetch:
            t0 = time.perf_counter()
            b = read_batch(self.loader, self.overfit)
            self.waits, self.batches, self.wait_s = self.waits + 1, self.batches + 1, \
                self.wait_s + time.perf_counter() - t0
            for dst, host in zip(self.dsts, (b.inputs, b.targets)):
                self.backend.upload(dst, host)
            self.position = b.position
            return
        if not self.pending:
            self._put_next()
        if not self.pending:
            raise self.error  # (_put_next failed)
        self.queue.take()
        self.position = self.pending.popleft()

    def ahead(self) -> None:
        """Puts the batch after the staged ones into the input queue (its copy overlaps the work enqueued)."""
        if self.prefetch and self.error is None and len(self.pending) < self.depth:
            self._put_next()

    def _put_next(self) -> None:
        self.start()
        try:
            b, waited = self.reader.next()
        except Exception as e:  # noqa: BLE001  (a DataError from a later shard, raised when its step comes)
            self.error = e
            return
        self.batches += 1
        if waited is not None:
            self.waits += 1
            self.wait_s += waited
        self.queue.put([b.inputs, b.targets])
        self.pending.append(b.position)
        self._read_position = b.position

    def close(self) -> None:
        """Stops the thread (safe to call twice). The batches already put stay queued; a later `stage()` or
        `ahead()` starts a thread again from where the last one was taken."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
            self._restart = True
