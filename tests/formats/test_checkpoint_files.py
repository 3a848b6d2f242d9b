"""Checkpoint and model files against their readers: state.json numbers that parse but that numpy or
Python refuse later (an RNG state past 128 bits, counts past int64, integers of 5000 digits), an optimizer.npz whose
.npy header claims more values than it holds, Adam's second moment below zero, a step folder holding a directory or
a FIFO where a file belongs, a run state of another family than the model beside it, Hugging Face configs asking for
what llmc's models do not compute (GELU or biases in a Llama, another layernorm epsilon in a GPT-2, unknown
tokenizers, rope factors that divide by zero), safetensors shapes no array can have and layer numbers of thousands
of digits. Each is one line naming the file, before any large allocation."""

import io
import json
import os
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats import hf_gpt2, hf_llama3
from llmc_cli.formats.hf import check_layer_count
from llmc_cli.formats.safetensors import read_safetensors
from llmc_cli.models.gpt2 import GPT2Config, init_parameters, num_parameters

CFG = GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
N = num_parameters(CFG)


def _state(**edits) -> dict:
    s = {"version": 1, "step": 1, "args": {}, "rng": np.random.default_rng(0).bit_generator.state,
         "dataloader": {"version": 1, "epoch": 0, "shard": 0, "sample": 0}, "family": "gpt2"}
    s.update(edits)
    return s


def _run_dir(tmp_path, state: dict | None = None, optimizer: dict | None = None):
    out = tmp_path / "run"
    opt = optimizer if optimizer is not None else {"m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32)}
    ckpt.write_run_checkpoint(out, 1, CFG, init_parameters(CFG, 0), False, opt, state or _state())
    return out, out / "step_00000001"


def _refused(fn, *needles) -> str:
    with pytest.raises(ckpt.CheckpointError) as e:
        fn()
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def _rng(state: int) -> dict:
    r = np.random.default_rng(0).bit_generator.state
    r["state"]["state"] = state
    return r


@pytest.mark.parametrize("raw, needle", [
    (json.dumps(_state(rng=_rng(-1))), "'rng'"),  # numpy: OverflowError (not a ValueError) on resume
    (json.dumps(_state(rng=_rng(2**200))), "'rng'"),
    (json.dumps(_state(optimizer_steps=10**400)), "'optimizer_steps'"),  # int -> float overflow in the schedule
    (json.dumps(_state(step=10**30)), "step 1000000000000000000000000000000 is out of range"),
    (json.dumps(_state()).replace('"step": 1', '"step": 1' + "0" * 5000), "not valid JSON"),  # past int()'s limit
    (json.dumps(_state(version=True)), "version True"),  # (True == 1)
], ids=["rng-negative", "rng-200-bits", "optimizer-steps-huge", "step-huge", "5000-digits", "version-true"])
def test_state_json_values_that_parse_but_break_later(tmp_path, raw, needle):
    p = tmp_path / "state.json"
    p.write_text(raw)
    _refused(lambda: ckpt.read_run_state(p), str(p), needle)


def test_resume_with_an_rng_state_past_128_bits_is_one_line(tmp_path, shards):
    """Was a traceback: OverflowError from numpy's PCG64 state setter, which the trainer's except did not name."""
    out, _ = _run_dir(tmp_path, _state(rng=_rng(2**200)))
    r = run("train", "--backend", "cpu", "--resume", "--out", out, "--data", shards, "--steps", 3, ok=False)
    one_line_error(r, "state.json", "'rng'")


def _npz(path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _npy_header_only(shape: tuple) -> bytes:
    """An .npy header claiming `shape` float32 values, and no data."""
    h = "{'descr': '<f4', 'fortran_order': False, 'shape': %r, }" % (shape,)
    h += " " * (-(10 + len(h) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode()


def test_npy_header_claiming_more_values_is_refused_before_allocating(tmp_path):
    """np.load allocated what the header claimed (here 1 GiB; a few bytes can claim terabytes) and only then found
    the data missing."""
    p = tmp_path / "optimizer.npz"
    _npz(p, {"m.npy": _npy_header_only((2**28,)), "v.npy": _npy(np.zeros(N, np.float32))})
    tracemalloc.start()
    try:
        _refused(lambda: ckpt.read_optimizer_state(p, N), str(p), "'m' has 268435456 values")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_npz_with_an_array_twice_or_short_is_refused(tmp_path):
    p = tmp_path / "optimizer.npz"
    zeros = _npy(np.zeros(N, np.float32))
    with pytest.warns(UserWarning, match="Duplicate name"):  # (zipfile's own, as it writes the second)
        with zipfile.ZipFile(p, "w") as zf:
            for name in ("m.npy", "v.npy", "m.npy"):
                zf.writestr(name, zeros)
    _refused(lambda: ckpt.read_optimizer_state(p, N), "'m.npy' is in the archive twice")
    _npz(p, {"m.npy": _npy_header_only((N,)), "v.npy": zeros})
    _refused(lambda: ckpt.read_optimizer_state(p, N), "'m.npy' holds less data")


def test_negative_second_moment_is_refused_on_load(tmp_path):
    """Was loaded: the first step's sqrt(v) made every weight NaN, found only when its checkpoint was refused."""
    p = tmp_path / "optimizer.npz"
    np.savez(p, m=np.zeros(N, np.float32), v=np.full(N, -1.0, np.float32))
    _refused(lambda: ckpt.read_optimizer_state(p, N), str(p), "of 'v' (Adam's second moment) are negative")


@pytest.mark.parametrize("what", ["a directory", "a FIFO"])
def test_step_folder_with_no_regular_file_names_what_is_there(tmp_path, what):
    """Was 'missing' for a directory or a FIFO where optimizer.npz belongs."""
    out, step = _run_dir(tmp_path)
    (step / "optimizer.npz").unlink()
    if what == "a directory":
        (step / "optimizer.npz").mkdir()
    else:
        os.mkfifo(step / "optimizer.npz")
    _refused(lambda: ckpt.read_run_checkpoint(out), "optimizer.npz", f"{what} where a file belongs")


def test_run_state_of_another_family_than_its_model(tmp_path):
    out, _ = _run_dir(tmp_path, _state(family="llama3"))
    _refused(lambda: ckpt.read_run_checkpoint(out), "state.json", "'family' is 'llama3'", "GPT-2 model")


LLAMA = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 48, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300, "max_position_embeddings": 32,
         "rope_theta": 500000.0, "rope_scaling": None}
GPT2 = {"model_type": "gpt2", "n_positions": 32, "vocab_size": 300, "n_layer": 1, "n_head": 2, "n_embd": 16}


@pytest.mark.parametrize("family, edit, needle", [
    ("llama", {"hidden_act": "gelu"}, 'hidden_act "gelu" is not supported'),  # were ignored: another model
    ("llama", {"attention_bias": True}, "attention_bias true is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias true is not supported"),
    ("llama", {"llmc_tokenizer": "bogus"}, "llmc_tokenizer 'bogus' is not a tokenizer"),  # was read as Llama 3's
    ("llama", {"llmc_tokenizer": ["gpt2"]}, "llmc_tokenizer ['gpt2']"),
    ("llama", {"rope_scaling": {"rope_type": ["llama3"], "factor": 8.0}}, "rope_scaling.rope_type ['llama3']"),
    ("llama", {"rope_scaling": [1]}, "rope_scaling must be an object"),  # was 'rope_scaling.factor must be'
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                "high_freq_factor": 4.0}},  # a division by zero in the frequencies
     "rope_scaling.high_freq_factor 4.0 must be greater than rope_scaling.low_freq_factor 4.0"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 2 is not a multiple of num_key_value_heads 3"),
    ("gpt2", {"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon nan is not 1e-05"),  # was ignored
    ("gpt2", {"layer_norm_epsilon": 1e-3}, "layer_norm_epsilon 0.001"),
    ("gpt2", {"n_head": 3}, "n_embd 16 is not a multiple of n_head 3"),  # (was --n-embd, an option of train)
    ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings false is not supported"),  # (lm_head was dropped)
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights false is not supported"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx true is not supported"),
])
def test_hf_config_asking_for_another_model(tmp_path, family, edit, needle):
    (tmp_path / "config.json").write_text(json.dumps((LLAMA if family == "llama" else GPT2) | edit))
    reader = hf_llama3.read_hf_config if family == "llama" else hf_gpt2.read_hf_config
    _refused(lambda: reader(tmp_path), "config.json", needle)


def test_hf_config_llmc_wrote_still_reads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA | {"hidden_act": "silu", "attention_bias": False,
                                                               "mlp_bias": False, "llmc_tokenizer": "gpt2"}))
    assert hf_llama3.read_hf_config(tmp_path).n_layer == 1
    (tmp_path / "config.json").write_text(json.dumps(hf_gpt2.hf_config(CFG)))
    assert hf_gpt2.read_hf_config(tmp_path) == CFG


@pytest.mark.parametrize("shape", [[2**70, 0], [2**62, 0], [1] * 70])
def test_safetensors_shape_no_array_can_have(tmp_path, shape):
    """A tensor of no data under a shape numpy cannot make was a ValueError traceback at reshape."""
    header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0 if 0 in shape else 4]}}).encode()
    header += b" " * (-len(header) % 8)
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    _refused(lambda: read_safetensors(p), str(p), "tensor t has a shape no array can have")


def test_layer_number_of_thousands_of_digits(tmp_path):
    """int() refuses more than 4300 digits: a ValueError traceback from a damaged tensor name."""
    names = ["transformer.h.0.ln_1.weight", "transformer.h." + "9" * 5000 + ".ln_1.weight"]
    _refused(lambda: check_layer_count(tmp_path, names, r"transformer\.h\.(\d+)\.", "n_layer", 1),
             "holds weights of layer 99999999999999999999...", "n_layer = 1")
    check_layer_count(tmp_path, ["transformer.h.00.ln_1.weight"], r"transformer\.h\.(\d+)\.", "n_layer", 1)
