"""Hugging Face interop: safetensors written in the real format under transformers' GPT-2 names, a bit-exact
round trip, and a PyTorch forward that reads the exported file by name with transformers' layout (Conv1D:
x @ W + b) and reproduces llmc's logits."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from llmc_test_support import run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats import hf, hf_gpt2, sources
from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters

CFG = GPT2Config(block_size=24, vocab_size=150, n_layer=2, n_head=4, n_embd=32)


def params(cfg=CFG, seed=0) -> np.ndarray:
    p = init_parameters(cfg, seed)
    rng = np.random.default_rng(seed)
    n = cfg.padded_vocab_size * cfg.n_embd
    p[n:] += rng.normal(0, 0.05, p.size - n).astype(np.float32)  # non-trivial biases and layernorms
    return p


def read_safetensors_torch(path) -> dict[str, torch.Tensor]:
    """An independent reader (struct + json + torch), so the test does not trust llmc's own."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = bytearray(raw[8 + n + b:8 + n + e])
        dt = {"F32": torch.float32, "BF16": torch.bfloat16}[info["dtype"]]
        out[name] = torch.frombuffer(buf, dtype=dt).reshape(info["shape"]).to(torch.float64)
    return out


def hf_forward(sd: dict[str, torch.Tensor], config: dict, idx: torch.Tensor) -> torch.Tensor:
    """transformers' GPT2LMHeadModel forward, written out: Conv1D is x @ W + b with W (in, out); tied head."""
    C, NH, eps = config["n_embd"], config["n_head"], config["layer_norm_epsilon"]
    B, T = idx.shape
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    for l in range(config["n_layer"]):
        h = f"transformer.h.{l}."

        def conv1d(t, name):
            return t @ sd[h + name + ".weight"] + sd[h + name + ".bias"]

        a = F.layer_norm(x, (C,), sd[h + "ln_1.weight"], sd[h + "ln_1.bias"], eps)
        q, k, v = conv1d(a, "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + conv1d((att @ v).transpose(1, 2).reshape(B, T, C), "attn.c_proj")
        m = F.layer_norm(x, (C,), sd[h + "ln_2.weight"], sd[h + "ln_2.bias"], eps)
        x = x + conv1d(F.gelu(conv1d(m, "mlp.c_fc"), approximate="tanh"), "mlp.c_proj")
    x = F.layer_norm(x, (C,), sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
    return x @ sd["transformer.wte.weight"].T  # lm_head tied to wte


def test_safetensors_layout_and_names(tmp_path):
    p = params()
    hf_gpt2.export_hf(tmp_path / "hf", CFG, p)
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    names = set(header) - {"__metadata__"}
    expected = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    for l in range(CFG.n_layer):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            expected |= {f"transformer.h.{l}.{part}.weight", f"transformer.h.{l}.{part}.bias"}
    assert names == expected
    C = CFG.n_embd
    assert header["transformer.wte.weight"]["shape"] == [CFG.vocab_size, C]  # un-padded
    assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [C, 3 * C]  # Conv1D: (in, out)
    assert header["transformer.h.1.mlp.c_proj.weight"]["shape"] == [4 * C, C]
    ends = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] == len(raw) - 8 - n
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["n_positions"], config["n_layer"], config["n_head"], config["n_embd"], config["vocab_size"]) == \
        (24, 2, 4, 32, 150)
    assert config["tie_word_embeddings"] is True and config["activation_function"] == "gelu_new"


def test_round_trip_is_bit_exact(tmp_path):
    p = params()
    hf_gpt2.export_hf(tmp_path / "hf", CFG, p)
    cfg2, p2 = hf_gpt2.import_hf(tmp_path / "hf")
    assert cfg2 == CFG and p2.dtype == np.float32 and np.array_equal(p2, p)
    # through the command line: .bin -> HF -> .bin gives the same file, byte for byte
    write_model(tmp_path / "a.bin", CFG, p)
    run("convert", tmp_path / "a.bin", tmp_path / "hf2")
    run("convert", tmp_path / "hf2", tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    # bf16: the HF file holds bf16 (half the bytes) and comes back as llm.c's version 5 file of the same model
    run("convert", tmp_path / "a.bin", tmp_path / "hf16", "--dtype", "bf16")
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    run("convert", tmp_path / "hf16", tmp_path / "c.bin", "--dtype", "bf16")
    write_model(tmp_path / "d.bin", CFG, p, bf16=True)
    assert (tmp_path / "c.bin").read_bytes() == (tmp_path / "d.bin").read_bytes()
    st16 = (tmp_path / "hf16" / "model.safetensors").stat().st_size
    st32 = (tmp_path / "hf2" / "model.safetensors").stat().st_size
    assert st16 < 0.55 * st32  # bf16 data plus the same JSON header


def test_convert_from_run_directory(tmp_path):
    p = params(seed=3)
    ckpt.write_run_checkpoint(tmp_path / "run", 5, CFG, p, bf16=False, optimizer={}, state={"step": 5})
    r = run("convert", tmp_path / "run", tmp_path / "hf")
    assert "run" in r.output
    assert np.array_equal(hf_gpt2.import_hf(tmp_path / "hf")[1], p)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_reference_reads_export_and_matches_llmc(cpu, tmp_path, dtype):
    p = params(seed=1)
    write_model(tmp_path / "m.bin", CFG, p)
    run("convert", tmp_path / "m.bin", tmp_path / "hf", "--dtype", dtype)
    sd = read_safetensors_torch(tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    idx = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)
    ref = hf_forward(sd, config, torch.tensor(idx, dtype=torch.long)).numpy()
    # llmc's engine on the weights it reads back from the same directory
    cfg2, p2 = hf_gpt2.import_hf(tmp_path / "hf")
    model = GPT2(cfg2, cpu, 2, 16, training=False)
    model.load_parameters(p2)
    model.forward(idx)
    got = cpu.download(model.acts["logits"])[:, :, :CFG.vocab_size].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    if dtype == "fp32":  # and the original fp32 .bin gives the same logits
        m0 = GPT2(CFG, cpu, 2, 16, training=False)
        m0.load_parameters(p)
        m0.forward(idx)
        assert np.array_equal(cpu.download(m0.acts["logits"]), cpu.download(model.acts["logits"]))


def test_import_accepts_hub_names_without_prefix(tmp_path):
    """The Hub's gpt2 files name tensors h.0.attn... (no transformer.) and carry attn.bias mask buffers."""
    p = params(seed=2)
    t = {k.removeprefix("transformer."): v for k, v in hf_gpt2.to_hf_tensors(CFG, p).items()}
    t["h.0.attn.bias"] = np.tril(np.ones((CFG.block_size, CFG.block_size), np.float32))[None, None]
    (tmp_path / "hub").mkdir()
    hf.write_safetensors(tmp_path / "hub" / "model.safetensors", t)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hf_gpt2.hf_config(CFG)))
    assert np.array_equal(hf_gpt2.import_hf(tmp_path / "hub")[1], p)


@pytest.mark.parametrize("case", ["not_hf_dir", "llama_config", "garbage_weights", "missing_tensor", "no_src",
                                  "dst_is_file"])
def test_bad_input_one_line_error(tmp_path, case):
    hf_gpt2.export_hf(tmp_path / "good", CFG, params())
    src, dst = tmp_path / "good", tmp_path / "out.bin"
    if case == "not_hf_dir":
        (tmp_path / "empty").mkdir()
        src = tmp_path / "empty"
    elif case == "llama_config":
        (tmp_path / "good" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif case == "garbage_weights":
        (tmp_path / "good" / "model.safetensors").write_bytes(b"\xff" * 64)
    elif case == "missing_tensor":
        t = hf_gpt2.to_hf_tensors(CFG, params())
        del t["transformer.h.1.mlp.c_fc.bias"]
        hf.write_safetensors(tmp_path / "good" / "model.safetensors", t)
    elif case == "no_src":
        src = tmp_path / "nothing"
    elif case == "dst_is_file":
        (tmp_path / "afile").write_text("x")
        dst = tmp_path / "afile"
    r = run("convert", src, dst, ok=False)
    msg = r.output.strip()
    assert r.exit_code == 2 and msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    assert not (tmp_path / "out.bin").exists()
    if case in ("not_hf_dir", "llama_config"):  # the same one-liner from sample / eval
        r = run("sample", "--backend", "cpu", "--checkpoint", src, ok=False)
        assert r.exit_code == 2 and r.output.strip().startswith("error:") and "\n" not in r.output.strip()


def test_convert_into_run_directory_every_direction(tmp_path):
    """.bin -> run, HF -> run, run -> .bin / HF: bit-exact, and the run directory is one sample/eval read."""
    p = params(seed=4)
    write_model(tmp_path / "a.bin", CFG, p)
    run("convert", tmp_path / "a.bin", tmp_path / "hf")
    run("convert", tmp_path / "a.bin", tmp_path / "run_b", "--to", "run")
    r = run("convert", tmp_path / "hf", tmp_path / "run_h", "--to", "run")
    assert "run directory" in r.output
    for d in ("run_b", "run_h"):
        assert (tmp_path / d / "latest").read_text().strip() == "step_00000000"
        assert sources.load_model_any(tmp_path / d)[2] == "run"
        run("convert", tmp_path / d, tmp_path / f"{d}.bin")
        assert (tmp_path / f"{d}.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()
    run("convert", tmp_path / "run_h", tmp_path / "hf2")
    assert np.array_equal(hf_gpt2.import_hf(tmp_path / "hf2")[1], p)
    from llmc_cli.formats.shards import write_shard
    write_shard(tmp_path / "v_val_000000.bin", np.arange(300) % CFG.vocab_size)
    losses = {json.loads(run("eval", "--backend", "cpu", "--checkpoint", tmp_path / src, "--data",
                             tmp_path / "v_val_*.bin", "-t", 16, "--json").stdout)["loss"]
              for src in ("a.bin", "run_b", "run_h", "hf")}
    assert len(losses) == 1  # the same model, whichever form it is read from
    # a directory that already holds something is not overwritten
    bad = run("convert", tmp_path / "a.bin", tmp_path / "run_b", "--to", "run", ok=False)
    assert bad.exit_code == 2 and "not an empty directory" in bad.output


def test_convert_never_replaces_what_it_did_not_write(tmp_path, monkeypatch):
    import errno
    import os

    from llmc_cli.formats.shards import write_shard
    p = params(seed=5)
    src = tmp_path / "a.bin"
    write_model(src, CFG, p)

    def tree():
        return {str(q.relative_to(tmp_path)): q.read_bytes() if q.is_file() else None
                for q in sorted(tmp_path.rglob("*"))}

    def refused(*args, expect):
        before = tree()
        r = run("convert", *args, ok=False)
        msg = r.output.strip()
        assert r.exit_code == 2 and msg.startswith("error: DST:") and "\n" not in msg and expect in msg, msg
        assert tree() == before  # nothing written, replaced or left behind
    write_shard(tmp_path / "shard.bin", np.arange(300) % CFG.vocab_size)
    refused(src, tmp_path / "shard.bin", expect="exists; llmc convert writes only new destinations")
    refused(src, tmp_path / "shard.bin", "--force", expect="is not an llmc model file")
    refused(src, src, "--force", expect="is the source itself")
    run("convert", src, tmp_path / "run", "--to", "run")
    refused(src, tmp_path / "run" / "step_00000000" / "model.bin", "--force", "--dtype", "bf16",
            expect="inside the checkpoint")
    refused(src, tmp_path / "run", "--force", expect="belongs to a run directory")
    run("convert", src, tmp_path / "hf")
    refused(src, tmp_path / "hf", expect="exists")
    (tmp_path / "hf" / "README.md").write_text("my notes")
    refused(src, tmp_path / "hf", "--force", expect="is not an llmc model file or Hugging Face model directory")
    (tmp_path / "hf" / "README.md").unlink()
    # a disk that fills up while the new directory is written leaves the old one as it was, and no temp folder
    from llmc_cli.formats import safetensors

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(safetensors, "atomic_write_bytes", full)
    refused(src, tmp_path / "hf", "--force", "--dtype", "bf16", expect="No space left on device")
    monkeypatch.undo()
    r = run("convert", src, tmp_path / "hf", "--force", "--dtype", "bf16")  # an earlier conversion: replaced
    assert "bf16" in r.output and not [q for q in tmp_path.iterdir() if q.name.startswith(".")]
    assert np.abs(hf_gpt2.import_hf(tmp_path / "hf")[1] - p).max() <= np.abs(p).max() * 2 ** -8
