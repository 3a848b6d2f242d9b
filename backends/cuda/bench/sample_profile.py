"""Where a token of `llmc sample` goes on the GPU: generate() timed token by token on a checkpoint, as the command
runs it (the window it plans, the tokenizer's vocabulary), the first token apart (its prefill, the first step run
uncaptured, the capture), with the token drawn on the device and on the host; then the parts of one token, each
timed alone; then the host's busiest functions over a generation (cProfile).
    python backends/cuda/bench/sample_profile.py CHECKPOINT [TOKENS=1000]"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np
from host_timing import per_call_ms

from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.formats.sources import load_config_any, tokenizer_for
from llmc_cli.inference import decode
from llmc_cli.inference.loading import load_model
from llmc_cli.inference.sampling import choose_token, generate
from llmc_cli.registry import create_backend

path = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
cfg = load_config_any(path)
tok = load_tokenizer(*tokenizer_for(path))
prompt = [tok.eot] if tok.name == "gpt2" else list(tok.doc_prefix)
window = min(cfg.block_size, max(64, -(-(len(prompt) + N) // 64) * 64))  # as `llmc sample` plans it
be = create_backend("cuda", dtype="bfloat16")
model = load_model(path, be, 1, window)


def tokens_timed(on_device: bool, temperature: float = 1.0) -> tuple[np.ndarray, list[int]]:
    """Seconds of each new token (generate's own, without the command's printing), and the tokens."""
    real = decode.samples_on_device
    if not on_device:
        decode.samples_on_device = lambda m: False
    try:
        stamps, tokens = [time.perf_counter()], []
        for t in generate(model, prompt, N, np.random.default_rng(1337), temperature, vocab_limit=tok.vocab_size):
            stamps.append(time.perf_counter())
            tokens.append(t)
    finally:
        decode.samples_on_device = real
    return np.diff(stamps), tokens


print(f"{path}: window {window}, vocabulary {tok.vocab_size:,}, {N} tokens, {be.describe()}")
print(f"  {'draw':24s} {'first ms':>9s} {'rest median ms':>15s} {'rest mean ms':>13s} {'tok/s':>8s}")
drawn = {}
for on_device, temperature in ((True, 1.0), (False, 1.0), (True, 1.0), (True, 0.0), (False, 0.0)):
    d, drawn[on_device, temperature] = tokens_timed(on_device, temperature)
    label = f"{'device' if on_device else 'host'}, T={temperature:g}"
    print(f"  {label:24s} {d[0] * 1e3:9.2f} {np.median(d[1:]) * 1e3:15.3f} {d[1:].mean() * 1e3:13.3f} "
          f"{d.size / d.sum():8.1f}")
for temperature in (1.0, 0.0):
    a, b = drawn[True, temperature], drawn[False, temperature]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"  T={temperature:g}: the device's {len(a)} tokens are the host's: "
          f"{'yes' if same is None and len(a) == len(b) else f'NO, from token {same}'}")

dec = decode.decoder_for(model)
v1 = dec._views[1]
Vp = dec.plan["logits"][0][-1]
row = be.view(dec.bufs["logits"], 0, (Vp,))
host_logits = be.download(v1["logits"])[0, 0, :tok.vocab_size].astype(np.float32)
rng = np.random.default_rng(0)


def per_token(fn, n=200) -> float:
    return per_call_ms(be, fn, n)


one = np.array([5], np.int32)
dec.pos = 10
rows = {
    "draw (whole token)": per_token(lambda: (dec.draw(one, 0.5, 1.0, tok.vocab_size), setattr(dec, "pos", 10))),
    "feed (whole token, logits)": per_token(lambda: (dec.feed(one), setattr(dec, "pos", 10))),
    "replay + synchronize": per_token(lambda: (dec._step(), be.synchronize())),
    "sample_token + synchronize": per_token(lambda: (be.sample_token(dec._drawn, row, 0.5, 1.0, tok.vocab_size),
                                                     be.synchronize())),
    "download [id, bad]": per_token(lambda: be.download(dec._drawn)),
    "download logits": per_token(lambda: be.download(v1["logits"])),
    "choose_token on the host": per_token(lambda: choose_token(host_logits, rng)),
}
print("parts of one token, ms:")
for k, v in rows.items():
    print(f"  {k:32s} {v:8.3f}")

prof = cProfile.Profile()
prof.enable()
tokens_timed(True)
prof.disable()
print(f"host functions over {N} tokens drawn on the device (by own time):")
pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
