"""Model files and checkpoint directories made to break their readers: JSON nested past Python's stack, configs
that describe a model far larger than the weights beside them, safetensors headers naming a tensor twice, two
tensors sharing bytes or a length past the end, llmc Llama files with tensors or a tokenizer the config does not
have, a `latest` or `state.json` of gigabytes, an `optimizer.npz` that inflates past the model, and `convert`
failing half-way, under a file or over a link. Each is one line naming the file, before any large allocation or
any write, and leaves nothing behind."""

import errno
import json
import shutil
import struct

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.llama_file import write_llama_model
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.shards import write_shard
from llmc_cli.formats.safetensors import read_safetensors, read_safetensors_header, write_safetensors
from llmc_cli.formats.sources import load_model_any
from llmc_cli.models.gpt2 import GPT2Config, init_parameters
from llmc_cli.models.llama3 import Llama3Config
from llmc_cli.models.llama3 import init_parameters as llama_init

GPT2_CFG = GPT2Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_embd=16)
LLAMA_CFG = Llama3Config(block_size=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, multiple_of=16,
                         ffn_dim_multiplier=None, rope_scaling=None)
HUGE = 2**45  # rows: with 16 columns, 2 PiB of float32, past any address space (so no allocator can fake it)
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    write_model(d / "g.bin", GPT2_CFG, init_parameters(GPT2_CFG, 0))
    write_llama_model(d / "l.safetensors", LLAMA_CFG, llama_init(LLAMA_CFG, 0))
    run("convert", d / "g.bin", d / "hf_gpt2")
    run("convert", d / "l.safetensors", d / "hf_llama")
    write_shard(d / "tiny_val_000000.bin", np.arange(400) % 300)  # ids of the tiny models' 300-token vocabulary
    return d


def _rewrite_header(src, dst, edit=None, text: bytes | None = None) -> None:
    """`src`'s safetensors data under an edited header (or the header text given)."""
    header, start = read_safetensors_header(src)
    body = src.read_bytes()[start:]
    if text is None:
        edit(header)
        text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dst.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _load_error(path) -> str:
    with pytest.raises(ckpt.CheckpointError) as e:
        load_model_any(path)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("where", ["safetensors header", "config.json", "index.json", "llama metadata config"])
def test_json_nested_past_the_stack_is_one_line(models, tmp_path, where):
    if where == "safetensors header":
        bad = tmp_path / "deep.safetensors"
        _rewrite_header(models / "l.safetensors", bad, text=DEEP)
    elif where == "llama metadata config":
        bad = tmp_path / "deep_meta.safetensors"
        _rewrite_header(models / "l.safetensors", bad,
                        lambda h: h["__metadata__"].update(config='{"n_layer": ' + DEEP.decode() + "}"))
    else:
        bad = tmp_path / "hf"
        shutil.copytree(models / "hf_gpt2", bad)
        if where == "config.json":
            (bad / "config.json").write_bytes(b'{"model_type": "gpt2", "x": ' + DEEP + b"}")
        else:
            (bad / "model.safetensors").rename(bad / "model-00001-of-00001.safetensors")
            (bad / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + DEEP + b"}")
    assert str(bad) in _load_error(bad)
    one_line_error(run("eval", "--backend", "cpu", "--checkpoint", bad, "--data", models / "*val*.bin", "-b", 1,
                       "-t", 8, "--batches", 1, ok=False), bad)


def _llama_meta_config(**fields):
    def edit(h):
        h["__metadata__"]["config"] = json.dumps(json.loads(h["__metadata__"]["config"]) | fields)
    return edit


@pytest.mark.parametrize("case", ["llmc llama vocab", "llmc llama layers", "hf gpt2 vocab", "hf gpt2 n_embd",
                                  "hf llama vocab", "hf llama intermediate_size"])
def test_config_far_larger_than_its_weights_is_refused_before_allocating(models, tmp_path, case):
    """The config's shapes are checked against the tensors before the parameters are allocated: a damaged config
    is a line naming the tensor, not MemoryError (nor, with room to overcommit, gigabytes touched)."""
    if case.startswith("llmc"):
        bad = tmp_path / "big.safetensors"
        fields = {"vocab_size": HUGE} if case.endswith("vocab") else {"n_layer": HUGE}
        _rewrite_header(models / "l.safetensors", bad, _llama_meta_config(**fields))
    else:
        family, key = case.split()[1:]
        bad = tmp_path / "hf"
        shutil.copytree(models / f"hf_{family}", bad)
        conf = json.loads((bad / "config.json").read_text())
        conf[{"vocab": "vocab_size"}.get(key, key)] = HUGE
        (bad / "config.json").write_text(json.dumps(conf))
    msg = _load_error(bad)
    assert "shape" in msg and str(HUGE) in msg, msg


def test_a_tensor_named_twice_or_sharing_bytes_is_refused(models, tmp_path):
    """json keeps the last of two equal keys, and nothing stopped two entries pointing at the same bytes: either
    way one tensor was silently read as another."""
    src = tmp_path / "two.safetensors"
    write_safetensors(src, {"a": np.ones((2, 3), np.float32), "b": np.full((2, 3), 2, np.float32)})
    header, _ = read_safetensors_header(src)
    dup = tmp_path / "dup.safetensors"
    text = json.dumps(header)
    _rewrite_header(src, dup, text=(text[:-1] + ', "a": ' + json.dumps(header["b"]) + "}").encode())
    with pytest.raises(ckpt.CheckpointError, match="names 'a' twice"):
        read_safetensors(dup)
    overlap = tmp_path / "overlap.safetensors"
    _rewrite_header(src, overlap, lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"]))
    with pytest.raises(ckpt.CheckpointError, match="tensors a and b overlap"):
        read_safetensors(overlap)
    # in a model file: the two norms share a shape, so only the overlap check tells them apart
    bad = tmp_path / "shared_norms.safetensors"
    _rewrite_header(models / "l.safetensors", bad, lambda h: h["ffn_norm"].update(
        data_offsets=h["attn_norm"]["data_offsets"]))
    assert "overlap" in _load_error(bad)


@pytest.mark.parametrize("edit, needle", [
    (lambda h: h.update(extra={"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}), "tensor extra is not one"),
    (lambda h: h["__metadata__"].update(tokenizer=7), "tokenizer 7"),
    (lambda h: h["__metadata__"].update(tokenizer="foo"), "tokenizer 'foo'"),
    (lambda h: h["__metadata__"].update(family="gpt2"), "model family 'gpt2'"),
], ids=["extra tensor", "tokenizer not a string", "unknown tokenizer", "family of .bin files"])
def test_llmc_llama_file_with_what_its_config_does_not_have(models, tmp_path, edit, needle):
    """An extra tensor was ignored and a tokenizer that is not a string was taken for GPT-2's, silently; a
    safetensors file claiming GPT-2 was read as a .bin ("bad magic")."""
    bad = tmp_path / "odd.safetensors"
    _rewrite_header(models / "l.safetensors", bad, edit)
    assert needle in _load_error(bad)
    one_line_error(run("eval", "--backend", "cpu", "--checkpoint", bad, "--data", models / "*val*.bin", "-b", 1,
                       "-t", 8, "--batches", 1, ok=False), bad, needle)


def test_latest_that_is_a_huge_file_is_not_read_whole(tmp_path):
    """`latest` names a step: a few bytes. A 64 GiB (sparse) file there was read whole (MemoryError)."""
    rd = tmp_path / "run"
    (rd / "step_00000001").mkdir(parents=True)
    write_model(rd / "step_00000001" / "model.bin", GPT2_CFG, init_parameters(GPT2_CFG, 0))
    for name in ("optimizer.npz", "state.json"):  # (a complete step: what the fallback takes)
        (rd / "step_00000001" / name).write_bytes(b"")
    with open(rd / "latest", "wb") as f:
        f.truncate(64 * 2**30)
    assert ckpt.resolve_checkpoint(rd) == rd / "step_00000001" / "model.bin"  # the newest complete step, as for
    (rd / "step_00000001" / "model.bin").unlink()                           # any `latest` naming no step
    with pytest.raises(ckpt.CheckpointError, match="latest is a file of over 4096 bytes"):
        ckpt.resolve_checkpoint(rd)


def test_a_failed_conversion_to_a_run_leaves_nothing(models, tmp_path, monkeypatch):
    """A full disk while `convert --to run` wrote the model left DST/step_00000000/ behind, and the retry was
    then refused (DST "exists")."""
    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ckpt, "write_model_file", full)
    dst = tmp_path / "run"
    one_line_error(run("convert", models / "g.bin", dst, "--to", "run", ok=False), dst, "No space left")
    assert not any(tmp_path.iterdir())
    monkeypatch.undo()
    run("convert", models / "g.bin", dst, "--to", "run")
    assert (dst / "latest").read_text() == "step_00000000\n"


def test_convert_under_a_file_names_it(models, tmp_path):
    """Creating DST's folders failed with "File exists", naming neither the file nor what was wrong with it."""
    (tmp_path / "notes.txt").write_text("mine")
    for dst in (tmp_path / "notes.txt" / "m.bin", tmp_path / "notes.txt" / "sub" / "hf"):
        one_line_error(run("convert", models / "g.bin", dst, ok=False), dst, f"{tmp_path / 'notes.txt'} is not a "
                                                                              "directory")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_optimizer_state_that_inflates_past_the_model_is_refused_before_inflating(tmp_path):
    """An .npz is a zip: a few compressed bytes can stand for gigabytes, which were inflated before their size was
    looked at. Each array holds at most the model's n float32 values."""
    n = 16
    path = tmp_path / "optimizer.npz"
    np.savez_compressed(path, m=np.zeros(n, np.float32), v=np.zeros(n, np.float32),
                        junk=np.zeros(2**22, np.float32))  # 16 MiB inflated, a few KiB on disk
    assert path.stat().st_size < 2**16
    with pytest.raises(ckpt.CheckpointError, match="'junk.npy' inflates to 16,777,344 bytes, more than 16 float32"):
        ckpt.read_optimizer_state(path, n)


def test_safetensors_header_length_past_the_end_says_so(models, tmp_path):
    """It was "the header is not JSON", which sends one looking at the JSON of a file cut short."""
    raw = (models / "l.safetensors").read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(raw[:8 + 100])
    with pytest.raises(ckpt.CheckpointError, match="past the end of the file"):
        read_safetensors_header(bad)


def test_force_over_a_link_to_an_earlier_conversion_leaves_no_temporary(models, tmp_path):
    """The link was moved aside as .hf.old-PID and never removed (rmtree refuses links); the directory it points
    to is left as it was."""
    run("convert", models / "g.bin", tmp_path / "real")
    (tmp_path / "hf").symlink_to("real")
    before = {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()}
    run("convert", models / "g.bin", tmp_path / "hf", "--force")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "real"]
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf").is_symlink()
    assert {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()} == before


def test_state_json_of_gigabytes_is_not_read_whole(tmp_path):
    """state.json is kilobytes; a 64 GiB (sparse) one was read whole before anything was checked (MemoryError,
    "lower -b/--batch-size")."""
    path = tmp_path / "state.json"
    with open(path, "wb") as f:
        f.truncate(64 * 2**30)
    with pytest.raises(ckpt.CheckpointError, match="state.json: over 64 MiB, not an llmc run state"):
        ckpt.read_run_state(path)


def test_what_is_not_a_model_file_is_told_apart_from_a_damaged_one(tmp_path):
    """A file that is neither an llm.c .bin nor a safetensors file (a run's state.json, a zip) is 'not a model file';
    a safetensors file whose JSON header begins with white space or a BOM is one (the reader takes it), and one cut
    short keeps its reader's 'truncated' line."""
    import json

    from llmc_cli.formats.checkpoint import CheckpointError, resolve_checkpoint
    from llmc_cli.formats.safetensors import read_safetensors_header, write_safetensors
    good = tmp_path / "m.safetensors"
    write_safetensors(good, {"w": np.ones((4, 4), np.float32)})
    raw = good.read_bytes()
    n = int(np.frombuffer(raw[:8], "<u8")[0])
    for lead in (b" ", b"\n", b"\xef\xbb\xbf"):
        header = lead + raw[8:8 + n]
        header += b" " * (-len(header) % 8)
        f = tmp_path / f"lead{len(lead)}.safetensors"
        f.write_bytes(np.uint64(len(header)).astype("<u8").tobytes() + header + raw[8 + n:])
        assert resolve_checkpoint(f) == f
        assert "w" in read_safetensors_header(f)[0]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:20])
    assert resolve_checkpoint(cut) == cut
    with pytest.raises(CheckpointError, match="past the end of the file"):
        read_safetensors_header(cut)
    (tmp_path / "state.json").write_text(json.dumps({"step": 2, "args": {}}, indent=1))
    for name, data in (("state.json", None), ("w.pt", b"PK\x03\x04" + bytes(100)), ("tiny", b"{}")):
        f = tmp_path / name
        if data is not None:
            f.write_bytes(data)
        with pytest.raises(CheckpointError, match="not a model file: expected an llm.c .bin"):
            resolve_checkpoint(f)
