"""Causal self-attention through cuDNN's fused SDPA (nvidia-cudnn-frontend), one graph per shape.

The packed qkv (B, T, (NH+2*NKV)*hd) buffer is described to cuDNN with strides, so q, k, v need no copies:
q is (B, NH, T, hd) with strides (T*W, hd, W, 1) starting at element 0, k and v the same with NKV heads
starting at NH*hd and (NH+NKV)*hd. The output (B, T, NH*hd) and the float32 log-sum-exp statistics
(B, NH, T, 1) are written in place. Graphs are built once per (B, T, NH, NKV, hd) and executed with raw
pointers; the backward graph asks for cuDNN's deterministic algorithm.

That deterministic backward wants a workspace that grows with B and the heads (about 1.5 GiB at GPT-2 124M, B=64,
T=1024; 4 GiB for one sequence of Llama 3.1 8B at T=8192), so the backward runs over batch slices, and when one
sequence is still too much, over groups of key/value heads (each with its query heads), the largest whose workspace
stays within `bwd_workspace_max`: sequences and head groups are independent, so the slices compute what one call
would. A head group's graph sees the full buffers' strides, so it too needs no copies.

Building a graph's plan takes cuDNN a few hundred milliseconds (its SDPA engines are compiled at run time), so
each built plan is serialized into `plan_dir` (llmc's cache directory, per GPU and cuDNN version) and a later run
deserializes it instead; a file that does not deserialize is rebuilt and replaced.
"""

from __future__ import annotations

import math
from pathlib import Path

import cudnn

from llmc_cli.kernels import CACHE_FILE_MAX, write_cache_file

from .options import backward_slices

Q, K, V, O, STATS, DO, DQ, DK, DV = 1, 2, 3, 4, 5, 6, 7, 8, 9


class CudnnAttention:
    def __init__(self, cupy, stream_ptr: int, bwd_workspace_max: int, plan_dir: Path | None = None, workspace=None):
        """`bwd_workspace_max`: bytes the backward's slices may take. `workspace(nbytes)`, when given, returns device
        memory of at least nbytes for one call (the backend's scratch, shared with what other calls need only while
        they run); else this object keeps its own."""
        self.cp = cupy
        self._workspace = workspace
        self.handle = cudnn.create_handle()
        cudnn.set_stream(self.handle, stream_ptr)
        self.plan_dir = plan_dir / f"cudnn-{cudnn.backend_version()}" if plan_dir is not None else None
        self.graphs: dict[tuple, object] = {}
        self.failed: dict[tuple, str] = {}
        self.workspace = None
        self.bwd_workspace_max = bwd_workspace_max
        # (B, T, NH, NKV, hd) -> (graph, sequences per slice, key/value heads per slice)
        self.bwd_slices: dict[tuple, tuple] = {}

    def _ws(self, size: int):
        if self._workspace is not None:
            self.workspace = self._workspace(size)
        elif self.workspace is None or self.workspace.size < size:
            self.workspace = self.cp.empty(max(size, 1), dtype=self.cp.uint8)
        return self.workspace

    @staticmethod
    def _dims(T, NH, NKV, hd):
        """Strides of q/k/v (and their gradients), of o/dO, of the statistics, for buffers of NH query heads and
        NKV key/value heads (a head group's graph describes part of them)."""
        W = (NH + 2 * NKV) * hd
        return [T * W, hd, W, 1], [T * NH * hd, hd, NH * hd, 1], [NH * T, T, 1, 1]

    def _build(self, key):
        # a head group's key ends with the full buffers' head counts: (kind, B, T, NH, NKV, hd[, NH_all, NKV_all])
        kind, B, T, NH, NKV, hd, *full = key
        bf = cudnn.data_type.BFLOAT16
        g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        qs, os_, ss = self._dims(T, *(full or (NH, NKV)), hd)
        if full:  # cuDNN wants the statistics packed: a head group's are, for one sequence (its only use)
            if B != 1:  # (an engine bug, not bad input: the planner splits sequences before head groups)
                raise ValueError(f"cuDNN attention: head groups are planned for one sequence at a time (got B={B})")
            ss = [NH * T, T, 1, 1]
        q = g.tensor(name="q", dim=[B, NH, T, hd], stride=qs, data_type=bf, uid=Q)
        k = g.tensor(name="k", dim=[B, NKV, T, hd], stride=qs, data_type=bf, uid=K)
        v = g.tensor(name="v", dim=[B, NKV, T, hd], stride=qs, data_type=bf, uid=V)
        scale = 1.0 / math.sqrt(hd)
        if kind == "fwd":
            o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale,
                              use_causal_mask=True)
            o.set_uid(O).set_output(True).set_dim([B, NH, T, hd]).set_stride(os_).set_data_type(bf)
            stats.set_uid(STATS).set_output(True).set_dim([B, NH, T, 1]).set_stride(ss) \
                .set_data_type(cudnn.data_type.FLOAT)
        else:
            o = g.tensor(name="o", dim=[B, NH, T, hd], stride=os_, data_type=bf, uid=O)
            do = g.tensor(name="do", dim=[B, NH, T, hd], stride=os_, data_type=bf, uid=DO)
            stats = g.tensor(name="stats", dim=[B, NH, T, 1], stride=ss,
                             data_type=cudnn.data_type.FLOAT, uid=STATS)
            dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                         attn_scale=scale, use_causal_mask=True,
                                         use_deterministic_algorithm=True)
            dq.set_uid(DQ).set_output(True).set_dim([B, NH, T, hd]).set_stride(qs).set_data_type(bf)
            dk.set_uid(DK).set_output(True).set_dim([B, NKV, T, hd]).set_stride(qs).set_data_type(bf)
            dv.set_uid(DV).set_output(True).set_dim([B, NKV, T, hd]).set_stride(qs).set_data_type(bf)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def _plan_file(self, key) -> Path | None:
        return self.plan_dir / ("sdpa-" + "-".join(map(str, key)) + ".plan") if self.plan_dir is not None else None

    def _load(self, key):
        """The plan an earlier run serialized for `key`, or None."""
        path = self._plan_file(key)
        try:  # (a plan is kilobytes: a bigger file there is no plan, and is never read whole)
            if path is None or not path.is_file() or path.stat().st_size > CACHE_FILE_MAX:
                return None
        except OSError:
            return None
        try:
            g = cudnn.pygraph(handle=self.handle)
            g.deserialize(path.read_bytes())
            g.get_workspace_size()
            return g
        except Exception:  # from another cuDNN build, or damaged: built again (and replaced) below
            return None

    def _keep(self, key, g) -> None:
        path = self._plan_file(key)
        if path is None:
            return
        try:
            data = bytes(g.serialize())
        except Exception:  # an engine cuDNN cannot serialize: the next run builds it again
            return
        write_cache_file(path, data)

    def graph(self, kind, B, T, NH, NKV, hd, *full):
        """The built graph, or None when cuDNN cannot plan this shape (the reason is kept in `failed`). `full`: the
        buffers' (NH, NKV) when the graph covers a group of their heads."""
        key = (kind, B, T, NH, NKV, hd, *full)
        g = self.graphs.get(key)
        if g is None and key not in self.failed:
            g = self._load(key)
            if g is None:
                try:
                    g = self._build(key)
                except Exception as e:  # cudnnGraphNotSupportedError and friends
                    self.failed[key] = f"{type(e).__name__}: {e}"
                    return None
                self._keep(key, g)
            self.graphs[key] = g
        return g

    def forward(self, out_ptr, lse_ptr, qkv_ptr, B, T, NH, NKV, hd, elsize=2) -> bool:
        g = self.graph("fwd", B, T, NH, NKV, hd)
        if g is None:
            return False
        self._ws(g.get_workspace_size())
        pack = {Q: qkv_ptr, K: qkv_ptr + NH * hd * elsize, V: qkv_ptr + (NH + NKV) * hd * elsize,
                O: out_ptr, STATS: lse_ptr}
        g.execute(pack, self.workspace.data.ptr, handle=self.handle)
        return True

    def _backward_plan(self, B, T, NH, NKV, hd):
        """(graph, sequences, key/value heads) of the largest slice (options.backward_slices) whose workspace fits,
        else of the smallest; None when cuDNN plans no backward."""
        key = (B, T, NH, NKV, hd)
        if key not in self.bwd_slices:
            plan, rep = None, NH // NKV
            for Bs, G in backward_slices(B, NKV):
                g = self.graph("bwd", Bs, T, G * rep, G, hd, *(() if G == NKV else (NH, NKV)))
                if g is None:
                    break
                plan = (g, Bs, G)
                if g.get_workspace_size() <= self.bwd_workspace_max:
                    break
            self.bwd_slices[key] = plan
        return self.bwd_slices[key]

    def backward(self, dqkv_ptr, dout_ptr, qkv_ptr, out_ptr, lse_ptr, B, T, NH, NKV, hd, elsize=2) -> bool:
        plan = self._backward_plan(B, T, NH, NKV, hd)
        if plan is None:
            return False
        g, Bs, G = plan
        ws = self._ws(g.get_workspace_size()).data.ptr
        rep, W = NH // NKV, (NH + 2 * NKV) * hd
        for b in range(0, B, Bs):
            for kv in range(0, NKV, G):  # byte offsets of sequence b's head group kv.. in each buffer
                h = kv * rep
                oq = (b * T * W + h * hd) * elsize
                ok, ov = (b * T * W + (NH + kv) * hd) * elsize, (b * T * W + (NH + NKV + kv) * hd) * elsize
                oo, ol = (b * T * NH + h) * hd * elsize, (b * NH + h) * T * 4
                pack = {Q: qkv_ptr + oq, K: qkv_ptr + ok, V: qkv_ptr + ov, O: out_ptr + oo, DO: dout_ptr + oo,
                        STATS: lse_ptr + ol, DQ: dqkv_ptr + oq, DK: dqkv_ptr + ok, DV: dqkv_ptr + ov}
                g.execute(pack, ws, handle=self.handle)
        return True
