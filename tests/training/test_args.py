"""What a run's options say together (training.args.check_together), stated once for the command line and the Python
API: each refusal names the fields as its caller spells them, flags for `llmc train`, field names for Python."""

from __future__ import annotations

import pytest

from llmc_cli.commands.options import check_tokens, flag_name
from llmc_cli.naming import python_name
from llmc_cli.training.args import TrainArgs, TrainError, check_together

CASES = [  # (fields, ranks, what a Python caller reads, what the command line says)
    (dict(zero=2, overlap=True), 1, "overlap: zero=2 already reduces", "--overlap: --zero 2 already reduces"),
    (dict(batch_size=2**20, seq_len=2**12), 1, "batch_size=1048576 seq_len=4096: 4,294,967,296 tokens",
     "-b 1048576 -t 4096: 4,294,967,296 tokens"),
    (dict(total_batch_size=100), 1, "total_batch_size=100 is not a multiple of B*T = 2*32 = 64",
     "--total-batch-size 100 is not a multiple of B*T = 2*32 = 64"),
    (dict(total_batch_size=192), 2, "total_batch_size=192 is not a multiple of B*T*ranks = 2*32*2 = 128",
     "--total-batch-size 192 is not a multiple of B*T*ranks = 2*32*2 = 128"),
]


@pytest.mark.parametrize("kw, ranks, python, flags", CASES)
def test_a_combination_is_refused_in_the_callers_words(kw, ranks, python, flags):
    a = TrainArgs(data="x", **({"batch_size": 2, "seq_len": 32} | kw))
    for name, expect, other in ((python_name, python, "--"), (flag_name, flags, "_size=")):
        with pytest.raises(TrainError) as e:
            check_together(a, ranks, name)
        assert expect in str(e.value) and other not in str(e.value), str(e.value)


def test_the_tokens_per_step_are_whole_micro_steps_of_every_rank():
    a = TrainArgs(data="x", batch_size=2, seq_len=32, total_batch_size=256)
    assert check_together(a, 2) == 256 and check_together(TrainArgs(data="x", batch_size=2, seq_len=32), 4) == 256
    assert check_tokens(2, 32) is None and check_tokens(2**31, 1).startswith("-b 2147483648 -t 1:")
