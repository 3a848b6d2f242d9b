"""Training steps replayed as captured graphs (CAP_GRAPHS): the trainer stages each batch, then replays one graph per
micro-step once GRAPH_AFTER steps ran uncaptured; the losses are those of the uncaptured run, bit for bit. The
graph here is the CPU backend with a capture that records nothing and replays the micro-step with uploads and
synchronizes forbidden, as a real graph (CUDA's) holds kernels only. (Downloads stay allowed: some of the CPU
backend's host defaults read buffers back; loss_sum is written here as the device kernel it is elsewhere.)"""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.kernels import CAP_GRAPHS
from llmc_cli.training import steps as steps_mod
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.steps import GRAPH_AFTER
from llmc_cli.training.trainer import Trainer


def graph_cpu(fail: bool = False):
    from llmc_cpu import CpuBackend

    class GraphCpu(CpuBackend):
        capabilities = CpuBackend.capabilities | {CAP_GRAPHS}

        def __init__(self):
            super().__init__()
            self.inside, self.captures, self.replays = False, 0, 0

        def capture(self, fn):
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.captures += 1

            def replay():
                self.inside = True
                try:
                    fn()
                finally:
                    self.inside = False
                self.replays += 1
            return replay

        def _host(self, what):
            assert not self.inside, f"{what} inside a captured step (a graph holds kernels only)"

        def upload(self, dst, host):
            self._host("upload")
            super().upload(dst, host)

        def loss_sum(self, out, losses, weight, accumulate):  # as a device kernel would: no upload
            total = float(np.sum(losses.astype(np.float64))) * weight
            out[0] = np.float32(total + (float(out[0]) if accumulate else 0.0))

        def synchronize(self):
            self._host("synchronize")
            super().synchronize()

    return GraphCpu()


def run_steps(shards, backend, steps=GRAPH_AFTER + 4, **kw):
    said = []
    a = TrainArgs(data=str(shards / "*train*.bin"), model="d2", n_embd=64, batch_size=2, seq_len=32, steps=steps,
                  val_every=0, sample_every=0, **kw)
    tr = Trainer(a, backend, say=said.append)
    losses = [tr.train_step(s)["loss"] for s in range(steps)]
    return losses, said


@pytest.mark.parametrize("accum", [1, 3])
def test_replayed_steps_give_the_losses_of_uncaptured_ones(shards, accum):
    kw = {"total_batch_size": 2 * 32 * accum}
    plain, _ = run_steps(shards, graph_cpu(), graphs=False, **kw)
    be = graph_cpu()
    replayed, said = run_steps(shards, be, **kw)
    assert replayed == plain
    assert be.captures == min(accum, 2), "one graph for the first micro-step, one for every later one"
    assert be.replays == 4 * accum
    assert any(f"from step {GRAPH_AFTER + 1}" in s for s in said), said


def test_a_failed_capture_turns_graphs_off_and_the_run_goes_on(shards):
    plain, _ = run_steps(shards, graph_cpu(), graphs=False)
    losses, said = run_steps(shards, graph_cpu(fail=True))
    assert losses == plain
    assert any(s.startswith("graphs: off (RuntimeError") for s in said), said


def test_no_capture_without_the_capability_or_with_no_graphs(shards, monkeypatch):
    from llmc_cpu import CpuBackend
    monkeypatch.setattr(steps_mod, "GRAPH_AFTER", 1)
    be = CpuBackend()
    _, said = run_steps(shards, be, steps=3)
    assert not any("graphs" in s for s in said)
    g = graph_cpu()
    run_steps(shards, g, steps=3, graphs=False)
    assert g.captures == 0
