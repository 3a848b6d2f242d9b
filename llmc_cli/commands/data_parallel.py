"""`llmc train --gpus N / --procs N`, mpirun and srun: the launch options checked before any rank starts, the ranks
started (this process then supervises them), or this process's place among them taken."""

from __future__ import annotations

import os
import sys

import click
from rich.markup import escape

from llmc_cli import registry
from llmc_cli.commands.console import _RANK, backend_options, console, err_console, fail, make_backend
from llmc_cli.commands.resume import child_args
from llmc_cli.kernels import BackendPlugin, BackendUnavailable
from llmc_cli.parallel import comm as comm_mod
from llmc_cli.parallel.launch import launch_gpus, launch_mpi, note_failure


def check_launch(o: dict) -> int:
    """What the launch options say together, refused in one line before any rank starts (a refusal in each rank
    would reach the user once per rank). Returns the number of ranks asked for."""
    gpus, procs = o["gpus"], o["procs"]
    if gpus and procs:
        fail("--gpus N (one process per GPU) and --procs N (MPI processes) are exclusive: give one of them")
    if o["init_file"] and o["init_addr"]:
        fail("give --init-file PATH or --init-addr HOST:PORT (how rank 0 hands out the communicator's id), not both")
    for where, addr in (("--init-addr", o["init_addr"]), ("LLMC_INIT_ADDR", os.environ.get("LLMC_INIT_ADDR"))):
        if addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                fail(f"{where} {addr!r}: expected HOST:PORT, a port in 1..65535 (rank 0's address, reachable by "
                     "every rank)")
            break
    return max(gpus, procs, 1)


def launch_ranks(o: dict, ctx: click.Context) -> None:
    """--gpus N or --procs N (N > 1): starts the ranks with this command's options and exits with their status;
    returns at once otherwise."""
    gpus, procs = o["gpus"], o["procs"]
    if gpus > 1:
        _check_gpus(o["backend"], gpus)
    if gpus <= 1 and procs <= 1:
        return
    args = child_args(ctx)

    def say(msg: str) -> None:  # the supervisor's own lines; rank 0's output owns stdout
        err_console.print(f"llmc launcher: {escape(msg)}", soft_wrap=True)
    sys.exit(launch_gpus(args, gpus, say=say) if gpus > 1 else launch_mpi(args, procs, say=say))


def join_ranks(o: dict):
    """This process's place among the ranks (one rank when there are no others), its backend and communicator:
    (backend, comm, rank_info)."""
    try:
        rank_info = comm_mod.discover()
    except comm_mod.CommError as e:
        fail(str(e))
    if rank_info.world_size > 1:
        _RANK.update(rank=rank_info.rank, world=rank_info.world_size)
        _check_init_file(o["init_file"], rank_info.rank)
        console.quiet = rank_info.rank != 0  # rank 0 speaks for the run
        if o["device"] is None:
            comm_mod.pin_local_device(rank_info)  # one GPU per rank, by rank on the node
    backend = make_backend(o["backend"], o["device"], o["dtype"], backend_options(o["backend_opt"]))
    try:
        comm = comm_mod.create(backend, rank_info, init_file=o["init_file"], init_addr=o["init_addr"])
    except comm_mod.CommError as e:
        fail(str(e))
    if comm.world_size > 1:
        _RANK["comm"] = comm
        _abort_on_uncaught(comm)
    return backend, comm, rank_info


def _abort_on_uncaught(comm) -> None:
    """One rank's traceback must not leave the others waiting in a collective forever."""
    previous = sys.excepthook

    def hook(tp, value, tb):
        previous(tp, value, tb)
        sys.stderr.write(f"llmc: rank {comm.rank} of {comm.world_size} failed ({tp.__name__}); stopping all ranks\n")
        sys.stderr.flush()
        note_failure(comm.rank, comm.world_size, f"{tp.__name__}: {value}")
        comm.abort(1)
    sys.excepthook = hook


def _check_gpus(backend: str, n: int) -> None:
    """--gpus N starts N processes here, one a GPU, that reduce through the backend's own communicator: refused in
    one line, before any starts, for a backend without one (cpu, OpenCL: --procs) or with fewer devices."""
    try:
        plugin = registry.usable_plugin(backend)
    except BackendUnavailable as e:
        fail(f"--gpus {n}: {e}")
    own = getattr(type(plugin), "communicator", None)
    if own is None or own is BackendPlugin.communicator:
        fail(f"--gpus {n}: the {plugin.name} backend reduces through MPI, so start its ranks with --procs {n} "
             "(or mpirun/srun)")
    try:
        devices = plugin.devices()
    except Exception:  # noqa: BLE001  (the ranks say what is wrong with the device)
        devices = []
    if devices and n > len(devices):
        fail(f"--gpus {n}: the {plugin.name} backend sees {len(devices)} device(s) here ({', '.join(devices)})")


def _check_init_file(init_file: str | None, rank: int) -> None:
    """Rank 0 writes the communicator's id to --init-file (or LLMC_INIT_FILE) and deletes it once every rank is in:
    a path that already exists is a stale id, or a file that is not llmc's, and stays as it is."""
    path = init_file or os.environ.get("LLMC_INIT_FILE")
    if rank == 0 and path and (os.path.lexists(path)):
        where = "--init-file" if init_file else "LLMC_INIT_FILE"
        fail(f"{where} {path}: exists; rank 0 writes a fresh id there, so give a path that does not exist yet (or "
             "delete a stale one); nothing was changed")
