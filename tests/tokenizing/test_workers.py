"""The tokenizer worker processes: results in order and equal to one process's, a worker that dies or fails named in
one line, a signal to the whole group answered by the parent alone, and no worker outliving its parent."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.tokenizing import workers


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gpt2", None)


def batches(n: int, docs: int = 3):
    for b in range(n):
        yield ([b * docs + i for i in range(docs)], [None] * docs,
               [f"batch {b} doc {i} " + "the quick brown fox " * (7 * i + b % 5) for i in range(docs)])


def flat(results):
    return [(idx, arr.tolist(), lens.tolist(), nbytes) for idx, _, arr, lens, nbytes in results]


def ours() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("llmc-tokenize-")]


@pytest.mark.parametrize("n", [2, 3])
def test_workers_give_one_process_results_in_order(tok, n):
    one = flat(workers.encoded(batches(17), 1, tok))
    many = flat(workers.encoded(batches(17), n, tok))
    assert many == one and [r[0][0] for r in many] == [3 * b for b in range(17)]
    assert not ours()


def test_a_killed_worker_is_named_and_the_others_end(tok):
    stream = workers.encoded(batches(40), 3, tok)
    next(stream)  # (worker 1's first batch; worker 2's is the next one wanted)
    (victim,) = [p for p in ours() if p.name == "llmc-tokenize-2"]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(workers.WorkerDied, match=r"worker 2 of 3 \(pid \d+\) was killed by SIGKILL .*resume"):
        for _ in stream:
            pass
    assert not ours()


def test_an_error_in_a_worker_is_raised_in_the_parent(tok):
    bad = iter([([0], [None], ["fine"]), ([1], [None], [None])])  # (None is no text: the worker's encoder fails)
    with pytest.raises(TypeError):
        list(workers.encoded(bad, 2, tok))
    assert not ours()


def test_workers_leave_with_their_parent(tmp_path):
    """The parent killed outright (no clean-up of its own): every worker goes too, a stopped one included, so none
    is left holding the output directory's lock (a rerun was refused while one lived on)."""
    script = textwrap.dedent("""
        import sys
        from llmc_cli.data.tokenizer import load_tokenizer
        from llmc_cli.tokenizing import workers
        texts = ["the quick brown fox " * 20000] * 4
        stream = workers.encoded((([i] * 4, [None] * 4, texts) for i in range(10**6)), 3, load_tokenizer("gpt2", None))
        next(stream)
        print(" ".join(str(p.pid) for p in workers.multiprocessing.active_children()), flush=True)
        import time; time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 3
    os.kill(pids[0], signal.SIGSTOP)  # (a stopped worker never reads its pipe's end: it must die all the same)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(q) for q in pids):
        time.sleep(0.1)
    assert not [q for q in pids if _alive(q)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # (a zombie has exited: only its parent's reaping is left)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_whole_group_gets_one_line_and_leaves_no_process(tmp_path, sig):
    """A terminal's Ctrl-C (or a hang-up, or a job scheduler's SIGTERM) reaches the parent and every worker at once:
    the parent alone answers, and ends them. (With multiprocessing.Pool, a worker that the signal ended while holding
    the task queue's lock could hang the shutdown.)"""
    src = tmp_path / "docs.jsonl"
    line = "the quick brown fox jumps over the lazy dog " * 40
    src.write_text("".join(json.dumps({"text": f"{i} {line}"}) + "\n" for i in range(8_000)))
    cmd = [sys.executable, "-m", "llmc_cli", "tokenize", "text", str(src), "--out-dir", str(tmp_path / "out"),
           "--workers", "2", "--shard-size", "100K"]
    p = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_children(p.pid)) < 2 and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # (batches handed out)
    kids = _children(p.pid)
    assert p.poll() is None and len(kids) == 2, "tokenize ended before the signal: the input is too small"
    os.killpg(p.pid, sig)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("tokenize hung after a signal to its process group") from None
    assert p.returncode == 130, err
    lines = [x for x in err.splitlines() if x.startswith("error")]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted") and "resume" in lines[0], err
    assert not [q for q in kids if _alive(q)]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def test_one_process_needs_no_worker(tok):
    out = list(workers.encoded(batches(3), 1, tok))
    assert not ours() and all(isinstance(r[2], np.ndarray) for r in out)


@pytest.mark.parametrize("numpy_path", [True, False])
def test_the_array_encoding_is_encode_ordinary(tok, monkeypatch, numpy_path):
    """Shards take ids as arrays (a list of Python ints cost over 30 bytes a token); special-token text stays text,
    with tiktoken's own array encoder and without it (tiktoken before 0.8)."""
    text = "a <|endoftext|> b <|begin_of_text|>\n\n  café 中文 \U0001F600 " * 5
    if not numpy_path:
        class Plain:  # (tiktoken's Encoding is a plain class: this hides one method)
            def __init__(self, enc):
                self._enc = enc

            def __getattr__(self, name):
                if name == "encode_to_numpy":
                    raise AttributeError(name)
                return getattr(self._enc, name)
        monkeypatch.setattr(tok, "enc", Plain(tok.enc))
    got = tok.encode_ordinary_array(text)
    assert got.dtype == np.uint32 and got.tolist() == tok.encode_ordinary(text)
    assert 50256 not in got.tolist()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sets the open-file limit of a child")
def test_more_workers_than_file_descriptors_is_one_line(tmp_path):
    """Each worker holds pipes in the parent: past the open-file limit the answer names --workers (it named the
    output directory: `error: out: Too many open files`)."""
    import resource
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(1024 * 61)))  # (61 batches)
    r = subprocess.run([sys.executable, "-m", "llmc_cli", "tokenize", "text", str(src), "--out-dir",
                        str(tmp_path / "out"), "--workers", "60"], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --workers 60: worker ") and "ulimit -n" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("n_batches, n_workers, started", [(40, 3, 3), (2, 8, 2)])
def test_workers_start_as_batches_need_them_and_end_when_closed(tok, n_batches, n_workers, started):
    """Each worker holds a tokenizer (tens of MB): --workers 512 on three documents took 34 s and 10 GB. Closing the
    stream early ends every worker started."""
    stream = workers.encoded(batches(n_batches), n_workers, tok)
    next(stream)
    assert len(ours()) == started
    stream.close()
    assert not ours()


def _in_workers_only(monkeypatch, obj, name, exc):
    """`obj.name` raises `exc` in the forked workers, and works in this process."""
    parent, real = os.getpid(), getattr(obj, name)

    def patched(*a, **k):
        if os.getpid() != parent:
            raise exc
        return real(*a, **k)
    monkeypatch.setattr(obj, name, patched)


def test_a_worker_that_cannot_take_its_batch_is_named(tok, monkeypatch):
    """A worker whose reading thread failed (out of memory for a batch) lived on without answering: a hang."""
    import multiprocessing.connection as mc
    _in_workers_only(monkeypatch, mc.Connection, "recv", MemoryError())
    with pytest.raises(workers.WorkerDied, match="could not take its batch .MemoryError"):
        list(workers.encoded(batches(6), 2, tok))
    assert not ours()


def test_a_worker_without_a_thread_is_named(tok, monkeypatch):
    """Under a process or thread limit each worker printed a traceback, and the line blamed memory."""
    import threading
    _in_workers_only(monkeypatch, threading.Thread, "start", RuntimeError("can't start new thread"))
    with pytest.raises(workers.WorkerDied, match=r"could not start a thread .*ulimit -u"):
        list(workers.encoded(batches(6), 2, tok))
    assert not ours()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork hook and signal masks")
def test_a_signal_during_a_workers_fork_is_not_lost(tmp_path):
    """A SIGTERM that landed while a worker was forked ran its handler inside the fork's after-hooks, where Python
    prints an exception and drops it: the run went on and exited 0."""
    script = textwrap.dedent("""
        import os, signal, sys
        from llmc_cli.commands import interrupts
        from llmc_cli.data.tokenizer import load_tokenizer
        from llmc_cli.tokenizing import workers
        interrupts.install()
        armed = [True]
        def hook():
            if armed:
                armed.clear()
                os.kill(os.getpid(), signal.SIGTERM)
        os.register_at_fork(after_in_parent=hook)
        try:
            for _ in workers.encoded((([i], [None], ["some text"]) for i in range(50)), 3,
                                     load_tokenizer("gpt2", None)):
                pass
        except interrupts.Interrupted as e:
            print("interrupted", len(workers.multiprocessing.active_children()))
            sys.exit(0)
        print("not interrupted")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "interrupted 0" and "Exception ignored" not in r.stderr, (r.stdout, r.stderr)


def test_out_of_memory_while_tokenizing_advises_tokenize_options(tmp_path, monkeypatch):
    """main's line for MemoryError advised the training options (-b/-t), with an empty `()`."""
    from click.testing import CliRunner

    from llmc_cli.commands import main
    from llmc_cli.tokenizing import pipeline

    def no_memory(*a, **k):
        raise MemoryError()
    monkeypatch.setattr(pipeline, "encoded", no_memory)
    (tmp_path / "a.txt").write_text("words " * 10)
    r = CliRunner().invoke(main, ["tokenize", "text", str(tmp_path / "a.txt"), "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 1 and "--workers" in r.output and "--batch-size" not in r.output, r.output
    assert not (tmp_path / "out").exists()
