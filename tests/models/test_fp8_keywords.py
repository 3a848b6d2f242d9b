"""What the engine tells a CAP_FP8 backend beyond the contract's arguments: `precise` on the classifier's products
and `fp8_next` on the producers (kernels.Backend.matmul_forward), checked on the cpu backend behind a spy that
announces CAP_FP8 and records every kernel call."""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from llmc_cli.kernels import CAP_FP8, Backend
from llmc_cli.models.gpt2 import GPT2, GPT2Config
from llmc_cli.models.gpt2 import init_parameters as gpt2_init
from llmc_cli.models.llama3 import Llama3, Llama3Config
from llmc_cli.models.llama3 import init_parameters as llama_init
from llmc_cli.registry import create_backend

# producer -> the argument it writes
PRODUCERS = {"layernorm_forward": "out", "fused_residual_layernorm_forward": "out", "rmsnorm_forward": "out",
             "swiglu_forward": "out", "swiglu_backward": "dinp", "gelu_forward": "out", "matmul_forward": "out",
             "classifier_forward_backward": "logits"}
NOT_KERNELS = {"alloc", "view", "memory_report", "describe", "variants", "variant", "capture", "timer"}

GPT2_CFG = GPT2Config(block_size=16, vocab_size=100, n_layer=2, n_head=2, n_embd=48)
LLAMA_CFG = Llama3Config(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                         rope_scaling=None)


def key(buf):
    return (buf.__array_interface__["data"][0], buf.size) if isinstance(buf, np.ndarray) else None


def spy_backend():
    """A cpu backend announcing CAP_FP8 whose kernels take `precise` and `fp8_next` and log what they meet:
    `pending` maps each output a producer wrote with fp8_next to that weight's key until a product reads it."""
    base = type(create_backend("cpu"))
    log = SimpleNamespace(pending={}, read=set(), bad=[], precise=[], produced=[], depth=0)

    def wrap(name):
        method = getattr(base, name)
        sig = inspect.signature(method)

        def call(self, *args, **kw):
            nxt, precise = kw.pop("fp8_next", None), kw.pop("precise", None)
            if log.depth:  # (a default built from other kernels: the engine's call is the one logged)
                return method(self, *args, **kw)
            bound = sig.bind(self, *args, **kw).arguments
            if name.startswith("matmul_"):
                log.precise.append((name, bound["weight"].shape, bool(precise)))
                for role in ("inp", "dout"):
                    w = log.pending.get(key(bound.get(role)))
                    if w is None:
                        continue
                    log.read.add(key(bound[role]))
                    # (the classifier's forward reads act; its backward may read the gradient the loss produced)
                    if w != key(bound["weight"]) or (precise and name == "matmul_forward") \
                            or (role == "dout" and bound["dbias"] is not None):
                        log.bad.append((name, role, "read by another product"))
            else:
                for arg, v in bound.items():
                    if arg not in ("self", PRODUCERS.get(name)) and key(v) in log.pending:
                        log.bad.append((name, arg, "read by a kernel other than its product"))
            if name == "matmul_forward" and nxt is not None and bound.get("pre_gelu") is None:
                log.bad.append((name, "fp8_next on a product without GELU"))
            if name in PRODUCERS:
                k = key(bound[PRODUCERS[name]])
                if k in log.pending and k not in log.read:
                    log.bad.append((name, "overwritten before its product read it"))
                log.pending.pop(k, None)
                log.read.discard(k)
                if nxt is not None:
                    log.pending[k] = key(nxt)
                    log.produced.append(name)
            elif nxt is not None:
                log.bad.append((name, "fp8_next on a kernel that is no producer"))
            log.depth += 1
            try:
                return method(self, *args, **kw)
            finally:
                log.depth -= 1
        return call

    names = [n for n in dir(Backend) if not n.startswith("_") and n not in NOT_KERNELS
             and inspect.isfunction(getattr(Backend, n))]
    spy = type("Spy", (base,), {"capabilities": base.capabilities | {CAP_FP8}, **{n: wrap(n) for n in names}})
    return spy(), log


def model(family, backend, recompute="none", training=True):
    if family == "gpt2":
        m = GPT2(GPT2_CFG, backend, 2, 8, training=training, recompute=recompute)
        m.load_parameters(gpt2_init(GPT2_CFG, 1))
    else:
        m = Llama3(LLAMA_CFG, backend, 2, 8, training=training, recompute=recompute)
        m.load_parameters(llama_init(LLAMA_CFG, 1))
    return m


def train_once(m):
    x = np.arange(16, dtype=np.int32).reshape(2, 8) % 90
    m.zero_grad()
    m.forward(x, x, dloss=1 / 16)
    m.backward()


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
@pytest.mark.parametrize("recompute", ["none", "gelu+layernorm"])
def test_fp8_next_names_the_product_that_reads_the_output_next(family, recompute):
    """Every output a producer writes with fp8_next is read next by the products with that weight alone (its
    input forward and backward, or the gradient of a product without bias, the classifier's too), before the
    producer writes it again; nothing else passes fp8_next. The classifier's input carries none (its forward stays
    precise)."""
    be, log = spy_backend()
    train_once(model(family, be, recompute))
    assert not log.bad, log.bad
    assert all(k in log.read for k in log.pending), "an output written for a product that never read it"
    L, again = 2, recompute != "none"
    want = ({"layernorm_forward": 1 + again * 2 * L, "fused_residual_layernorm_forward": 2 * L - 1,
             "matmul_forward": L, **({"gelu_forward": L} if again else {})}
            if family == "gpt2" else
            {"rmsnorm_forward": 2 * L * (1 + again), "swiglu_forward": L * (1 + again), "swiglu_backward": L})
    want["classifier_forward_backward"] = 1  # (one chunk: the whole batch)
    assert {n: log.produced.count(n) for n in set(log.produced)} == want


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_inference_forward_passes_fp8_next_as_training_does(family):
    be, log = spy_backend()
    m = model(family, be, training=False)
    m.forward(np.arange(16, dtype=np.int32).reshape(2, 8) % 90)
    assert not log.bad and log.produced


def test_classifier_products_are_precise_only_on_fp8_backends():
    """The engine passes precise=True to the classifier's matmuls on a CAP_FP8 backend (and neither keyword to
    the others, whose kernels need not know them)."""
    be, log = spy_backend()
    train_once(model("gpt2", be))
    head_shape = (GPT2_CFG.padded_vocab_size, GPT2_CFG.n_embd)
    head = [(k, p) for k, shape, p in log.precise if shape == head_shape]
    layers = [p for k, shape, p in log.precise if shape != head_shape]
    assert head == [("matmul_forward", True), ("matmul_backward", True)] and layers and not any(layers)
    train_once(model("gpt2", create_backend("cpu")))  # a backend without CAP_FP8 is called as before
    train_once(model("llama3", create_backend("cpu")))
