"""Data parallel on the CPU backend through MPI (issue 7): 2 ranks x B=2 == 1 rank x B=4, ZeRO-1 == plain
all-reduce, a ZeRO checkpoint resumes on 1 rank, a failing rank takes the launcher down naming it; plus the
communicator and launcher pieces that need no second process (rank discovery, NCCL id rendezvous, supervisor)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from llmc_test_support import losses, phrase_tokens, rewind_run, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.parallel import comm as comm_mod
from llmc_cli.parallel import rendezvous
from llmc_cli.formats.shards import write_shard
from llmc_cli.parallel.zero import reshard_loader_state
from llmc_cli.parallel.launch import find_mpiexec, supervise

try:
    import mpi4py  # noqa: F401
    HAVE_MPI = find_mpiexec() is not None
except ImportError:
    HAVE_MPI = False
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs MPI: pip install mpich mpi4py (llmc[mpi])")

TINY = ["train", "--backend", "cpu", "--model", "d2", "--n-layer", "1", "--n-embd", "32", "-t", "16",
        "--val-every", "0", "--sample-every", "0", "--lr", "1e-3", "--weight-decay", "0.1", "--warmup", "2"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpdata")
    write_shard(d / "tiny_train_000001.bin", phrase_tokens(120))
    return str(d / "*train*.bin")


def llmc(*args, env=None, check=True, timeout=120):
    """`llmc ARGS` in a process of its own: the ranks' launcher (one process's cases go through `run`)."""
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "llmc_cli", *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def assert_close(a, b, rtol=RTOL):
    assert len(a) == len(b) and len(a) > 0
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=rtol, atol=0)


def test_dry_run_plans_the_gradient_inbox_of_an_overlapped_zero1_run(tmp_path):
    """--dry-run with --gpus 4 --zero 1 --overlap counts the inbox the cuda plugin takes where the GPUs reach each
    other's memory with `p2p=on` (three chunks of a quarter of the gradients), an upper bound otherwise; without
    --overlap, or under --zero 0, none."""
    from llmc_cli.models.families import family_of, memory_plan
    from llmc_cli.training.args import TrainArgs, model_config
    cfg = model_config(TrainArgs(data="", model="d12"))
    n = family_of(cfg).num_parameters(cfg)
    plan = memory_plan(cfg, 4, 64, "bfloat16", world_size=4, zero=1, overlap=True)
    assert plan["gradient inbox (--overlap; cuda: 2 GPUs, or p2p=on)"] == 3 * (n // 4) * 2
    for kw in ({"zero": 1}, {"zero": 0, "overlap": True}, {"zero": 1, "overlap": True, "world_size": 1}):
        assert not any("inbox" in k for k in memory_plan(cfg, 4, 64, "bfloat16", **({"world_size": 4} | kw)))
    common = ["train", "--backend", "cpu", "--model", "d12", "-b", 4, "-t", 64, "--gpus", 4, "--zero", 1, "--dry-run"]
    with_inbox = run(*common, "--overlap").stdout
    assert "gradient inbox" in with_inbox and "gradient inbox" not in run(*common).stdout


@needs_mpi
def test_two_ranks_match_one_rank_and_zero_matches_allreduce(data, tmp_path):
    """1 rank x B=4 == 2 MPI ranks x B=2 (all-reduce) == 2 ranks x B=2 with ZeRO-1, step by step (fp32)."""
    common = [*TINY, "--data", data, "--steps", 5]
    llmc(*common, "-b", 4, "--log", tmp_path / "one.jsonl")
    r = llmc(*common, "-b", 2, "--procs", 2, "--log", tmp_path / "dp.jsonl")
    assert "data parallel: 2 ranks" in r.stdout
    assert r.stdout.count("step     1/5") == 1, "only rank 0 prints"
    llmc(*common, "-b", 2, "--procs", 2, "--zero", 1, "--log", tmp_path / "zero.jsonl")
    one, dp, zero = (losses(tmp_path / f"{n}.jsonl") for n in ("one", "dp", "zero"))
    assert len(one) == 5
    assert_close(dp, one)
    assert_close(zero, dp)
    assert one[-1] < one[0]


@needs_mpi
def test_overlapped_reduction_matches_the_reduction_after_backward(data, tmp_path):
    """Gradients reduced layer by layer during the backward pass (--overlap) train as the one reduction
    after it (--no-overlap, the default), with --zero 0 and 1: three ranks (the ZeRO-1 owners' boundaries cut layers' tensors,
    and a tail of the parameter vector is all-reduced), two micro-steps a step (only the last one's backward
    reduces)."""
    common = [*TINY, "--n-layer", 2, "--data", data, "--steps", 4, "-b", 1, "--procs", 3,
              "--total-batch-size", 2 * 3 * 16]
    for zero in (0, 1):
        runs = {}
        for flag in ("--overlap", "--no-overlap"):
            log = tmp_path / f"z{zero}{flag}.jsonl"
            r = llmc(*common, "--zero", zero, flag, "--log", log)
            assert ("layer by layer" in r.stdout) == (flag == "--overlap"), r.stdout
            recs = [json.loads(x) for x in log.read_text().splitlines()]
            runs[flag] = [(x["loss"], x["norm"]) for x in recs if "norm" in x]
        assert len(runs["--overlap"]) == 4
        assert_close(np.ravel(runs["--overlap"]), np.ravel(runs["--no-overlap"]), rtol=1e-6)


@needs_mpi
def test_zero2_trains_as_zero1_and_its_checkpoint_resumes_under_zero1(data, tmp_path):
    """ZeRO-2 (each layer's gradients reduced into the owners' shards on every micro-step, the rank holding a
    shard, one layer's slot and the embeddings) trains as ZeRO-1: three ranks (owners' boundaries cut layers and
    a tail is all-reduced), two micro-steps a step; its checkpoint is the whole state and continues under ZeRO-1
    with the same losses."""
    common = [*TINY, "--n-layer", 2, "--data", data, "--steps", 4, "-b", 1, "--procs", 3,
              "--total-batch-size", 2 * 3 * 16]
    runs = {}
    for zero in (1, 2):
        log = tmp_path / f"z{zero}.jsonl"
        r = llmc(*common, "--zero", zero, "--log", log, "--out", tmp_path / f"run{zero}", "--checkpoint-every", 2)
        assert f"ZeRO-{zero}" in r.stdout
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        runs[zero] = [(x["loss"], x["norm"]) for x in recs if "norm" in x]
    assert len(runs[2]) == 4
    assert_close(np.ravel(runs[2]), np.ravel(runs[1]), rtol=1e-6)
    assert "reduced layer by layer into the ranks' shards" in r.stdout

    rewind_run(tmp_path / "run2", 2, 4)
    lines = (tmp_path / "z2.jsonl").read_text().splitlines()[:2]
    (tmp_path / "cont.jsonl").write_text("\n".join(lines) + "\n")
    llmc(*common, "--zero", 1, "--out", tmp_path / "run2", "--log", tmp_path / "cont.jsonl", "--resume")
    assert_close(losses(tmp_path / "cont.jsonl"), [x for x, _ in runs[2]])


def test_zero2_on_one_rank_matches_plain_adamw_and_plans_its_gradients(data, tmp_path):
    """One process with --zero 2 (the shard is the whole vector) trains as --zero 0 through two micro-steps a
    step; --dry-run plans the shard, one layer's slot and the unstacked tensors; --overlap with it is refused."""
    common = [*TINY, "--n-layer", 3, "--data", data, "--steps", 3, "-b", 1, "--total-batch-size", 32]
    for zero in (0, 2):
        run(*common, "--zero", zero, "--log", tmp_path / f"one{zero}.jsonl")
    assert_close(losses(tmp_path / "one2.jsonl"), losses(tmp_path / "one0.jsonl"), rtol=1e-6)

    from llmc_cli.models.families import memory_plan
    from llmc_cli.models.llama3 import PRESETS
    cfg = PRESETS["llama3.1-8b"]
    z1 = memory_plan(cfg, 1, 8192, "bfloat16", world_size=8, zero=1)
    z2 = memory_plan(cfg, 1, 8192, "bfloat16", world_size=8, zero=2)
    g2 = next(v for k, v in z2.items() if k.startswith("gradients"))
    n = 8_030_261_248
    # shard n/8 (+ tail), one layer (218,112,000), wte + lm_head + norm (1,050,677,248), two bytes each
    assert g2 == 2 * (n // 8 + n % 8 + 218_112_000 + 1_050_677_248)
    assert g2 < z1["gradients"] / 3

    r = run(*common, "--zero", 2, "--overlap", ok=False)
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.exception  # (not a traceback)
    assert "--overlap: --zero 2" in r.stderr + r.stdout


@needs_mpi
def test_zero_checkpoint_is_whole_and_resumes_on_one_rank(data, tmp_path):
    """A ZeRO-1 run on 2 ranks writes the whole optimizer state; resumed on 1 rank (gradient accumulation makes
    up the same total batch) it continues with the same losses as the 2-rank run."""
    common = [*TINY, "--data", data, "--steps", 6, "-b", 2, "--total-batch-size", 64]
    llmc(*common, "--procs", 2, "--zero", 1, "--out", tmp_path / "run", "--checkpoint-every", 3,
         "--log", tmp_path / "ref.jsonl")
    ref = losses(tmp_path / "ref.jsonl")
    _, params, opt, state = ckpt.read_run_checkpoint(tmp_path / "run" / "step_00000003")
    assert opt["m"].shape == params.shape == opt["v"].shape and np.abs(opt["v"]).sum() > 0
    assert state["world_size"] == 2 and state["args"]["zero"] == 1

    shutil.copytree(tmp_path / "run", tmp_path / "one")
    rewind_run(tmp_path / "one", 3, 6)
    lines = open(tmp_path / "ref.jsonl").read().splitlines()[:3]
    (tmp_path / "one.jsonl").write_text("\n".join(lines) + "\n")
    r = llmc(*common, "--out", tmp_path / "one", "--log", tmp_path / "one.jsonl", "--resume")
    assert "grad accumulation 2" in r.stdout and "resumed" in r.stdout
    assert_close(losses(tmp_path / "one.jsonl"), ref)

    # and the other way: a 1-rank checkpoint continues on 2 ranks with ZeRO (state sliced into shards)
    rewind_run(tmp_path / "one", 3, 6)
    (tmp_path / "two.jsonl").write_text("\n".join(lines) + "\n")
    llmc(*common, "--procs", 2, "--zero", 1, "--out", tmp_path / "one", "--log", tmp_path / "two.jsonl", "--resume")
    assert_close(losses(tmp_path / "two.jsonl"), ref)


@needs_mpi
def test_failing_rank_stops_the_run_and_is_named(data, tmp_path):
    r = llmc(*TINY, "--data", data, "--steps", 50, "-b", 2, "--procs", 2, check=False,
             env={"LLMC_FAULT_RANK": "1:2"}, timeout=90)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "rank 1 of 2" in err and "injected failure" in err
    assert "step    50/50" not in r.stdout


def test_resume_on_more_ranks_than_the_total_batch_allows_is_refused(data, tmp_path):
    run(*TINY, "--data", data, "--steps", 2, "-b", 2, "--out", tmp_path / "run")
    # the run took B*T = 32 tokens per step; 1 rank x B=4 would take 64: a different run, refused by name
    r = run(*TINY, "--data", data, "--steps", 4, "-b", 2, "--total-batch-size", 64, "--out", tmp_path / "run",
            "--resume", ok=False)
    assert r.exit_code != 0 and "--total-batch-size" in r.stderr


# ---- pieces that need no second process ----------------------------------------------------------------------

def test_rank_discovery_from_each_launcher():
    def d(env):  # (rank, world, local) and which launcher's variables said so
        i = comm_mod.discover(env)
        return (i.rank, i.world_size, i.local_rank, i.source) if env else i

    assert d({}) == comm_mod.RankInfo()
    assert d({"LLMC_RANK": "1", "LLMC_WORLD_SIZE": "4", "LLMC_LOCAL_RANK": "1"})[:3] == (1, 4, 1)
    assert d({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
              "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (5, 8, 1, "Open MPI")
    assert d({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"})[:3] == (3, 4, 3)
    s = d({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1"})
    assert s == (9, 16, 1, "Slurm")
    # mpirun inside a Slurm allocation: MPI's own variables win
    assert d({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})[:2] == (1, 2)
    with pytest.raises(comm_mod.CommError, match="rank 4 is not in 0..3"):
        d({"LLMC_RANK": "4", "LLMC_WORLD_SIZE": "4"})


def test_pin_local_device():
    info = comm_mod.RankInfo(rank=5, world_size=8, local_rank=1)
    env = {}
    assert comm_mod.pin_local_device(info, env) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert comm_mod.pin_local_device(info, env) == "5"
    env = {"CUDA_VISIBLE_DEVICES": "3"}  # the launcher already gave this rank its GPU
    assert comm_mod.pin_local_device(info, env) == "3" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert comm_mod.pin_local_device(comm_mod.RankInfo(), {}) is None


def test_nccl_id_rendezvous_file_and_tcp(tmp_path):
    uid = bytes(range(128))
    got = {}
    path = tmp_path / "nccl_id"
    t = threading.Thread(target=lambda: got.update(f=rendezvous.share_file(None, 1, str(path), 10)))
    t.start()
    assert rendezvous.share_file(uid, 0, str(path), 10) == uid
    t.join()
    assert got["f"] == uid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    ts = [threading.Thread(target=lambda r=r: got.update({r: rendezvous.share_tcp(None, r, 3, addr, 20)}))
          for r in (1, 2)]
    for t in ts:
        t.start()
    assert rendezvous.share_tcp(uid, 0, 3, addr, 20) == uid
    for t in ts:
        t.join()
    assert got[1] == got[2] == uid
    with pytest.raises(comm_mod.CommError, match="HOST:PORT"):
        rendezvous.share_tcp(None, 1, 2, "nohostport", 1)


def test_loader_state_moves_between_world_sizes():
    st = {"sample": 3, "world_size": 2, "shuffle": False, "B": 2}
    assert reshard_loader_state(st, 1)["sample"] == 6
    assert reshard_loader_state(st, 2) is st
    with pytest.raises(ValueError, match="window"):
        reshard_loader_state(st, 4)
    with pytest.raises(ValueError, match="shuffled"):
        reshard_loader_state(dict(st, shuffle=True), 1)


def test_single_process_zero_equals_plain_adamw(data, tmp_path):
    """--zero 1 on one process is the plain optimizer (same code path as many ranks, one shard)."""
    common = [*TINY, "--data", data, "--steps", 3, "-b", 2]
    llmc(*common, "--log", tmp_path / "a.jsonl")
    llmc(*common, "--zero", 1, "--log", tmp_path / "b.jsonl")
    assert_close(losses(tmp_path / "b.jsonl"), losses(tmp_path / "a.jsonl"), rtol=1e-6)


def test_supervisor_stops_all_ranks_and_names_the_failed_one(tmp_path, capfd):
    """The --gpus launcher's process supervision, with stand-in ranks: rank 1 fails, rank 0 (which would wait
    forever in a collective) is stopped, the exit status is rank 1's and the message names it. Rank 0 sleeps for an
    hour: a supervisor that waited for it meets the watchdog, which fails the test."""
    pid = tmp_path / "rank0.pid"
    sleeper = [sys.executable, "-c", f"import os, time; open({str(pid)!r}, 'w').write(str(os.getpid())); "
               "print('rank 0 up', flush=True); time.sleep(3600)"]
    failer = [sys.executable, "-c", "import sys, time; time.sleep(0.5); print('boom on rank 1'); sys.exit(5)"]
    env = dict(os.environ)
    fired = []

    def watchdog():  # (a hang guard only: ends the rank a supervisor waits for)
        fired.append(True)
        os.kill(int(pid.read_text()), signal.SIGKILL)
    timer = threading.Timer(600, watchdog)
    timer.start()
    try:
        rc = supervise([sleeper, failer], [env, env], tmp_path, grace=2.0)
    finally:
        timer.cancel()
    assert rc == 5 and not fired, "the supervisor did not stop rank 0 when rank 1 failed"
    err = capfd.readouterr().err
    assert "rank 1 exited with status 5" in err and "boom on rank 1" in err
    ok = [sys.executable, "-c", "pass"]
    assert supervise([ok, ok], [env, env], tmp_path) == 0


class _HostlessComm:
    """A communicator of the tests below whose collectives that move no gradients do nothing."""

    def all_gather(self, buf):
        pass

    def broadcast(self, buf, root=0):
        pass

    def all_reduce_value(self, x, op="avg"):
        return float(x)

    def barrier(self):
        pass


def test_overlapped_reduction_covers_every_gradient_once_in_backward_order(tmp_path):
    """What OverlappedReduction queues, on a recording communicator of 3 ranks: on the last micro-step only, the
    layers from the last to the first while backward runs, then the rest; every element exactly once; --zero 1
    cuts the pieces at the owners' boundaries and all-reduces the tail."""
    from llmc_cli.kernels import AVG
    from llmc_cli.optim import FLAGS
    from llmc_cli.parallel.zero import OverlappedReduction
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer

    class Recorder(_HostlessComm):
        name, rank, world_size, local_rank = "recorder", 0, 3, 0

        def __init__(self):
            self.calls, self.scalars, self.joined = [], [], 0

        def _rec(self, kind, buf, root=None):
            lo = (buf.__array_interface__["data"][0] - base[0]) // buf.itemsize
            if 0 <= lo < base[1]:
                self.calls.append((kind, lo, buf.size, root))
            else:  # the step's loss and squared norm, reduced on the device
                self.scalars.append((kind, buf.size))

        def all_reduce(self, buf, op=AVG):
            self._rec("all_reduce", buf)

        def reduce(self, buf, root, op=AVG):
            self._rec("reduce", buf, root)

        def reduce_scatter(self, buf, op=AVG):
            self._rec("reduce_scatter", buf)

        def join(self):
            self.joined += 1

    write_shard(tmp_path / "r_train_000001.bin", phrase_tokens(2000))
    for zero in (0, 1):
        comm = Recorder()
        a = TrainArgs(data=str(tmp_path / "r_train_*.bin"), model="d2", n_layer=3, n_embd=32, batch_size=1,
                      seq_len=16, total_batch_size=2 * 3 * 16, steps=1, val_every=0, sample_every=0, zero=zero,
                      overlap=True)
        tr = Trainer(a, create_backend("cpu"), say=lambda m: None, comm=comm)
        assert isinstance(tr.reducer, OverlappedReduction)
        base = [tr.model.grads.buf.__array_interface__["data"][0], tr.model.grads.size]
        layer_order = []
        done = tr.reducer.layer_done
        tr.reducer.layer_done = lambda l: (layer_order.append(l), done(l))
        tr.train_step(0)
        assert layer_order == [2, 1, 0], "once per layer, last to first, on the last micro-step only"
        assert comm.joined == 1
        n = tr.model.grads.size
        covered = np.zeros(n, dtype=int)
        for kind, lo, size, root in comm.calls:
            covered[lo:lo + size] += 1
            if zero == 1 and kind == "reduce":  # a piece never crosses its owner's chunk
                assert lo // tr.opt.chunk == root and (lo + size - 1) // tr.opt.chunk == root
            if zero == 1 and kind == "all_reduce":
                assert lo >= tr.opt.main, "only the tail is all-reduced under ZeRO-1"
        assert (covered == 1).all(), "every gradient element is reduced exactly once"
        assert not any(k == "reduce_scatter" for k, *_ in comm.calls)
        # no host round trip for the verdict or the votes: the votes (optim.FLAGS: stop, checkpoint clock, step
        # time), the loss (and under ZeRO-1 the squared norm) reduced as buffers
        assert sorted(comm.scalars) == [("all_reduce", 1)] * (1 + zero) + [("all_reduce", FLAGS)], comm.scalars


def test_overlapped_zero1_sends_each_owners_piece_once_where_the_communicator_copies_pieces(tmp_path):
    """A communicator with reduce_scatter_pieces (the CUDA plugin's copy engines, on GPUs that reach each other's
    memory) gets, under --zero 1 --overlap, every element of the reduce-scattered range sent once, in ranges that
    never cross an owner's chunk, layer by layer from the last while backward runs, then finish() once; the tail
    every rank updates is all-reduced after it, and no piece goes through reduce() (5 ranks: a tail of 2)."""
    from llmc_cli.kernels import AVG
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer

    events = []

    class Pieces:
        def __init__(self, buf):
            self.buf = buf

        def send(self, ranges):
            events.append(("send", list(ranges)))

        def finish(self):
            events.append(("finish",))

    class Copier(_HostlessComm):
        name, rank, world_size, local_rank = "copier", 1, 5, 1

        def reduce_scatter_pieces(self, buf):
            events.append(("pieces", buf.size))
            return Pieces(buf)

        def all_reduce(self, buf, op=AVG):
            events.append(("all_reduce", buf.size))

        def reduce(self, buf, root, op=AVG):
            events.append(("reduce", buf.size))


    write_shard(tmp_path / "c_train_000001.bin", phrase_tokens(2000))
    a = TrainArgs(data=str(tmp_path / "c_train_*.bin"), model="d2", n_layer=3, n_embd=32, batch_size=1, seq_len=16,
                  total_batch_size=2 * 5 * 16, steps=1, val_every=0, sample_every=0, zero=1, overlap=True)
    tr = Trainer(a, create_backend("cpu"), say=lambda m: None, comm=Copier())
    assert tr.reducer.by_copies
    opt = tr.opt
    assert events == [("pieces", opt.main)] and opt.tail > 0, "(the test wants a tail: 5 ranks, 1,680,672 values)"
    events.clear()
    tr.train_step(0)
    sends = [e[1] for e in events if e[0] == "send"]
    assert len(sends) == 3 + 1, "one send per layer on the last micro-step, then the rest"
    fin = events.index(("finish",))
    assert all(e[0] == "send" for e in events[:fin]) and not any(e[0] == "reduce" for e in events)
    covered = np.zeros(opt.n, dtype=int)
    for lo, hi in (r for rs in sends for r in rs):
        assert lo // opt.chunk == (hi - 1) // opt.chunk, "a range inside one owner's chunk"
        covered[lo:hi] += 1
    assert (covered[:opt.main] == 1).all() and (covered[opt.main:] == 0).all()
    assert events[fin + 1] == ("all_reduce", opt.tail), "the tail all-reduced after finish"


def test_step_observations_are_combined_with_max_before_end_step_and_carried_into_checkpoints(tmp_path):
    """The trainer's side of Backend.begin_step / step_observations / end_step / carried_state (FP8's delayed
    scaling on CUDA): begin_step before the step's kernels, the ranks' observations all-reduced with MAX, then
    end_step, once a step; carried_state written to state.json and handed back to load_carried_state on resume,
    where a damaged one is refused in one line."""
    from llmc_cli.kernels import MAX
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs, TrainError
    from llmc_cli.training.trainer import Trainer

    events = []

    class Observing:  # the CPU backend with a backend's carried state around it
        def __init__(self, inner):
            self.inner, self.obs, self.loaded = inner, inner.alloc(4), None

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def begin_step(self):
            events.append("begin")

        def step_observations(self):
            return self.obs

        def end_step(self):
            events.append("end")

        def carried_state(self):
            return {"history": [[1.5, 0.25]]}

        def load_carried_state(self, state):
            if state.get("history") != [[1.5, 0.25]]:
                raise ValueError("history: expected what was saved")
            self.loaded = state

    class Recorder:
        name, rank, world_size, local_rank = "recorder", 0, 2, 0
        overlapped = None  # (no side stream)

        def all_reduce(self, buf, op=None):
            if buf is be.obs:
                events.append(("all_reduce", op))

        def __getattr__(self, name):
            return lambda *a, **k: a[0] if name == "all_reduce_value" else None

    write_shard(tmp_path / "o_train_000001.bin", phrase_tokens(2000))
    run = tmp_path / "run"
    base = dict(data=str(tmp_path / "o_train_*.bin"), model="d2", n_layer=1, n_embd=32, batch_size=2, seq_len=16,
                total_batch_size=2 * 2 * 16, steps=2, val_every=0, sample_every=0, out=str(run))
    be = Observing(create_backend("cpu"))
    tr = Trainer(TrainArgs(**base), be, say=lambda m: None, comm=Recorder())
    for s in range(2):
        tr.train_step(s)
    assert events == ["begin", ("all_reduce", MAX), "end"] * 2
    tr.save(2)
    tr.close()
    state = json.loads((run / "step_00000002" / "state.json").read_text())
    assert state["backend_state"] == {"history": [[1.5, 0.25]]}
    be = Observing(create_backend("cpu"))
    tr = Trainer(TrainArgs(**base, resume=True), be, say=lambda m: None, comm=Recorder())
    tr.close()
    assert be.loaded == {"history": [[1.5, 0.25]]}
    state["backend_state"] = {"history": [[1.5]]}
    (run / "step_00000002" / "state.json").write_text(json.dumps(state))
    with pytest.raises(TrainError, match=r"state\.json's backend_state is damaged: history: expected"):
        Trainer(TrainArgs(**base, resume=True), Observing(create_backend("cpu")), say=lambda m: None,
                comm=Recorder())
    state["backend_state"] = [1]
    (run / "step_00000002" / "state.json").write_text(json.dumps(state))
    with pytest.raises(TrainError, match="'backend_state' must be a JSON object"):
        Trainer(TrainArgs(**base, resume=True), Observing(create_backend("cpu")), say=lambda m: None,
                comm=Recorder())
