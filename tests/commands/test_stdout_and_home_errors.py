"""Errors that belong to no option: standard output closed early (`llmc ... | head -1` said `error: Broken pipe`, a
full disk behind it `error: No space left on device`, neither naming standard output) and a missing home directory,
which `llmc sample` reported as `error: --checkpoint: HOME is not set...`, though the checkpoint was fine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner
from llmc_test_support import LLAMA_HF_CONFIG, hf_tensors, one_line_error, run, write_hf_dir


LLMC = [sys.executable, "-m", "llmc_cli"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Hugging Face Llama with a byte-level tokenizer.model (no installed tokenizer needed)."""
    import base64
    d = tmp_path_factory.mktemp("hf") / "hf"
    cfg = LLAMA_HF_CONFIG | {"vocab_size": 512}
    write_hf_dir(d, hf_tensors(cfg, np.random.default_rng(0)))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return d


def closed_early(args, timeout=120):
    """`llmc ARGS` whose stdout is a pipe its reader closed before anything was written (`| head -0`)."""
    p = subprocess.Popen([*LLMC, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # (the child is still importing: its first write meets a pipe without a reader)
    try:
        err = p.stderr.read()
        return p.wait(timeout=timeout), err.decode()
    finally:
        p.kill()


def onto_full_disk(args, timeout=120):
    with open("/dev/full", "w") as full:
        r = subprocess.run([*LLMC, *map(str, args)], stdout=full, stderr=subprocess.PIPE, timeout=timeout)
    return r.returncode, r.stderr.decode()


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


@pytest.mark.parametrize("args", [["backends", "--json"], ["backends"], ["backends", "--help"]])
def test_a_closed_stdout_ends_quietly_as_unix_tools_do(args):
    code, err = closed_early(args)
    assert (code, err) == (141, ""), (code, err)  # 128 + SIGPIPE, no message, no "Exception ignored"


def test_sample_into_a_closed_pipe_ends_quietly(llama_dir):
    code, err = closed_early(["sample", "--backend", "cpu", "--checkpoint", llama_dir, "--max-new-tokens", 4])
    assert (code, err) == (141, ""), (code, err)


@needs_dev_full
@pytest.mark.parametrize("args", [["backends", "--json"], ["backends", "--help"]])
def test_a_full_stdout_is_one_line_naming_standard_output(args):
    code, err = onto_full_disk(args)
    assert (code, err) == (2, "error: standard output: No space left on device\n"), (code, err)


@needs_dev_full
def test_sample_onto_a_full_stdout_is_one_line(llama_dir):
    code, err = onto_full_disk(["sample", "--backend", "cpu", "--checkpoint", llama_dir, "--max-new-tokens", 4])
    assert (code, err) == (2, "error: standard output: No space left on device\n"), (code, err)


def test_stdout_into_a_reader_is_unchanged():
    r = subprocess.run([*LLMC, "backends", "--json"], capture_output=True, timeout=120)
    assert r.returncode in (0, 1) and r.stderr == b"", r.stderr  # (1: no backend usable here)
    assert {b["name"] for b in json.loads(r.stdout)} >= {"cpu"}


def test_a_broken_pipe_in_any_other_write_is_still_reported():
    """Only standard output's reader going is quiet: a FIFO llmc writes losing its reader, or a pipe to a worker, is
    an error line as before."""
    from llmc_cli.commands.main import _Main

    @click.group(cls=_Main)
    def group():
        pass

    @group.command()
    @click.argument("name", required=False)
    def write(name):
        raise BrokenPipeError(32, "Broken pipe", name) if name else BrokenPipeError(32, "Broken pipe")

    r = CliRunner().invoke(group, ["write", "/tmp/a-fifo"])
    assert (r.exit_code, r.output) == (2, "error: /tmp/a-fifo: Broken pipe\n"), r.output
    r = CliRunner().invoke(group, ["write"])
    assert (r.exit_code, r.output) == (2, "error: Broken pipe\n"), r.output


# ---- no home directory ----------------------------------------------------------------------------------------------

@pytest.fixture
def no_home(monkeypatch):
    """HOME empty (the path of HOME unset with no password entry): GPT-2's ranks, looked up in llmc's data home."""
    from llmc_cli.data import tokenizer as tk
    for var in ("LLMC_DATA_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(tk, "_CACHE", {})
    # (wherever openai-whisper is installed, the ranks are looked up in the data home, as where it is not)
    monkeypatch.setattr(tk, "gpt2_ranks_path", lambda: tk.packages_dir() / "whisper" / "assets" / "gpt2.tiktoken")




def test_sample_without_a_home_names_no_option(no_home, gpt2_model):
    line = one_line_error(run("sample", "--checkpoint", gpt2_model, "--backend", "cpu", "--max-new-tokens", 2,
                              ok=False), "HOME is not set", "LLMC_DATA_HOME")
    assert "--checkpoint" not in line, line


def test_tokenize_hellaswag_with_a_checkpoint_without_a_home_names_no_option(no_home, gpt2_model, tmp_path):
    f = tmp_path / "hs.jsonl"
    f.write_text(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n")
    line = one_line_error(run("tokenize", "hellaswag", "--checkpoint", gpt2_model, "--local", f, "--out-dir",
                              tmp_path / "o", ok=False), "HOME is not set", "LLMC_DATA_HOME")
    assert "--checkpoint" not in line, line
    assert not (tmp_path / "o").exists()


def test_the_checkpoints_own_tokenizer_file_keeps_the_option(llama_dir, tmp_path):
    bad = tmp_path / "hf"
    bad.mkdir()
    for f in llama_dir.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "tokenizer.model").unlink()
    (bad / "tokenizer.model").write_text("not base64 0\n")
    one_line_error(run("sample", "--checkpoint", bad, "--backend", "cpu", "--max-new-tokens", 1, ok=False),
                   "--checkpoint", "tokenizer.model:1")


def test_a_training_run_whose_stdout_closes_stops_with_a_checkpoint(tmp_path):
    """`llmc train ... | head`: the run is worth more than its lines, so a closed standard output is a stop request
    (exit 75 after a checkpoint, the resume command on stderr), not the end of the process with nothing saved."""
    from llmc_cli.formats.shards import write_shard
    from llmc_test_support import TINY, phrase_tokens
    d = tmp_path / "d"
    d.mkdir()
    write_shard(d / "x_train_000000.bin", phrase_tokens(200))
    write_shard(d / "x_val_000000.bin", phrase_tokens(20, 1))
    p = subprocess.Popen([*LLMC, *map(str, TINY), "--data", str(d), "--steps", "300", "--out", str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in p.stdout:  # the reader goes once the first step is shown
            if line.startswith(b"step"):
                break
        p.stdout.close()
        code, err = p.wait(timeout=300), p.stderr.read().decode()
    finally:
        p.kill()
    assert code == 75, (code, err)
    assert "a closed standard output: finishing the current step" in err and "--resume" in err, err
    assert (tmp_path / "run" / "latest").is_file() and list((tmp_path / "run").glob("step_*"))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenize_with_standard_error_gone_finishes_its_run(tmp_path, workers):
    """`llmc tokenize ... 2>&1 | head -c 0`: rich's progress display met the closed pipe at its last write and
    ended the command with exit 1 before the manifest was marked complete (and pointed standard output at
    /dev/null). Now what is left for standard error is dropped; the run and its summary line are whole."""
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(3000)))
    r, w = os.pipe()
    os.close(r)  # (standard error's reader gone before the first write)
    try:
        p = subprocess.run([*LLMC, "tokenize", "text", str(src), "--out-dir", str(tmp_path / "out"), "--workers",
                            workers, "--shard-size", "20K"], stdout=subprocess.PIPE, stderr=w, text=True,
                           timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 0 and "shards" in p.stdout, (p.returncode, p.stdout)
    assert json.loads((tmp_path / "out" / "a_manifest.json").read_text())["complete"] is True


def test_commands_run_with_standard_output_closed(tmp_path):
    """`llmc ... >&-`: Python's sys.stdout is then None; llmc's flush after the command was a traceback, and later
    `eval --json` and `sample` ended in success with their only result lost. Now the first write to it fails as
    writing a closed descriptor does in any Unix tool (one line, non-zero); tokenize's shards, written before its
    summary line, stay complete."""
    src = tmp_path / "a.txt"
    src.write_text("some words to tokenize\n" * 50)
    p = subprocess.run(" ".join([*LLMC, "tokenize", "text", str(src), "--out-dir", str(tmp_path / "out"),
                                 "--workers", "1"]) + " >&-", shell=True, capture_output=False,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "error: standard output: closed when llmc started (>&-)", p.stderr
    assert json.loads((tmp_path / "out" / "a_manifest.json").read_text())["complete"] is True
    q = subprocess.run(" ".join([*LLMC, "backends", "--json"]) + " >&-", shell=True, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    assert q.returncode != 0 and q.stderr.strip().endswith("closed when llmc started (>&-)"), q.stderr


def test_commands_run_with_standard_error_closed(tmp_path):
    """`llmc ... 2>&-`: rich wrote to a stream over the closed descriptor (or to None) and a command whose work
    was done exited 1. Now what it would say goes nowhere, and its result and status are whole."""
    p = subprocess.run(" ".join([*LLMC, "backends", "--json"]) + " 2>&-", shell=True, stdout=subprocess.PIPE,
                       text=True, timeout=120)
    assert p.returncode == 0 and isinstance(json.loads(p.stdout), (list, dict)), p.stdout
