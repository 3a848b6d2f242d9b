"""Resumes, writers' cleanup and eval's counting options: a resume refused for a changed data setup in the loader's
words (`num_shards 2 -> 1`), naming neither the option nor the run; `tokenize tinystories --local DIR` passing over
FIFOs, dangling links and unlistable folders (and the generic input path over FIFOs and dangling links); a failed
download leaving the empty folder made for it; a bad `latest` falling back to the newest complete step without a
word; `train --steps 0 --out` writing no checkpoint; `eval --batches` / `--hellaswag-limit` ignored without the
option they count for."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llmc_test_support import TINY, fifo, local_http_server, one_line_error, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import atomic_file, write_dir_beside
from llmc_cli.formats.shards import write_shard
from llmc_cli.tokenizing import downloads


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for i in range(2):
        write_shard(d / f"x_train_{i:06d}.bin", rng.integers(0, 50257, 4096))
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory, two_shards) -> Path:
    """A run of two steps, both checkpointed."""
    out = tmp_path_factory.mktemp("runs") / "run"
    run(*TINY, "--data", two_shards, "--steps", 2, "--checkpoint-every", 1, "--out", out)
    assert ckpt.resolve_checkpoint(out) == out / "step_00000002" / "model.bin"
    return out


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    c = tmp_path / "run"
    shutil.copytree(trained, c)
    return c


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


# ---------------------------------------------------------------------------------------------------------------
# 1. a resume whose data setup changed


def test_a_resume_with_another_data_setup_names_the_option_and_the_run(copy, two_shards, tmp_path):
    """Was: `error: cannot resume the data position, the data setup changed: num_shards 2 -> 1`."""
    before = tree(copy)
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(two_shards / "x_train_000000.bin", one)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for i in range(2):
        shutil.copy(two_shards / f"x_train_{i:06d}.bin", renamed / f"y_train_{i:06d}.bin")
    for data, extra, said in (
            (one, [], "--data gives 1 shard(s) where the run read 2"),
            (two_shards, ["--shuffle"], "--shuffle is given where the run read its data in order"),
            (renamed, [], "is y_train_000000.bin where the run's was x_train_000000.bin")):
        r = run(*TINY, "--data", data, "--steps", 3, "--out", copy, "--resume", *extra, ok=False)
        line = one_line_error(r, f"--resume {copy}: ", said, "give the run's options, or start a new --out")
        assert "num_shards" not in line and "->" not in line, line
    assert tree(copy) == before


def test_a_shuffled_resume_with_another_seed_names_seed(two_shards, tmp_path):
    out = tmp_path / "shuffled"
    run(*TINY, "--data", two_shards, "--steps", 1, "--shuffle", "--out", out)
    one_line_error(run(*TINY, "--data", two_shards, "--steps", 2, "--seed", 7, "--out", out, "--resume", ok=False),
                   f"--resume {out}: --seed 7 where the run shuffled with --seed ")


# ---------------------------------------------------------------------------------------------------------------
# 2. inputs found in a directory that are no files


def _stories(d: Path) -> Path:
    d.mkdir()
    for i in range(3):
        (d / f"data{i:02d}.json").write_text(json.dumps([{"story": f"once upon a time {i}"}]))
    return d


@pytest.mark.parametrize("cmd", ["tinystories", "text"])
def test_a_fifo_or_a_dangling_link_in_an_input_directory_is_refused(tmp_path, cmd):
    """Was: passed over without a word (rglob / is_file), the corpus written without its documents."""
    d = _stories(tmp_path / "in")
    args = ["tokenize", "tinystories", "--local", d] if cmd == "tinystories" else \
        ["tokenize", "text", d, "--text-field", "story"]
    out = tmp_path / "out"
    with fifo(d / "data05.json") as f:
        one_line_error(run(*args, "--out-dir", out, "--workers", 1, ok=False), f"input {f} is a FIFO")
    (d / "data05.json").unlink()
    (d / "data05.json").symlink_to("nowhere")
    one_line_error(run(*args, "--out-dir", out, "--workers", 1, ok=False), "data05.json is a link to nothing")
    assert not out.exists()
    (d / "data05.json").unlink()
    (d / "notes.fifo").symlink_to("nowhere")  # (a name of no input kind is no input: passed over as before)
    assert run(*args, "--out-dir", out, "--workers", 1).exit_code == 0


def test_an_unlistable_folder_under_tinystories_local_is_named(tmp_path):
    caps = "-dac_override,-dac_read_search"
    prefix = [] if os.geteuid() != 0 else ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    if prefix and (shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0):
        pytest.skip("running as root without setpriv: every folder can be listed")
    d = _stories(tmp_path / "in")
    (d / "sub").mkdir()
    (d / "sub" / "data09.json").write_text("[]")
    (d / "sub").chmod(0)
    try:
        r = subprocess.run([*prefix, sys.executable, "-m", "llmc_cli", "tokenize", "tinystories", "--local", str(d),
                            "--out-dir", str(tmp_path / "o"), "--workers", "1"], capture_output=True, text=True,
                           timeout=120)
    finally:
        (d / "sub").chmod(0o755)
    assert r.returncode == 2 and "sub: cannot list this input directory" in r.stderr, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# 3. a failed download leaves no folder


@pytest.fixture
def failing_server(monkeypatch) -> None:
    """Every download URL points at a local server that answers 404."""
    port = local_http_server(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    for k in list(downloads.URLS):
        monkeypatch.setitem(downloads.URLS, k, f"http://127.0.0.1:{port}/{k}")


@pytest.mark.parametrize("cmd", ["tinyshakespeare", "tinystories", "hellaswag"])
def test_a_failed_download_leaves_no_folder(tmp_path, monkeypatch, failing_server, cmd):
    """Was: the empty --out-dir (and its parents; datasets/NAME by default) made for the download stayed."""
    nested = tmp_path / "a" / "b"
    one_line_error(run("tokenize", cmd, "--out-dir", nested, ok=False), "download of http://127.0.0.1", "Not Found")
    monkeypatch.chdir(tmp_path)
    one_line_error(run("tokenize", cmd, ok=False), "download of http://127.0.0.1")
    assert sorted(os.listdir(tmp_path)) == []


def test_atomic_writers_remove_the_folders_they_made_when_they_fail(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError):
        with atomic_file(tmp_path / "kept" / "a" / "b" / "f.bin") as tmp:
            tmp.write_bytes(b"x")
            raise OSError(28, "No space left on device")

    def fail(tmp):
        tmp.mkdir()
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_dir_beside(tmp_path / "kept" / "c" / "d", fail)
    assert os.listdir(tmp_path / "kept") == []
    with atomic_file(tmp_path / "kept" / "a" / "f.bin") as tmp:  # (a write that succeeds keeps its folders)
        tmp.write_bytes(b"x")
    assert (tmp_path / "kept" / "a" / "f.bin").read_bytes() == b"x"


# ---------------------------------------------------------------------------------------------------------------
# 4. a `latest` naming no usable step


@pytest.mark.parametrize("latest", ["garbage\n", "../x\n", "/etc\n", "step_00000009\n", "", "step_00000005\n", "dir"])
def test_a_bad_latest_falls_back_with_a_note(copy, two_shards, latest):
    shards = two_shards
    """Was: the newest complete step was taken silently, whatever `latest` said (a --resume from another step than
    the one the user or a script pointed it at)."""
    if latest == "dir":
        (copy / "latest").unlink()
        (copy / "latest").mkdir()
    else:
        (copy / "latest").write_text(latest)
    (copy / "step_00000005").mkdir()  # (a step folder without a model: latest naming it is no usable step)
    (copy / "step_00000005" / "state.json").write_text("{}")
    r = run("sample", "--backend", "cpu", "--checkpoint", copy, "--max-new-tokens", 1, "--prompt", "hi")
    note = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and note[0].startswith(f"note: {copy}/latest ") and \
        note[0].endswith("; using the newest complete step, step_00000002"), r.stderr
    assert note == [line for line in r.stderr.splitlines() if "latest" in line]  # (said once, as a note only)
    r = run("eval", "--backend", "cpu", "--checkpoint", copy, "--data", str(shards / "*.bin"), "--batches", 1, "-b", 2,
            "-t", 32)
    assert [line for line in r.stderr.splitlines() if line.startswith("note:")] == note, r.stderr
    if latest == "dir":  # (--resume refuses a `latest` that is not a file: llmc would write over it)
        return
    r = run(*TINY, "--data", shards, "--steps", 2, "--out", copy, "--resume")  # (at step 2: nothing to train)
    assert [line for line in r.stderr.splitlines() if line.startswith("note:")] == \
        [note[0].replace("; using ", "; resuming from ")], r.stderr


def test_a_good_latest_or_none_says_nothing(copy):
    r = run("sample", "--backend", "cpu", "--checkpoint", copy, "--max-new-tokens", 1, "--prompt", "hi")
    assert "note:" not in r.stderr
    (copy / "latest").unlink()  # (killed before its first `latest`: the documented recovery, quiet)
    r = run("sample", "--backend", "cpu", "--checkpoint", copy, "--max-new-tokens", 1, "--prompt", "hi")
    assert "note:" not in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# 5. --steps 0


def test_steps_0_with_out_writes_the_initial_checkpoint(two_shards, tmp_path):
    """`--steps 0 --out D` exited 0 with D/config.toml and an empty log but no checkpoint, where the help says one is
    written at the end. The choice: the end of a run of 0 steps is step 0, so its checkpoint is the initial model
    (step_00000000 with a zero optimizer state), a run that --resume continues exactly as if it had never stopped
    and that sample, eval and --init take. A resumed run's first step stays unwritten (it is on disk already)."""
    out = tmp_path / "zero"
    r = run(*TINY, "--data", two_shards, "--steps", 0, "--out", out)
    assert f"checkpoint: {out / 'step_00000000'}" in r.output, r.output
    assert (out / "latest").read_text() == "step_00000000\n"
    assert ckpt.read_run_checkpoint(out)[3]["step"] == 0
    run(*TINY, "--data", two_shards, "--steps", 2, "--out", out, "--resume")
    fresh = tmp_path / "fresh"
    run(*TINY, "--data", two_shards, "--steps", 2, "--out", fresh)
    loss = [[json.loads(line)["loss"] for line in open(d / "log.jsonl")] for d in (out, fresh)]
    assert loss[0] == loss[1] and len(loss[0]) == 2
    before = tree(out)
    r = run(*TINY, "--data", two_shards, "--steps", 2, "--out", out, "--resume")  # (complete: nothing written)
    assert "checkpoint:" not in r.output and tree(out) == before


# ---------------------------------------------------------------------------------------------------------------
# 6. eval options that count for another option


def test_eval_options_without_the_option_they_count_for_are_refused(trained, two_shards):
    ev = ["eval", "--backend", "cpu", "--checkpoint", trained]
    one_line_error(run(*ev, "--hellaswag", "hs.bin", "--batches", 3, ok=False),
                   "--batches: only with --data")
    one_line_error(run(*ev, "--data", two_shards, "--hellaswag-limit", 3, ok=False),
                   "--hellaswag-limit: only with --hellaswag")


def test_a_failed_write_keeps_a_folder_another_writer_made_meanwhile(tmp_path, monkeypatch):
    """Was: make_folders listed the missing folders before it made them, so a folder that a second writer of the
    same new parent made in between (found missing here, made there) was this writer's to remove when its write
    failed: the other writer's folder went from under it."""
    from llmc_cli.formats import files
    theirs = tmp_path / "runs"
    theirs.mkdir()  # (made by the other writer after this one looked)
    real = os.path.lexists
    monkeypatch.setattr(files.os.path, "lexists", lambda p: False if Path(p) == theirs else real(p))
    with pytest.raises(OSError):
        with atomic_file(theirs / "mine" / "f.bin") as tmp:
            tmp.write_bytes(b"x")
            raise OSError(28, "No space left on device")
    assert theirs.is_dir() and os.listdir(theirs) == []
