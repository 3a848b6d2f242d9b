"""Which cuBLASLt FP8 problems this GPU runs: the three products of a linear layer (forward TN, dinp, dweight) with
each epilogue the backend asks for, with fast accumulation on and off; prints ok or the library's error per case.
Run with CUBLASLT_LOG_LEVEL=5 (and CUBLASLT_LOG_FILE) to see why a case is refused."""

from __future__ import annotations

import sys

import numpy as np

from llmc_cli import registry


def main() -> None:
    from nvmath.bindings.cublasLt import Epilogue as E
    N, C, OC = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (256, 128, 192)))
    be = next(p for p in registry.discover() if p.name == "cuda").plugin.create(dtype="fp8")
    cp = __import__("cupy")
    lt, s = be.lt, be.stream.ptr
    x8, w8 = cp.zeros(N * C, np.uint8), cp.zeros(OC * C, np.uint8)
    d8, d8t, x8t, w8t = (cp.zeros(n, np.uint8) for n in (N * OC, N * OC, N * C, OC * C))
    out, pre = cp.zeros(N * OC, be.bf16), cp.zeros(N * OC, be.bf16)
    bias = cp.zeros(OC, be.bf16)
    dinp, dw = cp.zeros(N * C, be.bf16), cp.zeros(OC * C, be.bf16)
    prec = cp.zeros(N * C, be.bf16)
    sc = (be._fp8_slot(1)[1], be._fp8_slot(0)[1])
    cases = []
    for fast in (True, False):
        cases += [(f"forward fast={fast}", lambda f=fast: lt.forward_fp8(out.data.ptr, x8.data.ptr, w8.data.ptr, N, C,
                                                                          OC, s, sc, fast_accum=f)),
                  (f"forward+bias fast={fast}", lambda f=fast: lt.forward_fp8(
                      out.data.ptr, x8.data.ptr, w8.data.ptr, N, C, OC, s, sc, bias=bias.data.ptr, fast_accum=f)),
                  (f"forward+gelu_aux_bias fast={fast}", lambda f=fast: lt.forward_fp8(
                      out.data.ptr, x8.data.ptr, w8.data.ptr, N, C, OC, s, sc, bias=bias.data.ptr,
                      aux=pre.data.ptr, epilogue=E.GELU_AUX_BIAS, fast_accum=f))]
    cases += [("dinp", lambda: lt.backward_input_fp8(dinp.data.ptr, d8.data.ptr, w8t.data.ptr, N, C, OC, s, sc)),
              ("dinp+dgelu", lambda: lt.backward_input_fp8(dinp.data.ptr, d8.data.ptr, w8t.data.ptr, N, C, OC, s, sc,
                                                           pre_gelu=prec.data.ptr)),
              ("dweight", lambda: lt.backward_weight_fp8(dw.data.ptr, d8t.data.ptr, x8t.data.ptr, N, C, OC, s, sc))]
    for name, fn in cases:
        try:
            ok = fn()
            cp.cuda.Stream.null.synchronize()
            be.synchronize()
            print(f"{name}: {'ok' if ok else 'no plan'}", flush=True)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
