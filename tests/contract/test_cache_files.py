"""The backends' caches on disk (kernels.read_cache_json / write_cache_file, the OpenCL tuner's and cuBLASLt's
entries): whatever is found where a cache belongs (damaged, truncated, nested past the parser's recursion, not
UTF-8, of the wrong type, a directory, a FIFO, a huge file) is passed over and rebuilt, never a traceback or a hang;
a write that fails leaves no temporary; two processes writing one cache never leave it torn; a symbolic link stays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types

import pytest

from llmc_cli.kernels import cache_root, read_cache_json, write_cache_file


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("content", [b"", b"{", b'{"a": ', b"[1, 2]", b'"text"', b"null", b"\xff\xfe{}",
                                     b"[" * 100_000, b'{"a": ' * 100_000, b"\x00" * 64],
                         ids=["empty", "brace", "truncated", "list", "string", "null", "not-utf8", "deep-list",
                              "deep-object", "nuls"])
def test_damaged_cache_files_read_as_empty(tmp_path, content):
    f = tmp_path / "cache.json"
    f.write_bytes(content)
    assert read_cache_json(f) == {}


def test_what_is_not_a_cache_file_reads_as_empty_without_blocking(tmp_path):
    assert read_cache_json(tmp_path / "missing.json") == {}
    assert read_cache_json(tmp_path) == {}  # a directory where the file belongs
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(read_cache_json(fifo)), daemon=True)
    t.start()
    t.join(10)
    if not done:  # (unblock the reader, so the thread ends)
        with open(fifo, "w"):
            pass
    assert done == [{}], "reading a FIFO where the cache belongs blocked"
    from llmc_cli.kernels import CACHE_FILE_MAX
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # (sparse: no disk used)
        f.write(b"{}")
        f.truncate(CACHE_FILE_MAX + 1)
    assert read_cache_json(big) == {}
    assert read_cache_json(tmp_path / "file" / "under" / "nothing.json") == {}
    (tmp_path / "plain").write_text("x")
    assert read_cache_json(tmp_path / "plain" / "under.json") == {}


def test_a_write_that_fails_leaves_no_temporary(tmp_path):
    d = tmp_path / "cache.json"
    d.mkdir()  # a directory where the file belongs: left as it is
    (d / "inside").write_text("kept")
    write_cache_file(d, '{"a": 1}')
    assert (d / "inside").read_text() == "kept" and _leftovers(tmp_path) == []
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    write_cache_file(fifo, '{"a": 1}')  # a FIFO stays a FIFO
    assert fifo.is_fifo() and _leftovers(tmp_path) == []
    (tmp_path / "plain").write_text("x")
    write_cache_file(tmp_path / "plain" / "c.json", "{}")  # a file where its folder belongs
    assert (tmp_path / "plain").read_text() == "x" and _leftovers(tmp_path) == []


def test_a_write_to_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    import builtins
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda p, mode="r", *a, **k: Full(real_open(p, mode, *a, **k))
                        if str(p).endswith(".tmp") else real_open(p, mode, *a, **k))
    f = tmp_path / "c.json"
    f.write_text('{"old": 1}')
    write_cache_file(f, '{"new": 1}')
    monkeypatch.undo()
    assert json.loads(f.read_text()) == {"old": 1} and _leftovers(tmp_path) == []


def test_a_symbolic_link_stays_and_its_file_is_rewritten(tmp_path):
    real = tmp_path / "shared" / "c.json"
    real.parent.mkdir()
    real.write_text('{"old": 1}')
    link = tmp_path / "c.json"
    link.symlink_to(real)
    write_cache_file(link, '{"new": 1}')
    assert link.is_symlink() and json.loads(real.read_text()) == {"new": 1}
    assert _leftovers(tmp_path) == [] and _leftovers(real.parent) == []


_WRITER = r"""
import json, sys
from pathlib import Path
from llmc_cli.kernels import read_cache_json, write_cache_file
path, me = Path(sys.argv[1]), sys.argv[2]
for i in range(150):
    data = read_cache_json(path)
    data[me] = i
    write_cache_file(path, json.dumps(data) + " " * 4096)  # (large enough that a torn write would show)
"""


def test_two_processes_writing_one_cache_never_tear_it(tmp_path):
    path = tmp_path / "c.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), w]) for w in ("a", "b")]
    seen = 0
    while any(p.poll() is None for p in procs):
        if path.exists():
            json.loads(path.read_text())  # a reader never sees half a file
            seen += 1
    assert [p.wait() for p in procs] == [0, 0]
    assert set(json.loads(path.read_text())) <= {"a", "b"} and _leftovers(tmp_path) == []


def test_cache_root_without_a_home(monkeypatch):
    """No HOME and no password entry (a container's arbitrary uid), or an empty HOME (which Python reads as /):
    no cache at all, rather than a traceback or a cache at /.cache."""
    import pwd
    for var in ("LLMC_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(var, raising=False)

    def no_entry(uid):
        raise KeyError(uid)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    root = cache_root()
    assert not str(root).startswith("/.cache")
    assert read_cache_json(root / "opencl_probe.json") == {}
    write_cache_file(root / "opencl_probe.json", "{}")  # (fails, silently)
    monkeypatch.setenv("HOME", "")
    assert cache_root() == root
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert cache_root() == root


# ---- the entries in a cache that parses ---------------------------------------------------------------------------

def test_opencl_tuner_takes_only_its_own_candidates_from_the_cache(tmp_path, monkeypatch):
    """A cached SGEMM configuration reaches the compiler's options only as one of today's candidates: an edited
    or damaged entry (numbers as strings, sizes no candidate has, a string, a list, inf) is tuned again."""
    pytest.importorskip("llmc_opencl")
    from llmc_opencl import tune
    cache = tmp_path / "tune.json"
    monkeypatch.setenv("LLMC_OPENCL_TUNE_CACHE", str(cache))
    monkeypatch.setattr(tune, "fits", lambda device, c: True)
    retuned = []
    monkeypatch.setattr(tune, "autotune", lambda be: (retuned.append(1), ({"NT": {}}, {}))[1])
    ns = types.SimpleNamespace
    be = ns(platform=ns(name="P"), device=ns(name="D", driver_version="1"))
    key = tune.device_key(be.platform, be.device)
    good = tune.DIRECT[2]
    for entry in ({lay: good for lay in tune.LAYOUTS},
                  {lay: {**good, "RM": str(good["RM"])} for lay in tune.LAYOUTS},  # (read as the candidate itself)
                  {lay: {**good, "RM": 4096} for lay in tune.LAYOUTS},
                  {lay: {**good, "RM": 1e400} for lay in tune.LAYOUTS},
                  {lay: "direct" for lay in tune.LAYOUTS},
                  {lay: [4, 4] for lay in tune.LAYOUTS},
                  ["NT"], "x", 5):
        retuned.clear()
        cache.write_text(json.dumps({key: {"config": entry}}))
        cfg = tune.get_config(be, mode="on")
        if entry in ({lay: good for lay in tune.LAYOUTS}, {lay: {**good, "RM": str(good["RM"])} for lay in tune.LAYOUTS}):
            assert cfg["source"] == "autotuned, cached" and all(cfg[lay] == good for lay in tune.LAYOUTS), entry
            assert retuned == []
        else:
            assert retuned == [1], entry
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def _cublaslt_module(monkeypatch):
    """llmc_cuda.cublaslt imported over a stand-in nvmath (no GPU is needed to read or keep a decision); the module
    is not left in sys.modules with the stand-in in it."""
    from unittest.mock import MagicMock
    for name in ("nvmath", "nvmath.bindings", "nvmath.bindings.cublasLt"):
        monkeypatch.setitem(sys.modules, name, MagicMock())
    monkeypatch.delitem(sys.modules, "llmc_cuda.cublaslt", raising=False)
    try:
        import llmc_cuda.cublaslt as m
    except ImportError as e:
        pytest.skip(f"llmc_cuda.cublaslt does not import here: {e}")
    finally:
        sys.modules.pop("llmc_cuda.cublaslt", None)
    return m


def _fake_plan(m, configs):
    class Plan:
        key, count, chosen, trials = ("k",), len(configs), None, None
        only, same_order = m.Plan.only, m.Plan.same_order

        def config(self, i):
            return configs[i]

        def choose(self, i):
            self.chosen = i
    return Plan()


def test_cublaslt_decision_of_the_wrong_type_is_raced_again(monkeypatch):
    """cuBLASLt's decisions cache (plan key -> the chosen candidate's config) with a number, a string or a dict
    where a list belongs: the plan is raced again, not a TypeError in the first matmul."""
    m = _cublaslt_module(monkeypatch)
    for want in (5, 1.5, True, {"a": 1}, "ab"):
        lt = types.SimpleNamespace(tune=True, decisions={"('k',)": want}, tuning={})
        p = _fake_plan(m, [(0, 7), (1, 7)])
        m.CublasLt._decided(lt, p)
        assert p.chosen is None, want
    lt = types.SimpleNamespace(tune=True, decisions={"('k',)": [1, 7]}, tuning={})
    p = _fake_plan(m, [(0, 7), (1, 7)])
    m.CublasLt._decided(lt, p)
    assert p.chosen == 1


def test_cublaslt_reads_each_config_attribute_at_its_own_size(monkeypatch):
    """cuBLASLt answers an algorithm's config attribute only into a buffer of the attribute's exact size (int32,
    uint32, uint16); read with one size for all, every attribute failed and every candidate's config was the same
    list of -1s, so a kept decision brought back the heuristic's first candidate in every later run (1-1.3 % of a
    GPT-2 d12 step on an H200)."""
    import ctypes
    m = _cublaslt_module(monkeypatch)
    sizes = dict(zip(m._CONFIG, (4, 4, 4, 4, 4, 4, 4, 2, 2)))  # ID .. CTA_SWIZZLING, CUSTOM, CLUSTER, INNER

    def get_attribute(algo, attr, buf, size, written):
        if size != sizes[attr]:
            raise RuntimeError("CUBLAS_STATUS_INVALID_VALUE")
        value = 1000 * m._CONFIG.index(attr) + algo  # each candidate's value, this attribute's
        ctypes.memmove(buf, value.to_bytes(size, "little"), size)
        ctypes.c_uint64.from_address(written).value = size

    monkeypatch.setattr(m.lt, "matmul_algo_config_get_attribute", get_attribute)
    plan = types.SimpleNamespace(_algo=lambda i: 40 + i)
    for i in range(3):
        assert m.Plan.config(plan, i) == tuple(1000 * a + 40 + i for a in range(len(m._CONFIG)))


def test_cublaslt_keeps_and_takes_only_a_decision_that_names_one_candidate(monkeypatch):
    """A config two candidates share (or one unreadable for all) cannot carry the race's pick to a later run: it is
    not written, and an entry matching several candidates is raced again, not taken as the first of them."""
    m = _cublaslt_module(monkeypatch)
    kept = []
    lt = types.SimpleNamespace(tune=True, decisions={}, tuning={}, on_decided=lambda: kept.append(1))
    alike = _fake_plan(m, [(-1, -1)] * 3)
    m.CublasLt._settle(lt, alike, None, 0, 0, {0: 1.0, 1: 0.5, 2: 0.9})
    assert alike.chosen == 1 and lt.decisions == {} and kept == []  # (the run itself keeps its pick)
    m.CublasLt._decided(types.SimpleNamespace(tune=True, decisions={"('k',)": [-1, -1]}, tuning={}),
                        p := _fake_plan(m, [(-1, -1)] * 3))
    assert p.chosen is None
    distinct = _fake_plan(m, [(5, 1), (6, 1), (5, 2)])
    m.CublasLt._settle(lt, distinct, None, 0, 0, {0: 1.0, 1: 0.5, 2: 0.9})
    assert lt.decisions == {"('k',)": [6, 1]} and kept == [1]
    again = _fake_plan(m, [(5, 1), (6, 1), (5, 2)])
    m.CublasLt._decided(lt, again)
    assert again.chosen == 1


def test_cublaslt_takes_no_decision_for_a_candidate_that_splits_k_otherwise(monkeypatch):
    """A decision naming a candidate whose split-K count or reduction scheme (config fields 3 and 4) differ from the
    heuristic's first, or cannot be read (-1), is raced again: its bits can differ from the first's (FP8's weight
    gradients on an H200)."""
    m = _cublaslt_module(monkeypatch)
    configs = [(66, 165, 36, 3, 2, 0, 6, 5, 0), (66, 28, 36, 2, 2, 0, 6, 7, 0), (66, 20, 36, 3, 1, 0, 6, 5, 0),
               (66, 29, 36, 3, 2, 0, 5, 3, 0)]
    unread = [(66, 165, 36, -1, -1, 0, 6, 5, 0), (66, 28, 36, -1, -1, 0, 6, 7, 0)]
    for cands, want, taken in ((configs, 1, None), (configs, 2, None), (configs, 3, 3), (configs, 0, 0),
                               (unread, 1, None), (unread, 0, 0)):
        p = _fake_plan(m, cands)
        m.CublasLt._decided(types.SimpleNamespace(tune=True, decisions={"('k',)": list(cands[want])}, tuning={}), p)
        assert p.chosen == taken, cands[want]


def test_a_users_file_named_as_a_cache_stays_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    """Outside llmc's cache folder (a variable naming the file) only an empty file or one that starts as a JSON object
    (whole or damaged) is replaced; inside it anything damaged is rebuilt."""
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    write_cache_file(notes, '{"a": 1}')
    assert notes.read_text() == "my notes\n" and _leftovers(tmp_path) == []
    for old in ("", '{"old": 1}', "{not json"):
        other = tmp_path / "other.json"
        other.write_text(old)
        write_cache_file(other, '{"a": 1}')
        assert json.loads(other.read_text()) == {"a": 1}
    damaged = cache_root() / "opencl_probe.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b'\xff\x00garbage')
    assert read_cache_json(damaged) == {}
    write_cache_file(damaged, '{"a": 1}')
    assert read_cache_json(damaged) == {"a": 1}
