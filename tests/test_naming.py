"""Errors of the layers below the commands name a setting as their caller spells it (llmc_cli.naming): the flag
under an `llmc` command, the Python argument for `llmc.Trainer`, `load_model` and the rest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmc_cli import naming
from llmc_cli.data.tokenizer import TokenizerError, load_tokenizer
from llmc_cli.formats.checkpoint import CheckpointError
from llmc_cli.formats.convert import check_destination_name
from llmc_cli.formats.rundir import RunDirError, check_out
from llmc_cli.kernels import CommError
from llmc_cli.models.base import check_recompute
from llmc_cli.parallel.rendezvous import share_tcp
from llmc_cli.training.args import TrainError, check_seq_len


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "step_00000002").mkdir(parents=True)
    (run / "latest").write_text("step_00000002\n")
    return run


CASES = [  # (what raises, the error, what the command line reads, what a Python caller reads)
    (lambda t: check_out(_run_dir(t), resume=False), RunDirError,
     "already holds a run (checkpoints up to step_00000002); add --resume to continue it, or give another --out",
     "already holds a run (checkpoints up to step_00000002); add resume=True to continue it, or give another out"),
    (lambda t: check_out(t / "new", resume=True), RunDirError,
     "--resume: --out ", "resume=True: out "),
    (lambda t: check_seq_len(128, SimpleNamespace(block_size=64)), TrainError,
     "-t 128 is longer than the model's block size 64", "seq_len=128 is longer than the model's block size 64"),
    (lambda t: check_recompute("all"), ValueError, "--recompute must be one of", "recompute must be one of"),
    (lambda t: share_tcp(None, 0, 2, "nohost", 1.0), CommError,
     "--init-addr 'nohost': expected HOST:PORT", "init_addr 'nohost': expected HOST:PORT"),
    (lambda t: check_destination_name(t / "m.bin", "run"), CheckpointError,
     "--to run writes a run directory", "to='run' writes a run directory"),
    (lambda t: load_tokenizer("bytes", str(t / "ranks")), TokenizerError,
     "leave out --tokenizer-path", "leave out tokenizer_path"),
]


@pytest.mark.parametrize("make, error, cli, python", CASES)
def test_an_error_names_the_setting_as_its_caller_spells_it(tmp_path, make, error, cli, python):
    with naming.flags(), pytest.raises(error) as e:
        make(tmp_path / "cli")
    assert cli in str(e.value), str(e.value)
    with pytest.raises(error) as e:
        make(tmp_path / "python")
    assert python in str(e.value) and "--" not in str(e.value), str(e.value)


def test_the_spellings():
    assert [naming.flag_name(*a) for a in (("seq_len",), ("zero", 2), ("resume", True), ("graphs", False))] == [
        "-t", "--zero 2", "--resume", "--no-graphs"]
    assert [naming.python_name(*a) for a in (("seq_len",), ("zero", 2), ("resume", True), ("to", "run"))] == [
        "seq_len", "zero=2", "resume=True", "to='run'"]
    assert naming.arg_both("batch_size") == "batch_size"
    with naming.flags():
        assert naming.arg_both("batch_size") == "-b/--batch-size" and naming.arg("n_embd") == "--n-embd"
        assert naming.arg("batch_size", short=False) == "--batch-size"
    assert naming.arg("n_embd") == "n_embd"  # (restored on the way out: a command run in process leaves no trace)
