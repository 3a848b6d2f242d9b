"""The cuDNN attention plans cached on disk are read like every other cache, only when they are regular
files of a cache's size; a sparse gigabyte under a plan's name is passed over (built again), never read whole. The
backward's slices under a workspace cap are the ones --dry-run plans. Runs without a GPU: `cudnn` is a stand-in."""

from __future__ import annotations

import importlib.util
import sys
import tracemalloc
import types
from pathlib import Path

import pytest


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
    spec = importlib.util.spec_from_file_location("llmc_cuda.cudnn_attention_under_test",  # (its package: llmc_cuda)
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


def _under_test(monkeypatch, graph_class):
    """cudnn_attention.py loaded under a name of its own beside a stand-in `cudnn` (the real module, on a GPU
    machine, is untouched)."""
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(pygraph=graph_class))
    llmc_cuda = pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    spec = importlib.util.spec_from_file_location("llmc_cuda.cudnn_attention_slices_under_test",
                                                  Path(llmc_cuda.__file__).parent / "cudnn_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", [(8, 2048, 32, 8, 64), (64, 1024, 12, 12, 64), (1, 8192, 32, 8, 128),
                                   (3, 96, 4, 2, 64)])
def test_the_backward_runs_the_slices_the_dry_run_plans(monkeypatch, shape):
    """CudnnAttention picks its backward's slice by the graphs' workspaces; with graphs that ask for what cuDNN
    asks (options.attention_backward_workspace), the slice's bytes under each cap are planned_attention_workspace's."""
    from llmc_cuda.options import attention_backward_workspace, planned_attention_workspace

    class Graph:
        def __init__(self, B, T, NH, NKV, hd):
            self.size = attention_backward_workspace(B, T, NH, NKV, hd)

        def get_workspace_size(self):
            return self.size

    mod = _under_test(monkeypatch, Graph)
    att = object.__new__(mod.CudnnAttention)
    att.bwd_slices = {}
    att.graph = lambda kind, B, T, NH, NKV, hd, *full: Graph(B, T, NH, NKV, hd)
    whole = attention_backward_workspace(*shape)
    for cap in (None, whole, whole - 1, whole // 3, 512 << 20, 0):
        att.bwd_workspace_max, att.bwd_slices = (1 << 62) if cap is None else cap, {}
        g, Bs, G = att._backward_plan(*shape)
        assert g.get_workspace_size() == planned_attention_workspace(*shape, cap), (cap, Bs, G)
