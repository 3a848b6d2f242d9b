"""Whether the cuBLASLt tuner's bit-identical candidates stay identical on operands other than the ones it checked.

    python backends/cuda/bench/tuner_identity.py --dtype fp8 --model d12 -b 16 --data 'datasets/shakespeare/*train*'

A run's bits may not depend on which candidate won a race, so the tuner admits only candidates that split the sum
over k as the heuristic's first does and whose outputs match its own on one call's real operands. Here a model
trains --steps steps with the tuner on and no decisions from earlier runs (a fresh cache); then every candidate the
tuner found identical is run again, against the heuristic's first, on two more operand sets: what lies at the
product's last call's operand addresses after training (later than the check) and random operands (the lower half of
the format's exponents, both signs, every mantissa). D goes to scratch (beta = 0), and the epilogue's outputs
(GELU's pre-activation, the bias gradient) are copied from their buffers after each run. A line per candidate that
differs: the product, the candidate's config and how many output values differ. The model is thrown away (random
operands are written over its buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import cupy as cp
import numpy as np

from llmc_cli import registry
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs
from llmc_cli.training.trainer import Trainer
from llmc_cuda.cublaslt import CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF, CUDA_R_32F


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="d12")
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("-b", type=int, default=16)
    ap.add_argument("-t", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--data", required=True)
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def _trained(o):
    """The backend after --steps training steps with a fresh tuner: every product has raced."""
    os.environ["LLMC_CACHE_DIR"] = tempfile.mkdtemp()  # no decisions of earlier runs
    be = next(p for p in registry.discover() if p.name == "cuda").plugin.create(dtype=o.dtype)
    args = TrainArgs(data=o.data, model=o.model, batch_size=o.b, seq_len=o.t, steps=o.steps,
                     optim=AdamWConfig(lr=6e-4, weight_decay=0.1), val_every=0, sample_every=0)
    tr = Trainer(args, be, say=lambda *a, **k: None)
    matmul = be.lt.matmul

    def recording(plan, *a, outputs=(), **k):  # the epilogue's outputs (aux, dbias) of each product's last call
        plan.outputs = outputs
        return matmul(plan, *a, outputs=outputs, **k)
    be.lt.matmul = recording
    for step in range(o.steps):
        tr.train_step(step)
    be.synchronize()
    return be


def _randomize(ptr: int, dtype: int, nbytes: int, rng) -> None:
    """Random finite values of `dtype` over [ptr, ptr + nbytes), spread over many exponents, so that sums depend
    on their order."""
    raw = _bytes(ptr, nbytes)
    bits = cp.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8))
    if dtype in (CUDA_R_8F_E4M3, CUDA_R_8F_E5M2):
        bits &= 0xBF  # (the exponent's top bit clear: no NaN or infinity, magnitudes up to 1.9)
    elif dtype == CUDA_R_16BF:
        bits[1::2] = (bits[1::2] & 0x80) | cp.asarray(rng.integers(0x38, 0x46, nbytes // 2, dtype=np.uint8))
    elif dtype == CUDA_R_32F:
        bits[3::4] = (bits[3::4] & 0x80) | cp.asarray(rng.integers(0x38, 0x46, nbytes // 4, dtype=np.uint8))
    raw[...] = bits


def _admitted(be, plan) -> list[int]:
    """The candidates the tuner raced (the heuristic's first among them)."""
    tuned = {r[0]: r for r in be.lt.tuning.get(plan.key, [])}
    return [i for i in range(plan.count) if i == 0 or (i in tuned and tuned[i][2])]


def _outputs(be, plan, args) -> list:
    """Each admitted candidate's outputs on `args` (D, then the epilogue's: copies), the heuristic's first at [0]."""
    lt = be.lt
    scratch = cp.empty(plan.m * plan.n * plan.elsize, dtype=cp.uint8)
    a, b, _d, alpha, _beta, ws, stream = args
    outs = []
    for i in _admitted(be, plan):
        plan.choose(i)
        plan.run(a, b, scratch.data.ptr, alpha, lt._zero.ctypes.data, ws, stream)  # (epilogue: its own pointers)
        extra = [_bytes(ptr, n).copy() for ptr, n in getattr(plan, "outputs", ())]
        outs.append((i, [scratch.copy()] + extra))
    return outs


def _bytes(ptr: int, n: int):
    return cp.ndarray(n, dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, n, None), 0))


def _check(be, key, plan, rng, source: str) -> list[dict]:
    """The admitted candidates whose outputs differ from the first's: on what lies at the last call's operand
    addresses after training ("later") or on random operands ("random")."""
    with be.lt._stream(plan.last[-1]):  # (the products' stream: CuPy's work here must follow them)
        return _compare(key, plan, rng, source, be)


def _compare(key, plan, rng, source, be) -> list[dict]:
    pick, found = plan.choice, []
    if source == "random":
        for (dtype, nbytes), ptr in zip(plan.operands, plan.last[:2]):
            _randomize(ptr, dtype, nbytes, rng)
    outs = _outputs(be, plan, plan.last)
    cp.cuda.get_current_stream().synchronize()
    word = cp.uint16 if plan.elsize == 2 else cp.uint32
    first = [x.view(word) for x in outs[0][1]]
    for i, out in outs[1:]:
        differ = sum(int((x.view(word) != f).sum()) for x, f in zip(out, first))
        if differ:
            found.append({"product": [str(k) for k in key], "candidate": i, "config": plan.config(i),
                          "first": plan.config(0), "operands": source, "values_differ": differ,
                          "of": sum(int(f.size) for f in first), "kept": i == pick})
    plan.choose(pick)
    return found


def main():
    o = _args()
    be = _trained(o)
    rng = np.random.default_rng(0)
    raced = [(k, p) for k, p in be.lt.plans.items()
             if p is not None and p.last is not None and p.tuned and len(_admitted(be, p)) > 1]
    checked = len(raced)
    found = []
    # every product on its later operands first: the random ones are written over buffers other products read
    for key, plan, source in [(k, p, "later") for k, p in raced] + [(k, p, "random") for k, p in raced]:
        for f in _check(be, key, plan, rng, source):
            found.append(f)
            print(f"{' '.join(f['product'][:6])}: #{f['candidate']} {tuple(f['config'])} against #0 "
                  f"{tuple(f['first'])} on {f['operands']} operands: {f['values_differ']:,} of {f['of']:,} values"
                  + (" (the tuner kept it)" if f["kept"] else ""))
    kept = sum(1 for p in be.lt.plans.values() if p is not None and p.tuned and p.choice != 0)
    print(f"{o.model} {o.dtype}: {checked} products raced two candidates or more, {kept} kept another than the first; "
          f"{len(found)} identical-by-the-tuner candidates differ elsewhere")
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"model": o.model, "dtype": o.dtype, "checked": checked, "found": found}, f, indent=1)


if __name__ == "__main__":
    main()
