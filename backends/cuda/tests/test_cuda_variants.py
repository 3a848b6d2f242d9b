"""The CUDA backend's kernel variants (`llmc bench kernels --variants`) and its settling of the cuBLASLt races.

Every variant of every kernel runs once on the inputs of `llmc bench kernels`' cases (GPT-2 with aligned and
unaligned channels, Llama 3) against the default's output: bit for bit where only the launch changes and the
arithmetic does not (elementwise kernels, AdamW, the warp-per-row norms), within the dtype's rounding where the
order of a sum changes; each twice, bit-identical (deterministic). The default's launches are pinned to what
they were before variants existed. `bench kernels` runs the races to their end before its timed calls."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_cli.bench import kernel_cases as kc
from llmc_cli.kernels import BFLOAT16, FLOAT32, VariantUnsupported
from llmc_cli.models.gpt2 import preset
from llmc_cli.models.llama3 import preset as llama_preset

from test_cuda import _INFO, cuda

pytestmark = pytest.mark.cuda

ELEMENTWISE = {"residual_forward", "gelu_forward", "gelu_backward", "swiglu_forward", "swiglu_backward",
               "adamw_update"}
CONFIGS = {"gpt2 C=128": (preset("d2", vocab_size=1000), 2, 64),
           "gpt2 C=98 (unaligned)": (preset("d2", n_embd=98, vocab_size=1000), 2, 33),
           "llama3-tiny": (llama_preset("llama3-tiny", vocab_size=256), 2, 64)}


def _exact(kernel: str, name: str) -> bool:
    """Variants that change the launch but not the arithmetic (a warp a row whatever the block): the default's
    bits."""
    return kernel in ELEMENTWISE or (kernel.endswith("norm_forward") and name.startswith("b"))


@pytest.fixture(scope="module")
def cpu():
    from llmc_cpu import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_variant_matches_the_default(dtype, config, cpu):
    b = cuda(dtype)
    cfg, B, T = CONFIGS[config]
    tol = 1e-5 if dtype == FLOAT32 else 2e-2
    ran, unsupported = 0, []
    for case in kc.kernel_cases(cfg, B, T):
        names = b.variants(case.kernel)
        if not names:
            continue
        host = kc._host_inputs(case, 0)
        if case.derive is not None:
            case.derive(host, cpu)  # (attention_bwd's out and lse)
        inputs = kc._upload(case, b, host)
        want = kc._call_once(case, b, kc._clone(case, b, inputs))
        for name in names:
            with b.variant(case.kernel, name):
                try:
                    got = kc._call_once(case, b, kc._clone(case, b, inputs))
                except VariantUnsupported as e:
                    unsupported.append(f"{case.name} {name}: {e}")
                    continue
                again = kc._call_once(case, b, kc._clone(case, b, inputs))
            ran += 1
            for out in case.outputs:
                where = f"{config} {dtype} {case.name} variant {name}: {out}"
                assert np.array_equal(got[out], again[out]), f"{where} differs between two runs"
                if _exact(case.kernel, name):
                    assert np.array_equal(got[out], want[out]), f"{where} is not the default's bits"
                else:
                    err = kc.rel_error(got[out], want[out])
                    assert err <= tol, f"{where}: {err:.2e} from the default"
        assert not b._variant, "a variant stayed in use after its block"
    print(f"{config} {dtype}: {ran} variants ran; not applicable: {unsupported}")
    assert ran > 50 and len(unsupported) < ran // 10


def test_variant_names_and_the_block_they_run_in():
    b = cuda(BFLOAT16)
    assert b.variants("layernorm_forward")[:2] == ["b32", "b64"] and "naive-b1024" in b.variants("layernorm_forward")
    assert "b512" not in b.variants("layernorm_backward") and "scalar-b512" in b.variants("layernorm_backward")
    blocks = (32, 64, 128, 256, 512, 1024)
    assert b.variants("matmul_forward") == []
    assert b.variants("adamw_update") == [f"b{n}" for n in blocks] + [f"scalar-b{n}" for n in blocks]
    if b._cudnn_ready():
        assert b.variants("attention_forward") == ["own"]
    assert cuda(FLOAT32).variants("attention_forward") == []  # fp32 attention is the own kernels already
    with pytest.raises(ValueError, match="no variant 'b48' of gelu_forward"):
        with b.variant("gelu_forward", "b48"):
            pass
    with b.variant("gelu_forward", "scalar-b64"):
        assert b._variant == {"gelu_forward": ("scalar", 64)}
        with b.variant("gelu_forward", "b1024"):
            assert b._variant["gelu_forward"] == ("", 1024)
        assert b._variant["gelu_forward"] == ("scalar", 64)
    assert b._variant == {}


def test_default_launches_are_unchanged(monkeypatch):
    """Outside a variant every kernel launches with the grid and block of its own formula (AdamW's packed loop:
    four elements a thread)."""
    b = cuda(BFLOAT16)
    seen = []
    real = b._launch
    monkeypatch.setattr(b, "_launch", lambda k, grid, block, args, shared=0: (seen.append((grid, block)),
                                                                              real(k, grid, block, args, shared))[1])
    rng = np.random.default_rng(0)

    def up(shape):
        buf = b.alloc(shape, b.dtype)
        b.upload(buf, rng.standard_normal(shape).astype(np.float32))
        return buf

    N, C, sms = 4096, 768, b.sm_count
    x, y, o = up((N, C)), up((N, C)), up((N, C))
    m, v, master = (b.alloc((N, C), FLOAT32) for _ in range(3))
    for t in (m, v, master):
        b.fill(t, 0.5)
    targets = b.alloc(64, "int32")
    b.fill(targets, 3)
    grid = lambda n, per: max(1, min((n // per + 255) // 256, sms * 32))  # noqa: E731
    for call, want in ((lambda: b.residual_forward(o, x, y), [(grid(N * C, 8), 256)]),
                       (lambda: b.gelu_forward(o, x), [(grid(N * C, 8), 256)]),
                       (lambda: b.gelu_backward(o, x, y), [(grid(N * C, 8), 256)]),
                       (lambda: b.swiglu_forward(up((N, C // 2)), x), [(grid(N * C // 2, 8), 256)]),
                       (lambda: b.layernorm_forward(o, b.alloc(N, FLOAT32), b.alloc(N, FLOAT32), x, up(C), up(C)),
                        [((N + 7) // 8, 256)]),
                       (lambda: b.adamw_update(o, x, m, v, master, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                               weight_decay=0.0, step=1, grad_scale=1.0, seed=0),
                        [(grid(N * C, 4), 256)]),  # (four elements a thread)
                       (lambda: b.classifier_forward_backward(up((64, 1024)), b.alloc(64, FLOAT32), targets, 1000,
                                                              None), [(64, 512)])):
        seen.clear()
        call()
        assert seen == want


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32])
def test_bench_runs_the_cublaslt_races_before_timing(dtype, monkeypatch):
    """No race call (bit check or timed trial) lands between a timer's start and stop in `bench kernels`; the
    races ran to a decision in settle() instead of being cut short."""
    b = _INFO.plugin.create(dtype=dtype)  # fresh: no plan raced yet
    lt, timing, inside = b.lt, [False], []
    real_timer, real_trial, real_identical = b.timer, lt._trial_call, lt._identical

    class Flagged:
        def __init__(self):
            self.t = real_timer()

        def start(self):
            timing[0] = True
            self.t.start()

        def stop(self):
            dt = self.t.stop()
            timing[0] = False
            return dt

    def trial(*a, **k):
        inside.append(("trial", timing[0]))
        return real_trial(*a, **k)

    def identical(*a, **k):
        inside.append(("identical", timing[0]))
        return real_identical(*a, **k)
    monkeypatch.setattr(b, "timer", Flagged)
    monkeypatch.setattr(lt, "_trial_call", trial)
    monkeypatch.setattr(lt, "_identical", identical)
    res = kc.run_kernels([("cuda", b)], preset("d12", vocab_size=50257), 2, 1024, repeat=20, warmup=2,
                         only=["matmul_fwd qkv", "matmul_bwd fc"])
    print([(r["kernel"], r["times_ms"]) for r in res["results"]])
    assert len(res["results"]) == 3  # (matmul_bwd fc and fcproj)
    assert inside and not any(t for _, t in inside), inside
    assert all(p is None or p.tuned for p in lt.plans.values())
    raced = [rows for rows in lt.tuning.values() if sum(r[2] for r in rows) > 1]
    assert raced and all(all(ms is not None for _, _, same, ms in rows if same) for rows in raced), lt.tuning
