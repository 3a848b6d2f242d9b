"""What llmc reads back, it checks by type before it uses: config.json of Hugging Face GPT-2 and Llama directories,
llmc's Llama model metadata, a run's state.json, and the weights themselves (never NaN or inf). Each bad case is
one line naming the file and the field, exit 2, and nothing on disk changes. Ctrl-C is one line and exit 130."""

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from llmc_test_support import TINY, run

from llmc_cli.formats.checkpoint import CheckpointError, read_run_state
from llmc_cli.formats.llama_file import write_llama_model
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.safetensors import read_safetensors
from llmc_cli.formats.safetensors import read_safetensors_header
from llmc_cli.models.gpt2 import GPT2Config, init_parameters
from llmc_cli.models.llama3 import Llama3Config
from llmc_cli.models.llama3 import init_parameters as llama_init

GPT2_CFG = GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
LLAMA_CFG = Llama3Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, multiple_of=16,
                         ffn_dim_multiplier=None, rope_scaling=None)


def one_line(r, code=2):
    msg = r.output.strip()
    assert r.exit_code == code and msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    write_model(d / "g.bin", GPT2_CFG, init_parameters(GPT2_CFG, 0))
    run("convert", d / "g.bin", d / "gpt2")
    write_llama_model(d / "l.safetensors", LLAMA_CFG, llama_init(LLAMA_CFG, 0))
    run("convert", d / "l.safetensors", d / "llama")
    return d


GPT2_BAD = [("n_layer", "1"), ("n_layer", True), ("n_layer", 1.0), ("n_layer", 0), ("n_head", None), ("n_embd", -16),
            ("n_positions", 1.5), ("vocab_size", [300]), ("vocab_size", {"a": 1}), ("n_layer", "MISSING")]
LLAMA_BAD = [("num_hidden_layers", "1"), ("num_hidden_layers", False), ("hidden_size", 16.0),
             ("num_key_value_heads", 0), ("rope_theta", 0), ("rope_theta", -1.0), ("rope_theta", "1e4"),
             ("rope_theta", None), ("rms_norm_eps", 0.0), ("rms_norm_eps", "x"), ("tie_word_embeddings", "yes"),
             ("intermediate_size", 64.5), ("max_position_embeddings", -1), ("rope_scaling", "llama3"),
             ("rope_scaling", {"rope_type": "llama3", "factor": "8"}), ("rope_scaling", {"rope_type": "yarn"}),
             ("vocab_size", "MISSING")]


@pytest.mark.parametrize("family, field, value", [("gpt2", *c) for c in GPT2_BAD] + [("llama", *c) for c in LLAMA_BAD])
def test_config_json_field_types(hf_dirs, tmp_path, family, field, value):
    import shutil
    d = tmp_path / family
    shutil.copytree(hf_dirs / family, d)
    conf = json.loads((d / "config.json").read_text())
    if value == "MISSING":
        conf.pop(field)
    else:
        conf[field] = value
    (d / "config.json").write_text(json.dumps(conf))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for args in (["sample", "--backend", "cpu", "--checkpoint", d, "--max-new-tokens", 2],
                 ["eval", "--backend", "cpu", "--checkpoint", d, "--data", hf_dirs / "none*.bin"],
                 ["convert", d, tmp_path / "out.bin"]):
        msg = one_line(run(*args, ok=False))
        assert "config.json" in msg and (field in msg or "no field" in msg or "rope_scaling" in msg), msg
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before and not (tmp_path / "out.bin").exists()


def test_llmc_llama_metadata_field_types(tmp_path):
    from llmc_cli.formats.safetensors import write_safetensors
    params = llama_init(LLAMA_CFG, 0)
    good = tmp_path / "good.safetensors"
    write_llama_model(good, LLAMA_CFG, params)
    header, _ = read_safetensors_header(good)
    for field, value in (("n_layer", "1"), ("rope_theta", float("nan")), ("norm_eps", -1.0), ("tie_embeddings", 1)):
        conf = json.loads(header["__metadata__"]["config"]) | {field: value}
        bad = tmp_path / f"bad_{field}.safetensors"
        tensors = read_safetensors(good)
        write_safetensors(bad, tensors, "F32", header["__metadata__"] | {"config": json.dumps(conf)})
        msg = one_line(run("sample", "--backend", "cpu", "--checkpoint", bad, "--max-new-tokens", 1, ok=False))
        assert "bad Llama config" in msg and field in msg, msg


def test_nonfinite_weights_are_refused_everywhere(tmp_path, shards):
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64)  # (TINY's model: train's --model must name --init's)
    p = init_parameters(cfg, 0)
    p[[3, 99]] = [np.nan, np.inf]
    bad = tmp_path / "diverged.bin"
    write_model(bad, cfg, p)
    for args in (["sample", "--backend", "cpu", "--checkpoint", bad, "--max-new-tokens", 2],
                 ["eval", "--backend", "cpu", "--checkpoint", bad, "--data", shards / "*val*.bin"],
                 ["convert", bad, tmp_path / "x.bin"],
                 [*TINY[:-4], "--init", bad, "--data", shards / "*train*.bin", "--steps", 1]):
        msg = one_line(run(*args, ok=False))
        assert "2 of" in msg and "weights are NaN or inf" in msg and str(bad) in msg, msg


STATE_BAD = [("optimizer_steps", "x"), ("optimizer_steps", -1), ("tokens_per_step", 0), ("world_size", "2"),
             ("tokenizer", 5), ("family", None), ("config", []), ("outliers", {"loss": ["a"]}),
             ("outliers", {"bad_streak": True}), ("dataloader", {}), ("dataloader.B", "4"), ("dataloader.shuffle", 0),
             ("dataloader.shard_file", 7), ("dataloader.version", -1), ("step", "1"), ("args", []), ("rng", "x")]


@pytest.fixture(scope="module")
def one_step_run(shards, tmp_path_factory):
    """A run directory after one step: the state.json a resume reads, as the trainer writes it (tests that
    write copy it)."""
    rd = tmp_path_factory.mktemp("run") / "r"
    run(*TINY, "--data", shards / "*train*.bin", "--out", rd, "--steps", 1)
    return rd


def damage(state: dict, field: str, value) -> dict:
    """`state` with `field` ("outer.inner" for a nested one) set to `value`."""
    if "." in field:
        outer, inner = field.split(".")
        state[outer][inner] = value
    else:
        state[field] = value
    return state


@pytest.mark.parametrize("field, value", STATE_BAD, ids=[f"{f}={v!r}" for f, v in STATE_BAD])
def test_state_json_field_types(one_step_run, tmp_path, field, value):
    st = json.loads((one_step_run / "step_00000001" / "state.json").read_text())
    path = tmp_path / "state.json"
    path.write_text(json.dumps(damage(st, field, value)))
    with pytest.raises(CheckpointError) as e:
        read_run_state(path)
    msg = str(e.value)
    assert "state.json" in msg and "\n" not in msg and (field.split(".")[-1] in msg or "RNG" in msg), msg


@pytest.mark.parametrize("field, value", [("tokens_per_step", 0), ("dataloader.B", "4")])
def test_a_resume_from_a_damaged_state_json_is_one_line_and_changes_nothing(one_step_run, shards, tmp_path, field,
                                                                          value):
    rd = shutil.copytree(one_step_run, tmp_path / "r")
    args = [*TINY, "--data", shards / "*train*.bin", "--out", rd]
    path = rd / "step_00000001" / "state.json"
    path.write_text(json.dumps(damage(json.loads(path.read_text()), field, value)))
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    msg = one_line(run(*args, "--steps", 2, "--resume", ok=False))
    assert "state.json" in msg and field.split(".")[-1] in msg, msg
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before


def test_ctrl_c_is_one_line_and_exit_130(shards, tmp_path):
    write_model(tmp_path / "m.bin", GPT2_CFG, init_parameters(GPT2_CFG, 0))
    for args in (["sample", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--max-new-tokens", 10 ** 7,
                  "--temperature", 0],
                 ["eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--data", shards / "*train*.bin",
                  "-b", 1, "-t", 8]):
        p = subprocess.Popen([sys.executable, "-m", "llmc_cli", *map(str, args)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        if p.poll() is not None:  # eval of a tiny shard may finish first: nothing left to interrupt
            continue
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1].strip()
        assert p.returncode == 130 and err == "error: interrupted", err


def test_nonfinite_optimizer_state_is_refused_on_resume(one_step_run, shards, tmp_path):
    rd = shutil.copytree(one_step_run, tmp_path / "r")
    args = [*TINY, "--data", shards / "*train*.bin", "--out", rd]
    opt = rd / "step_00000001" / "optimizer.npz"
    z = dict(np.load(opt))
    z["v"][5] = np.inf
    with open(opt, "wb") as f:
        np.savez(f, **z)
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    msg = one_line(run(*args, "--steps", 2, "--resume", ok=False))
    assert "optimizer.npz ('v'): 1 of" in msg and "NaN or inf" in msg, msg
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before
