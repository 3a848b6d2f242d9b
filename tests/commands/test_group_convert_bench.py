"""`llmc bench`, `llmc convert` as a command, and the `llmc` group's own options.

Each test holds one class of problem: the group's options read outside the one-line error
handling (`llmc --bogus`, `--help` into a full disk or a closed pipe), `convert` destinations whose name or place
contradicts what is written (inside the source, `--to run` onto a `.bin`, `m.pt` as a directory, empty paths),
`bench` options that failed only after the whole benchmark (`--plot` into a folder that takes no file) or not at
all (`--plot ''`), `-b`/`-t` that the out-of-memory killer ended, and a training benchmark with no step count."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

TINY = ["--model", "d2", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64", "--block-size", "16",
        "-b", "1", "-t", "8"]


def _llmc(*args, stdout=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc_cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          timeout=120, **kw)


# ---- the `llmc` group's own options -------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [(["--bogus"], "No such option '--bogus'"),
                                          (["--Version"], "Did you mean '--version'?"),
                                          (["--help", "--bogus"], "--bogus")])
def test_the_groups_own_usage_errors_are_one_line(args, needle):
    one_line_error(run(*args, ok=False), needle, "(see ")


def test_a_group_without_its_command_shows_its_help():
    r = run("bench", ok=False)  # (was "error: Usage: ... Options: ..." squeezed into one line)
    assert r.exit_code == 2 and r.output.startswith("Usage:") and "\nCommands:\n" in r.output, r.output
    assert "error:" not in r.output


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["bench", "--help"]])
def test_help_and_version_report_an_output_they_cannot_write(args):
    with open("/dev/full", "w") as full:
        r = _llmc(*args, stdout=full)
    err = r.stderr.decode()
    assert r.returncode == 2 and err == "error: standard output: No space left on device\n", err
    r = _llmc(*args, stdout=subprocess.DEVNULL)
    assert r.returncode == 0
    read, write = os.pipe()
    os.close(read)  # the reader has gone (`llmc --help | head -0`): quiet, 141
    try:
        r = _llmc(*args, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == b"", r.stderr


def test_help_with_standard_output_closed_is_not_a_success():
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and b"closed when llmc started" in r.stderr, r.stderr


# ---- convert --------------------------------------------------------------------------------------------------

@pytest.fixture
def model(tmp_path):
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.models.gpt2 import GPT2Config, init_parameters
    cfg = GPT2Config(block_size=24, vocab_size=150, n_layer=2, n_head=4, n_embd=32)
    write_model(tmp_path / "a.bin", cfg, init_parameters(cfg, 0))
    return tmp_path / "a.bin"


def _tree(root) -> dict:
    return {str(q.relative_to(root)): q.read_bytes() if q.is_file() else None for q in sorted(root.rglob("*"))}


def test_convert_never_writes_inside_its_source_or_over_a_folder_holding_it(tmp_path, model):
    run("convert", model, tmp_path / "hf")
    run("convert", model, tmp_path / "run", "--to", "run")
    before = _tree(tmp_path)
    for src, dst, extra, needle in [
            ("hf", "hf/inner.bin", (), "is inside the source"),
            ("hf", "hf/sub", (), "is inside the source"),
            ("hf", "hf/../hf/deeper/x.bin", (), "is inside the source"),
            ("run", "run/model.bin", (), "is inside the source"),
            ("hf", ".", ("--force",), "holds the source")]:
        msg = one_line_error(run("convert", tmp_path / src, tmp_path / dst, *extra, ok=False), "DST:", needle)
        assert "nothing was changed" in msg
    assert _tree(tmp_path) == before
    (tmp_path / "loop").symlink_to("loop")  # (the containment check must not trip on a loop of links itself)
    for dst in ("loop", "loop/x.bin"):
        one_line_error(run("convert", model, tmp_path / dst, ok=False), "DST:")


@pytest.mark.parametrize("dst, extra, needle", [
    ("b.bin", ("--to", "run"), "--to run writes a run directory, not a .bin model file"),
    ("c.SafeTensors", ("--to", "run"), "not a .safetensors model file"),
    ("m.pt", (), "not a .pt file"),
    ("m.txt", (), "not a .txt file"),
    ("m.Safetensors", (), "a GPT-2 model is written to a .bin file"),
])
def test_convert_destinations_whose_name_contradicts_what_is_written(tmp_path, model, dst, extra, needle):
    before = _tree(tmp_path)
    one_line_error(run("convert", model, tmp_path / dst, *extra, ok=False), f"DST: {tmp_path / dst}", needle)
    assert _tree(tmp_path) == before


def test_convert_takes_a_model_suffix_in_any_case(tmp_path, model):
    r = run("convert", model, tmp_path / "B.BIN")  # (was a Hugging Face directory named B.BIN)
    assert "llm.c model file" in r.output and (tmp_path / "B.BIN").is_file()
    assert (tmp_path / "B.BIN").read_bytes() == model.read_bytes()
    run("convert", model, tmp_path / "Llama-3.2-1B")  # a dot in a directory's name is no suffix of a file's
    assert (tmp_path / "Llama-3.2-1B" / "config.json").is_file()


def test_convert_names_an_empty_path_and_its_own_prefix_once(tmp_path, model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    one_line_error(run("convert", model, "", ok=False), "DST: an empty path")
    one_line_error(run("convert", "", "x.bin", ok=False), "SRC: an empty path")
    assert _tree(tmp_path) == before
    run("convert", model, tmp_path / "r", "--to", "run")
    msg = one_line_error(run("convert", model, tmp_path / "r" / "step_00000000" / "o.bin", ok=False), "checkpoint")
    assert msg.count("DST") == 1, msg  # (was "DST: DST ...")


# ---- bench ----------------------------------------------------------------------------------------------------

def test_bench_refuses_an_empty_plot_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cmd in (["kernels", "--backend", "cpu", *TINY, "--only", "gelu_fwd"], ["overlap", "--backend", "cpu"],
                ["decode", "--backend", "cpu"]):
        r = run("bench", *cmd, "--plot", "", ok=False)
        assert r.exit_code == 2 and r.output.startswith("error: --plot"), r.output
    assert not list(tmp_path.iterdir())


def _no_benchmark(monkeypatch):
    from llmc_cli.commands import bench

    def ran(*a, **kw):
        raise AssertionError("the benchmark ran before --plot was checked")
    for name in ("run_kernels", "run_train", "run_overlap"):
        monkeypatch.setattr(bench, name, ran)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_bench_plot_into_a_folder_that_takes_no_file_is_refused_before_running(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    _no_benchmark(monkeypatch)
    one_line_error(run("bench", "kernels", "--backend", "cpu", *TINY, "--plot", "/proc/llmc-bench.png", ok=False),
                   "--plot /proc/llmc-bench.png: cannot write in /proc", "nothing was run")
    # a read-only file system, as the probe meets it
    import tempfile

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    out = tmp_path / "sub" / "k.png"
    one_line_error(run("bench", "train", "--backend", "cpu", *TINY, "--plot", out, ok=False),
                   f"cannot write in {tmp_path}", "Read-only file system")
    assert not list(tmp_path.iterdir())


def test_bench_plot_probe_leaves_nothing_behind(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    run("bench", "kernels", "--backend", "cpu", *TINY, "--repeat", "1", "--warmup", "0", "--only", "gelu_fwd",
        "--plot", "k.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.png"]


@pytest.mark.parametrize("name, needle", [("", "--backend: an empty name"),
                                          ("cpu,opencl", "give one backend per --backend")])
def test_bench_backend_names_that_are_no_name(name, needle):
    one_line_error(run("bench", "kernels", "--backend", name, *TINY, "--only", "gelu_fwd", ok=False), needle)
    one_line_error(run("bench", "overlap", "--backend", name, ok=False), needle)


def test_bench_train_steps_and_warmup_past_a_runs_count_name_both():
    msg = one_line_error(run("bench", "train", "--backend", "cpu", *TINY, "--steps", "2147483647", "--warmup", "1",
                             ok=False), "--steps 2147483647 --warmup 1")
    assert "2147483648" not in msg and "steps=" not in msg, msg  # (was "--steps ... (got steps=2147483648)")


def test_bench_kernels_shapes_past_host_memory_are_refused_before_allocating(monkeypatch):
    from llmc_cli.bench import kernel_cases
    monkeypatch.setattr(kernel_cases, "_host_available", lambda: 1 << 30)
    big = ["--model", "d2", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64", "--block-size", "1024",
           "-b", "256", "-t", "1024"]
    one_line_error(run("bench", "kernels", "--backend", "cpu", *big, ok=False),
                   "-b 256 -t 1024: the kernel case", "GiB of host memory", "1.0 GiB is available", "lower -b")
    # a case that fits is measured as before
    r = run("bench", "kernels", "--backend", "cpu", *TINY, "--repeat", "1", "--warmup", "0", "--only", "gelu_fwd")
    assert "gelu_fwd" in r.output


def test_bench_train_progress_counts_the_steps():
    from llmc_cli.bench.backends import resolve_backends
    from llmc_cli.bench.train_steps import run_train
    from llmc_cli.models.families import family_for
    cfg = family_for("d2").preset("d2", n_embd=32, n_head=2)
    backends, _ = resolve_backends(["cpu"])
    said: list[str] = []
    res = run_train(backends, cfg, 1, 8, steps=2, warmup=1, progress=said.append)
    assert res["results"] and not res["failed"]
    assert "training on cpu: step 1/3 (warm-up)" in said and "training on cpu: step 3/3" in said, said
    assert np.isfinite(res["results"][0]["loss_last"])


# ---- sampling from masked logits -----------------------------------------------------------------------------

def test_choose_token_still_takes_masked_logits():
    """-inf is how a caller bans a token (choose_token draws around it); only NaN, +inf or
    no finite logit at all is nothing to sample from."""
    from llmc_cli.inference.sampling import NonFiniteLogits, choose_token
    logits = np.array([-np.inf, 1.0, 2.0, -np.inf])
    for kw in ({}, {"temperature": 0.0}, {"top_k": 1}, {"top_p": 0.5}, {"temperature": 0.7, "top_p": 0.99}):
        assert {choose_token(logits, np.random.default_rng(s), **kw) for s in range(20)} <= {1, 2}, kw
    for bad in (np.array([-np.inf, np.nan, 1.0]), np.array([-np.inf, np.inf, 1.0]), np.full(3, -np.inf)):
        with pytest.raises(NonFiniteLogits):
            choose_token(bad, np.random.default_rng(0))


@pytest.mark.parametrize("args, needle", [(["convert"], "Missing argument 'SRC'"),
                                          (["convert", "m.bin"], "Missing argument 'DST'"),
                                          (["sample"], "Missing option '--checkpoint'")])
def test_a_missing_argument_or_option_is_named_as_missing(args, needle):
    one_line_error(run(*args, ok=False), needle, "(see ")  # (was "error: SRC: (see ...)", saying nothing)
