"""Where a decoded token's time goes on the GPU: the whole `KVDecoder.feed` against its parts, each timed alone
over the same tokens (the captured step replayed and waited for, the logits download, the host's staging).
    python backends/cuda/bench/decode_profile.py [MODEL=d12] [WINDOW=1024] [TOKENS=200]"""

from __future__ import annotations

import sys

import numpy as np
from host_timing import per_call_ms

from llmc_cli.inference.decode import KVDecoder
from llmc_cli.models.families import family_for
from llmc_cli.registry import create_backend

model_name = sys.argv[1] if len(sys.argv) > 1 else "d12"
S = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200
be = create_backend("cuda", dtype="bfloat16")
fam = family_for(model_name)
cfg = fam.preset(model_name)
model = fam.model_class(cfg, be, 1, S, training=False)
model.load_parameters(fam.init_parameters(cfg, 0))
dec = KVDecoder(model, 1, max_len=S)
logits = dec.feed(np.arange(16, dtype=np.int32))
for _ in range(20):
    logits = dec.feed(np.array([[int(np.argmax(logits))]], np.int32))


def per_token(fn, n=N) -> float:
    return per_call_ms(be, fn, n)


tok = np.array([[1]], np.int32)
v1 = dec._views[1]
rows = {
    "feed (whole token)": per_token(lambda: dec.feed(tok)),
    "replay + synchronize": per_token(lambda: (dec._step(), be.synchronize())),
    "replay only (queued)": per_token(dec._step),
    "logits download": per_token(lambda: be.download(v1["logits"])),
    "upload token + position": per_token(lambda: (be.upload(v1["inputs"], tok), be.upload(dec.pos_buf, np.array([5], np.int32)))),
    "decode_inputs": per_token(lambda: model.decode_inputs(v1, 5)),
    "argmax of the logits": per_token(lambda: np.argmax(logits)),
}
print(f"{model_name}, window {S}, bf16, {N} tokens each, ms per token:")
for k, v in rows.items():
    print(f"  {k:28s} {v:8.3f}")

# one step uncaptured, queued behind a spin kernel so the GPU runs the calls back to back: each call's device time
import cupy as cp  # noqa: E402

calls, orig = [], {}
for name in ("encoder_forward", "layernorm_forward", "fused_residual_layernorm_forward", "rmsnorm_forward",
             "residual_forward", "matmul_forward", "swiglu_forward", "gelu_forward", "rope_forward",
             "attention_decode"):
    f = orig[name] = getattr(be, name)

    def timed(*a, _f=f, _n=name, **kw):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(be.stream)
        _f(*a, **kw)
        e1.record(be.stream)
        label = _n + (f" {a[2].shape[1]}->{a[2].shape[0]}" if _n == "matmul_forward" else "")
        calls.append((label, e0, e1))
    setattr(be, name, timed)
spin = cp.RawKernel('extern "C" __global__ void spin(long long c) { long long t0 = clock64(); '
                    'while (clock64() - t0 < c) { } }', "spin")
be.synchronize()
with be.stream:
    spin((1,), (1,), (np.int64(int(3e8)),))
model.decode_forward(v1, dec.pos_buf, dec.k_cache, dec.v_cache)
be.synchronize()
for name, f in orig.items():
    setattr(be, name, f)
by: dict[str, list] = {}
for label, e0, e1 in calls:
    by.setdefault(label, []).append(cp.cuda.get_elapsed_time(e0, e1))
total = sum(sum(v) for v in by.values())
print(f"one uncaptured step, device time of the calls {total:.3f} ms:")
for label, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    print(f"  {label:40s} {len(v):4d} {sum(v):8.3f} ms  {sum(v) / len(v) * 1e3:8.1f} us each")
