"""Data parallel over peer memory (llmc_cuda/p2p.py). On one GPU: adamw_update's mirrors receive the bits it
writes into the parameters (nothing on a skipped step); peer_mean (`p2p_reduce=on`'s reduce-scatter) is the ranks'
float32 sum in rank order divided once. On two GPUs: `llmc train --gpus 2 --zero 1` with the all-gather written by
the update, with the reduce-scatter loading the peers' chunks too, and with NCCL's (`--backend-opt p2p=off`) log the
same losses and save the same bytes, and the run says which path it took.

Everything skips, with the plugin's own reason, where the CUDA backend cannot run; the two-GPU test where fewer
than two GPUs are visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_support import cuda_backend

from llmc_cli.formats.shards import write_shard
from llmc_cli.kernels import BFLOAT16, FLOAT32
from llmc_cli.testing.helpers import bf16_round

pytestmark = pytest.mark.cuda


def cuda(dtype=BFLOAT16):
    return cuda_backend(dtype)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return bf16_round(x) if dtype == BFLOAT16 else x


def pointers(be, bufs, at=0):
    import cupy as cp
    with be.stream:  # (on the stream the kernels that read it run on)
        a = cp.asarray(np.array([b.data.ptr + at * b.dtype.itemsize for b in bufs], dtype=np.uint64))
    be.synchronize()
    return a


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("off,n", [(0, 4096), (64, 1000), (3, 517)])  # packs; more packs; unaligned: scalar
def test_peer_mean_is_the_ranks_sum_in_order_divided_once(dtype, ranks, off, n):
    """--backend-opt p2p_reduce=on's kernel: every copy's element off + i summed in rank order in float32 and divided
    once, rounded to the buffer's dtype, into a poisoned output (the 128-bit and the scalar path)."""
    be = cuda(dtype)
    rng = np.random.default_rng(ranks * 1000 + off)
    total = off + n + 5
    host = [rounded(rng.standard_normal(total).astype(np.float32) * 10.0 ** rng.integers(-3, 3), dtype)
            for _ in range(ranks)]
    copies = [be.alloc(total, dtype) for _ in range(ranks)]
    for c, h in zip(copies, host):
        be.upload(c, h)
    out = be.view(be.alloc(n + 1, dtype), 1, n) if off % 8 else be.alloc(n, dtype)
    be.upload(out, np.full(n, np.nan, np.float32))
    be.peer_mean(out, pointers(be, copies), ranks, off)
    acc = host[0][off:off + n].copy()
    for h in host[1:]:
        acc = acc + h[off:off + n]  # float32, in rank order
    want = rounded(acc / np.float32(ranks), dtype)
    np.testing.assert_array_equal(be.download(out), want)


@pytest.mark.parametrize("n", [3001, 3000])  # (one element a thread; four, in packs)
@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_adamw_mirrors_receive_the_bits_of_the_update(dtype, n):
    be = cuda(dtype)
    rng = np.random.default_rng(5)
    p, g = be.alloc(n, dtype), be.alloc(n, dtype)
    m, v = be.alloc(n, FLOAT32), be.alloc(n, FLOAT32)
    master = be.alloc(n, FLOAT32) if dtype == BFLOAT16 else None
    w = rng.standard_normal(n).astype(np.float32)
    be.upload(p, w)
    if master is not None:
        be.upload(master, rounded(w, dtype))
    be.upload(g, rng.standard_normal(n).astype(np.float32))
    be.fill(m, 0.0)
    be.fill(v, 0.0)
    mirrors = [be.alloc(n, dtype) for _ in range(2)]
    guard = be.alloc(4, FLOAT32)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0, seed=11)
    for apply in (1.0, 0.0):
        for mb in mirrors:
            be.upload(mb, np.full(n, np.nan, np.float32))
        before = be.download(p)
        be.upload(guard, np.array([1.0, 1.0, 1.0, apply], np.float32))
        be.adamw_update(p, g, m, v, master, guard=guard, mirrors=pointers(be, mirrors), **kw)
        got = be.download(p)
        if apply:
            assert not np.array_equal(got, before)
            for mb in mirrors:
                np.testing.assert_array_equal(be.download(mb), got)
        else:  # a skipped step writes nothing anywhere
            np.testing.assert_array_equal(got, before)
            for mb in mirrors:
                assert np.isnan(be.download(mb)).all()


def _gpus() -> int:
    cuda()
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


SETUPS = {"zero1": ["--zero", "1"], "zero2": ["--zero", "2"], "overlap": ["--zero", "1", "--overlap"],
          "accumulation": ["--zero", "1", "--total-batch-size", "1024"],  # (1024 = 2 micro-steps of 2 x 4 x 64)
          "overlap_accumulation": ["--zero", "1", "--overlap", "--total-batch-size", "1024"]}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_two_gpus_through_peer_memory_train_the_bits_of_nccl(tmp_path, setup):
    """GPT-2 d2 (C=64) on two GPUs, bf16, ZeRO-1 (also with --overlap and with gradient accumulation) and ZeRO-2:
    peer memory (ZeRO-1: with and without p2p_reduce; --overlap: the pieces copied to their owners or reduced by
    NCCL) and NCCL give the same losses, norms and saved model bytes
    (for two ranks the average is one float32 sum divided by two either way)."""
    if _gpus() < 2:
        pytest.skip("needs two GPUs (one visible here)")
    import cupy as cp
    if not cp.cuda.runtime.deviceCanAccessPeer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer access here: the run would take NCCL's all-gather either way")
    write_shard(tmp_path / "p2p_train_000.bin", np.random.default_rng(0).integers(0, 50257, 8 * 4 * 64 * 2 + 1))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    out, lines = {}, {}
    modes = {"on": ["p2p=on"], "off": ["p2p=off"]}
    if setup == "zero1":  # (unset, two ranks go through each other's memory)
        modes["default"] = []
    if setup in ("zero1", "accumulation"):  # (the reduce-scatter p2p_reduce replaces: ZeRO-1's after the backward)
        modes["reduce"] = ["p2p=on", "p2p_reduce=on"]
    if setup.startswith("overlap"):  # (the pieces copied to their owners by default; p2p_copies=off: NCCL reduces each)
        modes["pieces_nccl"] = ["p2p=on", "p2p_copies=off"]
    for mode, opts in modes.items():
        run = tmp_path / f"run_{mode}"
        r = subprocess.run([sys.executable, "-m", "llmc_cli", "train", "--backend", "cuda", "--dtype", "bf16",
                            "--model", "d2", "--n-embd", "64", "-b", "4", "-t", "64", "--steps", "9", *SETUPS[setup],
                            "--gpus", "2", "--val-every", "0", "--sample-every", "0",
                            *[x for o in opts for x in ("--backend-opt", o)],
                            "--data", str(tmp_path / "p2p_train_*.bin"), "--out", str(run),
                            "--log", str(tmp_path / f"{mode}.jsonl")],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        recs = [json.loads(ln) for ln in (tmp_path / f"{mode}.jsonl").read_text().splitlines()]
        lines[mode] = [(rec["loss"], rec["norm"]) for rec in recs if "loss" in rec]
        assert len(lines[mode]) == 9, r.stdout[-2000:]  # (steps 7-9 replay captured graphs where the run has them)
        out[mode] = r.stdout
        model = sorted(Path(run).rglob("model*.bin"))
        assert model, list(Path(run).rglob("*"))
        out[mode + "_bytes"] = model[-1].read_bytes()
    assert "written by the update into the other ranks' memory" in out["on"], out["on"][-2000:]
    assert "written by the update" not in out["off"]
    for mode in modes:
        assert lines[mode] == lines["off"], mode
        assert out[mode + "_bytes"] == out["off_bytes"], mode
        if mode != "off":
            assert "written by the update into the other ranks' memory" in out[mode], mode
        assert ("the reduce-scatter read from it" in out[mode]) == (mode == "reduce"), mode
        assert ("copied layer by layer to their owners" in out[mode]) == (setup.startswith("overlap") and mode == "on"), mode


def _rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the --gpus launcher's ranks (its children, by the LLMC_RANK it gave each)."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                if "LLMC_RANK" in env:
                    out[int(env["LLMC_RANK"])] = int(d.name)
        except (OSError, ValueError, IndexError):  # (a process that ended meanwhile)
            pass
    return out


def test_a_stop_request_on_one_rank_stops_both_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone (a scheduler that signals one process): the ranks' vote, carried by the step's own
    collectives, stops both after the same step, with one checkpoint and exit 75."""
    if _gpus() < 2:
        pytest.skip("needs two GPUs (one visible here)")
    import signal
    write_shard(tmp_path / "v_train_000.bin", np.random.default_rng(0).integers(0, 50257, 100_000))
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "llmc_cli", "train", "--backend", "cuda", "--dtype", "bf16",
                          "--model", "d2", "--n-embd", "64", "-b", "4", "-t", "64", "--steps", "100000", "--gpus", "2",
                          "--val-every", "0", "--sample-every", "0", "--data", str(tmp_path / "v_train_*.bin"),
                          "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    try:
        for line in p.stdout:
            if line.startswith(b"step"):
                break
        ranks = _rank_pids(p.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGTERM)
        rest = p.stdout.read().decode()
        code, err = p.wait(timeout=300), p.stderr.read().decode()
    finally:
        p.kill()
    assert code == 75, (code, err[-2000:])  # (p.wait's timeout guards against a hang)
    assert "a stop request on another rank" in rest + err, (rest[-1000:], err[-2000:])
    steps = sorted(run.glob("step_*"))
    assert len(steps) == 1 and (run / "latest").read_text().strip() == steps[0].name, sorted(run.iterdir())
