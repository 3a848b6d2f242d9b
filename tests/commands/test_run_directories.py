"""`train`, `sample` and `convert` on run directories and paths at their edges: a
symbolic link or a user's file under a lock's name, folders and files beside the checkpoints that only look like
them, `--resume` with another run's log or a bad option, config.toml after a resume, empty paths, a `--log` onto
the run's own files, `--out` under a file, a Hugging Face config listing fewer layers than its weights, a prompt
that is not UTF-8, launcher variables that are not integers, a working directory deleted under the shell."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llmc_test_support import TINY, last_line_error, run
from llmc_test_support import train_tiny as train

from llmc_cli.parallel.comm import CommError, discover

LLMC = [sys.executable, "-m", "llmc_cli"]


one_line_error = last_line_error


def test_a_link_or_a_users_file_under_the_lock_name_is_never_written(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    precious = tmp_path / "p.txt"
    precious.write_text("precious\n")
    (out / ".lock").symlink_to(precious)
    one_line_error(train(data, "--steps", 2, "--out", out, "--resume", ok=False), "is a symbolic link")
    assert precious.read_text() == "precious\n" and (out / ".lock").is_symlink()
    (out / ".lock").unlink()
    (out / ".lock").write_text("my notes\n")
    one_line_error(train(data, "--steps", 2, "--out", out, "--resume", ok=False), "not an llmc lock file")
    assert (out / ".lock").read_text() == "my notes\n"


def test_keep_rotates_only_llmcs_own_step_folders(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 2, "--out", out)
    backup = out / "step_00000002.bak"
    os.system(f"cp -a '{out / 'step_00000002'}' '{backup}'")
    (out / "step_best").mkdir()
    (out / "step_best" / "notes").write_text("n")
    train(data, "--steps", 4, "--out", out, "--resume", "--keep", 1, "--checkpoint-every", 1)
    assert backup.is_dir() and (out / "step_best" / "notes").read_text() == "n"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_0")) == ["step_00000002.bak",
                                                                                   "step_00000004"]


def test_a_file_under_a_step_name_is_refused_not_moved_aside(tmp_path, data):
    out = tmp_path / "o"
    out.mkdir()
    (out / "step_00000001").write_text("precious")
    one_line_error(train(data, "--steps", 1, "--out", out, ok=False), "step_00000001 is not a checkpoint folder")
    assert sorted(os.listdir(out)) == ["step_00000001"] and (out / "step_00000001").read_text() == "precious"


def test_config_toml_after_a_resume_records_the_options_in_effect(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out, "--lr", "1e-3")
    train(data, "--steps", 2, "--out", out, "--resume")
    text = (out / "config.toml").read_text()
    assert 'model = "d2"' in text and "lr = 0.001" in text and "batch-size = 2" in text, text


def test_a_resume_never_trims_another_runs_log_nor_one_it_fails_to_start(tmp_path, data):
    other = tmp_path / "other"
    train(data, "--steps", 4, "--out", other)
    log = other / "log.jsonl"
    before = log.read_bytes()
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    one_line_error(train(data, "--steps", 2, "--out", out, "--resume", "--log", log, "--tensorboard", os.devnull,
                         ok=False), "--tensorboard")
    assert log.read_bytes() == before
    train(data, "--steps", 2, "--out", out, "--resume", "--log", log)
    assert log.read_bytes().startswith(before) and len(log.read_bytes()) > len(before)  # appended to, not cut


@pytest.mark.parametrize("option", ["--out", "--init", "--log", "--tensorboard", "--hellaswag"])
def test_an_empty_path_is_refused_not_taken_as_left_out(tmp_path, data, option):
    one_line_error(train(data, "--steps", 1, option, "", ok=False), f"{option}: an empty path")


@pytest.mark.parametrize("name", [".lock", "latest", "config.toml"])
def test_a_log_onto_the_run_directorys_own_files_is_refused(tmp_path, data, name):
    out = tmp_path / "r"
    one_line_error(train(data, "--steps", 1, "--out", out, "--log", out / name, ok=False), "--log",
                   "a file of the run directory's own")
    assert not out.exists()


def test_out_under_a_file_names_out(tmp_path, data):
    f = tmp_path / "a.txt"
    f.write_text("x")
    one_line_error(train(data, "--steps", 1, "--out", f / "run", ok=False), "--out", "is not a directory")


def test_a_hugging_face_config_listing_fewer_layers_than_its_weights(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    hf = tmp_path / "hf"
    run("convert", out, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["n_layer"] = 1
    (hf / "config.json").write_text(json.dumps(cfg))
    one_line_error(run("convert", hf, tmp_path / "m.bin", ok=False), "weights of layer 1", "n_layer = 1")
    assert not (tmp_path / "m.bin").exists()


def test_a_prompt_that_is_not_utf8_is_refused(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    p = subprocess.run([*LLMC, "sample", "--checkpoint", str(out), "--backend", "cpu", "--max-new-tokens", "1",
                        "--prompt", os.fsdecode(b"a\xff")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == ("error: --prompt: not UTF-8 text (byte 0xff); give UTF-8, or "
                                                       "the text in a UTF-8 file with --prompt-file"), p.stderr


def test_a_launcher_variable_that_is_not_an_integer_is_named():
    with pytest.raises(CommError, match="SLURM_LOCALID='x' is not an integer"):
        discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "x"})
    with pytest.raises(CommError, match="SLURM_NTASKS='two' is not an integer"):
        discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"})


def test_a_deleted_working_directory_is_said(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    p = subprocess.Popen([*LLMC, "train", "--backend", "cpu", "--steps", "1", "--out", "rel"], cwd=gone,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.rmdir(gone))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.strip() == ("error: the current directory no longer exists (deleted while this "
                                                 "shell was in it); cd to a directory that does"), err
    assert not Path(tmp_path / "rel").exists()


def test_a_plot_is_never_written_into_a_checkpoint_folder(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    step = out / "step_00000001"
    before = sorted(os.listdir(step))
    one_line_error(run("plot", out, "--out", step / "curves.png", ok=False), "--out", "is inside the checkpoint")
    assert sorted(os.listdir(step)) == before


def test_folders_made_for_a_run_that_cannot_start_go_again(tmp_path, data):
    """Under `umask 777` the run's parent folder is made unusable (mode 000): the run directory inside it fails,
    and the parent stayed behind."""
    import shutil
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search,-fowner"
        if shutil.which("setpriv") is None or subprocess.run(
                ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "true"]).returncode != 0:
            pytest.skip("running as root without setpriv: umask 777 stops nothing")
        prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    else:
        prefix = []
    p = subprocess.run([*prefix, *LLMC, *TINY, "--data", data, "--steps", "1", "--out", str(tmp_path / "um" / "run")],
                       capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o777))
    assert p.returncode == 2 and "cannot create the run directory" in p.stderr, p.stderr
    assert not (tmp_path / "um").exists()


def test_bench_decode_with_a_window_of_one_names_the_window():
    one_line_error(run("bench", "decode", "--backend", "cpu", "--model", "d2", "-t", 1, ok=False),
                   "-t/--seq-len 1: the window must hold the prompt")


def test_a_link_planted_at_latest_is_replaced_not_written_through(tmp_path, data):
    out = tmp_path / "run"
    train(data, "--steps", 1, "--out", out)
    precious = tmp_path / "p.txt"
    precious.write_text("step_00000001\n")
    (out / "latest").unlink()
    (out / "latest").symlink_to(precious)
    train(data, "--steps", 2, "--out", out, "--resume")
    assert precious.read_text() == "step_00000001\n"
    assert not (out / "latest").is_symlink() and (out / "latest").read_text() == "step_00000002\n"
