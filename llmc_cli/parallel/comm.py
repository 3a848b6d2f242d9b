"""Communicators: how data-parallel ranks find each other and move gradients.

No home-made cluster layer: the ranks are started by `llmc train --gpus N` (one process per GPU on this machine),
by `mpirun` / `mpiexec` or by Slurm's `srun`, and this module reads who-is-who from their environment:

    llmc's launcher   LLMC_RANK, LLMC_WORLD_SIZE, LLMC_LOCAL_RANK (and LLMC_INIT_FILE)
    Open MPI          OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
    MPICH (hydra)     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
    Slurm (srun)      SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID

Which communicator (the collectives themselves are described in `llmc_cli.kernels.Communicator`): the
backend's plugin's own where it has one (`BackendPlugin.communicator`; the cuda plugin's, whose id travels through
`rendezvous`), else MPI (mpi4py) here: numpy buffers are reduced where they are, other devices' are staged
through host memory.
"""

from __future__ import annotations

import os
import time

import numpy as np

from llmc_cli.kernels import (
    AVG,
    MAX,
    SUM,
    BackendPlugin,
    CommError,
    Communicator,
    RankInfo,
    check_reduce_op,
    chunk_elements,
)
from llmc_cli.parallel.rendezvous import EngineRendezvous, mpi_world

# ---------------------------------------------------------------------------------------------------------------
# who am I


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
        local_var = next((v for v in local_vars if v in env), None)
        for var in (rank_var, size_var, *([local_var] if local_var else [])):  # (the one that is not, by name)
            try:
                int(env[var])
            except ValueError:
                raise CommError(f"{source}: {var}={env[var]!r} is not an integer") from None
        rank, size = int(env[rank_var]), int(env[size_var])
        if size < 1:
            raise CommError(f"{source}: {size_var}={size} is not a number of ranks (expected 1 or more)")
        if not 0 <= rank < size:  # (before the local rank: without a variable of its own, it is this one)
            raise CommError(f"{source}: rank {rank} is not in 0..{size - 1} ({rank_var}, {size_var})")
        local = int(env[local_var]) if local_var else rank
        if local < 0:
            raise CommError(f"{source}: {local_var}={local} is negative (a rank's index on its node)")
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


class SingleProcess:
    """One rank: every collective is the identity."""

    name = "single"

    def __init__(self):
        self.rank, self.world_size, self.local_rank = 0, 1, 0

    def all_reduce(self, buf, op=AVG):
        check_reduce_op(op)

    def reduce_scatter(self, buf, op=AVG):
        check_reduce_op(op)

    def reduce(self, buf, root, op=AVG):
        check_reduce_op(op)

    def all_gather(self, buf):
        pass

    def broadcast(self, buf, root=0):
        pass

    def all_reduce_value(self, x, op=AVG):
        check_reduce_op(op)
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
    return mpi_world()


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
        check_reduce_op(op)
        h, staged = self._host(buf)
        self.comm.Allreduce(self.MPI.IN_PLACE, h, op=self._ops[op])
        if op == AVG:
            h *= h.dtype.type(1.0 / self.world_size)
        self._back(buf, h, staged)

    def reduce_scatter(self, buf, op=AVG):
        check_reduce_op(op)
        c = chunk_elements(buf, self.world_size)
        h, staged = self._host(buf)
        out = np.empty(c, dtype=h.dtype)
        self.comm.Reduce_scatter_block(h, out, op=self._ops[op])
        if op == AVG:
            out *= out.dtype.type(1.0 / self.world_size)
        h[self.rank * c:(self.rank + 1) * c] = out
        self._back(buf, h, staged)

    def reduce(self, buf, root, op=AVG):
        check_reduce_op(op)
        h, staged = self._host(buf)
        out = np.empty_like(h) if self.rank == root else None
        self.comm.Reduce(h, out, op=self._ops[op], root=root)
        if self.rank == root:
            if op == AVG:
                out *= out.dtype.type(1.0 / self.world_size)
            h[...] = out
            self._back(buf, h, staged)

    def all_gather(self, buf):
        chunk_elements(buf, self.world_size)
        h, staged = self._host(buf)
        self.comm.Allgather(self.MPI.IN_PLACE, h)
        self._back(buf, h, staged)

    def broadcast(self, buf, root=0):
        h, staged = self._host(buf)
        self.comm.Bcast(h, root=root)
        self._back(buf, h, staged)

    def all_reduce_value(self, x, op=AVG):
        check_reduce_op(op)
        v = self.comm.allreduce(float(x), op=self._ops[op])
        return v / self.world_size if op == AVG else float(v)

    def barrier(self):
        # polled: a blocking MPI_Barrier holds off Python's signal handlers until it returns, so a rank waiting
        # here for rank 0's last checkpoint could be neither stopped nor aborted (a second signal was lost)
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.005)

    def abort(self, code=1):
        self.comm.Abort(code)

    def close(self):
        pass


def create(backend, info: RankInfo | None = None, init_file: str | None = None, init_addr: str | None = None,
           timeout: float = 300.0, plugin: BackendPlugin | None = None) -> Communicator:
    """The communicator for `backend` and this process's rank (from `discover()` unless given): the plugin's own
    (`BackendPlugin.communicator`, e.g. the cuda plugin's) where it has one, else MPI through host memory."""
    info = info or discover()
    init_file = init_file or os.environ.get("LLMC_INIT_FILE") or None
    init_addr = init_addr or os.environ.get("LLMC_INIT_ADDR") or None
    if info.world_size == 1:
        return SingleProcess()
    if plugin is None:
        from llmc_cli.registry import load_plugin
        plugin = load_plugin(backend.name)
    rendezvous = EngineRendezvous(info, init_file, init_addr, timeout)
    comm = plugin.communicator(backend, info, rendezvous) if plugin is not None else None
    if comm is not None:
        comm.how = rendezvous.how
        comm.barrier()  # every rank is in
        rendezvous.done()
        return comm
    MPI = _mpi()
    size = MPI.COMM_WORLD.Get_size()
    if size != info.world_size:
        raise CommError(f"{info.source} says {info.world_size} ranks but MPI sees {size}: the {backend.name} "
                        "backend reduces through MPI, so start the ranks with `llmc train --procs N`, "
                        "mpirun/mpiexec or srun")
    comm = MPICommunicator(backend, local_rank=info.local_rank)
    comm.how = "mpi"
    return comm
