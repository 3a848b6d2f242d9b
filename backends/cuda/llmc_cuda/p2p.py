"""Data parallel over peer memory: every rank's copy of a buffer mapped into each rank's process through CUDA IPC,
so that kernels here write the other GPUs' memory over NVLink (or PCIe peer access) directly.

ZeRO-1's step on two H200s spent 0.49 ms in NCCL's all-gather of GPT-2 d12's bf16 parameters after the update
(docs/performance.md); the update can instead store every rank's copy of the chunk it updates as it writes its own,
which costs 0.08 ms more than the update alone: the stores to the peer ride beside the update's own memory
traffic. (A reduce-scatter that loads the peers' gradient chunks the same way is kept as an option, off: for
d12 it was no faster than NCCL's, 0.6-0.7 ms against 0.52-0.56 with both GPUs loading at once; for d48 it took 4.86
ms against NCCL's 5.9, measured once, so it may pay for large buffers: `--backend-opt p2p_reduce=on`.) Ranks are
separate processes that each see one GPU (`llmc train --gpus N`); IPC maps a peer's allocation all the same where
the GPUs have peer access.

Ordering across processes is NCCL's: a one-value all-reduce on each rank's stream (`device_barrier`) is a point no
rank's stream passes before every rank's stream reached it, so a kernel queued after it reads what the peers'
kernels queued before it wrote.
"""

from __future__ import annotations

import ctypes
import hashlib
import socket

import numpy as np

from llmc_cli.kernels import BFLOAT16, FLOAT32

_RECORD = 8 + 64 + 8 + 8  # per rank: ok flag, cudaIpcMemHandle_t, offset in the allocation, the host's id


def allocation_base(ptr: int) -> int:
    """The start of the driver allocation holding `ptr` (CuPy's pool hands out pieces of larger allocations; IPC
    maps whole allocations)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed (CUresult {rc})")
    return base.value


class PeerCopies:
    """Every rank's copy of one buffer: `ptrs[r]` is where rank r's copy is mapped in this process (this rank's own
    pointer at its own index)."""

    def __init__(self, cp, stream, buf, ptrs: list[int], rank: int, opened: list[int]):
        self.cp, self.stream, self.ptr, self.nbytes = cp, stream, buf.data.ptr, buf.nbytes
        self.itemsize = buf.dtype.itemsize
        self.ptrs, self.rank, self._opened = ptrs, rank, opened
        self._arrays: dict[tuple, object] = {}

    def contains(self, buf) -> bool:
        p = buf.data.ptr
        return self.ptr <= p and p + buf.nbytes <= self.ptr + self.nbytes

    def offset(self, buf) -> int:
        """`buf`'s position in the mapped buffer, in elements."""
        return (buf.data.ptr - self.ptr) // self.itemsize

    def all(self):
        """Device array of every rank's pointer to element 0, in rank order."""
        return self._array(("all",), self.ptrs)

    def _array(self, key: tuple, ptrs: list[int]):
        a = self._arrays.get(key)
        if a is None:  # kept: the kernels read it when they run, and a captured graph would hold its address
            with self.stream:  # (the backend's stream, which the kernels that read it run on)
                a = self.cp.asarray(np.array(ptrs, dtype=np.uint64))
            self.stream.synchronize()
            self._arrays[key] = a
        return a

    def others(self, offset: int):
        """Device array of the other ranks' pointers to element `offset`, in rank order."""
        return self._array(("others", offset), [p + offset * self.itemsize for r, p in enumerate(self.ptrs)
                                                if r != self.rank])

    def close(self) -> None:
        for p in self._opened:
            try:
                self.cp.cuda.runtime.ipcCloseMemHandle(p)
            except Exception:  # noqa: BLE001  (at exit the context may already be gone)
                pass
        self._opened = []


def map_peers(comm, buf) -> PeerCopies | None:
    """Collective: every rank passes its copy of the same buffer; returns the copies mapped here, or None on every
    rank when any rank could not export or map one (no peer access between two of the GPUs, say)."""
    cp, W, r = comm.cp, comm.world_size, comm.rank
    stream = comm.backend.stream
    rec = np.zeros(W * _RECORD, np.uint8)
    mine = rec[r * _RECORD:(r + 1) * _RECORD]
    host = hashlib.sha256(socket.gethostname().encode()).digest()[:8]  # IPC maps memory of this host's GPUs only
    mine[80:88] = np.frombuffer(host, np.uint8)
    try:
        base = allocation_base(buf.data.ptr)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))  # (a handle names a whole allocation)
        mine[0] = 1
        mine[8:8 + len(handle)] = np.frombuffer(handle, np.uint8)
        mine[72:80] = np.frombuffer(int(buf.data.ptr - base).to_bytes(8, "little"), np.uint8)
    except Exception:  # noqa: BLE001  (no IPC here: every rank falls back to NCCL)
        pass
    with stream:  # the upload ordered before the all-gather, which runs on the backend's stream
        dev = cp.asarray(rec)
    comm.all_gather(dev)
    stream.synchronize()
    rec = cp.asnumpy(dev)
    ptrs, opened, ok = [], [], True
    for q in range(W):
        part = rec[q * _RECORD:(q + 1) * _RECORD]
        if q == r:
            ptrs.append(buf.data.ptr)
            continue
        if not part[0] or bytes(part[80:88]) != host:
            ok = False
            break
        try:
            base = cp.cuda.runtime.ipcOpenMemHandle(bytes(part[8:72]), 1)  # cudaIpcMemLazyEnablePeerAccess
        except Exception:  # noqa: BLE001
            ok = False
            break
        opened.append(base)
        ptrs.append(base + int.from_bytes(bytes(part[72:80]), "little"))
    copies = PeerCopies(cp, stream, buf, ptrs, r, opened)
    if comm.all_reduce_value(0.0 if ok else 1.0, "max") > 0:
        copies.close()
        return None
    return copies


class PeerPieces:
    """ZeRO-1's reduce-scatter in pieces, moved by the GPUs' copy engines while the backward pass computes
    (`--overlap`; NCCLCommunicator.reduce_scatter_pieces). Every rank holds an inbox of world_size - 1 chunks, one
    per other rank, mapped into every process. As the backward pass makes a piece of the gradients final, `send`
    queues, on a stream of its own, a device-to-device copy of it into the inbox of the rank that owns it; `finish`
    waits for this rank's copies, passes a device barrier (after which every rank's copies into this inbox have
    landed) and averages the chunk this rank owns over its own values and the inbox, in rank order: what
    peer_mean computes over the ranks' memory, and (two ranks) the bits of NCCL's reduce-scatter.

    Why: NCCL's reduction kernels, run beside the backward pass, take SMs from it; a copy engine takes none. On two
    H100s this path beat NCCL's overlapped reduce for GPT-2 d12 and matched it for d48, yet both slowed the backward
    by more than the reduction after it costs (docs/performance.md), which is why `--overlap` is off by default.
    The price is the inbox, (world_size - 1) / world_size of the gradients' bytes."""

    def __init__(self, comm, buf, inbox, copies: PeerCopies):
        cp = comm.cp
        self.cp, self.comm, self.backend, self.buf = cp, comm, comm.backend, buf
        W, r = comm.world_size, comm.rank
        self.chunk, self.itemsize, self.rank, self.world = buf.size // W, buf.dtype.itemsize, r, W
        self.inbox, self.copies = inbox, copies
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.own = buf[r * self.chunk:(r + 1) * self.chunk]
        # where this rank's chunk is read from, in rank order: its own values at its own index, the others' inbox
        # chunks at theirs
        srcs = [self.own.data.ptr if q == r else inbox.data.ptr + self._slot(q, r) * self.chunk * self.itemsize
                for q in range(W)]
        with self.backend.stream:
            self.srcs = cp.asarray(np.array(srcs, dtype=np.uint64))
        self.backend.stream.synchronize()
        self.pending = False

    @staticmethod
    def _slot(sender: int, owner: int) -> int:
        """Which of the owner's inbox chunks the sender writes."""
        return sender if sender < owner else sender - 1

    @classmethod
    def create(cls, comm, buf):
        """Collective: None on every rank where a rank has no room for its inbox or cannot map another's."""
        W = comm.world_size
        if buf.size % W:
            raise ValueError(f"reduce_scatter_pieces: {buf.size} elements do not split into {W} equal chunks")
        b = comm.backend
        dtype = BFLOAT16 if b._is_bf16(buf) else FLOAT32
        try:
            with b.stream:
                inbox = b.alloc((W - 1) * (buf.size // W), dtype, tag="grads")
        except Exception as e:  # (out of memory on one rank: every rank goes on without inboxes)
            if not b.is_out_of_memory(e):
                raise
            inbox = None
        if comm.all_reduce_value(0.0 if inbox is not None else 1.0, "max") > 0:
            return None
        copies = map_peers(comm, inbox)
        return None if copies is None else cls(comm, buf, inbox, copies)

    def send(self, ranges: list[tuple[int, int]]) -> None:
        """Queue the copies of buf[lo:hi] (final once the work queued so far on the backend's stream has run) to
        their owners; each range lies inside one owner's chunk, and this rank's own are left where they are."""
        cp, c, isz = self.cp, self.chunk, self.itemsize
        todo = [(lo, hi) for lo, hi in ranges if hi > lo and lo // c != self.rank]
        if not todo:
            return
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(self.backend.stream)
        self.stream.wait_event(ev)
        base = self.buf.data.ptr
        for lo, hi in todo:
            owner = lo // c
            if (hi - 1) // c != owner:
                raise ValueError(f"reduce_scatter_pieces: [{lo}, {hi}) crosses the owners' boundary at "
                                 f"{(owner + 1) * c}")
            dst = self.copies.ptrs[owner] + (self._slot(self.rank, owner) * c + lo - owner * c) * isz
            cp.cuda.runtime.memcpyAsync(dst, base + lo * isz, (hi - lo) * isz, cp.cuda.runtime.memcpyDefault,
                                        self.stream.ptr)
        self.pending = True

    def finish(self) -> None:
        """Queue, on the backend's stream, the wait for every rank's copies and the average of this rank's chunk
        (every piece of every rank's gradients must have been sent)."""
        cp = self.cp
        if self.pending:
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.stream)
            self.backend.stream.wait_event(ev)
            self.pending = False
        self.comm.device_barrier()
        self.backend.peer_mean(self.own, self.srcs, self.world, 0)

    def close(self) -> None:
        self.copies.close()
