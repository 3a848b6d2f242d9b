"""The bench workflows' refusals name a setting as their caller spells it (llmc_cli.naming): `llmc bench` reads its
flags, a Python caller of run_kernels, run_decode, run_overlap, run_train or resolve_backends its own arguments."""

from __future__ import annotations

import pytest

from llmc_cli import naming
from llmc_cli.bench import decode, kernel_cases, overlap, train_steps
from llmc_cli.bench.backends import BenchError, resolve_backends
from llmc_cli.kernels import OVERLAP_MODES
from llmc_cli.models.families import family_for

CFG = family_for("d2").preset("d2", n_embd=32, n_head=2)


def _grid(batches, T, C, streams=(4,)):
    overlap.check_grid(batches, T, C, OVERLAP_MODES, streams, (32,), ("pinned",))


CASES = [  # (what raises, the error, what the command line reads, what a Python caller reads)
    (lambda: kernel_cases.check_host_memory(kernel_cases.kernel_cases(CFG, 2, 16), CFG, 2, 16, available=1),
     BenchError, ("-b 2 -t 16: the kernel case", "lower -b/--batch-size or -t/--seq-len, or leave it out with --only"),
     ("B=2 T=16: the kernel case", "lower B or T, or leave it out with only")),
    (lambda: decode.run_decode([], CFG, 1, 1), ValueError, ("-t/--seq-len 1: the window",), ("S=1: the window",)),
    (lambda: decode.run_decode([], CFG, 1, 8, prompt_len=0), ValueError, ("--prompt-len 0 must be",),
     ("prompt_len=0 must be",)),
    (lambda: _grid((2,), 16, 0), BenchError, ("-b/--batch-size, -t/--seq-len and -c/--channels must be >= 1",),
     ("batches, T and C must be >= 1 (got [2], 16, 0)",)),
    (lambda: _grid((1,), 2, 48), BenchError, ("--streams 4: more chunks than the 2 rows of -b 1 -t 2",),
     ("streams 4: more chunks than the 2 rows of batches 1 T=2",)),
    (lambda: train_steps.run_train([], CFG, 1, 8, steps=2**31 - 1, warmup=1), BenchError,
     ("--steps 2147483647 --warmup 1: ",), ("steps=2147483647 warmup=1: ",)),
    (lambda: resolve_backends(["cpu,opencl"], plugins=[]), BenchError,
     ("--backend cpu,opencl: not installed", "give one backend per --backend, e.g. --backend cpu --backend opencl"),
     ("names cpu,opencl: not installed", "give one backend per names, e.g. names=['cpu', 'opencl']")),
]


@pytest.mark.parametrize("make, error, cli, python", CASES)
def test_a_bench_refusal_names_the_setting_as_its_caller_spells_it(make, error, cli, python):
    with naming.flags(), pytest.raises(error) as e:
        make()
    assert all(s in str(e.value) for s in cli), str(e.value)
    with pytest.raises(error) as e:
        make()
    assert all(s in str(e.value) for s in python) and "--" not in str(e.value), str(e.value)
