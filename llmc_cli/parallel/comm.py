"""Communicators: how data-parallel ranks find each other and move gradients (NCCL on CUDA, MPI elsewhere).

No home-made cluster layer: the ranks are started by `llmc train --gpus N` (one process per GPU on this machine),
by `mpirun` / `mpiexec` or by Slurm's `srun`, and this module reads who-is-who from their environment:

    llmc's launcher   LLMC_RANK, LLMC_WORLD_SIZE, LLMC_LOCAL_RANK (and LLMC_INIT_FILE)
    Open MPI          OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
    MPICH (hydra)     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
    Slurm (srun)      SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID

A communicator moves *backend buffers*. Every collective is in place:

* ``all_reduce(buf, op)``: every rank ends with the sum (or average / max) of all ranks' ``buf``.
* ``reduce_scatter(buf, op)``: ``buf`` holds ``world_size`` equal chunks; afterwards chunk ``rank`` holds the
  reduction of that chunk over all ranks (the other chunks are undefined).
* ``all_gather(buf)``: chunk ``rank`` of ``buf`` is this rank's contribution; afterwards every chunk is filled.
* ``broadcast(buf, root)``, ``barrier()``, and ``all_reduce_value(x, op)`` for one host float.

Which communicator: CUDA buffers (``__cuda_array_interface__``) go through NCCL, whose unique id is shared
through MPI, a shared file (``--init-file``) or a TCP rendezvous (``--init-addr host:port``), llm.c's three
ways; host buffers (cpu backend) and other devices (OpenCL, staged through the host) go through MPI (mpi4py).
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SUM, AVG, MAX = "sum", "avg", "max"
_OPS = (SUM, AVG, MAX)


class CommError(RuntimeError):
    """Ranks cannot be set up or cannot talk; the message says what to change."""


# ---------------------------------------------------------------------------------------------------------------
# who am I


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single process"  # which launcher's variables said so


_SOURCES = (
    ("llmc launcher", "LLMC_RANK", ("LLMC_WORLD_SIZE",), ("LLMC_LOCAL_RANK",)),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("MPICH", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ("Slurm", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",)),
)


def discover(env: dict | None = None) -> RankInfo:
    """This process's rank, world size and rank on its node, from the launcher's environment (first match of
    llmc's own launcher, Open MPI, MPICH, Slurm); one process alone when none of them is set."""
    env = os.environ if env is None else env
    for source, rank_var, size_vars, local_vars in _SOURCES:
        if rank_var not in env:
            continue
        size_var = next((v for v in size_vars if v in env), None)
        if size_var is None:
            continue
        try:
            rank, size = int(env[rank_var]), int(env[size_var])
            local_var = next((v for v in local_vars if v in env), None)
            local = int(env[local_var]) if local_var else rank
        except ValueError:
            raise CommError(f"{source}: {rank_var}={env.get(rank_var)!r} / {size_var}={env.get(size_var)!r} "
                            "are not integers") from None
        if size < 1 or not 0 <= rank < size:
            raise CommError(f"{source}: rank {rank} is not in 0..{size - 1} ({rank_var}, {size_var})")
        return RankInfo(rank, size, local, source)
    return RankInfo()


def pin_local_device(info: RankInfo, env: dict | None = None) -> str | None:
    """One GPU per process: restrict CUDA_VISIBLE_DEVICES to this rank's device (by local rank), before any CUDA
    library starts. Does nothing for one process, or when the launcher already gave each rank one device.
    Returns the device it kept (or None)."""
    env = os.environ if env is None else env
    if info.world_size <= 1:
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and len(visible) <= 1:
        return visible[0] if visible else None
    pick = visible[info.local_rank % len(visible)] if visible else str(info.local_rank)
    env["CUDA_VISIBLE_DEVICES"] = pick
    return pick


# ---------------------------------------------------------------------------------------------------------------
# the protocol


class Communicator(Protocol):
    rank: int
    world_size: int
    local_rank: int
    name: str

    def all_reduce(self, buf: Any, op: str = AVG) -> None: ...
    def reduce_scatter(self, buf: Any, op: str = AVG) -> None: ...
    def all_gather(self, buf: Any) -> None: ...
    def broadcast(self, buf: Any, root: int = 0) -> None: ...
    def all_reduce_value(self, x: float, op: str = AVG) -> float: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...
    def close(self) -> None: ...


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r} (one of {', '.join(_OPS)})")


def _chunk(buf, world: int) -> int:
    n = int(buf.size)
    if n % world:
        raise ValueError(f"a buffer of {n} elements does not split into {world} equal chunks")
    return n // world


class SingleProcess:
    """One rank: every collective is the identity."""

    name = "single"

    def __init__(self):
        self.rank, self.world_size, self.local_rank = 0, 1, 0

    def all_reduce(self, buf, op=AVG):
        _check_op(op)

    def reduce_scatter(self, buf, op=AVG):
        _check_op(op)

    def all_gather(self, buf):
        pass

    def broadcast(self, buf, root=0):
        pass

    def all_reduce_value(self, x, op=AVG):
        _check_op(op)
        return float(x)

    def barrier(self):
        pass

    def abort(self, code=1):
        os._exit(code)

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------------------
# MPI: host buffers


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise CommError(f"more than one rank on a backend without NCCL needs MPI: pip install mpich mpi4py "
                        f"(or pip install 'llmc[mpi]'); {e}") from None
    return MPI


class MPICommunicator:
    """Collectives through mpi4py on host memory. numpy buffers (the cpu backend) are reduced where they are;
    any other backend's buffers are downloaded, reduced on the host and uploaded back."""

    name = "mpi"

    def __init__(self, backend=None, comm=None, local_rank: int | None = None):
        MPI = _mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.local_rank = self.rank if local_rank is None else local_rank
        self.backend = backend
        self._ops = {SUM: MPI.SUM, AVG: MPI.SUM, MAX: MPI.MAX}

    # host staging for non-numpy buffers
    def _host(self, buf) -> tuple[np.ndarray, bool]:
        if isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.dtype in (np.float32, np.float64):
            return buf.reshape(-1), False
        if self.backend is None:
            raise CommError(f"MPI communicator got a {type(buf).__name__} buffer but has no backend to stage it")
        return np.ascontiguousarray(self.backend.download(buf), dtype=np.float32).reshape(-1), True

    def _back(self, buf, host: np.ndarray, staged: bool) -> None:
        if staged:
            self.backend.upload(buf, host.reshape(buf.shape))

    def all_reduce(self, buf, op=AVG):
        _check_op(op)
        h, staged = self._host(buf)
        self.comm.Allreduce(self.MPI.IN_PLACE, h, op=self._ops[op])
        if op == AVG:
            h *= h.dtype.type(1.0 / self.world_size)
        self._back(buf, h, staged)

    def reduce_scatter(self, buf, op=AVG):
        _check_op(op)
        c = _chunk(buf, self.world_size)
        h, staged = self._host(buf)
        out = np.empty(c, dtype=h.dtype)
        self.comm.Reduce_scatter_block(h, out, op=self._ops[op])
        if op == AVG:
            out *= out.dtype.type(1.0 / self.world_size)
        h[self.rank * c:(self.rank + 1) * c] = out
        self._back(buf, h, staged)

    def all_gather(self, buf):
        _chunk(buf, self.world_size)
        h, staged = self._host(buf)
        self.comm.Allgather(self.MPI.IN_PLACE, h)
        self._back(buf, h, staged)

    def broadcast(self, buf, root=0):
        h, staged = self._host(buf)
        self.comm.Bcast(h, root=root)
        self._back(buf, h, staged)

    def all_reduce_value(self, x, op=AVG):
        _check_op(op)
        v = self.comm.allreduce(float(x), op=self._ops[op])
        return v / self.world_size if op == AVG else float(v)

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code=1):
        self.comm.Abort(code)

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------------------
# NCCL: device buffers on the backend's stream

_NCCL_DTYPES = {"float32": 7, "bfloat16": 9, "float64": 8, "float16": 6, "int32": 2,
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
                   "ncclBroadcast", "ncclCommDestroy", "ncclCommAbort"):
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

    def __init__(self, backend, rank: int, world_size: int, local_rank: int, uid: bytes, mpi_comm=None):
        import cupy as cp
        self.cp = cp
        self.backend = backend
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.mpi_comm = mpi_comm
        self._stream = getattr(backend, "stream", None)
        self._scalar = None
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
        return self._stream.ptr if self._stream is not None else self.cp.cuda.get_current_stream().ptr

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
        _check_op(op)
        p = buf.data.ptr
        self._call("ncclAllReduce", p, p, int(buf.size), self._dtype(buf), _NCCL_OPS[op], self.stream_ptr)

    def reduce_scatter(self, buf, op=AVG):
        _check_op(op)
        c = _chunk(buf, self.world_size)
        p = buf.data.ptr
        self._call("ncclReduceScatter", p, p + self.rank * c * buf.itemsize, c, self._dtype(buf), _NCCL_OPS[op],
                   self.stream_ptr)

    def all_gather(self, buf):
        c = _chunk(buf, self.world_size)
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
        _check_op(op)
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
        if self.mpi_comm is not None:
            self.mpi_comm.Abort(code)
        os._exit(code)

    def close(self):
        pass


# The NCCL unique id travels from rank 0 to the others in one of llm.c's three ways.

def _share_id_mpi(uid: bytes | None, rank: int, comm) -> bytes:
    return comm.bcast(uid if rank == 0 else None, root=0)


def _share_id_file(uid: bytes | None, rank: int, path: str, timeout: float) -> bytes:
    p = Path(path)
    if rank == 0:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_bytes(uid)
        os.replace(tmp, p)  # the others never see a half-written id
        return uid
    t0 = time.monotonic()
    while True:
        try:
            data = p.read_bytes()
            if len(data) == NCCL_ID_BYTES:
                return data
        except FileNotFoundError:
            pass
        if time.monotonic() - t0 > timeout:
            raise CommError(f"--init-file {path}: rank 0 did not write the NCCL id within {timeout:.0f} s "
                            "(is the path on a file system every node shares?)")
        time.sleep(0.05)


def _share_id_tcp(uid: bytes | None, rank: int, world: int, addr: str, timeout: float) -> bytes:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise CommError(f"--init-addr {addr!r}: expected HOST:PORT (rank 0's address, reachable by every rank)")
    port_i = int(port)
    if rank == 0:
        srv = socket.create_server(("", port_i), reuse_port=False, backlog=world)
        srv.settimeout(timeout)
        try:
            for _ in range(world - 1):
                try:
                    conn, _peer = srv.accept()
                except socket.timeout:
                    raise CommError(f"--init-addr {addr}: not every rank connected within {timeout:.0f} s") from None
                with conn:
                    conn.sendall(uid)
        finally:
            srv.close()
        return uid
    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port_i), timeout=5) as s:
                data = b""
                while len(data) < NCCL_ID_BYTES:
                    chunk = s.recv(NCCL_ID_BYTES - len(data))
                    if not chunk:
                        break
                    data += chunk
                if len(data) == NCCL_ID_BYTES:
                    return data
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise CommError(f"--init-addr {addr}: could not reach rank 0 within {timeout:.0f} s")
        time.sleep(0.1)


def _is_device_buffer(backend) -> bool:
    probe = backend.alloc(1, "float32", tag="comm")
    return hasattr(probe, "__cuda_array_interface__")


def create(backend, info: RankInfo | None = None, init_file: str | None = None, init_addr: str | None = None,
           timeout: float = 300.0) -> Communicator:
    """The communicator for `backend` and this process's rank (from `discover()` unless given)."""
    info = info or discover()
    init_file = init_file or os.environ.get("LLMC_INIT_FILE") or None
    init_addr = init_addr or os.environ.get("LLMC_INIT_ADDR") or None
    if info.world_size == 1:
        return SingleProcess()
    if _is_device_buffer(backend):
        mpi_comm = None
        if init_file:
            how = "file"
        elif init_addr:
            how = "tcp"
        else:
            MPI = _mpi()
            mpi_comm = MPI.COMM_WORLD
            if mpi_comm.Get_size() != info.world_size:
                raise CommError(f"{info.source} says {info.world_size} ranks but MPI sees {mpi_comm.Get_size()}: "
                                "without mpirun, give --init-file PATH (a shared file) or --init-addr HOST:PORT")
            how = "mpi"
        uid = _nccl_unique_id()[1] if info.rank == 0 else None
        if how == "file":
            uid = _share_id_file(uid, info.rank, init_file, timeout)
        elif how == "tcp":
            uid = _share_id_tcp(uid, info.rank, info.world_size, init_addr, timeout)
        else:
            uid = _share_id_mpi(uid, info.rank, mpi_comm)
        comm = NCCLCommunicator(backend, info.rank, info.world_size, info.local_rank, uid, mpi_comm=mpi_comm)
        comm.how = how
        comm.barrier()  # every rank is in: a shared id file has done its job
        if how == "file" and info.rank == 0:
            try:
                os.unlink(init_file)
            except OSError:
                pass
        return comm
    MPI = _mpi()
    size = MPI.COMM_WORLD.Get_size()
    if size != info.world_size:
        raise CommError(f"{info.source} says {info.world_size} ranks but MPI sees {size}: the {backend.name} "
                        "backend reduces through MPI, so start the ranks with `llmc train --procs N`, "
                        "mpirun/mpiexec or srun (--gpus N and --init-file/--init-addr are for CUDA's NCCL)")
    comm = MPICommunicator(backend, local_rank=info.local_rank)
    comm.how = "mpi"
    return comm
