"""Where a decoded token's time goes on the GPU: the whole `KVDecoder.feed` against its parts, each timed alone
over the same tokens (the captured step replayed and waited for, the logits download, the host's staging).
    python backends/cuda/bench/decode_profile.py [MODEL=d12] [WINDOW=1024] [TOKENS=200]"""

from __future__ import annotations

import sys
import time

import numpy as np

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
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    be.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


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
