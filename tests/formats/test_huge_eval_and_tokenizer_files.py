"""Files read whole that a stray huge file (sparse here, so the tests cost no disk) or a device could stand in for: an
eval file with a valid header (read whole: "out of host memory; lower -b", no file named), a Llama's tokenizer.model
or tokenizer.json, GPT-2's ranks file and llm.c's tokenizer .bin. Each is one line naming the file, before the file is
read into memory; nothing is written."""

import base64
import json

import numpy as np
import pytest
from llmc_test_support import LLAMA_HF_CONFIG, hf_tensors, one_line_error, run, write_hf_dir

from llmc_cli.data import tokenizer as tk
from llmc_cli.formats.evalfile import read_evalfile, write_evalfile
from llmc_cli.formats.files import DataError

HUGE = 64 * 2**30
EXAMPLE = {"label": 1, "ctx_tokens": [10, 11], "ending_tokens": [[1], [2, 3], [4], [5]]}


def sparse(path, size=HUGE):
    with open(path, "ab") as f:
        f.truncate(size)
    return path




# ---- eval files ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", ["gpt2", "llama3"])
def test_an_eval_file_larger_than_its_header_allows_is_refused_before_it_is_read(tmp_path, tokenizer):
    path = tmp_path / "hellaswag_val.bin"
    write_evalfile(path, [EXAMPLE] * 3, tokenizer=tokenizer)
    assert len(read_evalfile(path)) == 3
    sparse(path)
    with pytest.raises(DataError, match=r"68,719,47[0-9,]+ trailing bytes after 3 examples \(more than its header "
                                        "allows") as e:
        read_evalfile(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_huge_eval_file_whose_header_allows_it_is_read_only_as_far_as_it_goes(tmp_path):
    """A header claiming 2**31-1 examples of 2**31-1 bytes allows any size: the file is mapped, not read, and its first
    (all-zero) example is the error."""
    path = tmp_path / "e.bin"
    header = np.zeros(256, "<i4")
    header[:4] = [20240522, 1, 2**31 - 1, 2**31 - 1]
    path.write_bytes(header.tobytes())
    sparse(path)
    with pytest.raises(DataError, match="example 0 does not start with the 65535 delimiter"):
        read_evalfile(path)


def test_an_example_longer_than_the_header_says_is_corrupt(tmp_path):
    """llm.c's reader sizes its buffer by the header's longest example: a longer one would overrun it."""
    path = tmp_path / "e.bin"
    write_evalfile(path, [EXAMPLE, {**EXAMPLE, "ctx_tokens": [10] * 20}])
    raw = bytearray(path.read_bytes())
    header = np.frombuffer(raw, "<i4", count=256).copy()
    header[3] -= 2  # the longest example, one token shorter than it is
    raw[:1024] = header.tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="example 1 length field .* at most the header's longest example"):
        read_evalfile(path)


def test_eval_and_train_name_the_huge_eval_file(gpt2_model, tmp_path, shards):
    path = tmp_path / "hellaswag_val.bin"
    write_evalfile(path, [EXAMPLE] * 2)
    sparse(path)
    one_line_error(run("eval", "--backend", "cpu", "--checkpoint", gpt2_model, "--hellaswag", path, ok=False),
                   "--hellaswag", path, "more than its header allows")
    out = tmp_path / "run"
    one_line_error(run("train", "--backend", "cpu", "--init", gpt2_model, "-b", 1, "-t", 8, "--steps", 1,
                       "--data", shards / "*train*.bin", "--hellaswag", path, "--out", out, ok=False),
                   "--hellaswag", path, "more than its header allows")
    assert not out.exists()


# ---- tokenizer files ----------------------------------------------------------------------------------------------

def byte_ranks() -> str:
    return "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))


@pytest.fixture
def llama_dir(tmp_path):
    """A tiny Hugging Face Llama whose vocabulary is a byte-level Llama 3 tokenizer's (256 ranks + 256 specials)."""
    d = tmp_path / "hf"
    cfg = LLAMA_HF_CONFIG | {"vocab_size": 512}
    write_hf_dir(d, hf_tensors(cfg, np.random.default_rng(0)))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.model").write_text(byte_ranks())
    return d


@pytest.fixture
def fresh_tokenizers(monkeypatch):
    monkeypatch.setattr(tk, "_CACHE", {})


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.json"])
def test_a_huge_tokenizer_file_is_one_line_naming_it(tmp_path, fresh_tokenizers, name):
    path = sparse(tmp_path / name, 2**30)
    with pytest.raises(tk.TokenizerError, match="larger than 64 MiB, not a Llama 3 ranks file") as e:
        tk.load_tokenizer("llama3", path)
    assert str(path) in str(e.value)
    with pytest.raises(tk.TokenizerError, match="larger than 64 MiB"):
        tk.ranks_file_bytes(path)  # (what a checkpoint or a conversion copies under the name tokenizer.model)
    with pytest.raises(tk.TokenizerError, match="larger than 64 MiB, not a GPT-2 ranks file"):
        tk.load_tokenizer("gpt2", path)


def test_a_huge_llm_c_tokenizer_bin_is_one_line(tmp_path):
    path = tmp_path / "gpt2_tokenizer.bin"
    header = np.zeros(256, "<i4")
    header[:4] = [tk.TOKENIZER_MAGIC, 2, 3, 2]
    path.write_bytes(header.tobytes())
    sparse(path, 2**30)
    with pytest.raises(tk.TokenizerError, match="larger than 64 MiB, not an llm.c tokenizer file"):
        tk.read_tokenizer_bin(path)
    with pytest.raises(tk.TokenizerError, match="cannot read the tokenizer file"):
        tk.read_tokenizer_bin(tmp_path)  # (a directory: IsADirectoryError's traceback before)


def test_sample_and_convert_name_a_huge_tokenizer_model(llama_dir, tmp_path, fresh_tokenizers):
    sparse(llama_dir / "tokenizer.model", HUGE)
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", llama_dir, "--max-new-tokens", 1, ok=False),
                   "--checkpoint", llama_dir / "tokenizer.model", "64 MiB")
    out = tmp_path / "out"
    one_line_error(run("convert", llama_dir, out, ok=False), llama_dir / "tokenizer.model", "64 MiB")
    assert not out.exists()


def test_a_device_as_tokenizer_model_is_named_as_one(llama_dir, fresh_tokenizers):
    """/dev/zero behind a link under the name: "needs its tokenizer ... expected in" before (as if it were not there)."""
    (llama_dir / "tokenizer.model").unlink()
    (llama_dir / "tokenizer.model").symlink_to("/dev/zero")
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", llama_dir, "--max-new-tokens", 1, ok=False),
                   "--checkpoint", "tokenizer.model: is a device")


def test_the_byte_tokenizer_still_samples(llama_dir, fresh_tokenizers):
    run("sample", "--backend", "cpu", "--checkpoint", llama_dir, "--max-new-tokens", 2, "--prompt", "hi")
