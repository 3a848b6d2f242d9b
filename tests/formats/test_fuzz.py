"""Fuzz the readers of every binary format (bounded: a few seconds each). A reader may reject its input only
with its clean error class (CheckpointError / DataError / TokenizerError: ValueErrors whose one-line message
the CLI prints); anything else (IndexError, struct errors, numpy ValueErrors, MemoryError, ...) is a bug.
`bench/fuzz_readers.py` runs the same targets for minutes."""

import os

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_targets import TARGETS, check_target, mutated_bytes

EXAMPLES = int(os.environ.get("LLMC_FUZZ_EXAMPLES", "150"))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_reader_rejects_garbage_cleanly(name, tmp_path_factory):
    target = TARGETS[name]
    d = tmp_path_factory.mktemp(f"fuzz_{name}")
    seed = target.seed(d)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=mutated_bytes(seed, target.header_ints))
    def fuzz(data):
        check_target(target, d, data)

    fuzz()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seed_file_is_accepted(name, tmp_path):
    """The unmutated seed is valid (so the mutations start from the real format, not from noise)."""
    target = TARGETS[name]
    seed = target.seed(tmp_path)
    p = tmp_path / ("input" + target.suffix)
    p.write_bytes(seed)
    target.read(p)
