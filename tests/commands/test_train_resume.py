"""`llmc train --out RUN --resume` is the run it continues: every option the run recorded comes back (the backend,
its device, options and dtype from RUN/config.toml, the rest from the checkpoint), its shards are the same from any
working directory, and the command a run prints to resume it is enough on its own."""

from __future__ import annotations

import json
import shlex

import click
import numpy as np
import pytest
from llmc_test_support import last_line_error, losses, run

from llmc_cli.commands.main import main
from llmc_cli.commands.resume import resume_command
from llmc_cli.commands.train import train
from llmc_cli.formats.shards import write_shard

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

MODEL = ["--model", "d2", "--n-embd", "64", "-b", "2", "-t", "32", "--val-every", "0", "--sample-every", "0"]
CPU = ["--backend", "cpu", "--dtype", "fp32", "--backend-opt", "threads=1"]


def _shards(folder, seed: int) -> None:
    rng = np.random.default_rng(seed)
    write_shard(folder / "x_val_000000.bin", rng.integers(0, 50257, 2048))
    write_shard(folder / "x_train_000001.bin", rng.integers(0, 50257, 4096))


def _recorded(out) -> dict:
    return tomllib.loads((out / "config.toml").read_text())


def test_a_plain_resume_from_another_directory_is_the_run_it_continues(tmp_path, monkeypatch):
    """Started in one directory with a relative --data; resumed from another whose own data/ holds other shards
    under the same names: the backend, its options and dtype come back, and the resumed steps read the run's shards
    (the losses are those of the run trained straight through)."""
    (tmp_path / "data").mkdir()
    _shards(tmp_path / "data", seed=0)
    other = tmp_path / "elsewhere"
    (other / "data").mkdir(parents=True)
    _shards(other / "data", seed=1)
    out, straight = tmp_path / "run", tmp_path / "straight"
    monkeypatch.chdir(tmp_path)
    run("train", *CPU, *MODEL, "--data", "data", "--steps", 1, "--out", out)
    run("train", *CPU, *MODEL, "--data", "data", "--steps", 3, "--out", straight)
    first = _recorded(out)
    assert first["data"] == str(tmp_path / "data"), first  # recorded absolute
    monkeypatch.chdir(other)
    r = run("train", "--out", out, "--resume", "--steps", 3)
    assert "--backend cpu" in r.output and "--dtype fp32" in r.output and "--backend-opt threads=1" in r.output, r.output
    after = _recorded(out)
    for key in ("backend", "dtype", "backend-opt", "data", "model", "n-embd", "batch-size", "seq-len"):
        assert after[key] == first[key], (key, after, first)
    assert json.loads((out / "step_00000003" / "state.json").read_text())["args"]["data"] == str(tmp_path / "data")
    assert losses(out / "log.jsonl") == losses(straight / "log.jsonl")


def test_the_resume_line_of_a_config_run_continues_it_on_its_backend(tmp_path):
    """A run whose options came from --config (backend, dtype, --out among them): the command it prints to resume it
    names the run directory, and following it keeps every option the run had."""
    data = tmp_path / "data"
    data.mkdir()
    _shards(data, seed=0)
    out = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'backend = "cpu"\ndtype = "fp32"\nbackend-opt = ["threads=1"]\nout = "{out}"\n'
                   f'data = "{data}"\nmodel = "d2"\nn-embd = 64\nbatch-size = 2\nseq-len = 32\nval-every = 0\n'
                   'sample-every = 0\nsteps = 1\n')
    run("train", "--config", cfg)
    with train.make_context("train", ["--config", str(cfg), "--steps", "2"],
                            parent=click.Context(main, info_name="llmc")) as ctx:
        line = resume_command(ctx)
    assert line == shlex.join(["llmc", "train", "--steps", "2", "--out", str(out), "--resume"]), line
    before = _recorded(out)
    r = run(*shlex.split(line)[1:])
    assert "--backend cpu" in r.output, r.output
    assert (out / "latest").read_text().strip() == "step_00000002"
    after = _recorded(out)
    assert {k: after[k] for k in ("backend", "dtype", "backend-opt")} == {"backend": "cpu", "dtype": "fp32",
                                                                          "backend-opt": ["threads=1"]}
    assert after["data"] == before["data"] == str(data)


@pytest.mark.parametrize("line, key, flag", [
    ('dtype = "fp64"\n', "dtype", "--dtype"),
    ("backend-opt = 5\n", "backend_opt", "--backend-opt"),
    ("backend = [1]\n", "backend", "--backend"),
])
def test_a_damaged_config_toml_is_one_line_and_a_flag_overrides_it(tmp_path, line, key, flag):
    data = tmp_path / "data"
    data.mkdir()
    _shards(data, seed=0)
    out = tmp_path / "run"
    run("train", *CPU, *MODEL, "--data", data, "--steps", 1, "--out", out)
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text("".join(x for x in text.splitlines(keepends=True)
                                             if not x.startswith(flag[2:] + " ")) + line)
    last_line_error(run("train", "--out", out, "--resume", "--steps", 2, ok=False), "--resume:", "config.toml",
                    f"its recorded {key}", f"give {flag} to override it")
    value = {"--dtype": "fp32", "--backend-opt": "threads=1", "--backend": "cpu"}[flag]
    run("train", "--out", out, "--resume", "--steps", 2, flag, value)
    assert (out / "latest").read_text().strip() == "step_00000002"
