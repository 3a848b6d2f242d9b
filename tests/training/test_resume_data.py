"""A resume reads the data the run read: its shards' fingerprint is recorded in each checkpoint and checked when
the run continues; shards whose tokenize run did not finish are refused before a run starts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import write_shard
from llmc_cli.registry import create_backend
from llmc_cli.training.args import TrainArgs, TrainError
from llmc_cli.training.trainer import Trainer

SHAPE = dict(model="d2", n_embd=64, batch_size=2, seq_len=32, val_every=0, sample_every=0)


def _shards(folder, seed: int, n: int = 4096) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / "x_train_000001.bin", np.random.default_rng(seed).integers(0, 50257, n))
    return str(folder / "*train*.bin")


def _train(data: str, out, steps: int, resume: bool = False) -> Trainer:
    tr = Trainer(TrainArgs(data=data, out=str(out) if out else None, steps=steps, resume=resume, **SHAPE), create_backend("cpu"),
                 say=lambda _: None)
    try:
        tr.run()
    finally:
        tr.close()
    return tr


def _refused(data: str, out, *needles) -> str:
    with pytest.raises(TrainError) as e:
        _train(data, out, 3, resume=True)
    text = str(e.value)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


def test_the_checkpoint_records_the_shards_fingerprint(tmp_path):
    data = _shards(tmp_path / "data", seed=0)
    _train(data, tmp_path / "run", 1)
    state = json.loads((tmp_path / "run" / "step_00000001" / "state.json").read_text())
    (shard,) = state["data_fingerprint"]["shards"]
    assert shard["name"] == "x_train_000001.bin" and shard["size"] > 0 and len(shard["sha256"]) == 64
    manifest = json.loads((tmp_path / "run" / "step_00000001" / "manifest.json").read_text())
    assert manifest["data"] == state["data_fingerprint"]


@pytest.mark.parametrize("change, needles", [
    ("retokenized", ("resume=True", ": data: x_train_000001.bin", "other tokens")),  # same name and size, other text
    ("longer", ("resume=True", ": data: x_train_000001.bin", "bytes")),
    ("renamed", ("resume=True", "data", "x_train_000002.bin")),  # (named by the data setup's own check)
])
def test_a_resume_on_other_shards_is_refused_naming_data(tmp_path, change, needles):
    data = _shards(tmp_path / "data", seed=0)
    out = tmp_path / "run"
    _train(data, out, 1)
    before = sorted(p.name for p in out.iterdir())
    shard = tmp_path / "data" / "x_train_000001.bin"
    if change == "retokenized":
        _shards(tmp_path / "data", seed=1)
    elif change == "longer":
        _shards(tmp_path / "data", seed=0, n=8192)
    else:
        shard.rename(tmp_path / "data" / "x_train_000002.bin")
    _refused(data, out, *needles)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written


def test_a_resume_on_the_same_shards_continues(tmp_path):
    data = _shards(tmp_path / "data", seed=0)
    _train(data, tmp_path / "run", 1)
    assert _train(data, tmp_path / "run", 2, resume=True).saved == 2


def test_a_checkpoint_without_a_fingerprint_still_resumes(tmp_path):
    """Steps written before checkpoints carried the data's fingerprint have nothing to compare: they resume."""
    data = _shards(tmp_path / "data", seed=0)
    out = tmp_path / "run"
    _train(data, out, 1)
    for name in ("state.json", "manifest.json"):
        p = out / "step_00000001" / name
        d = json.loads(p.read_text())
        d.pop("data_fingerprint" if name == "state.json" else "data", None)
        p.write_text(json.dumps(d))
    (out / "step_00000001" / "manifest.json").unlink()  # (a step from before manifests)
    assert _train(data, out, 2, resume=True).saved == 2


@pytest.mark.parametrize("complete, refused", [(False, True), (True, False)])
def test_shards_of_an_unfinished_tokenize_run_are_refused(tmp_path, complete, refused):
    data = _shards(tmp_path / "data", seed=0)
    (tmp_path / "data" / "x_manifest.json").write_text(json.dumps({"complete": complete, "shards": []}))
    if refused:
        with pytest.raises(DataError) as e:  # (as a missing or damaged shard is)
            _train(data, None, 1)
        assert str(e.value).startswith("data: ") and "x_manifest.json" in str(e.value) and "llmc tokenize" in str(e.value)
    else:
        _train(data, None, 1)
