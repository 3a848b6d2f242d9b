"""Readers of a live run take one consistent step: resolved once and held while it is read; where `train --keep`
removed it meanwhile, resolved afresh and read once more, then one line. Was: 1 read in ~1,400 refused, and a
TypeError traceback (a step checked, then gone, then its model file taken as None)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats import sources
from llmc_cli.inference.loading import load_model
from llmc_cli.models.gpt2 import GPT2Config, init_parameters, num_parameters
from llmc_cli.registry import create_backend

CFG = GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
N = num_parameters(CFG)


def _write(run, step: int, keep: int = 1):
    state = {"version": 1, "step": step, "args": {}, "rng": np.random.default_rng(0).bit_generator.state,
             "dataloader": {"version": 1, "epoch": 0, "shard": 0, "sample": step}, "family": "gpt2"}
    opt = {"m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32)}
    ckpt.write_run_checkpoint(run, step, CFG, init_parameters(CFG, step), False, opt, state, keep=keep)


# (reader, what it gives back for a run at `step`)
READERS = [
    ("load_model_any", sources.load_model_any, lambda r, step: r[1][0] == init_parameters(CFG, step)[0]),
    ("load_config_any", sources.load_config_any, lambda r, step: r == CFG),
    ("tokenizer_name_for", sources.tokenizer_name_for, lambda r, step: r == "gpt2"),
    ("read_run_checkpoint", ckpt.read_run_checkpoint, lambda r, step: r[3]["step"] == step),
    ("load_model_and_tokenizer_name", sources.load_model_and_tokenizer_name,
     lambda r, step: r[1][0] == init_parameters(CFG, step)[0] and r[2] == "gpt2"),
    ("load_model", lambda p: load_model(p, create_backend("cpu"), 1, 8),
     lambda r, step: r.tokenizer == "gpt2"),
]


def _pruned_while_read(monkeypatch, run, times: int):
    """The run moves on (a new step written, the one before removed by --keep 1) after each of the first `times`
    resolutions, before the reader opens what was resolved."""
    real = ckpt.resolve_checkpoint
    step = [3]

    def resolve(path, note_as="using"):
        model = real(path, note_as)
        if step[0] < 3 + times:
            step[0] += 1
            _write(run, step[0])
        return model
    monkeypatch.setattr(ckpt, "resolve_checkpoint", resolve)
    return step


@pytest.mark.parametrize("name,read,check", READERS, ids=[r[0] for r in READERS])
def test_a_step_removed_while_it_is_read_is_read_again_from_the_newest(tmp_path, monkeypatch, name, read, check):
    run = tmp_path / "run"
    _write(run, 3)
    step = _pruned_while_read(monkeypatch, run, 1)
    assert check(read(run), 4) and step == [4]


# (tokenizer_name_for reads nothing of a GPT-2's file: llm.c files are GPT-2's by their name alone)
@pytest.mark.parametrize("name,read,check", [r for r in READERS if r[0] != "tokenizer_name_for"],
                         ids=[r[0] for r in READERS if r[0] != "tokenizer_name_for"])
def test_a_step_removed_twice_is_one_line(tmp_path, monkeypatch, name, read, check):
    run = tmp_path / "run"
    _write(run, 3)
    _pruned_while_read(monkeypatch, run, 2)
    with pytest.raises(ckpt.CheckpointError) as e:
        read(run)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{run}: step_00000004 was removed while it was read"), msg


def test_a_model_file_given_by_name_keeps_its_own_error(tmp_path):
    run = tmp_path / "run"
    _write(run, 3)
    model = run / "step_00000003" / "model.bin"
    model.write_bytes(model.read_bytes()[:2000])
    with pytest.raises(ckpt.CheckpointError, match="bytes, expected"):
        sources.load_model_any(model)


def test_readers_beside_a_pruning_writer_never_fail_otherwise(tmp_path):
    """Whatever the interleaving, a read gives a step's model or one CheckpointError line, never another error."""
    run = tmp_path / "run"
    _write(run, 1)
    stop = threading.Event()

    def writer():
        step = 2
        while not stop.is_set():
            _write(run, step)
            step += 1
    t = threading.Thread(target=writer)
    t.start()
    odd = []
    try:
        for _ in range(100):
            for read in (sources.load_model_any, sources.load_config_any, ckpt.read_run_checkpoint):
                try:
                    read(run)
                except ckpt.CheckpointError as e:
                    if "\n" in str(e) or "removed while it was read" not in str(e):
                        odd.append(str(e))
                except Exception as e:  # noqa: BLE001 (what is being tested: nothing else ever escapes)
                    odd.append(f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        t.join()
    assert odd == []
