"""Helpers shared by llmc's own tests (import them with ``from llmc_test_support import ...``): the kit's device and
tolerance helpers (llmc_cli.testing.helpers), and the command line on a tiny GPT-2."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from llmc_cli.formats.shards import write_shard  # noqa: E402
from llmc_cli.testing.backends import make_backend, unusable_reason  # noqa: F401
from llmc_cli.testing.helpers import (  # noqa: F401
    POISON,
    TOLERANCES,
    assert_close,
    bf16_neighbours,
    bf16_round,
    check_accumulated,
    empty,
    from_device,
    poison,
    prefill,
    randn,
    rel_err,
    to_device,
    tol,
)

# ---------------------------------------------------------------------------------------------------------------
# the command line on a tiny GPT-2 (tests of train / eval / sample / convert / faults)

TINY = ["train", "--backend", "cpu", "--model", "d2", "--n-embd", "64", "-b", "2", "-t", "32", "--val-every", "0",
        "--sample-every", "0"]


def phrase_tokens(repeats: int, seed: int = 0, vocab: int = 50257) -> np.ndarray:
    """A 40-token random phrase rolled `repeats` times: a little structure, so a tiny model's loss can fall."""
    phrase = np.random.default_rng(seed).integers(0, vocab, 40)
    return np.concatenate([np.roll(phrase, k) for k in range(repeats)])


def dtype_tol(backend, fp32: float, bf16: float) -> float:
    """The bound a model-level test allows at the backend's compute dtype."""
    return bf16 if backend.dtype == "bfloat16" else fp32


def run(*args, ok: bool = True):
    """`llmc ARGS` in-process through click's runner; raises with the output unless it exits 0 (or ok=False)."""
    from click.testing import CliRunner

    from llmc_cli.commands import main
    r = CliRunner().invoke(main, [str(a) for a in args])
    if ok and r.exit_code != 0:
        raise AssertionError(f"exit {r.exit_code}: {r.output}\n{r.exception!r}")
    return r


def line_of(output: str, head: str) -> str:
    """The line of `output` that starts with `head`, as it reads on a console wide enough for it: train breaks a
    long line of facts (shards, memory, options) into lines that fit the console, the later ones indented."""
    rows = output.splitlines()
    i = next(i for i, row in enumerate(rows) if row.startswith(head))
    j = i + 1
    while j < len(rows) and rows[j].startswith("  "):
        j += 1
    return " ".join([rows[i], *(row.strip() for row in rows[i + 1:j])])


def losses(log) -> list[float]:
    """The training losses of a --log JSONL file, in order."""
    import json
    return [json.loads(line)["loss"] for line in open(log) if "loss" in json.loads(line)]


def rewind_run(run_dir, died_after: int, dropped: int, log=None) -> None:
    """Make a run directory look as if the run died after its step `died_after` checkpoint: the later checkpoint
    step_`dropped` is gone and `latest` points back; with `log`, that JSONL log ends at step `died_after` too."""
    import shutil
    from pathlib import Path
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / f"step_{dropped:08d}")
    (run_dir / "latest").write_text(f"step_{died_after:08d}\n")
    if log is not None:
        lines = Path(log).read_text().splitlines()[:died_after]
        Path(log).write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# a tiny Llama 3 in a Hugging Face directory (sharded safetensors written by hand)

LLAMA_HF_CONFIG = {  # a tiny Llama 3 as transformers' config.json describes it
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
          "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32},
          "tie_word_embeddings": False, "torch_dtype": "float32"}


def hf_tensors(c, rng):
    C, H, V, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["hidden_size"] // c["num_attention_heads"]
    NH, NKV = c["num_attention_heads"], c["num_key_value_heads"]
    t = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                  p + "self_attn.q_proj.weight": (NH * hd, C), p + "self_attn.k_proj.weight": (NKV * hd, C),
                  p + "self_attn.v_proj.weight": (NKV * hd, C), p + "self_attn.o_proj.weight": (C, NH * hd),
                  p + "mlp.gate_proj.weight": (H, C), p + "mlp.up_proj.weight": (H, C),
                  p + "mlp.down_proj.weight": (C, H)})
    return {n: (1.0 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else 0.05 * rng.standard_normal(s))
            .astype(np.float32) for n, s in t.items()}


def write_st(path, tensors):
    """safetensors by hand: u64 header length, JSON header, raw little-endian F32 data."""
    header, blobs, off = {}, [], 0
    for n, a in tensors.items():
        raw = a.astype("<f4").tobytes()
        header[n] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(np.uint64(len(h)).tobytes() + h + b"".join(blobs))


def write_hf_dir(d, tensors):
    """Two shards and an index, as transformers' save_pretrained writes them."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_HF_CONFIG))
    names = list(tensors)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in parts.items():
        write_st(d / f, {n: tensors[n] for n in ns})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": {n: f for f, ns in parts.items() for n in ns}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def one_line_error(r, *needles) -> str:
    """A command's failure as the brief wants it: exit 2, one line starting with "error:", no traceback, naming
    each of `needles`; returns the line."""
    msg = r.output.strip()
    assert r.exit_code == 2, r.output
    assert msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


def last_line_error(r, *needles) -> str:
    """A training command's failure: exit 2, no traceback, the last line an "error:" naming each of `needles`
    (lines the run printed before it, the model's and the data's, may precede it); returns that line."""
    out = r.output.strip()
    assert r.exit_code == 2 and "Traceback" not in out, out
    line = out.splitlines()[-1]
    assert line.startswith("error:"), out
    for n in needles:
        assert n in line, line
    return line


def two_shard_dir(tmp_path: Path) -> str:
    """A data folder of one val and one train shard of random GPT-2 ids (4,096 and 8,192 tokens)."""
    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(0)
    write_shard(d / "x_val_000000.bin", rng.integers(0, 50257, 4096))
    write_shard(d / "x_train_000001.bin", rng.integers(0, 50257, 8192))
    return str(d)


def train_tiny(data, *args, ok: bool = True):
    """`llmc train` of the TINY model on `data` with ARGS, in process (see `run`)."""
    return run(*TINY, "--data", data, *args, ok=ok)


def local_http_server(answer: bytes) -> int:
    """The port of a local server giving every request `answer` (a connection that sends nothing, a reachability
    probe, gets nothing): downloads tested without the internet."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def serve():
        while True:
            c, _ = s.accept()
            c.settimeout(5)
            try:
                if c.recv(65536):
                    c.sendall(answer)
            except OSError:
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# a backend with CAP_COPY_OVERLAP in plain numpy (`llmc bench overlap` without a device)

def overlap_backend(fault: str | None = None, seconds: float | None = None):
    """The cpu backend announcing CAP_COPY_OVERLAP: overlap_layernorm copies host -> its "device" arrays, runs
    layernorm_forward chunk by chunk and copies back, as the contract says. `fault` breaks one thing: "no_out"
    (out is never copied back), "last_chunk" (the chunked mode forgets its last chunk's copies out), "stale" (the
    kernel runs on the first call only, so later calls copy back whatever the device outputs hold), "rstd" (rstd
    1 % too large). `seconds`: the time every call reports (else the host clock's)."""
    import time

    from llmc_cli.kernels import CAP_COPY_OVERLAP, OVERLAP_SYNC

    class HostOverlap(type(make_backend("cpu"))):
        name = "hostoverlap"
        capabilities = frozenset({CAP_COPY_OVERLAP})
        calls = 0

        def host_alloc(self, shape, pinned=False):
            return np.empty(shape, np.float32)  # "pinned" too: the host is the device here

        def overlap_layernorm(self, out, mean, rstd, inp, d_out, d_mean, d_rstd, d_inp, d_weight, d_bias, *, mode,
                              streams, block):
            t0 = time.perf_counter()
            N = inp.shape[0]
            k = 1 if mode == OVERLAP_SYNC else streams
            for i in range(k):
                a, b = i * N // k, (i + 1) * N // k
                d_inp[a:b] = inp[a:b]
                if fault != "stale" or self.calls == 0:
                    self.layernorm_forward(d_out[a:b], d_mean[a:b], d_rstd[a:b], d_inp[a:b], d_weight, d_bias)
                if fault == "last_chunk" and k > 1 and i == k - 1:
                    continue
                if fault != "no_out":
                    out[a:b] = d_out[a:b]
                mean[a:b] = d_mean[a:b]
                rstd[a:b] = d_rstd[a:b] * (1.01 if fault == "rstd" else 1.0)
            self.calls += 1
            return seconds if seconds is not None else time.perf_counter() - t0
    return HostOverlap()

@contextmanager
def fifo(path: Path):
    """A FIFO at `path`. A reader that opens it (what llmc must not do) is let go with an empty read by a writer that
    keeps opening and closing the other end, so the test fails on its assertions instead of hanging."""
    os.mkfifo(path)
    stop = threading.Event()

    def release():
        while not stop.wait(0.2):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader waiting: nothing to release
                pass

    t = threading.Thread(target=release, daemon=True)
    t.start()
    try:
        yield path
    finally:
        stop.set()
        t.join()


def cpu_with(capabilities=None, lacks: tuple[str, ...] = (), name: str = "liar"):
    """The cpu backend announcing `capabilities` (a class attribute as given), its kernels in `lacks` raising
    NotImplementedError as a backend's unfinished override would."""
    from llmc_cli.registry import create_backend
    be_cls = type(create_backend("cpu"))

    def missing(kernel):
        def method(self, *a, **k):
            raise NotImplementedError(f"{kernel} is not written yet")
        method.__code__ = method.__code__.replace(co_name=kernel)  # (as a backend's own override is named)
        return method
    attrs = {"name": name, "capabilities": capabilities} | {k: missing(k) for k in lacks}
    return type("Liar", (be_cls,), attrs)()


# ---------------------------------------------------------------------------------------------------------------
# the conformance kit in a pytest of its own, as a backend's author runs it

# (the pytest plugins of this environment that the kit does not use are left out: importing hypothesis, xdist and
# the others is a third of a short kit run)
KIT_PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
              "-p", "no:xdist", "-p", "no:xdist.looponfail", "-p", "no:benchmark", "-p", "no:anyio",
              "--pyargs", "llmc_cli.testing"]
