"""A checkpoint proves what it holds: each step folder's manifest.json (written last) binds its files to the run and
the step, and every reader of a step (resume: read_run_checkpoint; sample, eval, convert and --init:
load_model_any) names the file that disagrees. Was: a state.json, model or optimizer state from another step or run,
swapped step folders or a GPT-2 model in a Llama run's step were loaded without a word."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats import manifest as mf
from llmc_cli.formats.shards import write_shard
from llmc_cli.formats.sources import export_run, load_model_any
from llmc_cli.models import gpt2, llama3

GPT = gpt2.GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
LLAMA = llama3.Llama3Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                            multiple_of=16, ffn_dim_multiplier=None, rope_scaling=None)


def _state(step: int, seed: int) -> dict:
    return {"version": 1, "step": step, "args": {"seed": seed}, "rng": np.random.default_rng(seed).bit_generator.state,
            "dataloader": {"version": 1, "epoch": 0, "shard": 0, "sample": step * 4}, "family": "gpt2",
            "backend_state": {}}


def _run(path, cfg=GPT, seed=0, steps=(1, 2)):
    mod = gpt2 if cfg is GPT else llama3
    n = mod.num_parameters(cfg)
    for step in steps:
        opt = {"m": np.full(n, step, np.float32), "v": np.full(n, seed + step, np.float32)}
        state = _state(step, seed) | {"family": "gpt2" if cfg is GPT else "llama3"}
        ckpt.write_run_checkpoint(path, step, cfg, mod.init_parameters(cfg, seed * 10 + step), False, opt, state)
    return path


@pytest.fixture
def runs(tmp_path):
    return _run(tmp_path / "a"), _run(tmp_path / "b", seed=1), _run(tmp_path / "llama", LLAMA)


def _copy(runs, src_run, src, dst):
    shutil.copy2(runs[src_run] / src, runs[0] / dst)


def _swap_steps(runs):
    a = runs[0]
    (a / "step_00000001").rename(a / "x")
    (a / "step_00000002").rename(a / "step_00000001")
    (a / "x").rename(a / "step_00000002")


def _step_of_another_run(runs):
    shutil.rmtree(runs[0] / "step_00000002")
    shutil.copytree(runs[1] / "step_00000002", runs[0] / "step_00000002")


def _gpt2_into_llama(runs):
    shutil.copy2(runs[0] / "step_00000002" / "model.bin", runs[2] / "step_00000002" / "model.bin")


def _tamper_state_in_place(runs):
    p = runs[0] / "step_00000002" / "state.json"
    s = json.loads(p.read_text())
    s["dataloader"]["sample"] = 0  # (the data position of another step: a resume would read other batches)
    p.write_text(json.dumps(s))


# (what is done to run a's step 2 (or the Llama run's), the run read, the file the one line names, what it says)
CASES = [
    ("state-of-another-step", lambda r: _copy(r, 0, "step_00000001/state.json", "step_00000002/state.json"), 0,
     "step_00000002/state.json", "another step's or run's state"),
    ("state-of-another-run", lambda r: _copy(r, 1, "step_00000002/state.json", "step_00000002/state.json"), 0,
     "step_00000002/state.json", "another step's or run's state"),
    ("state-position-edited", _tamper_state_in_place, 0, "step_00000002/state.json", "data position"),
    ("model-of-another-step", lambda r: _copy(r, 0, "step_00000001/model.bin", "step_00000002/model.bin"), 0,
     "step_00000002/model.bin", "differs from what step 2's manifest.json records"),
    ("model-of-another-run", lambda r: _copy(r, 1, "step_00000002/model.bin", "step_00000002/model.bin"), 0,
     "step_00000002/model.bin", "differs"),
    ("optimizer-of-another-step",
     lambda r: _copy(r, 0, "step_00000001/optimizer.npz", "step_00000002/optimizer.npz"), 0,
     "step_00000002/optimizer.npz", "differs"),
    ("swapped-steps", _swap_steps, 0, "step_00000002/manifest.json", "records step 1, but its folder is step_00000002"),
    ("step-of-another-run", _step_of_another_run, 0, "step_00000002/manifest.json", "a step folder of another run"),
    ("gpt2-model-in-a-llama-step", _gpt2_into_llama, 2, "step_00000002/model.bin", "not in its step's manifest.json"),
]


@pytest.mark.parametrize("name,damage,which,file,says", CASES, ids=[c[0] for c in CASES])
def test_every_reader_names_the_file_that_disagrees(runs, name, damage, which, file, says):
    damage(runs)
    run = runs[which]
    readers = [ckpt.read_run_checkpoint]
    if "state" not in name and "optimizer" not in name:  # (a model alone is what sample, eval, convert, --init read)
        readers.append(load_model_any)
    for read in readers:
        with pytest.raises(ckpt.CheckpointError) as e:
            read(run)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(run / file)) and says in msg, msg


def test_an_untouched_run_loads_and_a_step_without_a_manifest_still_does(runs):
    a = runs[0]
    assert ckpt.read_run_checkpoint(a)[3]["step"] == 2
    assert load_model_any(a)[2] == "run"
    assert load_model_any(runs[2])[0] == LLAMA
    (a / "step_00000002" / "manifest.json").unlink()  # (a step written before manifests: loads as it did)
    _copy(runs, 0, "step_00000001/model.bin", "step_00000002/model.bin")
    assert ckpt.read_run_checkpoint(a)[3]["step"] == 2


def test_a_state_edited_in_place_keeps_its_readers_message(runs):
    """The manifest binds the state's identity, not its bytes: a damaged backend_state is its reader's to name."""
    p = runs[0] / "step_00000002" / "state.json"
    s = json.loads(p.read_text())
    s["backend_state"] = {"history": [1]}
    s["args"]["steps"] = 10**30  # (a recorded option: the command line may override it on resume)
    p.write_text(json.dumps(s))
    assert ckpt.read_run_checkpoint(runs[0])[3]["backend_state"] == {"history": [1]}


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'{"version": 1, "step": 2}', b"\xff" * 100])
def test_a_manifest_llmc_cannot_read_is_one_line(runs, raw):
    (runs[0] / "step_00000002" / "manifest.json").write_bytes(raw)
    with pytest.raises(ckpt.CheckpointError, match="manifest.json: not a step manifest llmc can read"):
        ckpt.read_run_checkpoint(runs[0])


def test_the_run_id_is_kept_and_recovered(runs):
    a = runs[0]
    ident = (a / mf.RUN_ID_FILE).read_text().strip()
    assert json.loads((a / "step_00000001" / "manifest.json").read_text())["run_id"] == ident
    (a / mf.RUN_ID_FILE).unlink()  # (lost: the next checkpoint takes the id its steps record)
    _run(a, steps=(3,))
    assert (a / mf.RUN_ID_FILE).read_text().strip() == ident
    assert ckpt.read_run_checkpoint(a / "step_00000001")[3]["step"] == 1


def test_the_manifest_is_written_last_and_lists_every_file(runs):
    body = json.loads((runs[0] / "step_00000002" / "manifest.json").read_text())
    assert (body["step"], body["family"], body["data"]) == (2, "gpt2", None)
    assert sorted(body["files"]) == ["model.bin", "optimizer.npz", "state.json"]
    for name, want in body["files"].items():
        assert mf.file_digest(runs[0] / "step_00000002" / name) == want


def test_each_file_is_digested_once_per_process_and_a_float32_bin_not_read_twice(runs, monkeypatch):
    calls = []
    real = mf.file_digest
    monkeypatch.setattr(mf, "file_digest", lambda p: calls.append(p.name) or real(p))
    mf._VERIFIED.clear()
    for _ in range(3):
        load_model_any(runs[0])  # (a float32 .bin: its CRC is taken from the bytes just read)
        ckpt.read_run_checkpoint(runs[0])
        load_model_any(runs[2])  # (a Llama's model.safetensors: read once more, in chunks)
    assert sorted(calls) == ["model.safetensors", "optimizer.npz"]


def test_the_digest_of_the_bytes_read_is_the_files(runs):
    model = runs[0] / "step_00000002" / "model.bin"
    params = ckpt.read_model_file(model)[1]
    assert ckpt.held_model_digest(model, params) == {"model.bin": mf.file_digest(model)}
    llama = runs[2] / "step_00000002" / "model.safetensors"
    assert ckpt.held_model_digest(llama, ckpt.read_model_file(llama)[1]) == {}


def test_an_exported_run_has_a_manifest(tmp_path):
    out = export_run(tmp_path / "x", GPT, gpt2.init_parameters(GPT, 0))
    assert json.loads((out / "step_00000000" / "manifest.json").read_text())["step"] == 0
    assert load_model_any(out)[0] == GPT


def test_the_writer_records_the_data_fingerprint(tmp_path):
    write_shard(tmp_path / "d" / "t_train_000001.bin", np.arange(1000) % 300)
    fp = mf.data_fingerprint([tmp_path / "d" / "t_train_000001.bin"])
    n = gpt2.num_parameters(GPT)
    ckpt.write_run_checkpoint(tmp_path / "r", 1, GPT, gpt2.init_parameters(GPT, 0), False,
                              {"m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32)}, _state(1, 0),
                              data_fingerprint=fp)
    assert mf.step_manifest(tmp_path / "r" / "step_00000001")["data"] == fp


def _shards(folder, tokens_by_name):
    return [write_shard(folder / name, tokens) for name, tokens in tokens_by_name.items()]


# (the shards now, what data_differences says: None = the same data)
BASE = {"t_train_000001.bin": np.arange(5000) % 300, "t_train_000002.bin": np.arange(3000) % 200}
DATA = [
    ("same", dict(BASE), None),
    ("retokenized-same-size", BASE | {"t_train_000002.bin": (np.arange(3000) * 7) % 200},
     "t_train_000002.bin holds other tokens"),
    ("longer", BASE | {"t_train_000001.bin": np.arange(5001) % 300}, "t_train_000001.bin is"),
    ("one-missing", {"t_train_000001.bin": BASE["t_train_000001.bin"]}, "t_train_000002.bin (which the run read)"),
    ("one-more", BASE | {"t_train_000003.bin": np.arange(10)}, "t_train_000003.bin is not among"),
]


@pytest.mark.parametrize("name,now,says", DATA, ids=[d[0] for d in DATA])
def test_data_differences(tmp_path, name, now, says):
    was = mf.data_fingerprint(_shards(tmp_path / "was", BASE))
    diff = mf.data_differences(was, mf.data_fingerprint(_shards(tmp_path / "now", now)))
    assert diff is None if says is None else says in diff, diff


def test_a_tokenize_manifest_written_again_is_a_difference(tmp_path):
    shards = _shards(tmp_path, BASE)
    (tmp_path / "t_manifest.json").write_text('{"complete": true, "files": ["a.txt"]}')
    was = mf.data_fingerprint(shards)
    (tmp_path / "t_manifest.json").write_text('{"complete": true, "files": ["b.txt"]}')
    assert "t_manifest.json differs" in mf.data_differences(was, mf.data_fingerprint(shards))
    assert mf.data_differences(None, was) is None  # (a run that recorded none: nothing to compare)
