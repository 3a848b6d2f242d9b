"""The rendezvous before a device communicator exists: rank 0 hands the communicator's unique id (a few bytes)
to every rank in one of llm.c's three ways: MPI (under mpirun), a fresh file on a file system every node shares
(``--init-file``), or a TCP socket on rank 0 (``--init-addr HOST:PORT``). The plugin that builds the
communicator asks for it through `llmc_cli.kernels.Rendezvous`; this engine module knows no device library."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from llmc_cli.formats.files import atomic_write_bytes, read_at_most, special_file
from llmc_cli.kernels import CommError, RankInfo
from llmc_cli.naming import arg

ID_BYTES = 128  # the usual size of a communicator's unique id


def mpi_world():
    """mpi4py's COMM_WORLD; CommError naming what to install when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise CommError(f"more than one rank without a device communicator needs MPI: pip install mpich mpi4py "
                        f"(or pip install 'llmc[mpi]'); {e}") from None
    return MPI


class EngineRendezvous:
    """The Rendezvous the engine hands to `BackendPlugin.communicator`: by --init-file, else --init-addr, else MPI
    (whose world must then match the launcher's)."""

    def __init__(self, info: RankInfo, init_file: str | None = None, init_addr: str | None = None,
                 timeout: float = 300.0):
        self.info, self.init_file, self.init_addr, self.timeout = info, init_file, init_addr, timeout
        self.how = "file" if init_file else "tcp" if init_addr else "mpi"
        self.mpi_comm = None

    def share(self, data: bytes | None, nbytes: int) -> bytes:
        r = self.info.rank
        if self.how == "file":
            return share_file(data, r, self.init_file, self.timeout, nbytes)
        if self.how == "tcp":
            return share_tcp(data, r, self.info.world_size, self.init_addr, self.timeout, nbytes)
        MPI = mpi_world()
        self.mpi_comm = MPI.COMM_WORLD
        if self.mpi_comm.Get_size() != self.info.world_size:
            raise CommError(f"{self.info.source} says {self.info.world_size} ranks but MPI sees "
                            f"{self.mpi_comm.Get_size()}: without mpirun, give {arg('init_file')} PATH (a shared "
                            f"file) or {arg('init_addr')} HOST:PORT")
        return share_mpi(data, r, self.mpi_comm)

    def abort(self, code: int) -> None:
        if self.mpi_comm is not None:
            self.mpi_comm.Abort(code)
        os._exit(code)

    def done(self) -> None:
        """Every rank is in (the communicator's first barrier passed): a shared id file has done its job."""
        if self.how == "file" and self.info.rank == 0:
            try:
                os.unlink(self.init_file)
            except OSError:
                pass


def share_mpi(uid: bytes | None, rank: int, comm) -> bytes:
    return comm.bcast(uid if rank == 0 else None, root=0)


def share_file(uid: bytes | None, rank: int, path: str, timeout: float, nbytes: int = ID_BYTES) -> bytes:
    p = Path(path)
    if rank == 0:
        atomic_write_bytes(p, uid)  # the others never see a half-written id
        return uid
    t0 = time.monotonic()
    while True:
        if kind := special_file(p):  # (opening a FIFO would wait for a writer forever, past the timeout)
            raise CommError(f"{arg('init_file', path)}: {kind}, not a file rank 0 writes the communicator's id to; "
                            "give a path that does not exist yet")
        try:
            data = read_at_most(p, nbytes)  # the id's few bytes: never the whole of a big file left there
            if data is not None and len(data) == nbytes:
                return data
        except FileNotFoundError:
            pass
        if time.monotonic() - t0 > timeout:
            raise CommError(f"{arg('init_file', path)}: rank 0 did not write the communicator's id within "
                            f"{timeout:.0f} s (is the path on a file system every node shares?)")
        time.sleep(0.05)


def share_tcp(uid: bytes | None, rank: int, world: int, addr: str, timeout: float, nbytes: int = ID_BYTES) -> bytes:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise CommError(f"{arg('init_addr')} {addr!r}: expected HOST:PORT (rank 0's address, reachable by every rank)")
    port_i = int(port)
    if rank == 0:
        srv = socket.create_server(("", port_i), reuse_port=False, backlog=world)
        srv.settimeout(timeout)
        try:
            for _ in range(world - 1):
                try:
                    conn, _peer = srv.accept()
                except socket.timeout:
                    raise CommError(f"{arg('init_addr', addr)}: not every rank connected within {timeout:.0f} s") \
                        from None
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
                while len(data) < nbytes:
                    chunk = s.recv(nbytes - len(data))
                    if not chunk:
                        break
                    data += chunk
                if len(data) == nbytes:
                    return data
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise CommError(f"{arg('init_addr', addr)}: could not reach rank 0 within {timeout:.0f} s")
        time.sleep(0.1)
