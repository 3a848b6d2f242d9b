"""Step numbers of any width, read by one parser (formats/rundir.step_of): a pattern of eight digits left
step_100000000 unpruned by --keep (the disk filled), unseen by the fallback resume (which then wrote over newer
steps) and unseen by a fresh run's check for a run already there."""
from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.rundir import RunDirError, check_out, is_run_dir, step_dir_name, step_dirs, step_of
from llmc_cli.models.gpt2 import GPT2Config, init_parameters, num_parameters

CFG = GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
N = num_parameters(CFG)

NAMES = [
    ("step_00000000", 0),
    ("step_00000042", 42),
    ("step_99999999", 99_999_999),
    ("step_100000000", 100_000_000),
    ("step_2147483647", 2**31 - 1),
    ("step_000000042", None),  # (llmc writes step 42 as step_00000042: another name for it is the user's)
    ("step_0000042", None),
    ("step_42", None),
    ("step_best", None),
    ("step_00000003.bak", None),
    ("step_00000003/", None),
    ("step_-0000003", None),
    ("step_" + "9" * 5000, None),  # (int() of 5,000 digits raises: never tried)
    ("Step_00000001", None),
    (".step_00000001.tmp-123", None),
    ("step_０００００００１", None),  # (full-width digits: \d takes them, int() too)
]


@pytest.mark.parametrize("name,step", NAMES)
def test_step_of_reads_llmc_names_only(name, step):
    assert step_of(name) == step
    if step is not None:
        assert step_dir_name(step) == name


@pytest.mark.parametrize("step", [0, 1, 99_999_999, 100_000_000, 2**31 - 1])
def test_step_dir_name_round_trips_with_eight_digits_at_least(step):
    assert step_of(step_dir_name(step)) == step and len(step_dir_name(step)) >= len("step_") + 8


def _state(step: int) -> dict:
    return {"version": 1, "step": step, "args": {}, "rng": np.random.default_rng(0).bit_generator.state,
            "dataloader": {"version": 1, "epoch": 0, "shard": 0, "sample": 0}, "family": "gpt2"}


def _write(run, step: int, keep: int = 0):
    opt = {"m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32)}
    return ckpt.write_run_checkpoint(run, step, CFG, init_parameters(CFG, 0), False, opt, _state(step), keep=keep)


def test_step_dirs_are_ordered_by_number(tmp_path):
    for name in ("step_100000000", "step_99999999", "step_00000002", "step_1000000000", "step_best", "step_7"):
        (tmp_path / name).mkdir()
    assert [p.name for p in step_dirs(tmp_path)] == ["step_00000002", "step_99999999", "step_100000000",
                                                     "step_1000000000"]


def test_keep_prunes_steps_past_eight_digits(tmp_path):
    run = tmp_path / "run"
    for step in (99_999_999, 100_000_000, 100_000_001):
        _write(run, step, keep=2)
    assert [p.name for p in step_dirs(run)] == ["step_100000000", "step_100000001"]
    _write(run, 100_000_002, keep=1)
    assert [p.name for p in step_dirs(run)] == ["step_100000002"]


def test_the_fallback_resume_takes_the_newest_step_of_any_width(tmp_path):
    run = tmp_path / "run"
    _write(run, 99_999_999)
    _write(run, 100_000_000)
    (run / "latest").unlink()  # (a crash before the first pointer of this process: the newest complete step)
    assert ckpt.resolve_checkpoint(run, note_as=None).parent.name == "step_100000000"
    assert ckpt.read_run_checkpoint(run)[3]["step"] == 100_000_000


def test_a_latest_naming_a_wide_step_is_followed(tmp_path):
    run = tmp_path / "run"
    _write(run, 100_000_000)
    _write(run, 5)  # (latest now names step_00000005; the wider step stays)
    assert ckpt.resolve_checkpoint(run).parent.name == "step_00000005"
    (run / "latest").write_text("step_100000000\n")
    assert ckpt.resolve_checkpoint(run).parent.name == "step_100000000"


def test_a_run_of_wide_steps_alone_is_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "step_100000000").mkdir(parents=True)
    assert is_run_dir(run)
    with pytest.raises(RunDirError, match="already holds a run"):
        check_out(run, resume=False)
