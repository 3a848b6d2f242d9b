"""Interruptions and concurrent writers, for the commands that write files.

Each interrupted process is held inside a chosen function by a small wrapper (`_PAUSE`: the function's Nth call
touches a marker file and sleeps), so the signal lands at a known moment; the test polls for the marker with a
deadline and never sleeps for correctness.

* `convert` to a Hugging Face directory killed (SIGKILL, SIGTERM) mid-write left its whole temporary model folder
  `.DST.tmp-PID` beside DST for ever; `convert --to run` killed so left `DST/step_00000000/`, and the rerun was refused
  ("belongs to a run directory"). Now the run is written beside too, and what a dead writer left is removed by the
  next conversion to that name.
* Every other atomic write (`plot --out`, the HellaSwag eval file, `convert x.bin`) killed mid-write left
  `.NAME.PID.tmp` for ever (only `tokenize` removed its own); now the next write of NAME removes a dead writer's.
* `tokenize` killed between its first shard and the first manifest left shards without a manifest: the rerun was
  refused ("without a manifest to resume from"). The manifest is now written before the run's first shard.
* Two `convert` to one destination at once both passed the "new destination" check: the later replaced the other's
  output unasked (without --force) or failed half-way on its rename. The second is now refused in one line.
* Two `train` runs given the same `--log` (different `--out`) interleaved their records in one file. The second is
  now refused in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from llmc_test_support import TINY, phrase_tokens, run

from llmc_cli.formats.shards import write_shard

_PAUSE = r'''
import importlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job may start with SIGINT ignored)
marker, mod, attr, nth, when = sys.argv[1:6]
m, count = importlib.import_module(mod), [0]
real = getattr(m, attr)
def held(*a, **k):
    count[0] += 1
    if count[0] == int(nth) and when == "before":
        open(marker, "w").close(); time.sleep(600)
    r = real(*a, **k)
    if count[0] == int(nth) and when == "after":
        open(marker, "w").close(); time.sleep(600)
    return r
setattr(m, attr, held)
sys.argv = ["llmc"] + sys.argv[6:]
from llmc_cli.commands import main
main()
'''


class Held:
    """`llmc ARGS` in a subprocess, held at the `nth` call of `mod.attr` (before or after it runs)."""

    def __init__(self, tmp_path: Path, where: str, args, nth: int = 1, when: str = "after", cwd=None):
        script = tmp_path / "_pause.py"
        script.write_text(_PAUSE)
        self.marker = tmp_path / f"_held.{time.monotonic_ns()}"
        mod, attr = where.split(":")
        self.p = subprocess.Popen([sys.executable, str(script), str(self.marker), mod, attr, str(nth), when,
                                   *[str(a) for a in args]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  cwd=cwd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 120
        while not self.marker.exists():
            if self.p.poll() is not None:
                raise AssertionError(f"exited {self.p.returncode} before {where}: {self.p.stdout.read().decode()}")
            assert time.monotonic() < deadline, f"never reached {where}"
            time.sleep(0.02)
        self.marker.unlink()

    def kill(self, sig=signal.SIGKILL) -> int:
        self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout=60)
        finally:
            self.p.stdout.close()
        return rc


def files(d: Path) -> dict:
    """Each file's bytes, but for the run's id (random for each new run directory, by design) where it stands."""
    got = {str(q.relative_to(d)): q.read_bytes() if q.is_file() else None for q in sorted(d.rglob("*"))}
    ident = got.get("run_id")
    if ident:
        got = {k: v.replace(ident.strip(), b"<run id>") if v else v for k, v in got.items()}
    return got


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny GPT-2 run directory (one step trained) to convert."""
    d = tmp_path_factory.mktemp("interrupts")
    write_shard(d / "t_train_000001.bin", phrase_tokens(20))
    run(*TINY, "--data", d / "t_train_000001.bin", "--steps", "1", "--out", d / "run")
    return d / "run"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("to, where", [("hf", "llmc_cli.formats.hf:write_safetensors"),
                                       ("run", "llmc_cli.formats.checkpoint:write_model_file")])
def test_convert_killed_mid_write_leaves_nothing_a_rerun_trips_on(model, tmp_path, to, where, sig):
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir(), out.mkdir()
    extra = ["--to", "run"] if to == "run" else []
    run("convert", model, ref / "dst", *extra)
    (out / "notes.txt").write_text("mine")
    Held(tmp_path, where, ["convert", model, out / "dst", *extra]).kill(sig)
    assert not (out / "dst").exists(), sorted(p.name for p in out.iterdir())  # nothing half-written under DST
    run("convert", model, out / "dst", *extra)  # the rerun succeeds ...
    assert sorted(p.name for p in out.iterdir()) == ["dst", "notes.txt"]  # ... and takes what the killed one left
    assert (out / "notes.txt").read_text() == "mine"
    assert files(out / "dst") == files(ref / "dst")  # the same as an uninterrupted conversion


@pytest.mark.parametrize("what", ["plot", "hellaswag", "convert"])
def test_a_killed_writers_temporary_goes_with_the_next_write(model, tmp_path, what):
    """SIGKILL after the temporary is written, before its rename: the real name is untouched (absent, or the earlier
    file); the next write of that name succeeds and removes the dead writer's `.NAME.PID.tmp`."""
    if what == "plot":
        pytest.importorskip("matplotlib")
        args, dst = ["plot", model, "--out", tmp_path / "p.png"], tmp_path / "p.png"
    elif what == "hellaswag":
        src = tmp_path / "h.jsonl"
        src.write_text(json.dumps({"ctx": "A man", "endings": [" a", " b", " c", " d"], "label": 1}) + "\n")
        args, dst = ["tokenize", "hellaswag", "--local", src, "--out-dir", tmp_path], tmp_path / "hellaswag_val.bin"
    else:
        args, dst = ["convert", model, tmp_path / "m.bin"], tmp_path / "m.bin"
    (tmp_path / "notes.txt").write_text("mine")
    Held(tmp_path, "os:fsync", args, when="before").kill()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.") and p.name.endswith(".tmp")]
    assert len(left) == 1 and not dst.exists(), left  # (what the kill left: the temporary, not DST)
    run(*args)
    assert dst.is_file() and (tmp_path / "notes.txt").read_text() == "mine"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.")]


def test_tokenize_killed_between_a_shard_and_its_manifest_resumes(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(f"word{i % 97}" for i in range(3000)))
    args = ["tokenize", "text", corpus, "--workers", "1", "--shard-size", "1000", "--out-dir"]
    run(*args, tmp_path / "ref")
    for nth in (1, 2):  # after the first shard of a fresh run, then after the first shard of the resumed run
        Held(tmp_path, "llmc_cli.tokenizing.pipeline:write_shard", [*args, tmp_path / "o"], nth=1).kill()
        assert (tmp_path / "o" / "c_manifest.json").is_file()  # the manifest came first: the shards can be resumed
    run(*args, tmp_path / "o")
    assert files(tmp_path / "o") == files(tmp_path / "ref")


def test_two_converts_to_one_destination(model, tmp_path):
    """The second is refused in one line while the first writes; the first's output stands alone."""
    held = Held(tmp_path, "llmc_cli.formats.hf:write_safetensors", ["convert", model, tmp_path / "hf"])
    try:
        before = files(tmp_path)
        for extra in ([], ["--force"]):
            r = run("convert", model, tmp_path / "hf", *extra, ok=False)
            line = r.output.strip()
            assert r.exit_code == 2 and "\n" not in line, line
            assert line.startswith(f"error: DST: {tmp_path / 'hf'} is in use by another llmc process (pid "), line
            assert files(tmp_path) == before
    finally:
        held.kill(signal.SIGTERM)
    run("convert", model, tmp_path / "hf")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")]


def test_two_runs_with_one_log_are_refused(model, tmp_path):
    data = model.parent / "t_train_000001.bin"
    log = tmp_path / "shared.jsonl"
    held = Held(tmp_path, "llmc_cli.training.trainer:open_log",
                [*TINY, "--data", data, "--steps", "3", "--out", tmp_path / "a", "--log", log])
    try:
        before = log.read_bytes()
        alias = tmp_path / "alias.jsonl"  # (the same log under another name: they meet at the file it names)
        alias.symlink_to(log)
        r = run(*TINY, "--data", data, "--steps", "3", "--out", tmp_path / "b", "--log", alias, ok=False)
        line = r.output.strip()
        assert r.exit_code == 2 and "\n" not in line and "is in use by another llmc process (pid " in line, line
        assert f"--log {alias} " in line and log.read_bytes() == before
        assert not (tmp_path / "b").exists()
    finally:
        held.kill()
    run(*TINY, "--data", data, "--steps", "2", "--out", tmp_path / "b", "--log", log)  # the lock died with it
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines()]
    assert steps == [1, 2], steps

