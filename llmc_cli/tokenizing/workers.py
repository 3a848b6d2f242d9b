"""Tokenizer worker processes: each holds the tokenizer and takes batches of documents through a pipe of its own;
the parent hands batches out in turn and reads the results back in the same order.

Why not multiprocessing.Pool: its workers share one task queue behind one lock, held by whichever idle worker
waits on it. A worker that a signal or the OOM killer ends while holding it takes the lock along, and the pool's
shutdown waits for that lock for ever; a worker killed mid-task loses the task, whose result the pool then waits
for for ever. Here nothing is shared: a worker that dies is seen at once (its process sentinel), named in one line,
and the others are killed without waiting on anything.
"""

from __future__ import annotations

import collections
import errno
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
from typing import Iterator

import numpy as np

from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import shard_format
from llmc_cli.naming import arg
from llmc_cli.parallel.launch import exit_words

class WorkerDied(RuntimeError):
    """A tokenizer process ended before it returned its batch."""


def encode_batch(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Documents -> (concatenated ids with a doc prefix each, per-doc lengths, utf-8 bytes)."""
    dtype = shard_format(tok.name).dtype
    prefix = np.asarray(tok.doc_prefix, dtype=dtype)
    parts, lens = [], []
    nbytes = 0
    for t in texts:
        ids = tok.encode_ordinary_array(t)
        parts += [prefix, ids.astype(dtype, copy=False)]
        lens.append(prefix.size + ids.size)
        nbytes += len(t.encode("utf-8"))
    out = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return out, np.asarray(lens, dtype=np.int64), nbytes


def encoded(batches, workers: int, tok) -> Iterator[tuple[list, list, np.ndarray, np.ndarray, int]]:
    """Tokenize (doc indices, splits, texts) batches in order, with at most 2 batches per worker handed out
    (bounded memory). Close the iterator (or exhaust it) to end the workers."""
    if workers <= 1:
        for idx, splits, texts in batches:
            yield (idx, splits, *encode_batch(tok, texts))
        return
    pool = _Workers(workers, tok)
    try:  # (the workers start as their first batches go out)
        pending: collections.deque = collections.deque()
        for n, (idx, splits, texts) in enumerate(batches):
            k = n % workers  # (in turn: each worker's results come back in the order its batches went out)
            pool.send(k, texts)
            pending.append((idx, splits, k))
            if len(pending) >= 2 * workers:
                i, s, k = pending.popleft()
                yield (i, s, *pool.receive(k))
        while pending:
            i, s, k = pending.popleft()
            yield (i, s, *pool.receive(k))
    finally:
        pool.close()


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_NO_THREAD = 3  # a worker's exit status when it could not start its reading thread (a process or thread limit)


class _Workers:
    """Up to `n` workers, each started when its first batch goes out (a small input needs few: each worker holds a
    tokenizer, tens of MB)."""

    def __init__(self, n: int, tok):
        self.n, self.tok = n, tok
        self.fork = sys.platform.startswith("linux")
        self.ctx = multiprocessing.get_context("fork" if self.fork else "spawn")
        self.conns, self.procs = [], []

    def _start(self) -> None:
        k, ctx = len(self.procs), self.ctx
        # the stop signals held back over the fork: one that landed in between was lost (raised inside the fork's
        # after-hooks, where Python only prints it) or ended the new worker before it ignores them; let through
        # once the worker is on the list that close() ends
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            mine, theirs = ctx.Pipe()
            try:
                # a forked worker holds copies of the parent's ends made before it: closed there, so that every
                # worker sees its pipe's end when the parent goes
                inherited = self.conns + [mine] if self.fork else []
                p = ctx.Process(target=_serve, args=(self.tok.name, self.tok.path, theirs, inherited, os.getpid()),
                                name=f"llmc-tokenize-{k + 1}", daemon=True)
                p.start()
            except BaseException:
                mine.close()
                raise
            finally:
                theirs.close()
            self.conns.append(mine)
            self.procs.append(p)
        except OSError as e:  # (out of file descriptors or processes: each worker holds a pipe and is a process)
            limit = " or raise the open-file limit (ulimit -n)" if e.errno == errno.EMFILE else ""
            raise DataError(f"{arg('workers', self.n)}: worker {k + 1} could not start ({e.strerror or e}); pass "
                            f"fewer {arg('workers')}{limit}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # (a signal held back is handled here)

    def send(self, k: int, texts: list[str]) -> None:
        while len(self.procs) <= k:
            self._start()
        try:
            self.conns[k].send(texts)
        except (BrokenPipeError, ConnectionResetError):
            self._died(k)

    def receive(self, k: int):
        conn, proc = self.conns[k], self.procs[k]
        while True:
            # (a signal for this process interrupts the wait and its handler runs: Ctrl-C is not held up here)
            ready = multiprocessing.connection.wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):  # (OSError: the pipe ended inside a message)
                    self._died(k)
                if kind == "error":
                    raise value
                return value
            if proc.sentinel in ready:
                self._died(k)

    def _died(self, k: int):
        p = self.procs[k]
        p.join(timeout=5)
        code = p.exitcode
        how, hint = exit_words(code) if code is not None else "closed its pipe", ""
        if code == -signal.SIGKILL:
            how += " (the system may have run out of memory)"
            hint = f" (fewer {arg('workers')} take less memory)"
        elif code == _NO_THREAD:
            how = "could not start a thread (the process or thread limit: ulimit -u, a container's pids limit)"
            hint = f" with fewer {arg('workers')}"
        raise WorkerDied(f"tokenizer worker {k + 1} of {self.n} (pid {p.pid}) {how} before returning its batch; "
                         f"finished shards stay: run the same command again{hint} to resume")

    def close(self) -> None:
        """End every worker now: the results still wanted have been read, or are no longer wanted."""
        for c in self.conns:
            c.close()
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join()
        self.conns, self.procs = [], []


def _serve(name: str, path: str | None, conn, inherited: list, parent: int) -> None:
    """A worker: batches in, results out, until the parent's end of the pipe goes or says stop."""
    # a terminal's Ctrl-C, a hang-up or a group SIGTERM reaches every process of the group: the parent alone
    # answers it (one line, the shards finished so far kept) and then kills the workers (the parent held these
    # signals back over the fork: ignored before they are let through)
    for s in _SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    _die_with(parent)
    for c in inherited:
        c.close()
    tok, failed = None, None
    try:
        tok = load_tokenizer(name, path)
    except Exception as e:  # noqa: BLE001  (said in answer to the first batch, by the parent)
        failed = e
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def take():  # batches are always taken off the pipe, so the parent never blocks sending while we send
        try:
            while True:
                tasks.put(conn.recv())
        except (EOFError, OSError):
            tasks.put(None)
        except BaseException as e:  # noqa: BLE001  (out of memory for a batch, say: the parent must hear of it)
            tasks.put(WorkerDied(f"a tokenizer worker could not take its batch ({type(e).__name__}: {e}); finished "
                                 f"shards stay: run the same command again with fewer {arg('workers')} to resume"))
    try:
        threading.Thread(target=take, daemon=True).start()
    except RuntimeError:  # (can't start a new thread: said by the parent, from this exit status)
        os._exit(_NO_THREAD)
    while (texts := tasks.get()) is not None:
        if isinstance(texts, WorkerDied):
            _send(conn, ("error", texts))
            return
        try:
            if failed is not None:
                raise failed
            out = ("ok", encode_batch(tok, texts))
        except Exception as e:  # noqa: BLE001  (raised again in the parent)
            out = ("error", e)
        if not _send(conn, out):
            return


def _send(conn, out) -> bool:
    """Whether `out` reached the parent's end of the pipe."""
    try:
        try:
            conn.send(out)
        except Exception:  # noqa: BLE001  (an exception that does not pickle: its text)
            if out[0] != "error":
                raise
            conn.send(("error", RuntimeError(f"{type(out[1]).__name__}: {out[1]}")))
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        return False
    return True


def _die_with(parent: int) -> None:
    """Linux: this process is killed when the parent goes, however it goes. A worker busy with a large batch (or
    stopped by SIGSTOP) outlived a killed parent, holding the output directory's lock it inherited, and the rerun
    was refused. (The pipe's end still ends a worker where this is unavailable, after its batch.)"""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # (the parent went before the request was made)
        os._exit(0)
