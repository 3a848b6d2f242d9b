"""`llmc train --resume`, `llmc sample`, `llmc eval` and `llmc bench` in odd states, each case as found:

* a damaged state.json's recorded options (-5 sequences, a NaN learning rate, 1e30 or infinitely many steps, a list
  for --model, 'yes' for a flag) were taken past click's checks: a traceback, a run of 10**30 steps, or an error
  naming a flag the user never gave; now each is checked as the command line's own and named in the file;
* resuming a copy (or a move) of a run directory trimmed and appended to the log of the directory it was copied
  from (its state.json records that path); the run's own files now follow the directory being resumed;
* OUT/latest that is a directory, a FIFO or a link to nothing was passed over when reading and failed only after
  the steps had run (a doubled message), or was replaced; now refused before anything runs;
* --resume with --steps below the run's step did nothing and exited 0; --resume of an empty or missing directory
  said "not a model file"; an --out that is a link to nothing said "File exists";
* --plot (and `llmc plot --out`) under a path whose folder is a file failed only after the whole benchmark;
* `bench train --steps 2147483647` without --data asked for a random shard of a token per step (128 GiB).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from llmc_test_support import TINY, one_line_error, run


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """A run of 2 steps (checkpoints at 1 and 2), with its own log."""
    rd = tmp_path_factory.mktemp("runs") / "run"
    run(*TINY, "--data", shards / "tiny_train_000001.bin", "--steps", 2, "--checkpoint-every", 1, "--out", rd)
    return rd


@pytest.fixture
def copy(trained, tmp_path):
    """A copy of the trained run, free to damage."""
    rd = tmp_path / "copy"
    shutil.copytree(trained, rd)
    return rd


def tree(d) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def resume(rd, *args, ok: bool = False):
    return run("train", "--backend", "cpu", "--out", rd, "--resume", *args, ok=ok)


@pytest.mark.parametrize("damage, needle", [
    (lambda a: a.update(batch_size=-5), "batch_size must be >= 1 (got -5)"),
    (lambda a: a["optim"].update(lr=float("nan")), "lr must be a finite number (got nan)"),
    (lambda a: a.update(steps=float("inf")), "steps must be an integer (got inf)"),
    (lambda a: a.update(warmup=10**30), "warmup must be <= 2147483647"),
    (lambda a: a.update(seq_len="abc"), "seq_len must be an integer (got 'abc')"),
    (lambda a: a.update(model=["x"]), "model must be a single value, not a list"),
    (lambda a: a.update(shuffle="yes"), "shuffle must be true or false (got 'yes')"),
    (lambda a: a.update(log=5), "log must be a string (got 5)"),
    (lambda a: a.update(zero=7), "zero: '7' is not one of"),
    (lambda a: a.update(optim=5), "args 'optim' must be a JSON object"),
])
def test_damaged_recorded_options_are_named_in_the_state_file(copy, damage, needle):
    state = copy / "step_00000002" / "state.json"
    s = json.loads(state.read_text())
    damage(s["args"])
    state.write_text(json.dumps(s))  # (NaN and Infinity as Python's json writes them)
    before = tree(copy)
    one_line_error(resume(copy), "--resume", str(state), needle)
    assert tree(copy) == before


def test_a_damaged_recorded_option_given_on_the_command_line_is_not_read(copy, shards):
    state = copy / "step_00000002" / "state.json"
    s = json.loads(state.read_text())
    s["args"]["steps"] = 10**30
    state.write_text(json.dumps(s))
    resume(copy, "--steps", 3, ok=True)
    assert (copy / "step_00000003").is_dir()


def test_resuming_a_copy_of_a_run_leaves_the_original_log_alone(trained, copy):
    original = (trained / "log.jsonl").read_bytes()
    r = resume(copy, "--steps", 3, ok=True)
    assert "--log" not in r.output, r.output  # (not taken from the run: the copy's own)
    assert (trained / "log.jsonl").read_bytes() == original
    assert [json.loads(line)["step"] for line in (copy / "log.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert json.loads((copy / "step_00000003" / "state.json").read_text())["args"]["log"] == str(copy / "log.jsonl")


@pytest.mark.parametrize("what", ["directory", "fifo", "dangling"])
def test_latest_that_is_not_a_file_is_refused_before_the_run(copy, what):
    latest = copy / "latest"
    latest.unlink()
    if what == "directory":
        latest.mkdir()
    elif what == "fifo":
        os.mkfifo(latest)
    else:
        latest.symlink_to("nowhere")
    before = sorted(p.name for p in copy.iterdir())
    line = one_line_error(resume(copy, "--steps", 3), f"{latest} is", "nothing was changed")
    assert "step_00000003" not in line
    assert sorted(p.name for p in copy.iterdir()) == before
    assert os.path.lexists(latest) and not latest.is_file()


def test_resume_with_fewer_steps_than_the_run_has_is_refused(copy):
    before = tree(copy)
    one_line_error(resume(copy, "--steps", 1), "--steps 1", "already at step 2", "--steps 2 or more")
    assert tree(copy) == before
    resume(copy, "--steps", 2, ok=True)  # the run is complete: nothing to do, not an error


def test_resume_of_no_run_and_an_out_that_is_a_link_to_nothing(shards, tmp_path):
    (tmp_path / "empty").mkdir()
    for d in (tmp_path / "empty", tmp_path / "missing"):
        one_line_error(run(*TINY, "--data", shards, "--steps", 1, "--out", d, "--resume", ok=False),
                       "--resume", f"--out {d} holds no run to continue")
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    for resuming in ([], ["--resume"]):
        one_line_error(run(*TINY, "--data", shards, "--steps", 1, "--out", loop, *resuming, ok=False),
                       f"--out {loop} is a symbolic link to nothing")
    assert os.readlink(loop) == "loop"


def test_a_run_without_a_complete_step_and_a_runs_other_files_as_models(trained, shards, tmp_path):
    """A run killed while writing its first checkpoint (an empty step folder, no 'latest') was "not a model file";
    a step folder's state.json or optimizer.npz given as a model was "header length 8315740998472829563 is
    implausible (not a safetensors file)". Each line now says what is there and what was expected."""
    half = tmp_path / "half"
    (half / "step_00000002").mkdir(parents=True)
    before = tree(half)
    one_line_error(run(*TINY, "--data", shards, "--steps", 1, "--out", half, "--resume", ok=False),
                   f"{half}: a run directory with no complete checkpoint", "step_00000002")
    one_line_error(run("sample", "--checkpoint", half, ok=False), "no complete checkpoint")
    assert tree(half) == before
    step = trained / "step_00000002"
    for name in ("state.json", "optimizer.npz"):
        for cmd in (["sample", "--checkpoint"], ["eval", "--data", shards, "--checkpoint"],
                    [*TINY, "--data", shards, "--steps", 1, "--init"]):
            line = one_line_error(run(*cmd, step / name, ok=False), f"{step / name}: not a model file",
                                  "expected an llm.c .bin", f"give that, or its model file {step / 'model.bin'}")
            assert "implausible" not in line
    junk = tmp_path / "weights.pt"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    line = one_line_error(run("sample", "--checkpoint", junk, ok=False), f"{junk}: not a model file")
    assert "step directory: give" not in line


def test_sample_shows_control_bytes_escaped_on_a_terminal_and_as_written_into_a_pipe(trained, monkeypatch):
    """A model's text can hold any bytes (an untrusted checkpoint's, on purpose): on a terminal an escape sequence
    printed raw retitles the window or clears the screen; it is now shown escaped there, and goes as the model
    wrote it into a pipe or a file."""
    import llmc_cli.commands.sample as sample_cmd
    import llmc_cli.inference.sampling as sampling
    from llmc_cli.data.tokenizer import load_tokenizer
    text = "\x1b]0;owned\x07 red\x1b[31m\rline"
    ids = load_tokenizer("gpt2").encode(text)
    monkeypatch.setattr(sampling, "generate", lambda *a, **k: iter(ids))
    args = ("sample", "--backend", "cpu", "--checkpoint", trained, "--max-new-tokens", len(ids),
            "--prompt", "\x1b[2J hi")
    raw = run(*args).output
    assert "\x1b[2J hi" + text in raw, repr(raw)

    monkeypatch.setattr(sample_cmd, "_stdout_is_terminal", lambda: True)
    shown = run(*args).output
    assert "\\x1b[2J hi\\x1b]0;owned\\x07 red\\x1b[31m\\rline" in shown, repr(shown)
    assert not any(c in shown for c in "\x1b\x07\r"), repr(shown)


def test_plot_under_a_file_is_refused_before_the_benchmark(trained, tmp_path):
    mine = tmp_path / "mine.png"
    mine.write_text("mine")
    r = run("bench", "kernels", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "--vocab-size", "256",
            "-b", "1", "-t", "8", "--repeat", "1", "--warmup", "0", "--only", "matmul", "--plot", mine / "k.png",
            ok=False)
    one_line_error(r, f"--plot {mine / 'k.png'}", "is not a directory")
    assert "matmul" not in r.output  # refused before any table
    one_line_error(run("plot", trained, "--out", mine / "p.png", ok=False), "--out", "is not a directory")
    assert mine.read_text() == "mine"


def test_bench_train_many_steps_writes_a_bounded_random_shard(monkeypatch):
    """Without --data, the random shard held a token for every step: --steps 2147483647 -b 1 -t 8 asked numpy for
    128 GiB of ids ("out of host memory; lower -b or -t", which were not the cause). The loader wraps around."""
    from llmc_cli.bench import train_steps
    from llmc_cli.bench.backends import BenchError
    asked = []

    def record(directory, cfg, ntokens, seed):
        asked.append(ntokens)
        raise BenchError("stop here")  # (the shard itself is not the point)
    monkeypatch.setattr(train_steps, "random_shard", record)
    r = run("bench", "train", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "-b", "1", "-t", "8",
            "--steps", 2147483647, "--warmup", 0, ok=False)
    one_line_error(r, "stop here")
    assert asked and asked[0] <= train_steps.RANDOM_SHARD_TOKENS, asked
