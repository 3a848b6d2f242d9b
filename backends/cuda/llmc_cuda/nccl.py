"""NCCL for the cuda backend: the Communicator `CudaPlugin.communicator` returns. Collectives run on CUDA buffers,
enqueued on the backend's stream so they are ordered with the kernels around them; bf16 gradients are reduced
in bf16, as llm.c does. Through CuPy's binding where CuPy was built with NCCL, else straight from libnccl.so.2
(ctypes). The unique id reaches every rank through the engine's rendezvous (MPI, a shared file or TCP)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from llmc_cli.kernels import AVG, MAX, SUM, CommError, RankInfo, Rendezvous, check_reduce_op, chunk_elements

_NCCL_DTYPES = {"float32": 7, "bfloat16": 9, "float64": 8, "float16": 6, "int32": 2, "uint8": 1,
                "uint16": 9}  # a CuPy without bfloat16 stores it as raw 16-bit words
_NCCL_OPS = {SUM: 0, MAX: 2, AVG: 4}  # ncclSum, ncclMax, ncclAvg (NCCL >= 2.10)
NCCL_ID_BYTES = 128


class _CtypesNccl:
    """The few NCCL entry points llmc needs, straight from libnccl.so.2 (used when CuPy was built without NCCL)."""

    def __init__(self):
        self.lib = self._load()
        L = self.lib
        L.ncclGetErrorString.restype = ctypes.c_char_p
        for fn in ("ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
                   "ncclReduce", "ncclBroadcast", "ncclCommDestroy", "ncclCommAbort", "ncclGroupStart", "ncclGroupEnd"):
            getattr(L, fn).restype = ctypes.c_int

    @staticmethod
    def _load():
        names = ["libnccl.so.2", "libnccl.so"]
        try:  # PyPI's nvidia-nccl-cu12 / -cu13
            import nvidia.nccl as nn
            for p in getattr(nn, "__path__", []):
                names.insert(0, str(Path(p) / "lib" / "libnccl.so.2"))
        except ImportError:
            pass
        errors = []
        for n in names:
            try:
                return ctypes.CDLL(n)
            except OSError as e:
                errors.append(str(e))
        raise CommError("NCCL not found (pip install nvidia-nccl-cu12, or a CuPy built with NCCL): "
                        + "; ".join(errors[-2:]))

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CommError(f"NCCL {what} failed: {self.lib.ncclGetErrorString(rc).decode()} (code {rc})")

    def unique_id(self) -> bytes:
        buf = ctypes.create_string_buffer(NCCL_ID_BYTES)
        self.check(self.lib.ncclGetUniqueId(buf), "ncclGetUniqueId")
        return buf.raw

    def init(self, world: int, uid: bytes, rank: int):
        comm = ctypes.c_void_p()
        idbuf = (ctypes.c_char * NCCL_ID_BYTES).from_buffer_copy(uid)

        class _Id(ctypes.Structure):
            _fields_ = [("internal", ctypes.c_char * NCCL_ID_BYTES)]
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), ctypes.c_int(world), _Id(idbuf.raw),
                                             ctypes.c_int(rank)), "ncclCommInitRank")
        return comm


def _nccl_unique_id() -> tuple[str, bytes]:
    """(which binding, a fresh NCCL unique id as 128 bytes)."""
    try:
        from cupy.cuda import nccl
        if getattr(nccl, "available", True):
            return "cupy", bytes(x & 0xFF for x in nccl.get_unique_id())
    except ImportError:
        pass
    return "ctypes", _CtypesNccl().unique_id()


class NCCLCommunicator:
    """NCCL collectives on CUDA buffers, enqueued on the backend's stream (so they are ordered with the kernels
    around them). bf16 gradients are reduced in bf16, as llm.c does."""

    name = "nccl"

    def __init__(self, backend, rank: int, world_size: int, local_rank: int, uid: bytes,
                 rendezvous: Rendezvous | None = None):
        import cupy as cp
        self.cp = cp
        self.backend = backend
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.rendezvous = rendezvous
        self._stream = getattr(backend, "stream", None)
        self._scalar = None
        self._side = None  # the stream of overlapped collectives (see overlapped)
        self._fence = None  # device_barrier's one value
        self._peers: dict[tuple[int, int], object] = {}  # (pointer, bytes) -> p2p.PeerCopies, or None: not mappable
        self._pieces: list = []  # p2p.PeerPieces handed out (their inboxes mapped)
        self._side_active = self._side_pending = False
        try:
            from cupy.cuda import nccl
            if not getattr(nccl, "available", True):
                raise ImportError
            try:  # CuPy >= 14 takes the id as bytes, older ones as a tuple of signed chars
                self._cupy = nccl.NcclCommunicator(world_size, bytes(uid), rank)
            except TypeError:
                self._cupy = nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid), rank)
            self._ct = None
            self.binding = "cupy.cuda.nccl"
        except ImportError:
            self._cupy = None
            self._ct = _CtypesNccl()
            self._comm = self._ct.init(world_size, uid, rank)
            self.binding = "libnccl (ctypes)"

    @property
    def stream_ptr(self) -> int:
        if self._side_active:
            return self._side.ptr
        return self._stream.ptr if self._stream is not None else self.cp.cuda.get_current_stream().ptr

    # ---- overlapped collectives: on a stream of their own, behind what the backend's stream held at the block's start
    @contextlib.contextmanager
    def overlapped(self):
        """The block's collectives go to the side stream as one NCCL group: one event and, where NCCL can fuse them,
        one kernel launch for a layer's dozen pieces (of which several are a few kilobytes) instead of one each."""
        cp = self.cp
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(self._stream if self._stream is not None else cp.cuda.get_current_stream())
        self._side.wait_event(ev)
        self._side_pending = self._side_active = True
        self._group(True)
        try:
            yield
        finally:
            self._side_active = False
            self._group(False)

    def _group(self, start: bool) -> None:
        if self._cupy is not None:
            from cupy.cuda import nccl
            (nccl.groupStart if start else nccl.groupEnd)()
        else:
            fn = "ncclGroupStart" if start else "ncclGroupEnd"
            self._ct.check(getattr(self._ct.lib, fn)(), fn)

    def join(self) -> None:
        """The backend's stream waits for every overlapped collective queued so far."""
        if not self._side_pending:
            return
        cp = self.cp
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(self._side)
        (self._stream if self._stream is not None else cp.cuda.get_current_stream()).wait_event(ev)
        self._side_pending = False

    @staticmethod
    def _dtype(buf) -> int:
        name = str(buf.dtype)
        if name not in _NCCL_DTYPES:
            raise CommError(f"NCCL: no reduction for dtype {name}")
        return _NCCL_DTYPES[name]

    def _call(self, fn: str, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        """ncclAllReduce / ncclReduceScatter: (send, recv, count, dtype, op, stream)."""
        if self._cupy is not None:
            meth = {"ncclAllReduce": "allReduce", "ncclReduceScatter": "reduceScatter"}[fn]
            getattr(self._cupy, meth)(send, recv, count, dtype, op, stream)
        else:
            ct = ctypes
            self._ct.check(getattr(self._ct.lib, fn)(ct.c_void_p(send), ct.c_void_p(recv), ct.c_size_t(count),
                                                     ct.c_int(dtype), ct.c_int(op), self._comm, ct.c_void_p(stream)),
                           fn)

    def all_reduce(self, buf, op=AVG):
        check_reduce_op(op)
        p = buf.data.ptr
        self._call("ncclAllReduce", p, p, int(buf.size), self._dtype(buf), _NCCL_OPS[op], self.stream_ptr)

    # ---- data parallel over peer memory (p2p.py) --------------------------------------------------------------
    @property
    def peer_memory(self) -> bool:
        """Whether the ranks move data through each other's memory (`--backend-opt p2p`). Unset, two ranks do and
        more do not: on four H200s the update's writes into three peers made Llama 3.1 8B's step a third slower than
        NCCL's all-gather, where GPT-2 d48 gained 0.5 % (docs/performance.md)."""
        p2p = getattr(self.backend, "p2p", None)
        return self.world_size > 1 and (self.world_size == 2 if p2p is None else bool(p2p))

    @property
    def peer_reduce(self) -> bool:
        """Whether reduce_scatter should read the peers' chunks from their memory in buffers mapped for it
        (`--backend-opt p2p_reduce=on`)."""
        return self.peer_memory and bool(getattr(self.backend, "p2p_reduce", False))

    def peer_copies(self, buf):
        """Collective: every rank's copy of `buf` mapped into this process (p2p.PeerCopies), or None where a rank
        cannot reach another's memory or the backend's `p2p` option is off. With `peer_reduce`, a reduce_scatter
        (AVG) of `buf` or of a view inside it then reads the peers' chunks straight from their memory."""
        key = (buf.data.ptr, buf.nbytes)
        if key not in self._peers:
            copies = None
            if self.peer_memory:
                from .p2p import map_peers
                copies = map_peers(self, buf)
            self._peers[key] = copies
        return self._peers[key]

    def reduce_scatter_pieces(self, buf):
        """Collective: ZeRO-1's reduce-scatter of `buf` sent piece by piece to the owners by the copy engines while
        the backward pass runs (p2p.PeerPieces: `send(ranges)`, then `finish()`), or None where a rank cannot reach
        another's memory or the backend's `p2p` or `p2p_copies` option is off (the caller then reduces each piece
        through NCCL)."""
        b = self.backend
        if not self.peer_memory or not getattr(b, "p2p_copies", False):
            return None
        from .p2p import PeerPieces
        pieces = PeerPieces.create(self, buf)
        if pieces is not None:
            self._pieces.append(pieces)
        return pieces

    def device_barrier(self) -> None:
        """A point no rank's stream passes before every rank's stream reached it (a one-value all-reduce, queued;
        the host does not wait)."""
        if self._fence is None:
            with self._stream if self._stream is not None else contextlib.nullcontext():  # (the all-reduces' stream)
                self._fence = self.cp.zeros(1, dtype=self.cp.float32)
        self.all_reduce(self._fence, MAX)

    def _mapped(self, buf):
        for copies in self._peers.values():
            if copies is not None and copies.contains(buf):
                return copies
        return None

    def reduce_scatter(self, buf, op=AVG):
        check_reduce_op(op)
        c = chunk_elements(buf, self.world_size)
        copies = self._mapped(buf) if op == AVG and self.peer_reduce and not self._side_active else None
        if copies is not None:  # every rank's chunk `rank` read from their memory, between two barriers
            off = copies.offset(buf) + self.rank * c
            self.device_barrier()
            self.backend.peer_mean(buf[self.rank * c:(self.rank + 1) * c], copies.all(), self.world_size, off)
            self.device_barrier()
            return
        p = buf.data.ptr
        self._call("ncclReduceScatter", p, p + self.rank * c * buf.itemsize, c, self._dtype(buf), _NCCL_OPS[op],
                   self.stream_ptr)

    def reduce(self, buf, root, op=AVG):
        check_reduce_op(op)
        p, n, dt, stream = buf.data.ptr, int(buf.size), self._dtype(buf), self.stream_ptr
        if self._cupy is not None:
            self._cupy.reduce(p, p, n, dt, _NCCL_OPS[op], root, stream)
        else:
            L, ct = self._ct.lib, ctypes
            self._ct.check(L.ncclReduce(ct.c_void_p(p), ct.c_void_p(p), ct.c_size_t(n), ct.c_int(dt),
                                        ct.c_int(_NCCL_OPS[op]), ct.c_int(root), self._comm, ct.c_void_p(stream)),
                           "ncclReduce")

    def all_gather(self, buf):
        c = chunk_elements(buf, self.world_size)
        p = buf.data.ptr
        if self._cupy is not None:
            self._cupy.allGather(p + self.rank * c * buf.itemsize, p, c, self._dtype(buf), self.stream_ptr)
        else:
            L, ct = self._ct.lib, ctypes
            self._ct.check(L.ncclAllGather(ct.c_void_p(p + self.rank * c * buf.itemsize), ct.c_void_p(p),
                                           ct.c_size_t(c), ct.c_int(self._dtype(buf)), self._comm,
                                           ct.c_void_p(self.stream_ptr)), "ncclAllGather")

    def broadcast(self, buf, root=0):
        p = buf.data.ptr
        if self._cupy is not None:
            self._cupy.broadcast(p, p, int(buf.size), self._dtype(buf), root, self.stream_ptr)
        else:
            L, ct = self._ct.lib, ctypes
            self._ct.check(L.ncclBroadcast(ct.c_void_p(p), ct.c_void_p(p), ct.c_size_t(int(buf.size)),
                                           ct.c_int(self._dtype(buf)), ct.c_int(root), self._comm,
                                           ct.c_void_p(self.stream_ptr)), "ncclBroadcast")

    def all_reduce_value(self, x, op=AVG):
        check_reduce_op(op)
        cp = self.cp
        if self._scalar is None:
            self._scalar = cp.empty(1, dtype=cp.float64)  # no kernel: it is filled on our stream
        s = self._scalar
        self._stream_do(lambda: s.fill(float(x)))
        self.all_reduce(s, op)
        if self._stream is not None:
            self._stream.synchronize()
        else:
            cp.cuda.get_current_stream().synchronize()
        return float(s.get()[0])

    def _stream_do(self, fn):
        if self._stream is not None:
            with self._stream:
                fn()
        else:
            fn()

    def barrier(self):
        self.all_reduce_value(0.0, SUM)

    def abort(self, code=1):
        if self.rendezvous is not None:
            self.rendezvous.abort(code)
        os._exit(code)

    def close(self):
        for copies in [*self._peers.values(), *self._pieces]:
            if copies is not None:
                copies.close()
        self._peers, self._pieces = {}, []


def create(backend, info: RankInfo, rendezvous: Rendezvous) -> NCCLCommunicator:
    """Every rank calls this: rank 0 draws the unique id, the rendezvous hands it to the others."""
    uid = _nccl_unique_id()[1] if info.rank == 0 else None
    uid = rendezvous.share(uid, NCCL_ID_BYTES)
    return NCCLCommunicator(backend, info.rank, info.world_size, info.local_rank, uid, rendezvous=rendezvous)
