"""Training with the next batches read ahead by a thread (--prefetch, the default) and copied ahead through the
backend's input queue: the same bits as reading each batch in its step (--no-prefetch), checkpoints that record
the batches the steps took (not those the thread read), a bad shard failing the step that reads it, no thread
left behind, and the order a CAP_ASYNC_INPUTS backend sees: the next batch put while the step's kernels run."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
from llmc_test_support import TINY, losses, rewind_run, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import write_shard
from llmc_cli.kernels import CAP_ASYNC_INPUTS, HostInputQueue
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

# B=2, T=32: 64 tokens a batch; each shard serves 5 batches, so 4 steps of 3 micro-steps cross shards and epochs
BT = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch")
    rng = np.random.default_rng(7)
    for i in range(3):
        write_shard(d / f"pf_train_{i:06d}.bin", rng.integers(0, 50257, 5 * BT + 1))
    return d


def args(data, **kw) -> TrainArgs:
    base = {"data": str(data / "*train*.bin"), "model": "d2", "n_embd": 64, "batch_size": 2, "seq_len": 32,
            "steps": 6, "val_every": 0, "sample_every": 0}
    return TrainArgs(**(base | kw))


def cpu():
    from llmc_cpu import CpuBackend
    return CpuBackend()


def error_line(r) -> str:
    """The last line of a run that failed mid-run: exit 2, no traceback, one line starting with "error:"."""
    out = r.output.strip()
    assert r.exit_code == 2 and "Traceback" not in out, out
    msg = out.splitlines()[-1]
    assert msg.startswith("error: "), out
    return msg


def train(a: TrainArgs, backend=None):
    tr = Trainer(a, backend or cpu(), say=lambda s: None)
    try:
        recs = tr.run()
        return recs, tr.model.parameters_host(), tr.feed.position, tr
    finally:
        tr.close()


@pytest.mark.parametrize("kw", [{}, {"total_batch_size": 3 * BT, "shuffle": True}, {"overfit_batch": True},
                                {"total_batch_size": 2 * BT, "shuffle": True, "seed": 3}],
                         ids=["plain", "accum3-shuffle", "overfit", "accum2-shuffle-seed"])
def test_prefetch_gives_the_bits_of_reading_in_the_step(data, kw):
    plain, w_plain, pos_plain, _ = train(args(data, prefetch=False, **kw))
    ahead, w_ahead, pos_ahead, tr = train(args(data, **kw))
    assert [r["loss"] for r in ahead] == [r["loss"] for r in plain]
    assert np.array_equal(w_ahead, w_plain), "the final weights must be the same bits"
    assert pos_ahead == pos_plain, "the position is that of the batches the steps took"
    accum = kw.get("total_batch_size", BT) // BT
    assert all(r["data_waits"] == accum for r in plain), "without prefetch every batch is read in its step"
    assert all(0 <= r["data_waits"] <= accum for r in ahead)
    assert tr.feed.batches == 6 * accum, "no batch is read past the run's last"


def test_checkpoint_and_resume_mid_run_are_bit_exact(data, tmp_path):
    """A checkpoint written while the thread has read batches ahead records the steps' position: a run resumed
    from it (the later checkpoint gone, as if it died) logs the losses of one that never stopped."""
    a = [*TINY, "--data", data / "*train*.bin", "--shuffle", "--total-batch-size", 3 * BT]
    run(*a, "--steps", 8, "--log", tmp_path / "ref.jsonl")
    rd = tmp_path / "r"
    run(*a, "--steps", 8, "--checkpoint-every", 3, "--out", rd)
    state = json.loads((rd / ckpt.step_dir_name(3) / "state.json").read_text())["dataloader"]
    assert (state["epoch"], state["shard"], state["sample"]) == (0, 1, 4), "9 batches taken: shard 1, sample 4"
    rewind_run(rd, died_after=6, dropped=8, log=rd / "log.jsonl")
    r = run(*a, "--steps", 8, "--out", rd, "--resume")
    assert "data: waited for" in r.output and "of 6 batches" in r.output, r.output
    assert losses(rd / "log.jsonl") == losses(tmp_path / "ref.jsonl")


@pytest.mark.parametrize("prefetch", ["--prefetch", "--no-prefetch"])
def test_a_bad_shard_fails_the_step_that_reads_it_and_resumes(tmp_path, prefetch):
    """Shard 1 holds an id past GPT-2's vocabulary. Its first batch is step 6's (5 batches a shard): steps 1-5
    log, step 6 fails with the loader's one line, the rescue checkpoint is step 5 at the end of shard 0, and once
    the shard is mended the run resumes to the losses of a run on good data (the thread read shard 1 while steps
    3-5 ran; it must change nothing)."""
    d = tmp_path / "data"
    rng = np.random.default_rng(1)
    good = [rng.integers(0, 50257, 5 * BT + 1) for _ in range(2)]
    bad = good[1].copy()
    bad[70] = 60000
    write_shard(d / "x_train_000000.bin", good[0])
    write_shard(d / "x_train_000001.bin", bad)
    rd = tmp_path / "r"
    a = [*TINY, "--data", d / "*train*.bin", prefetch]
    r = run(*a, "--steps", 9, "--out", rd, ok=False)
    msg = error_line(r)
    assert "x_train_000001.bin: token id 60000 at position 70" in msg, msg
    assert f"checkpoint {rd / ckpt.step_dir_name(5)} written (the last completed step)" in msg, msg
    assert [json.loads(s)["step"] for s in (rd / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    state = json.loads((rd / ckpt.step_dir_name(5) / "state.json").read_text())
    assert (state["step"], state["dataloader"]["shard"], state["dataloader"]["sample"]) == (5, 0, 5)
    write_shard(d / "x_train_000001.bin", good[1])
    run(*a, "--steps", 9, "--out", rd, "--resume")
    run(*a, "--steps", 9, "--log", tmp_path / "ref.jsonl")
    assert losses(rd / "log.jsonl") == losses(tmp_path / "ref.jsonl")


def test_no_thread_outlives_the_trainer(data, tmp_path, monkeypatch):
    """Finished, failed, interrupted, closed unrun, or dropped unclosed: the data thread ends."""
    _, _, _, tr = train(args(data, steps=2))
    assert tr.feed.reader is None
    bad = tmp_path / "bad"
    tokens = np.random.default_rng(2).integers(0, 50257, 5 * BT + 1)
    write_shard(bad / "b_train_000000.bin", tokens)
    tokens[3] = 60000
    write_shard(bad / "b_train_000001.bin", tokens)
    tr = Trainer(args(bad, steps=9), cpu(), say=lambda s: None)
    thread = tr.feed.reader.thread
    with pytest.raises(DataError, match="token id 60000"):
        tr.run()
    assert not thread.is_alive()
    tr.close()

    tr = Trainer(args(data, steps=9), cpu(), say=lambda s: None)
    thread = tr.feed.reader.thread

    def interrupt(rec):
        if rec["step"] == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        tr.run(on_step=interrupt)
    assert not thread.is_alive()
    tr.close()

    tr = Trainer(args(data), cpu(), say=lambda s: None)
    thread = tr.feed.reader.thread
    tr.close()
    assert not thread.is_alive()

    tr = Trainer(args(data), cpu(), say=lambda s: None)
    thread = tr.feed.reader.thread
    tr.train_step(0)
    del tr
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a Trainer dropped without close() stops its thread"


def test_the_command_reports_the_waits(data, tmp_path):
    a = [*TINY, "--data", data / "*train*.bin", "--steps", 4, "--total-batch-size", 2 * BT]
    r = run(*a, "--log", tmp_path / "a.jsonl")
    line = [s for s in r.output.splitlines() if s.startswith("data: waited for")]
    assert len(line) == 1 and " of 8 batches" in line[0], r.output
    recs = [json.loads(s) for s in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert sum(rec["data_waits"] for rec in recs) == int(line[0].split()[3])
    r = run(*a, "--no-prefetch")
    assert "data: 8 batches read inside the steps" in r.output and "--no-prefetch" in r.output, r.output


# ---- a backend with CAP_ASYNC_INPUTS: the order of operations ----------------------------------------------------

def async_cpu():
    """The CPU backend announcing CAP_ASYNC_INPUTS, with an input queue that records put and take (each batch
    numbered in the order put), and a log of what the engine enqueues: the encoder's launch (the micro-step's first
    kernel, with the number of the batch its input buffer holds) and every read back to the host (where the host
    waits for the device). loss_sum is written as the device kernel it is elsewhere (no read back)."""
    from llmc_cpu import CpuBackend

    class AsyncCpu(CpuBackend):
        capabilities = CpuBackend.capabilities | {CAP_ASYNC_INPUTS}

        def __init__(self):
            super().__init__()
            self.log: list[tuple] = []
            self.batches: list[np.ndarray] = []

        def input_queue(self, dsts, depth=2):
            be = self

            class Recorded(HostInputQueue):
                def put(self, hosts):
                    be.batches.append(np.array(hosts[0]))
                    be.log.append(("put", len(be.batches) - 1))
                    super().put(hosts)

                def take(self):
                    be.log.append(("take", sum(e[0] == "take" for e in be.log)))
                    super().take()
            return Recorded(self, dsts, depth)

        def encoder_forward(self, out, inp, wte, wpe):
            holds = [i for i, b in enumerate(self.batches) if np.array_equal(b, inp)]
            self.log.append(("kernels", holds[-1] if holds else None))
            super().encoder_forward(out, inp, wte, wpe)

        def download(self, src):
            self.log.append(("read",))
            return super().download(src)

        def loss_sum(self, out, losses, weight, accumulate):
            total = float(np.sum(losses.astype(np.float64))) * weight
            out[0] = np.float32(total + (float(out[0]) if accumulate else 0.0))
    return AsyncCpu()


@pytest.mark.parametrize("accum", [1, 3])
def test_the_next_batch_is_put_while_the_step_computes(data, accum):
    """Micro-step k: take(k) right before its kernels, whose input holds batch k; then put(k+1) once they are
    enqueued and before the host reads anything back (the step's end), so batch k+1's copy overlaps the rest of
    step k; the compute side takes it only at micro-step k+1. The losses are those of reading in the step."""
    be = async_cpu()
    steps = 4
    recs, _, _, _ = train(args(data, steps=steps, total_batch_size=accum * BT), be)
    plain, _, _, _ = train(args(data, steps=steps, total_batch_size=accum * BT, prefetch=False))
    assert [r["loss"] for r in recs] == [r["loss"] for r in plain]
    log = be.log
    micro = steps * accum
    kernels = [i for i, e in enumerate(log) if e[0] == "kernels"]
    assert [log[i][1] for i in kernels] == list(range(micro)), "micro-step k computes on batch k"
    for k, at in enumerate(kernels):
        assert log[at - 1] == ("take", k), f"take({k}) is the last thing before micro-step {k}'s kernels"
        if k + 1 < micro:
            put = log.index(("put", k + 1))
            assert at < put, f"batch {k + 1} is put after micro-step {k}'s kernels are enqueued"
            assert ("read",) not in log[at:put], f"batch {k + 1} is put before the host waits for micro-step {k}"
            assert put < log.index(("take", k + 1))
    assert ("put", micro) not in log, "nothing is put past the run's last batch"
