"""cuDNN's causal attention on one GPU, plan by plan: which of the engines cuDNN offers for the backward (and the
forward) is fastest at Llama's shapes, what each needs as workspace, and what the deterministic algorithm costs.

    python backends/cuda/bench/attn_plans.py [--shape 1b|8b|d12 ...] [--repeat 10]

Per shape and graph (forward; backward deterministic or not; GQA as llmc runs it, or every query head with its own
key/value head, "mha"): each plan's name, workspace, median ms over `--repeat` calls, and TFLOP/s counted as
causal attention (forward 2 products, backward 5, over half the T x T square).
"""

from __future__ import annotations

import argparse
import math
import time

import cupy as cp
import cudnn

SHAPES = {  # name: (B, T, NH, NKV, hd)
    "d12": (64, 1024, 12, 12, 64),
    "1b": (8, 2048, 32, 8, 64),
    "8b": (1, 8192, 32, 8, 128),
}
Q, K, V, O, STATS, DO, DQ, DK, DV = 1, 2, 3, 4, 5, 6, 7, 8, 9


def graph(handle, kind, B, T, NH, NKV, hd, deterministic):
    bf, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=bf, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    W = (NH + 2 * NKV) * hd
    qs, os_, ss = [T * W, hd, W, 1], [T * NH * hd, hd, NH * hd, 1], [NH * T, T, 1, 1]
    q = g.tensor(name="q", dim=[B, NH, T, hd], stride=qs, data_type=bf, uid=Q)
    k = g.tensor(name="k", dim=[B, NKV, T, hd], stride=qs, data_type=bf, uid=K)
    v = g.tensor(name="v", dim=[B, NKV, T, hd], stride=qs, data_type=bf, uid=V)
    scale = 1.0 / math.sqrt(hd)
    if kind == "fwd":
        o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_causal_mask=True)
        o.set_uid(O).set_output(True).set_dim([B, NH, T, hd]).set_stride(os_).set_data_type(bf)
        st.set_uid(STATS).set_output(True).set_dim([B, NH, T, 1]).set_stride(ss).set_data_type(f32)
    else:
        o = g.tensor(name="o", dim=[B, NH, T, hd], stride=os_, data_type=bf, uid=O)
        do = g.tensor(name="do", dim=[B, NH, T, hd], stride=os_, data_type=bf, uid=DO)
        st = g.tensor(name="stats", dim=[B, NH, T, 1], stride=ss, data_type=f32, uid=STATS)
        dq, dk, dv = g.sdpa_backward(name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=st, attn_scale=scale,
                                     use_causal_mask=True, use_deterministic_algorithm=deterministic)
        dq.set_uid(DQ).set_output(True).set_dim([B, NH, T, hd]).set_stride(qs).set_data_type(bf)
        dk.set_uid(DK).set_output(True).set_dim([B, NKV, T, hd]).set_stride(qs).set_data_type(bf)
        dv.set_uid(DV).set_output(True).set_dim([B, NKV, T, hd]).set_stride(qs).set_data_type(bf)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


def bf16_random(n, scale):
    x = (cp.random.standard_normal(n, dtype=cp.float32) * scale).view(cp.uint32)
    return (x >> 16).astype(cp.uint16)


def time_plans(handle, stream, kind, shape, deterministic, repeat):
    B, T, NH, NKV, hd = shape
    W = (NH + 2 * NKV) * hd
    qkv, dqkv = bf16_random(B * T * W, 1.0), cp.zeros(B * T * W, dtype=cp.uint16)
    out, dout = bf16_random(B * T * NH * hd, 1.0), bf16_random(B * T * NH * hd, 0.01)
    lse = cp.full(B * NH * T, math.log(T / 2), dtype=cp.float32)
    e = 2
    pack = {Q: qkv.data.ptr, K: qkv.data.ptr + NH * hd * e, V: qkv.data.ptr + (NH + NKV) * hd * e,
            O: out.data.ptr, STATS: lse.data.ptr}
    if kind == "bwd":
        pack.update({DO: dout.data.ptr, DQ: dqkv.data.ptr, DK: dqkv.data.ptr + NH * hd * e,
                     DV: dqkv.data.ptr + (NH + NKV) * hd * e})
    g = graph(handle, kind, *shape, deterministic)
    flops = (2 if kind == "fwd" else 5) * 2 * B * NH * T * T * hd / 2
    rows = []
    for i in range(g.get_execution_plan_count()):
        name = g.get_plan_name_at_index(i)
        try:
            g.build_plan_at_index(i)
            ws_n = g.get_workspace_size_plan_at_index(i)
            ws = cp.empty(max(ws_n, 1), dtype=cp.uint8)
            g.execute_plan_at_index(pack, ws.data.ptr, i, handle=handle)
            stream.synchronize()
            times = []
            for _ in range(repeat):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                g.execute_plan_at_index(pack, ws.data.ptr, i, handle=handle)
                b.record(stream)
                b.synchronize()
                times.append(cp.cuda.get_elapsed_time(a, b))
            times.sort()
            ms = times[len(times) // 2]
            rows.append(f"  plan {i:2d} {name[:60]:60s} ws {ws_n / 2**20:8.1f} MiB {ms:8.3f} ms "
                        f"{flops / ms / 1e9:6.1f} TFLOP/s")
            del ws
        except Exception as ex:  # a plan cuDNN cannot build here
            rows.append(f"  plan {i:2d} {name[:60]:60s} not built: {type(ex).__name__}: {str(ex)[:80]}")
    return rows


def workspaces(handle):
    """cuDNN's deterministic backward workspace (its first plan) over a grid of shapes, one line each."""
    for hd in (16, 32, 64, 128):
        for T in (64, 256, 1024, 2048, 8192):
            for B, NH, NKV in ((1, 4, 4), (2, 4, 2), (1, 32, 8), (3, 25, 25)):
                try:
                    g = graph(handle, "bwd", B, T, NH, NKV, hd, True)
                    g.build_plan_at_index(0)
                    ws = g.get_workspace_size_plan_at_index(0)
                except Exception as ex:
                    ws = f"{type(ex).__name__}"
                print(f"ws hd={hd} T={T} B={B} NH={NH} NKV={NKV} {ws}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--workspace", action="store_true", help="only the workspace grid, no timing")
    a = ap.parse_args()
    stream = cp.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, stream.ptr)
    print(f"cuDNN {cudnn.backend_version()}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    with stream:
        if a.workspace:
            return workspaces(handle)
        for name in a.shape or ["1b", "8b"]:
            B, T, NH, NKV, hd = SHAPES[name]
            variants = [("fwd", (B, T, NH, NKV, hd), True), ("bwd", (B, T, NH, NKV, hd), True),
                        ("bwd", (B, T, NH, NKV, hd), False)]
            if NKV != NH:
                variants += [("bwd", (B, T, NH, NH, hd), True)]
            if B > 1:
                variants += [("bwd", (B // 2, T, NH, NKV, hd), True), ("bwd", (1, T, NH, NKV, hd), True)]
            for kind, shape, det in variants:
                t0 = time.perf_counter()
                head = (f"{name} {kind} B={shape[0]} T={shape[1]} NH={shape[2]} NKV={shape[3]} hd={shape[4]}"
                        f"{' deterministic' if kind == 'bwd' and det else ''}")
                try:
                    rows = time_plans(handle, stream, kind, shape, det, a.repeat)
                except Exception as ex:
                    rows = [f"  no graph: {type(ex).__name__}: {str(ex)[:120]}"]
                print(f"{head} ({time.perf_counter() - t0:.1f} s)", *rows, sep="\n", flush=True)


if __name__ == "__main__":
    main()
