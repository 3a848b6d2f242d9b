"""Shared fixtures and helpers for llmc's own tests.

The backend fixtures and the device/tolerance helpers are the conformance kit's (`llmc_cli.testing`), so llmc's
tests and a third-party backend's run the same code: `backend` is parametrised over every installed backend,
and one that is installed but cannot run here is a skip with its reason. Import helpers from here
(``from conftest import to_device, assert_close, ...``) or from `llmc_cli.testing.helpers`.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.register_assert_rewrite("llmc_cli.testing")

from llmc_cli.testing.backends import make_backend, unusable_reason  # noqa: F401
from llmc_cli.testing.helpers import (  # noqa: F401
    POISON,
    TOLERANCES,
    assert_close,
    bf16_neighbours,
    bf16_round,
    check_accumulated,
    empty,
    from_device,
    poison,
    prefill,
    randn,
    rel_err,
    to_device,
    tol,
)
from llmc_cli.testing.plugin import *  # noqa: F401,F403  (fixtures and hooks)
from llmc_cli.testing.plugin import BACKEND_MARKERS  # noqa: F401


# ---------------------------------------------------------------------------------------------------------------
# the command line on a tiny GPT-2 (tests of train / eval / sample / convert / faults)

TINY = ["train", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "-b", "2", "-t", "32", "--val-every", "0",
        "--sample-every", "0"]


def phrase_tokens(repeats: int, seed: int = 0, vocab: int = 50257) -> np.ndarray:
    """A 40-token random phrase rolled `repeats` times: a little structure, so a tiny model's loss can fall."""
    phrase = np.random.default_rng(seed).integers(0, vocab, 40)
    return np.concatenate([np.roll(phrase, k) for k in range(repeats)])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder with tiny_val_000000.bin (2,000 tokens) and tiny_train_000001.bin (4,800 tokens)."""
    from llmc_cli.formats.shards import write_shard
    d = tmp_path_factory.mktemp("data")
    tokens = phrase_tokens(120)
    write_shard(d / "tiny_val_000000.bin", tokens[:2000])
    write_shard(d / "tiny_train_000001.bin", tokens)
    return d


def run(*args, ok: bool = True):
    """`llmc ARGS` in-process through click's runner; raises with the output unless it exits 0 (or ok=False)."""
    from click.testing import CliRunner

    from llmc_cli.commands import main
    r = CliRunner().invoke(main, [str(a) for a in args])
    if ok and r.exit_code != 0:
        raise AssertionError(f"exit {r.exit_code}: {r.output}\n{r.exception!r}")
    return r


def losses(log) -> list[float]:
    """The training losses of a --log JSONL file, in order."""
    import json
    return [json.loads(line)["loss"] for line in open(log) if "loss" in json.loads(line)]


def rewind_run(run_dir, died_after: int, dropped: int, log=None) -> None:
    """Make a run directory look as if the run died after its step `died_after` checkpoint: the later checkpoint
    step_`dropped` is gone and `latest` points back; with `log`, that JSONL log ends at step `died_after` too."""
    import shutil
    from pathlib import Path
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / f"step_{dropped:08d}")
    (run_dir / "latest").write_text(f"step_{died_after:08d}\n")
    if log is not None:
        lines = Path(log).read_text().splitlines()[:died_after]
        Path(log).write_text("\n".join(lines) + "\n")
