"""OpenCL-specific tests: the plugin probe, device selection, the SGEMM autotune cache and the SGEMM itself on
awkward sizes (every layout, both kernel families) against numpy. Kernel conformance against the CPU backend is
llmc_cli/testing/test_kernels.py, which runs over every installed backend."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from llmc_cli.kernels import BackendUnavailable, VariantUnsupported

llmc_opencl = pytest.importorskip("llmc_opencl", reason="llmc-opencl is not installed")
from llmc_opencl import tune  # noqa: E402

PLUGIN = llmc_opencl.OpenCLPlugin()
USABLE, REASON = PLUGIN.probe()
needs_device = pytest.mark.opencl  # skipped by conftest with the probe's reason where no device runs kernels

_BE = {}


def get_backend():
    if "be" not in _BE:
        _BE["be"] = PLUGIN.create()
    return _BE["be"]


# ---- probe ---------------------------------------------------------------------------------------------------
def test_probe_returns_a_line():
    ok, reason = PLUGIN.probe()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason and "\n" not in reason


def test_probe_without_pyopencl(monkeypatch):
    monkeypatch.setattr(llmc_opencl, "cl", None)
    monkeypatch.setattr(llmc_opencl, "_IMPORT_ERROR", ImportError("No module named 'pyopencl'"))
    ok, reason = PLUGIN.probe()
    assert not ok and "pyopencl" in reason
    assert PLUGIN.devices() == []
    with pytest.raises(BackendUnavailable, match="pyopencl"):
        PLUGIN.create()


def test_probe_without_platform(monkeypatch):
    if llmc_opencl.cl is None:
        pytest.skip("pyopencl missing")

    def no_platform():
        raise llmc_opencl.cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
    monkeypatch.setattr(llmc_opencl, "_all_devices", no_platform)
    ok, reason = PLUGIN.probe()
    assert not ok and "platform" in reason.lower()
    monkeypatch.setattr(llmc_opencl, "_all_devices", lambda: [])
    ok, reason = PLUGIN.probe()
    assert not ok and "no OpenCL device" in reason
    with pytest.raises(BackendUnavailable):
        PLUGIN.create()


# ---- device selection ----------------------------------------------------------------------------------------
def _fake(name, kind, cus, mhz):
    cl = llmc_opencl.cl
    t = {"gpu": cl.device_type.GPU, "cpu": cl.device_type.CPU}[kind]
    return types.SimpleNamespace(name=name, type=t, max_compute_units=cus, max_clock_frequency=mhz)


def test_default_device_is_fastest_gpu_else_cpu(monkeypatch):
    if llmc_opencl.cl is None:
        pytest.skip("pyopencl missing")
    p0, p1 = types.SimpleNamespace(name="CPU platform"), types.SimpleNamespace(name="GPU platform")
    cpu = _fake("some cpu", "cpu", 64, 3000)
    small, big = _fake("small gpu", "gpu", 8, 1000), _fake("big gpu", "gpu", 80, 1500)
    monkeypatch.setattr(llmc_opencl, "_all_devices",
                        lambda: [(0, 0, p0, cpu), (1, 0, p1, small), (1, 1, p1, big)])
    monkeypatch.setattr(llmc_opencl.cl.device_type, "to_string", lambda t: "GPU" if t == big.type else "CPU",
                        raising=False)
    broken = {}  # device name -> why it cannot run kernels (the probe's verdict)
    monkeypatch.setattr(llmc_opencl, "_why_not", lambda d: broken.get(d[3].name, ""))
    assert llmc_opencl.select_device(None)[1] is big
    assert llmc_opencl.select_device("1:0")[1] is small
    assert llmc_opencl.select_device("0:0")[1] is cpu
    assert llmc_opencl.select_device("SMALL")[1] is small   # substring, case-insensitive
    assert llmc_opencl.select_device("cpu")[1] is cpu
    with pytest.raises(BackendUnavailable, match="no OpenCL device 2:0"):
        llmc_opencl.select_device("2:0")
    with pytest.raises(BackendUnavailable, match="matches"):
        llmc_opencl.select_device("no such thing")
    monkeypatch.setattr(llmc_opencl, "_all_devices", lambda: [(0, 0, p0, cpu)])
    assert llmc_opencl.select_device(None)[1] is cpu
    # a device that cannot build kernels is passed over by "auto" and refused, with its reason, by name
    monkeypatch.setattr(llmc_opencl, "_all_devices", lambda: [(0, 0, p0, cpu), (1, 0, p1, small), (1, 1, p1, big)])
    broken["big gpu"] = "cannot build a kernel: error: unknown target CPU 'generic'"
    assert llmc_opencl.select_device(None)[1] is small
    assert llmc_opencl.select_device("gpu")[1] is small
    with pytest.raises(BackendUnavailable, match="big gpu.*unknown target CPU 'generic'"):
        llmc_opencl.select_device("1:1")
    broken.update({"small gpu": "x", "some cpu": "cannot build a kernel: error: y"})
    with pytest.raises(BackendUnavailable, match="some cpu.*error: y"):
        llmc_opencl.select_device(None)


@needs_device
def test_devices_listed_and_selectable():
    devs = PLUGIN.devices()
    assert devs and all(d.split(" ")[0].count(":") == 1 for d in devs)
    be = PLUGIN.create(device=devs[0].split(" ")[0])          # "P:D"
    assert be.device.name.strip() in devs[0]
    assert be.describe().startswith("OpenCL ") and "SGEMM" in be.describe()
    with pytest.raises(BackendUnavailable):
        PLUGIN.create(device="no-such-device-anywhere")
    with pytest.raises(BackendUnavailable, match="float32"):
        PLUGIN.create(dtype="bfloat16")


def test_entry_point_registered():
    from llmc_cli import registry
    names = {p.name: p for p in registry.discover()}
    assert "opencl" in names and names["opencl"].distribution == "llmc-opencl"


# ---- autotune cache ------------------------------------------------------------------------------------------
@needs_device
def test_autotune_cache_written_and_reused(tmp_path, monkeypatch):
    be = get_backend()
    path = tmp_path / "tune.json"
    monkeypatch.setenv("LLMC_OPENCL_TUNE_CACHE", str(path))
    monkeypatch.delenv("LLMC_OPENCL_TUNE", raising=False)
    small = [c for c in tune.candidates(be.device) if tune.fits(be.device, c)][:2]
    monkeypatch.setattr(tune, "candidates", lambda device: small)
    cfg = tune.get_config(be)
    assert cfg["source"] == "autotuned"
    data = json.loads(path.read_text())
    key = tune.device_key(be.platform, be.device)
    assert be.device.name.strip() in key and set(data[key]["config"]) == set(tune.LAYOUTS)
    assert all(len(v) == len(small) for v in data[key]["gflops"].values())

    def boom(_be):
        raise AssertionError("the cached result must be reused")
    monkeypatch.setattr(tune, "autotune", boom)
    again = tune.get_config(be)
    assert again["source"] == "autotuned, cached"
    assert all(again[lay] == cfg[lay] for lay in tune.LAYOUTS)
    monkeypatch.setenv("LLMC_OPENCL_TUNE", "0")
    assert tune.get_config(be)["source"] == "default"


@needs_device
def test_autotune_cache_survives_garbage(tmp_path, monkeypatch):
    be = get_backend()
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    monkeypatch.setenv("LLMC_OPENCL_TUNE_CACHE", str(path))
    monkeypatch.delenv("LLMC_OPENCL_TUNE", raising=False)
    monkeypatch.setattr(tune, "candidates", lambda device: [tune.default_config(device)["NT"]])
    assert tune.get_config(be)["source"] == "autotuned"
    assert tune.device_key(be.platform, be.device) in json.loads(path.read_text())


# ---- SGEMM on awkward sizes ------------------------------------------------------------------------------------
# (M, N, K); the multiples of 4 take the float4 global reads of the VEC tiles, partial tiles included
SIZES = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (130, 67, 129), (3, 200, 1), (64, 64, 64), (97, 1, 300),
         (132, 68, 260), (132, 68, 67), (36, 260, 12)]
CONFIGS = {"direct": tune.DIRECT[0], "tiled": tune.TILED[0], "direct-4x16": tune.DIRECT[2],
           "direct-8x16": tune.DIRECT[3], "tiled-128": tune.TILED[1], "tiled-128-k8": tune.TILED[6],
           "tiled-prefetch": tune.TILED[9], "tiled-prefetch-64x128": tune.TILED[11],
           "tiled-float4": tune.TILED[12], "tiled-float4-k16": tune.TILED[13], "tiled-float4-128x64": tune.TILED[15]}


def rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@needs_device
@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_sgemm_awkward_sizes(kind, layout):
    import pyopencl.array as cla
    be = get_backend()
    c = CONFIGS[kind]
    if not tune.fits(be.device, c):
        pytest.skip(f"{kind} does not fit or does not build on this device ({tune.config_name(c)})")
    rng = np.random.default_rng(1)
    a_t, b_t = int(layout[0] == "T"), int(layout[1] == "T")
    for M, N, K in SIZES:
        a = rng.standard_normal((K, M) if a_t else (M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if b_t else (K, N)).astype(np.float32)
        c0 = rng.standard_normal((M, N)).astype(np.float32)
        A, B = cla.to_device(be.queue, a), cla.to_device(be.queue, b)
        C = cla.to_device(be.queue, np.full((M, N), np.nan, np.float32))
        ref = (a.T if a_t else a).astype(np.float64) @ (b.T if b_t else b).astype(np.float64)
        be.gemm(a_t, b_t, M, N, K, A.data, 0, M if a_t else K, B.data, 0, K if b_t else N, C.data, 0, N,
                config=c)
        got = C.get().astype(np.float64)
        assert rel(got, ref) <= 1e-5, (layout, kind, M, N, K)
        C.set(c0)  # accumulate: C += alpha * AB
        be.gemm(a_t, b_t, M, N, K, A.data, 0, M if a_t else K, B.data, 0, K if b_t else N, C.data, 0, N,
                config=c, alpha=0.5, accumulate=True)
        assert rel(C.get().astype(np.float64), c0 + 0.5 * ref) <= 1e-5, (layout, kind, M, N, K, "acc")


@needs_device
@pytest.mark.parametrize("T", [40, 37])
def test_attention_with_float4_tiles(T):
    """Attention walks (batch, head) through packed qkv with grouped-query heads and the causal modes; the VEC
    tiles (float4 reads where T and the head offsets allow, scalar reads where not) against the default tiles."""
    be = get_backend()
    B, NH, NKV, hd = 2, 4, 2, 16
    W = (NH + 2 * NKV) * hd
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, T, W)).astype(np.float32)
    g = rng.standard_normal((B, T, NH * hd)).astype(np.float32)
    saved = dict(be.gemm_config)
    res = []
    try:
        for c in (tune.TILED[0], tune.TILED[12]):
            be.gemm_config.update({lay: dict(c) for lay in tune.LAYOUTS})
            qkv, dout = be.alloc(B * T * W), be.alloc(B * T * NH * hd)
            qkv, dout = be.view(qkv, 0, (B, T, W)), be.view(dout, 0, (B, T, NH * hd))
            be.upload(qkv, x)
            be.upload(dout, g)
            out = be.view(be.alloc(B * T * NH * hd), 0, (B, T, NH * hd))
            lse = be.view(be.alloc(B * NH * T), 0, (B, NH, T))
            dqkv = be.view(be.alloc(B * T * W), 0, (B, T, W))
            be.attention_forward(out, lse, qkv, NH, NKV)
            be.attention_backward(dqkv, dout, qkv, out, lse, NH, NKV)
            res.append([be.download(t).astype(np.float64) for t in (out, lse, dqkv)])
    finally:
        be.gemm_config.clear()
        be.gemm_config.update(saved)
    for a, b in zip(*res):
        assert rel(b, a) <= 1e-5


@needs_device
def test_matmul_on_views_at_odd_offsets():
    """The engine carves one parameter buffer into tensors: kernels must honour arbitrary element offsets."""
    be = get_backend()
    rng = np.random.default_rng(2)
    N, C, OC = 19, 23, 29
    pool = be.alloc(3 + OC * C + OC + 1)
    w, bias = be.view(pool, 3, (OC, C)), be.view(pool, 3 + OC * C, (OC,))
    wh, bh = rng.standard_normal((OC, C)).astype(np.float32), rng.standard_normal(OC).astype(np.float32)
    be.upload(w, wh)
    be.upload(bias, bh)
    acts = be.alloc(5 + N * C + N * OC)
    x, out = be.view(acts, 5, (N, C)), be.view(acts, 5 + N * C, (N, OC))
    xh = rng.standard_normal((N, C)).astype(np.float32)
    be.upload(x, xh)
    be.matmul_forward(out, x, w, bias)
    ref = xh.astype(np.float64) @ wh.T.astype(np.float64) + bh
    assert rel(be.download(out).astype(np.float64), ref) <= 1e-5
    np.testing.assert_array_equal(be.download(x), xh)  # neighbours untouched


@needs_device
def test_sgemm_faster_than_naive_numpy_baseline_is_reported():
    """Not a speed requirement: measures GFLOP/s of the tuned SGEMM so `pytest -s` shows it."""
    be = get_backend()
    n = 256
    g = {lay: tune.measure(be, be.gemm_config[lay], n, n, n, reps=1, layout=lay) for lay in tune.LAYOUTS}
    print(f"\nSGEMM {n}^3 GFLOP/s on {be.device.name.strip()}: {g}")
    assert all(v > 0 for v in g.values())


@needs_device
def test_classifier_rejects_out_of_range_targets():
    """Like the CPU backend: a ValueError, not NaN losses, checked against the uploaded host ids (no read-back);
    targets written on the device (no host record) are read back and checked too."""
    from llmc_cli.kernels import FLOAT32, INT32
    be = get_backend()
    V, Vp, N = 10, 16, 4
    logits = be.alloc((N, Vp), FLOAT32)
    losses = be.alloc((N,), FLOAT32)
    targets = be.alloc((N,), INT32)
    be.upload(logits, np.zeros((N, Vp), np.float32))
    for bad in ([0, 1, 2, V], [0, -1, 2, 3]):
        be.upload(targets, np.array(bad, np.int32))
        with pytest.raises(ValueError, match="out of range"):
            be.classifier_forward_backward(logits, losses, targets, V, 1.0 / N)
    be.upload(targets, np.array([0, 1, 2, V - 1], np.int32))
    be.classifier_forward_backward(logits, losses, targets, V, 1.0 / N)
    assert np.allclose(be.download(losses), np.log(V))
    be.fill(targets, V + 3)  # device-side write: the record is dropped, the check reads the ids back
    with pytest.raises(ValueError, match="out of range"):
        be.classifier_forward_backward(logits, losses, targets, V, None)


@needs_device
@pytest.mark.parametrize("epi", [0, 1, 2])
def test_splitk_matches_plain_sgemm(epi):
    """The split-K path (long-K NN products on CPU devices) against float64, with accumulate/alpha, bias and the
    GELU epilogues, K not a multiple of the chunk."""
    import pyopencl.array as cla
    be = get_backend()
    rng = np.random.default_rng(3)
    M, N, K = 37, 29, 211
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    aux0 = rng.standard_normal((M, N)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    saved = be._splitk
    try:
        outs = []
        for sk in (0, 16):
            be._splitk = sk
            A, B, Bi = (cla.to_device(be.queue, x) for x in (a, b, bias))
            C, X = cla.to_device(be.queue, c0), cla.to_device(be.queue, aux0)
            be.gemm(0, 0, M, N, K, A.data, 0, K, B.data, 0, N, C.data, 0, N, alpha=0.5, accumulate=epi == 0,
                    bias=Bi if epi != 2 else None, aux=X if epi else None, epi=epi)
            outs.append((C.get().astype(np.float64), X.get().astype(np.float64)))
    finally:
        be._splitk = saved
    v = 0.5 * ref + (c0 if epi == 0 else 0) + (bias if epi != 2 else 0)
    if epi == 2:
        x = aux0.astype(np.float64)
        t = np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3))
        v = v * (0.5 * (1 + t) + x * 0.5 * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x))
    for C, X in outs:
        assert rel(C, v) <= 1e-5
        if epi == 1:
            assert rel(X, 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))) <= 1e-5


# ---- a device whose compiler fails (PoCL on a CPU its LLVM does not know) --------------------------------------
_POCL_LOG = ("clBuildProgram failed: BUILD_PROGRAM_FAILURE - clBuildProgram failed: BUILD_PROGRAM_FAILURE\n\n"
             "Build on <pyopencl.Device 'pthread-AMD EPYC 9B45' on 'Portable Computing Language'>:\n\n"
             "error: unknown target CPU 'generic'\nDevice pthread-AMD EPYC failed to build the program\n"
             "(options: -I /tmp)\n(source saved as /tmp/x.cl)")


@pytest.fixture
def broken_compiler(monkeypatch, tmp_path):
    """Every OpenCL build fails as PoCL's does on an AMD EPYC it cannot name; a fresh probe cache."""
    if llmc_opencl.cl is None:
        pytest.skip("pyopencl is not installed")
    from llmc_opencl import probe

    def build(self, *a, **kw):
        raise RuntimeError(_POCL_LOG)
    monkeypatch.setenv("LLMC_OPENCL_PROBE_CACHE", str(tmp_path / "probe.json"))
    monkeypatch.setattr(probe, "_SEEN", {})
    monkeypatch.setattr(llmc_opencl.cl.Program, "build", build)
    return tmp_path / "probe.json"


def test_a_device_whose_compiler_fails_is_unusable_with_the_compilers_line(broken_compiler, monkeypatch):
    from llmc_cli.testing import plugin as kit_plugin
    from click.testing import CliRunner

    from llmc_cli import registry
    from llmc_cli.commands import main
    ok, reason = llmc_opencl.OpenCLPlugin().probe()
    if "no OpenCL device" in reason or "platform" in reason.lower():
        pytest.skip(f"no OpenCL device to fake a compiler failure on: {reason}")
    assert not ok and "\n" not in reason
    assert reason.endswith("cannot build a kernel: error: unknown target CPU 'generic'") or \
        "more device(s), none usable" in reason, reason
    verdicts = json.loads(broken_compiler.read_text())  # cached per device and driver for the next start
    assert any(v["reason"].endswith("error: unknown target CPU 'generic'") for v in verdicts.values())
    with pytest.raises(BackendUnavailable, match="unknown target CPU 'generic'"):
        llmc_opencl.OpenCLPlugin().create()
    # what a user sees
    r = CliRunner().invoke(main, ["backends", "--json"])
    row = next(b for b in json.loads(r.output) if b["name"] == "opencl")
    assert row["usable"] is False and "error: unknown target CPU 'generic'" in row["reason"]
    r = CliRunner().invoke(main, ["train", "--backend", "opencl", "--data", "x.bin", "--steps", "1"])
    line = r.output.strip()
    assert r.exit_code == 2 and "\n" not in line and line.startswith("error: --backend opencl:") \
        and "unknown target CPU 'generic'" in line, line
    r = CliRunner().invoke(main, ["bench", "kernels", "--model", "d2", "-b", "1", "-t", "8", "--only", "gelu",
                                  "--json"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    # and the test suite skips the backend's tests with that reason
    from llmc_cli.testing import backends as kit_backends
    monkeypatch.setattr(kit_backends, "_DISCOVERED", registry.discover())
    monkeypatch.setattr(kit_backends, "_CREATED", {})
    assert "unknown target CPU 'generic'" in kit_backends.unusable_reason("opencl")
    with pytest.raises(pytest.skip.Exception, match="unknown target CPU 'generic'"):
        kit_backends.make_backend("opencl")
    marked = types.SimpleNamespace(get_closest_marker=lambda name: object() if name == "opencl" else None)
    with pytest.raises(pytest.skip.Exception, match="unknown target CPU 'generic'"):
        kit_plugin.pytest_runtest_setup(marked)


def test_a_build_failure_after_the_probe_names_the_compilers_error(broken_compiler, monkeypatch):
    from llmc_opencl import probe
    monkeypatch.setattr(probe, "check", lambda platform, device: "")  # the probe passed earlier (cached)
    try:
        llmc_opencl.select_device(None)
    except BackendUnavailable as e:
        pytest.skip(f"no OpenCL device: {e}")
    with pytest.raises(BackendUnavailable, match=r"cannot build kernels\.cl: error: unknown target CPU 'generic'$"):
        llmc_opencl.OpenCLPlugin().create()


def test_a_build_that_drops_a_kernel_silently_is_refused(monkeypatch, tmp_path):
    """PoCL on a Zen 4 EPYC it takes for Zen 3 "builds" some float16 kernels into an empty program."""
    if llmc_opencl.cl is None:
        pytest.skip("pyopencl is not installed")
    from llmc_opencl import probe
    monkeypatch.setenv("LLMC_OPENCL_PROBE_CACHE", str(tmp_path / "probe.json"))
    monkeypatch.setattr(probe, "_BUILT", {})
    try:
        dev = llmc_opencl.select_device(None)[1]
    except BackendUnavailable as e:
        pytest.skip(f"no OpenCL device: {e}")
    ctx = llmc_opencl.cl.Context([dev])
    real = llmc_opencl.sources.signatures
    monkeypatch.setattr(llmc_opencl.sources, "signatures", lambda src: {**real(src), "sgemm_wide": []})
    with pytest.raises(BackendUnavailable, match=r"cannot build sgemm_direct\.cl \(-DRN=8\): gave no kernel sgemm_wide$"):
        llmc_opencl.build_program(ctx, "sgemm_direct.cl", "-DRN=8")  # (found by the child process)
    monkeypatch.setattr(probe, "build_verdicts", lambda d, jobs: {f"{n} {o}": "" for n, o in jobs})
    with pytest.raises(BackendUnavailable, match=r"cannot build sgemm_direct\.cl \(-DRN=8\): gave no kernel sgemm_wide$"):
        llmc_opencl.build_program(ctx, "sgemm_direct.cl", "-DRN=8")  # (and by the build here, had the child missed it)


def test_programs_that_do_not_build_are_found_in_a_child_and_never_built_here(monkeypatch, tmp_path):
    """Every program is built first in a child process (a failed build can abort the process that tried it at
    exit), in batches, and the verdicts cached: configurations that do not build neither fit, nor are tuned, nor
    are the default, and build_program refuses them in one line without building them."""
    if llmc_opencl.cl is None:
        pytest.skip("pyopencl is not installed")
    from llmc_opencl import probe
    try:
        dev = llmc_opencl.select_device(None)[1]
    except BackendUnavailable as e:
        pytest.skip(f"no OpenCL device: {e}")
    monkeypatch.setenv("LLMC_OPENCL_PROBE_CACHE", str(tmp_path / "probe.json"))
    monkeypatch.setattr(probe, "_BUILT", {})
    real_child, asked = probe._builds_in_child, []

    def child(device, jobs):  # this compiler builds nothing transposed 16 wide
        asked.append(jobs)
        return {f"{n} {o}": "gave no kernel sgemm" if "=16" in o and "-DA_T=0 -DB_T=0" not in o else ""
                for n, o in jobs}
    monkeypatch.setattr(probe, "_builds_in_child", child)
    wide = [c for c in tune.DIRECT if 16 in (c["VK"], c["RN"])]
    assert wide and not any(tune.fits(dev, c) for c in wide)
    assert all(tune.fits(dev, c) or c["LX"] * c["LY"] > dev.max_work_group_size
               for c in tune.DIRECT if c not in wide)
    n = len(asked)
    monkeypatch.setattr(probe, "_BUILT", {})  # a new process: the cached verdicts, no child
    assert not tune.fits(dev, wide[0]) and len(asked) == n
    for c in tune.default_config(dev).values():
        assert tune.fits(dev, c)
    tried = []
    monkeypatch.setattr(tune, "measure", lambda be, c, *a, **k: tried.append(c) or 1.0)
    tune.autotune(types.SimpleNamespace(device=dev))
    assert tried and not any(c in wide for c in tried)
    ctx = llmc_opencl.cl.Context([dev])
    with pytest.raises(BackendUnavailable, match=r"cannot build sgemm_direct\.cl \(-DRM=4 -DRN=4 -DVK=16 -DA_T=0 "
                                                 r"-DB_T=1\): gave no kernel sgemm$"):
        llmc_opencl.build_program(ctx, *tune.build_options(wide[0], "NT"))
    # the real child on this machine answers for every job, built or not, and a broken source gets its error line
    monkeypatch.setattr(probe, "_BUILT", {})
    jobs = [tune.build_options(c, lay) for c in wide for lay in tune.LAYOUTS] + [("kernels.cl", "-DRED_LS=1")]
    said = real_child(dev, jobs)
    assert set(said) == {f"{n} {o}" for n, o in jobs} and said["kernels.cl -DRED_LS=1"] == ""
    said = real_child(dev, [("kernels.cl", "-DRED_LS=)")])
    assert list(said.values())[0], "a build that fails must say why"


def test_first_error_line():
    from llmc_opencl.probe import first_error_line
    assert first_error_line(RuntimeError(_POCL_LOG)) == "error: unknown target CPU 'generic'"
    assert first_error_line(ValueError("clBuildProgram failed: OUT_OF_HOST_MEMORY")) == \
        "ValueError: clBuildProgram failed: OUT_OF_HOST_MEMORY"


# ---- variants: the elementwise kernels' work-group sizes (`llmc bench kernels --variants`) ----------------------
@needs_device
def test_every_work_group_variant_computes_the_defaults_bits():
    from llmc_cli.bench import kernel_cases as kc
    from llmc_cli.models.llama3 import preset as llama_preset
    from llmc_cli.models.gpt2 import preset
    b = get_backend()
    ran = 0
    for cfg in (preset("d2", n_embd=72, vocab_size=500), llama_preset("llama3-tiny", vocab_size=256)):
        for case in kc.kernel_cases(cfg, 2, 33):  # 33: sizes no work-group size divides
            names = b.variants(case.kernel)
            if not names:
                continue
            inputs = kc._upload(case, b, kc._host_inputs(case, 0))
            want = kc._call_once(case, b, kc._clone(case, b, inputs))
            for name in names:
                try:
                    with b.variant(case.kernel, name):
                        got = kc._call_once(case, b, kc._clone(case, b, inputs))
                except VariantUnsupported as e:  # (a device's limit for this kernel: NVIDIA's is 256 for some)
                    assert name[2:].isdigit() and int(name[2:]) > 64, f"{case.name} {name}: {e}"
                    continue
                ran += 1
                for out in case.outputs:
                    assert np.array_equal(got[out], want[out]), f"{case.name} {name}: {out}"
    assert ran >= 6 * 2 and not b._wg_of
    assert b.variants("layernorm_forward") == [] and "wg32" in b.variants("gelu_forward")
    with pytest.raises(ValueError, match="no variant 'wg48' of gelu_forward"):
        with b.variant("gelu_forward", "wg48"):
            pass
