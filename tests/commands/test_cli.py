"""`llmc train / eval / sample / backends` end to end on the CPU backend: resume bit-exactness, determinism,
llm.c file compatibility, and bad input answered by one clear line and a non-zero exit."""

import json
import subprocess
import sys

import numpy as np
import pytest
from llmc_test_support import TINY, losses, rewind_run, run

from llmc_cli.formats.llmc_bin import read_model, write_model
from llmc_cli.formats.safetensors import bf16_bits_to_float32, float32_to_bf16_bits
from llmc_cli.formats.shards import write_shard
from llmc_cli.models.gpt2 import GPT2Config, init_parameters, num_parameters, preset


def test_train_resume_is_bit_exact(shards, tmp_path):
    """10 steps == 5 steps, resume, 5 steps: identical losses (schedule, weight decay and clipping on)."""
    common = [*TINY, "--data", shards / "*train*.bin", "--steps", 10, "--lr", "1e-3", "--warmup", 3,
              "--lr-decay-frac", "0.1", "--weight-decay", "0.1", "--shuffle"]
    run(*common, "--out", tmp_path / "a", "--log", tmp_path / "a.jsonl")
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--checkpoint-every", 5)
    rewind_run(tmp_path / "b", 5, 10, log=tmp_path / "b.jsonl")  # as if the run died after step 5
    r = run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--resume")
    assert "resumed" in r.output
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert len(a) == 10 and a == b
    assert a[-1] < a[0]


def test_run_directory_keeps_its_own_log(shards, tmp_path):
    """--out without --log logs to OUT/log.jsonl; a resume trims it to the checkpoint and continues it."""
    common = [*TINY, "--data", shards / "*train*.bin", "--steps", 6, "--checkpoint-every", 3]
    run(*common, "--out", tmp_path / "a")
    full = losses(tmp_path / "a" / "log.jsonl")
    assert len(full) == 6
    run(*common, "--out", tmp_path / "b")
    rewind_run(tmp_path / "b", 3, 6)  # the run died after step 3's checkpoint (and logged on)
    run(*common, "--out", tmp_path / "b", "--resume")
    assert losses(tmp_path / "b" / "log.jsonl") == full
    run("plot", tmp_path / "a", "--out", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_two_runs_are_identical_and_log_has_fields(shards, tmp_path):
    for name in ("x", "y"):
        r = run(*TINY, "--data", shards / "*train*.bin", "--val-data", shards / "*val*.bin", "--steps", 4,
                "--val-every", 2, "--val-batches", 2, "--log", tmp_path / f"{name}.jsonl")
    assert "tok/s" in r.output and "val loss" in r.output
    recs = [json.loads(line) for line in open(tmp_path / "x.jsonl")]
    steps = [r for r in recs if "loss" in r]
    assert {"step", "loss", "norm", "lr", "ms", "tok_per_s"} <= set(steps[0])
    assert any("val_loss" in r for r in recs)
    assert losses(tmp_path / "x.jsonl") == losses(tmp_path / "y.jsonl")


def test_overfit_batch_drives_loss_down(shards, tmp_path):
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 20, "--lr", "3e-3", "--overfit-batch",
        "--log", tmp_path / "o.jsonl")
    ls = losses(tmp_path / "o.jsonl")
    assert ls[-1] < 0.6 * ls[0]


def test_gradient_accumulation_option(shards, tmp_path):
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--total-batch-size", 256)
    assert "grad accumulation 4" in r.output
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--total-batch-size", 100, ok=False)
    assert r.exit_code != 0 and "--total-batch-size" in r.output


def test_eval_and_sample_from_run_dir_and_bin(shards, tmp_path):
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 3, "--out", tmp_path / "run")
    r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "run", "--data", shards / "*val*.bin",
            "--batches", 3, "-b", 2, "-t", 32, "--json")
    loss = json.loads(r.output)["loss"]
    assert 5 < loss < 12
    model_bin = tmp_path / "run" / "step_00000003" / "model.bin"
    r2 = run("eval", "--backend", "cpu", "--checkpoint", model_bin, "--data", shards / "*val*.bin",
             "--batches", 3, "-b", 2, "-t", 32, "--json")
    assert json.loads(r2.output)["loss"] == loss
    s1 = run("sample", "--backend", "cpu", "--checkpoint", tmp_path / "run", "--prompt", "Hello",
             "--max-new-tokens", 8, "--seed", 5, "--top-k", 20).stdout  # stderr: tokens/s
    s2 = run("sample", "--backend", "cpu", "--checkpoint", model_bin, "--prompt", "Hello",
             "--max-new-tokens", 8, "--seed", 5, "--top-k", 20).stdout
    assert s1 == s2 and s1.startswith("Hello") and len(s1) > len("Hello")


def test_llmc_model_file_layout(tmp_path):
    """Headers byte for byte as llm.c writes them; fp32 round trip exact, bf16 rounds to nearest even."""
    cfg = GPT2Config(block_size=32, vocab_size=300, n_layer=2, n_head=2, n_embd=16)
    p = init_parameters(cfg, 0)
    write_model(tmp_path / "m.bin", cfg, p)
    raw = np.fromfile(tmp_path / "m.bin", dtype=np.int32, count=256)
    assert list(raw[:8]) == [20240326, 3, 32, 300, 2, 2, 16, 384] and not raw[8:].any()
    assert (tmp_path / "m.bin").stat().st_size == 1024 + 4 * num_parameters(cfg)
    cfg2, p2, v = read_model(tmp_path / "m.bin")
    assert cfg2 == cfg and v == 3 and np.array_equal(p, p2)
    write_model(tmp_path / "h.bin", cfg, p, bf16=True)
    assert list(np.fromfile(tmp_path / "h.bin", dtype=np.int32, count=2)) == [20240326, 5]
    assert (tmp_path / "h.bin").stat().st_size == 1024 + 2 * num_parameters(cfg)
    _, ph, v = read_model(tmp_path / "h.bin")
    assert v == 5 and np.allclose(ph, p, rtol=2 ** -8, atol=0)
    # ties to even: 1 + 2^-8 is halfway between two bf16 values and must round down to 1.0
    assert bf16_bits_to_float32(float32_to_bf16_bits(np.array([1 + 2 ** -8], np.float32)))[0] == 1.0


def test_train_from_llmc_bin_init(shards, tmp_path):
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)
    write_model(tmp_path / "init.bin", cfg, init_parameters(cfg, 4))
    r = run("train", "--backend", "cpu", "--init", tmp_path / "init.bin", "-b", 2, "-t", 32, "--steps", 2,
            "--data", shards / "*train*.bin", "--val-every", 0, "--sample-every", 0)
    assert "L=1 NH=2 C=32" in r.output
    n = f"{num_parameters(cfg):,}"
    assert f"init: {tmp_path / 'init.bin'} (GPT-2, {n} params)\n" in r.output, r.output


def test_a_run_says_whether_it_saves_a_checkpoint(shards, tmp_path):
    """Without --out nothing is saved, said once at the start; with --out that line is absent."""
    common = [*TINY, "--data", shards / "*train*.bin", "--steps", 1]
    said = "no --out: this run saves no checkpoint"
    assert run(*common).output.count(said) == 1
    assert said not in run(*common, "--out", tmp_path / "run").output


@pytest.mark.parametrize("case", ["magic", "truncated", "vocab", "missing", "backend", "block", "model_bin",
                                  "resume_shape"])
def test_bad_input_one_line_error(case, shards, tmp_path):
    data = shards / "*train*.bin"
    args = [*TINY, "--data", data, "--steps", 1]
    if case == "magic":
        bad = tmp_path / "bad.bin"
        bad.write_bytes(np.zeros(300, np.int32).tobytes())
        args[args.index(data)] = bad
    elif case == "truncated":
        bad = tmp_path / "trunc.bin"
        bad.write_bytes((shards / "tiny_train_000001.bin").read_bytes()[:2000])
        args[args.index(data)] = bad
    elif case == "vocab":
        bad = tmp_path / "big.bin"
        write_shard(bad, np.full(500, 50300))
        args[args.index(data)] = bad
    elif case == "missing":
        args[args.index(data)] = tmp_path / "nothing_*.bin"
    elif case == "backend":
        args[args.index("cpu")] = "nosuchbackend"
    elif case == "block":
        args[args.index("-t") + 1] = "2048"
    elif case == "model_bin":
        (tmp_path / "m.bin").write_bytes(b"\0" * 2000)
        args = ["sample", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin"]
    elif case == "resume_shape":
        run(*args, "--out", tmp_path / "r")
        args[args.index("-b") + 1] = "3"
        args += ["--out", tmp_path / "r", "--resume"]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    r = run(*args, ok=False)
    assert r.exit_code == 2, r.output
    msg = r.output.strip()
    assert msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written or lost


def test_backends_and_help():
    r = run("backends", "--json")
    found = {b["name"]: b for b in json.loads(r.output)}
    assert found["cpu"]["usable"] is True
    for cmd in ("train", "sample", "eval", "backends"):
        assert "Example:" in run(cmd, "--help").output


def test_help_shows_no_doubled_percent_sign():
    """click does not %-format help text: a "%%" written there reaches the reader as it is."""
    import click

    from llmc_cli.commands import main

    def commands(group, path):
        for name, cmd in group.commands.items():
            yield [*path, name]
            if isinstance(cmd, click.Group):
                yield from commands(cmd, [*path, name])
    for path in [[], *commands(main, [])]:
        assert "%%" not in run(*path, "--help").output, path


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "llmc_cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "llmc" in out.stdout


def test_train_without_data_is_one_line_error():
    r = run("train", "--backend", "cpu", "--model", "d2", ok=False)
    msg = r.output.strip()
    assert r.exit_code == 2 and msg.startswith("error:") and "--data" in msg and "\n" not in msg, msg


def test_backend_options_reach_the_plugin_and_bad_ones_are_one_line(tmp_path):
    """--backend-opt KEY=VALUE goes to the plugin that declares KEY; an unknown key, a bad value or a missing '='
    is one line naming the option (train, eval, sample and bench alike)."""
    from click.testing import CliRunner

    from llmc_cli.commands import main
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.registry import create_backend
    assert create_backend("cpu", options={"threads": "3"}).threads == 3
    cfg = preset("d2", n_embd=64)
    write_model(tmp_path / "m.bin", cfg, init_parameters(cfg, 0))
    for opt, expect in (("threads=zero", "threads=zero: expected an integer in [1, 1024]"),
                        ("nope=1", "backend 'cpu' has no such option (options: threads"),
                        ("nope", "--backend-opt 'nope': expected KEY=VALUE")):
        for cmd in (["train", "--data", str(tmp_path / "x.bin")],
                    ["eval", "--checkpoint", str(tmp_path / "m.bin"), "--data", str(tmp_path / "x.bin")],
                    ["sample", "--checkpoint", str(tmp_path / "m.bin"), "--max-new-tokens", "1"]):
            r = CliRunner().invoke(main, [*cmd, "--backend", "cpu", "--backend-opt", opt])
            line = r.output.strip().splitlines()[-1] if r.output.strip() else ""
            assert r.exit_code == 2 and line.startswith("error:") and expect in line, (cmd, opt, r.output)
    r = CliRunner().invoke(main, ["bench", "kernels", "--backend", "cpu", "--model", "d2", "-b", "1", "-t", "8",
                                  "--only", "gelu", "--backend-opt", "nope=1", "--json"])
    assert r.exit_code == 2 and "none of the benchmarked backends has this option" in r.output, r.output
    r = CliRunner().invoke(main, ["backends", "--options", "--json"])
    assert r.exit_code == 0 and '"threads"' in r.output


def test_backend_option_parsers_take_the_option_then_the_environment_and_name_bad_values(monkeypatch):
    """The helpers plugins parse their options with (kernels.option_flag / option_int / option_choice)."""
    from llmc_cli.kernels import BackendUnavailable, option_choice, option_flag, option_int
    monkeypatch.setenv("LLMC_T_OPT", "delayed")
    assert option_choice(None, "mode", ("current", "delayed"), "current", env="LLMC_T_OPT") == "delayed"
    assert option_choice({"mode": " Current "}, "mode", ("current", "delayed"), "x", env="LLMC_T_OPT") == "current"
    assert option_choice(None, "mode", ("current", "delayed"), "current") == "current"
    assert option_flag({"f": "off"}, "f", True) is False and option_flag(None, "f", True) is True
    assert option_int({"n": "7"}, "n", 0) == 7 and option_int(None, "n", 5) == 5
    for call, expect in ((lambda: option_choice({"mode": "later"}, "mode", ("current", "delayed"), "current"),
                          "--backend-opt mode=later: expected one of current, delayed"),
                         (lambda: option_flag({"f": "maybe"}, "f", True), "--backend-opt f=maybe: expected on or off"),
                         (lambda: option_int({"n": "-1"}, "n", 0), "--backend-opt n=-1: expected an integer >= 0")):
        with pytest.raises(BackendUnavailable) as e:
            call()
        assert str(e.value) == expect


def test_cuda_without_a_driver_says_so_in_one_hint(monkeypatch):
    """No NVIDIA driver: the cuda plugin names that, not a missing CuPy (and no pip hints contradicting each other)."""
    import ctypes

    pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    real = ctypes.CDLL

    def no_libcuda(name, *a, **k):
        if "libcuda" in str(name):
            raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
        return real(name, *a, **k)
    monkeypatch.setattr(ctypes, "CDLL", no_libcuda)
    r = run("train", "--backend", "cuda", "--data", "x.bin", ok=False)
    line = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and "no NVIDIA GPU/driver found" in line and "pip install" not in line, r.output


def test_step_lines_say_elapsed_eta_and_tokens_seen(tmp_path, monkeypatch):
    """Not a terminal, but wide (an 80-column one keeps the step, loss, ms, tok/s and ETA: test_progress.py): plain
    step lines, each with tokens seen, elapsed time and the ETA (MFU where the device's peak is known: not for the
    cpu backend)."""
    import io

    from llmc_test_support import phrase_tokens
    from rich.console import Console

    import llmc_cli.commands.progress as progress
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, width=200))
    write_shard(tmp_path / "t_train_000001.bin", phrase_tokens(60))
    run(*TINY, "--data", tmp_path, "--steps", 2)
    steps = [l for l in out.getvalue().splitlines() if l.startswith("step ")]
    assert len(steps) == 2 and all(" tokens | " in l and " elapsed | ETA " in l for l in steps), out.getvalue()
    assert "| 64 tokens |" in steps[0] and "| 128 tokens |" in steps[1] and "MFU" not in out.getvalue(), steps
