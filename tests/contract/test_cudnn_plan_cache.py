"""The cuDNN attention plans cached on disk are read like every other cache, only when they are regular
files of a cache's size; a sparse gigabyte under a plan's name is passed over (built again), never read whole.
Runs without a GPU: `cudnn` is a stand-in that records what would be deserialized."""

from __future__ import annotations

import importlib.util
import sys
import tracemalloc
import types
from pathlib import Path


def test_a_huge_file_under_a_plan_name_is_passed_over_not_read(tmp_path, monkeypatch):
    seen = []

    class Graph:
        def __init__(self, handle=None):
            pass

        def deserialize(self, data):
            seen.append(len(data))

        def get_workspace_size(self):
            return 0

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(pygraph=Graph))
    # the module loaded under a name of its own: the real llmc_cuda.cudnn_attention (on a GPU machine) is untouched
    import llmc_cuda
    spec = importlib.util.spec_from_file_location("cudnn_attention_under_test",
                                                  Path(llmc_cuda.__file__).parent / "cudnn_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    CudnnAttention = mod.CudnnAttention
    att = object.__new__(CudnnAttention)
    att.plan_dir, att.handle = tmp_path, None
    key = (1, 2, 3)
    path = att._plan_file(key)
    path.write_bytes(b"plan")
    assert att._load(key) is not None and seen == [4]  # a plan of its size is read
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        assert att._load(key) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == [4] and peak < 32 << 20, f"{peak / 2**20:.0f} MiB read"
