"""The process environment, paths and machine-readable output, across the commands:

* a file name holding a newline, an escape sequence or bytes that are not UTF-8 is still one error line (shown
  escaped, as Python's repr does), never a second line or a terminal's colour change;
* no home directory (HOME unset with no password entry, or HOME empty) is one line naming the variable to set,
  not a traceback, and never a cache or data folder at /;
* LLMC_STEP_PHASES appends only to its own files: a FIFO (which would block), a device or a user's file there is
  one line naming it, unchanged; a write that fails names the file;
* every --json prints strict JSON (NaN and infinities are null) and, when the command fails, nothing on stdout;
* `llmc plot` reads a damaged log (non-UTF-8 bytes, "[[[[..." past the parser's recursion, steps and values of
  the wrong type, integers past float's range) as one line or a plot, never a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from llmc_test_support import TINY, one_line_error, run


NASTY = "no\nsuch\x1b[31m\udcff"  # a newline, an escape sequence, a byte that is not UTF-8 (surrogateescape)


@pytest.fixture(scope="module")
def data(shards):
    """(conftest's tiny shards, under the name these tests use)"""
    return shards


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("envp_run") / "run"
    run(*TINY, "--steps", "1", "--data", data / "tiny_train_000001.bin", "--out", out)
    return out


def _strict_json(text: str):
    def refuse(c):
        raise ValueError(f"{c} is not JSON")
    return json.loads(text, parse_constant=refuse)


class _FullDisk:
    """An open file on a full disk: every write fails with ENOSPC."""

    def write(self, data):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


# ---- names with control characters -------------------------------------------------------------------------------

def test_printable_escapes_what_would_break_the_line():
    from llmc_cli.commands.console import printable
    assert printable("a\nb\tc\r\x1b[31m\x7f\x85\u2028\udcff é ü/[x]") == \
        "a\\nb\\tc\\r\\x1b[31m\\x7f\\x85\\u2028\\xff é ü/[x]"
    assert printable("plain/path.bin") == "plain/path.bin"


@pytest.mark.parametrize("where", ["train --data", "train --init", "train --hellaswag", "train --val-data",
                                   "sample", "eval", "plot", "convert"])
def test_names_with_control_characters_are_one_line(where, data, checkpoint, tmp_path):
    bad = str(tmp_path / NASTY)
    shard = str(data / "tiny_train_000001.bin")
    args = {"train --data": [*TINY, "--data", bad],
            "train --init": [*TINY, "--data", shard, "--init", bad],
            "train --hellaswag": [*TINY, "--data", shard, "--hellaswag", bad, "--hellaswag-every", "1"],
            "train --val-data": [*TINY, "--data", shard, "--val-data", bad],
            "sample": ["sample", "--checkpoint", bad, "--backend", "cpu"],
            "eval": ["eval", "--checkpoint", checkpoint, "--backend", "cpu", "--hellaswag", bad],
            "plot": ["plot", bad],
            "convert": ["convert", bad, str(tmp_path / "out\nname")]}[where]
    r = run(*args, ok=False)
    msg = one_line_error(r)
    assert "\x1b" not in msg and "\udcff" not in msg, msg
    assert ("no\\nsuch" in msg or "'no\\nsuch" in msg) and "\\x1b[31m" in msg, msg


def test_a_name_that_is_not_utf8_from_the_shell_is_one_line(tmp_path):
    """The real thing: bytes from the command line (surrogateescape), and stderr that is a pipe."""
    bad = os.fsencode(str(tmp_path)) + b"/no\nsuch\xff"
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "plot", bad], capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2 and err.count("\n") == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert "no\\nsuch\\xff" in err and r.stdout == b""


# ---- no home directory --------------------------------------------------------------------------------------------

@pytest.fixture
def no_home(monkeypatch):
    """A process as a container's arbitrary uid runs it: no HOME, no password entry, no XDG or LLMC folders."""
    import pwd
    for var in ("HOME", "LLMC_DATA_HOME", "XDG_DATA_HOME", "LLMC_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_entry(uid):
        raise KeyError(uid)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    from llmc_cli.data import tokenizer
    monkeypatch.setattr(tokenizer, "_CACHE", {})  # (this process may have loaded GPT-2's ranks already)


def test_data_home_without_a_home_names_the_variable(no_home, monkeypatch):
    from llmc_cli.data.home import DataHomeError, data_home
    from llmc_cli.formats.files import DataError
    for home in (None, ""):  # unset, or empty (which Python would read as /)
        if home is not None:
            monkeypatch.setenv("HOME", home)
        with pytest.raises(DataHomeError, match="LLMC_DATA_HOME") as e:
            data_home()
        assert isinstance(e.value, DataError)
    monkeypatch.setenv("XDG_DATA_HOME", "relative")  # ignored, as the XDG spec says
    with pytest.raises(DataHomeError):
        data_home()
    monkeypatch.setenv("LLMC_DATA_HOME", "/somewhere")
    assert str(data_home()) == "/somewhere"


def test_sample_without_a_home_is_one_line_or_works(no_home, checkpoint):
    r = run("sample", "--checkpoint", checkpoint, "--backend", "cpu", "--max-new-tokens", "2", ok=False)
    if r.exit_code != 0:  # (GPT-2's ranks where no data home is needed: an installed openai-whisper)
        one_line_error(r, "LLMC_DATA_HOME")


# ---- LLMC_STEP_PHASES ---------------------------------------------------------------------------------------------

def test_step_phases_fifo_is_refused_not_a_hang(data, tmp_path):
    d = tmp_path / "phases"
    d.mkdir()
    os.mkfifo(d / "rank0.jsonl")
    env = dict(os.environ, LLMC_STEP_PHASES=str(d))
    try:
        r = subprocess.run([sys.executable, "-m", "llmc_cli", *TINY, "--steps", "1", "--data",
                            str(data / "tiny_train_000001.bin")], capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("LLMC_STEP_PHASES naming a folder with a FIFO blocked the run")
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and err.startswith("error:"), err
    assert "LLMC_STEP_PHASES" in err and "rank0.jsonl" in err, err
    assert (d / "rank0.jsonl").is_fifo()


def test_step_phases_never_appends_to_a_users_file(data, tmp_path, monkeypatch):
    d = tmp_path / "phases"
    d.mkdir()
    user = d / "rank0.jsonl"
    user.write_bytes(b"my notes\n")
    monkeypatch.setenv("LLMC_STEP_PHASES", str(d))
    r = run(*TINY, "--steps", "1", "--data", data / "tiny_train_000001.bin", ok=False)
    one_line_error(r, "LLMC_STEP_PHASES", "rank0.jsonl")
    assert user.read_bytes() == b"my notes\n"
    user.write_bytes(b"")  # an empty file, or one of its own step lines, is appended to
    run(*TINY, "--steps", "1", "--data", data / "tiny_train_000001.bin")
    run(*TINY, "--steps", "1", "--data", data / "tiny_train_000001.bin")
    assert [json.loads(line)["step"] for line in user.read_text().splitlines()] == [1, 1]


def test_step_phases_write_error_names_the_file(tmp_path):
    from llmc_cli.training.phases import StepPhases

    class Timer:
        def mark(self):
            pass

        def marks(self):
            return []

    p = StepPhases(tmp_path, 0)

    p.file.close()
    p.file = _FullDisk()
    p.begin(Timer())
    with pytest.raises(OSError) as e:
        p.end(1, 0.01)
    from llmc_cli.commands.console import one_line
    line = one_line(e.value)
    assert "rank0.jsonl" in line and "No space left" in line and "LLMC_STEP_PHASES" in line, line


# ---- JSON on stdout -----------------------------------------------------------------------------------------------

def test_json_text_is_strict():
    from llmc_cli.commands.console import json_text
    out = json_text({"loss": float("nan"), "x": [float("inf"), -float("inf"), 1.5], "n": {"m": float("nan")}})
    assert _strict_json(out) == {"loss": None, "x": [None, None, 1.5], "n": {"m": None}}


def test_eval_json_with_a_non_finite_loss_is_strict_json(checkpoint, data, monkeypatch):
    """Finite weights can still overflow to a NaN loss (weights near float32's max): --json says null, as JSON."""
    from llmc_cli.evals import evaluate
    monkeypatch.setattr(evaluate, "evaluate_loss", lambda *a, **k: float("nan"))
    r = run("eval", "--checkpoint", checkpoint, "--backend", "cpu", "--data", data / "tiny_val_000000.bin",
            "-b", "2", "-t", "32", "--json")
    assert _strict_json(r.stdout) == {"loss": None, "batches": 20}


def test_backends_json_is_strict():
    r = run("backends", "--json")
    assert [b["name"] for b in _strict_json(r.stdout)]


def test_bench_json_prints_nothing_when_its_plot_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    r = run("bench", "kernels", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "--vocab-size", "256",
            "-b", "1", "-t", "8", "--repeat", "1", "--warmup", "0", "--only", "matmul", "--json",
            "--plot", tmp_path / "file" / "k.png", ok=False)
    assert r.exit_code == 2 and r.stdout == "", r.stdout[:200]
    assert r.stderr.strip().startswith("error: --plot") and "\n" not in r.stderr.strip(), r.stderr
    r = run("bench", "kernels", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "--vocab-size", "256",
            "-b", "1", "-t", "8", "--repeat", "1", "--warmup", "0", "--only", "matmul", "--json",
            "--plot", tmp_path / "k.png")
    assert _strict_json(r.stdout)["machine"] and (tmp_path / "k.png").is_file()


# ---- llmc plot on damaged logs ------------------------------------------------------------------------------------

GOOD = '{"step": 2, "loss": 3.0, "norm": 1.0, "lr": 0.001, "ms": 10, "tok_per_s": 100}'


WRONG_KIND = {
    "step-str": '{"step": "a", "loss": 3.0}', "step-list": '{"step": [1], "loss": 3.0}',
    "step-nan": '{"step": NaN, "loss": 3.0}', "step-bool": '{"step": true, "loss": 3.0}',
    "step-huge": '{"step": 1e308, "loss": 3.0}', "step-bigint": '{"step": 1' + "0" * 400 + ', "loss": 3.0}',
    "loss-str": '{"step": 1, "loss": "x"}', "loss-inf": '{"step": 1, "loss": Infinity}',
    "tokens-str": '{"step": 1, "loss": 3.0, "tokens": "a"}', "tps-str": '{"step": 1, "loss": 3.0, "tokens_per_step": "abc"}',
    "rate-str": '{"step": 1, "loss": 3.0, "tok_per_s": "a", "ms": 5}', "tokens-list": '{"step": 1, "loss": 3.0, "tokens": [1]}',
    "loss-bigint": '{"step": 1, "loss": 1' + "0" * 400 + "}",
}


def plot_of(line: str, x: str, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n" + GOOD + "\n")
    return run("plot", log, "--x", x, "--out", tmp_path / "p.png", ok=False)


@pytest.mark.parametrize("line", WRONG_KIND.values(), ids=WRONG_KIND.keys())
@pytest.mark.parametrize("x", ["step", "tokens"])
def test_plot_skips_values_of_the_wrong_kind(line, x, tmp_path, monkeypatch):
    """What reaches the drawing is drawable: finite, and within what matplotlib's axes take (charts' limits); the
    drawing itself is stood in for here, and done for real in the test after this one."""
    from llmc_cli import charts
    handed = []

    def drawable(lines, several, x, out):
        for panel, curves in lines.items():
            logy = charts.PANELS[panel][3]
            for *_, xs, ys in curves:
                assert xs and len(xs) == len(ys) and all(abs(a) <= charts.LINEAR_LIMIT for a in xs), (xs, ys)
                assert all(charts.LOG_FLOOR < v <= charts.LOG_LIMIT if logy else abs(v) <= charts.LINEAR_LIMIT
                           for v in ys), ys
        handed.append(str(out))
        return out
    monkeypatch.setattr(charts, "_draw_runs", drawable)
    r = plot_of(line, x, tmp_path)
    assert r.exit_code == 0 or one_line_error(r), (r.output, r.exception)
    assert handed == ([str(tmp_path / "p.png")] if r.exit_code == 0 else []), handed


@pytest.mark.parametrize("name", ["step-huge", "loss-bigint", "tokens-str"])
@pytest.mark.parametrize("x", ["step", "tokens"])
def test_plot_draws_a_log_with_values_of_the_wrong_kind(name, x, tmp_path):
    pytest.importorskip("matplotlib")
    r = plot_of(WRONG_KIND[name], x, tmp_path)
    assert r.exit_code == 0 or one_line_error(r), (r.output, r.exception)
    if r.exit_code == 0:
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content", [b"\xff\xfe{\"step\": 1}\n", b"[" * 100_000 + b"\n", b'{"a": ' * 50_000 + b"\n"],
                         ids=["not-utf8", "deep-list", "deep-object"])
def test_plot_of_a_damaged_log_is_one_line(content, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_bytes(np.frombuffer(content, dtype=np.uint8).tobytes())
    r = run("plot", log, "--out", tmp_path / "p.png", ok=False)
    one_line_error(r, "log.jsonl:1", "not a JSON line")
    assert not (tmp_path / "p.png").exists()


def test_plot_passes_over_what_is_not_a_log_file(tmp_path):
    """A FIFO named like a log in a run directory would block the read; a directory or a device is not a log."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / "log.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    for target, needle in ((run_dir, "no log.jsonl"), (run_dir / "log.jsonl", "not a regular file"),
                           (tmp_path / "dir.jsonl", "no log.jsonl"), ("/dev/zero", "not a regular file")):
        one_line_error(run("plot", target, "--out", tmp_path / "p.png", ok=False), needle)


# ---- --config and --tensorboard -----------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["/dev/zero", "fifo", "/dev/null", "not-utf8", "deep", "huge"])
def test_config_that_is_not_a_file_of_options_is_one_line(what, data, tmp_path):
    """--config reads a regular TOML file or a pipe (`--config <(...)`, a named FIFO whose writer comes later:
    waited for, as `cat` would, not read as empty); /dev/zero would never end; bytes that are not UTF-8 and arrays
    nested past the parser's recursion are "not valid TOML"."""
    path = {"fifo": tmp_path / "c.toml", "not-utf8": tmp_path / "c.toml", "deep": tmp_path / "c.toml",
            "huge": tmp_path / "c.toml"}.get(what, what)
    if what == "fifo":
        os.mkfifo(path)

        def writer():  # a second after llmc opened it
            time.sleep(1.0)
            with open(path, "w") as f:
                f.write("lr = 2e-3\n")
        threading.Thread(target=writer, daemon=True).start()
    elif what == "not-utf8":
        path.write_bytes(b"\xff = 1\n")
    elif what == "deep":
        path.write_text("a = " + "[" * 100_000 + "\n")
    elif what == "huge":
        with open(path, "wb") as f:  # (sparse)
            f.write(b"# options\n")
            f.truncate(1 << 30)
    log = tmp_path / "log.jsonl"
    r = run(*TINY, "--config", path, "--steps", "1", "--data", data / "tiny_train_000001.bin", "--log", log, ok=False)
    if what == "fifo":  # (the lr the --config file gave, as the step's record has it)
        assert r.exit_code == 0 and json.loads(log.read_text())["lr"] == 2e-3, r.output
        return
    one_line_error(r, "error: --config")


@pytest.mark.parametrize("line", ["log = 5", "out = 5", "init = 1.5", "tensorboard = 1", "seq-len = inf"])
def test_config_values_where_a_path_or_an_integer_belongs(line, data, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    r = run(*TINY, "--config", cfg, "--steps", "1", "--data", data / "tiny_train_000001.bin", ok=False)
    one_line_error(r, "c.toml", line.split()[0], "must be")


def test_config_through_a_pipe(data, tmp_path):
    """`--config <(...)`: a pipe, read until its writer closes it."""
    script = (f"{sys.executable} -m llmc_cli {' '.join(TINY)} --steps 1 --data {data / 'tiny_train_000001.bin'} "
              "--config <(sleep 0.5; echo 'lr = 2e-3')")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"COLUMNS": "200"})  # (a wide console's step line shows the lr)
    assert proc.returncode == 0 and "lr 2.00e-03" in proc.stdout, proc.stderr


def test_tensorboard_onto_a_device_names_the_option(data):
    r = run(*TINY, "--steps", "1", "--data", data / "tiny_train_000001.bin", "--tensorboard", "/dev/null", ok=False)
    err = r.stderr.strip()  # (the run's first lines are on stdout)
    assert r.exit_code == 2 and err.startswith("error: --tensorboard /dev/null") and "\n" not in err, err


def test_a_log_that_cannot_grow_names_the_log(data, tmp_path):
    """A real EFBIG (RLIMIT_FSIZE) on --log's append: the write's error names no file, the line must."""
    log = tmp_path / "log.jsonl"
    line = json.dumps({"step": 1, "loss": 1.0}) + "\n"
    log.write_text(line * ((1 << 20) // len(line)))
    limit = log.stat().st_size + 10
    code = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            "from llmc_cli.commands import main; sys.argv = ['llmc'] + sys.argv[1:]; main()")
    proc = subprocess.run([sys.executable, "-c", code, *TINY, "--steps", "2", "--data",
                           str(data / "tiny_train_000001.bin"), "--log", str(log)], capture_output=True, text=True,
                          timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and "Traceback" not in err, err
    assert str(log) in err and "File too large" in err and "--log" in err, err


def test_tensorboard_write_error_names_the_event_file(tmp_path):
    from llmc_cli.formats.tensorboard import EventWriter
    w = EventWriter(tmp_path / "tb")

    w._f.close()
    w._f = _FullDisk()
    with pytest.raises(OSError) as e:
        w.write_record({"step": 1, "loss": 2.0})
    assert e.value.filename == str(w.path) and e.value.errno == 28


def test_plot_never_replaces_a_symbolic_link_to_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    log.write_text(GOOD + "\n")
    loop, dangling = tmp_path / "loop.png", tmp_path / "dangling.png"
    loop.symlink_to(loop.name)
    dangling.symlink_to(tmp_path / "nowhere" / "x.png")
    for link in (loop, dangling):
        r = run("plot", log, "--out", link, ok=False)
        one_line_error(r, "symbolic link")
        assert link.is_symlink()


@pytest.mark.parametrize("endpoint", ["http://x:99999", "http://[::1", "garbage", "ftp://hub"])
def test_hf_endpoint_that_is_not_a_url_names_the_variable(endpoint, monkeypatch):
    """urllib reads a port past 65535 or a broken IPv6 host with a ValueError: a traceback before any download."""
    from llmc_cli.formats.files import DataError
    from llmc_cli.tokenizing.downloads import hf_check
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(DataError, match="HF_ENDPOINT="):
        hf_check("HuggingFaceFW/fineweb")


def test_a_terminal_that_cannot_show_a_name_gets_an_escape_not_a_traceback(data, tmp_path):
    """PYTHONIOENCODING=ascii (or a Latin-1 locale) and a data path with an é: the run's lines show it escaped."""
    d = tmp_path / "donn\u00e9es"
    d.mkdir()
    (d / "tiny_train_000001.bin").write_bytes((data / "tiny_train_000001.bin").read_bytes())
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    proc = subprocess.run([sys.executable, "-m", "llmc_cli", *TINY, "--steps", "1", "--data",
                           str(d / "tiny_train_000001.bin")], capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    assert b"donn\\xe9es" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "llmc_cli", "plot", str(d / "missing.jsonl")], capture_output=True,
                          timeout=120, env=env)
    err = proc.stderr.decode("ascii")
    assert proc.returncode == 2 and err.count("\n") == 1 and "donn\\xe9es" in err, err


def test_convert_force_onto_a_fifo_is_refused_not_a_hang(checkpoint, tmp_path):
    """`--force` reads what is at DST to tell an earlier conversion: reading a FIFO would wait for ever."""
    fifo = tmp_path / "model.bin"
    os.mkfifo(fifo)
    try:
        proc = subprocess.run([sys.executable, "-m", "llmc_cli", "convert", str(checkpoint), str(fifo), "--force"],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("convert --force onto a FIFO blocked")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and "will not replace it" in err, err
    assert fifo.is_fifo()


def test_config_toml_of_a_run_whose_path_is_not_utf8_reads_back(data, tmp_path):
    """OUT/config.toml holds the options a run used, for --config: a TOML string cannot hold a byte that is not
    UTF-8, so such a path is left out (said in a comment) rather than written as a "\\udcff" TOML refuses. (The
    path is the str Python makes of such argv bytes, surrogateescape: the shell's bytes themselves are
    test_a_name_that_is_not_utf8_from_the_shell_is_one_line's.)"""
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    base = [*TINY, "--data", data / "tiny_train_000001.bin"]
    run(*base, "--steps", "1", "--out", out)
    cfg = out + "/config.toml"
    assert b"\\udcff" not in open(cfg, "rb").read()
    run(*base, "--config", cfg, "--steps", "2", "--out", out, "--resume")
