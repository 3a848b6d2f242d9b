"""LLMC_STEP_PHASES=DIR: one JSON line a step in DIR/rank<r>.jsonl whose phases add up to the step's time, the
same bits trained as without it, and the summary `bench/step_phases.py` prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc_cli.formats.shards import write_shard
from llmc_cli.training.phases import ENV
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("phases")
    write_shard(d / "ph_train_000.bin", np.random.default_rng(3).integers(0, 50257, 40 * 64 + 1))
    return d


def train(data, **kw):
    from llmc_cpu import CpuBackend
    a = TrainArgs(**({"data": str(data / "*train*.bin"), "model": "d2", "n_embd": 64, "batch_size": 2, "seq_len": 32,
                      "steps": 4, "val_every": 0, "sample_every": 0, "total_batch_size": 128} | kw))
    tr = Trainer(a, CpuBackend(), say=lambda s: None)
    try:
        recs = tr.run()
        return recs, tr.model.parameters_host()
    finally:
        tr.close()


def test_phases_add_up_and_change_nothing(data, tmp_path, monkeypatch):
    plain_recs, plain = train(data)
    monkeypatch.setenv(ENV, str(tmp_path / "ph"))
    recs, params = train(data)
    np.testing.assert_array_equal(params, plain)
    assert [r["loss"] for r in recs] == [r["loss"] for r in plain_recs]
    lines = [json.loads(x) for x in (tmp_path / "ph" / "rank0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    for x, r in zip(lines, recs):
        assert list(x["device_ms"]) == ["stage", "compute", "reduce", "guard", "adamw", "gather"]
        assert all(v >= 0 for v in x["device_ms"].values())
        assert sum(x["device_ms"].values()) == pytest.approx(x["ms"], abs=0.01)
        assert x["ms"] == pytest.approx(r["ms"], abs=1e-3)
        assert x["device_ms"]["compute"] > 0
    assert lines[0]["gap_ms"] is None and all(x["gap_ms"] >= 0 for x in lines[1:])
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "step_phases.py"), str(tmp_path / "ph"), "--skip", "1",
                          "--json"], capture_output=True, text=True, check=True).stdout
    s = json.loads(out)["ph/rank0"]
    assert s["steps"] == 3 and set(s["device_ms"]) == set(lines[0]["device_ms"])


def test_a_path_that_is_a_file_is_one_line(data, tmp_path, monkeypatch):
    """LLMC_STEP_PHASES naming a file (or a path under one): the run stops before its first step with one line
    naming the variable, and the file is left as it was."""
    from llmc_cli.training.args import TrainError
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    for where in (f, f / "sub"):
        monkeypatch.setenv(ENV, str(where))
        with pytest.raises(TrainError, match=f"{ENV}=.*cannot write the step phases there"):
            train(data)
    assert f.read_text() == "mine\n"
