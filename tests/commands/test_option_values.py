"""Bad input to the options of Llama at scale, FP8 and multi-GPU, each answered by one line naming the option (or the
environment variable, or the file) and a non-zero exit, before anything runs, with nothing on disk changed:

* every numeric backend option and its environment variable goes through one parser (kernels.option_int) with a
  range, so NaN, negative, huge or non-power-of-two values never reach a thread pool, a kernel or an allocation;
  a variable set to garbage is refused (not read as the default) and named as the variable;
* integers the kernels index in 32 bits (-b, -t, --block-size, ...) and B*T together, so --dry-run cannot hang;
* the options' combinations (--gpus with --procs, --zero 2 with --overlap, --total-batch-size) refused by --dry-run
  as by a run, and --gpus refused before it starts processes that cannot reduce (cpu: --procs);
* a user's file where llmc writes (OUT/config.toml, --init-file) stays as it is;
* text printed by a run (paths, samples) is never read as rich markup.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest
from llmc_test_support import TINY, hf_tensors, one_line_error, phrase_tokens, run, write_hf_dir

from llmc_cli.formats.shards import write_shard
from llmc_cli.kernels import BackendUnavailable, option_choice, option_flag, option_int


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("adv_data")
    write_shard(d / "tiny_train_000001.bin", phrase_tokens(60))
    return d


@pytest.fixture
def no_rank():
    """A test that plays rank 0 of 2 leaves the console as one process again."""
    from llmc_cli.commands.console import _RANK, console
    yield
    _RANK.clear()
    console.quiet = False


def _llmc(*args, env=None, timeout=120):
    """`llmc ARGS` in a child process, with a deadline: a hang is a failure, not a stuck suite."""
    import os
    e = dict(os.environ, **(env or {}))
    try:
        return subprocess.run([sys.executable, "-m", "llmc_cli", *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=e)
    except subprocess.TimeoutExpired:
        pytest.fail(f"llmc {' '.join(map(str, args))} did not finish within {timeout} s")


def _one_line(p, *needles):
    msg = (p.stdout + p.stderr).strip()
    assert p.returncode == 2 and msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


# ---- backend options and their environment variables ------------------------------------------------------------

def test_option_int_checks_range_power_of_two_and_off_and_names_the_variable(monkeypatch):
    assert option_int({"n": "64"}, "n", 1, min=1, max=1024, power_of_two=True) == 64
    assert option_int({"n": "0"}, "n", 512, min=16, max=1 << 24, off=0) == 0
    assert option_int(None, "n", None) is None
    for opts, kw, expect in (({"n": "nan"}, {}, "--backend-opt n=nan: expected an integer >= 0"),
                             ({"n": "3"}, {"min": 1, "max": 1024, "power_of_two": True},
                              "--backend-opt n=3: expected a power of two in [1, 1024]"),
                             ({"n": "99999999999999999999"}, {"max": 1 << 20},
                              "--backend-opt n=99999999999999999999: expected an integer in [0, 1048576]"),
                             ({"n": "1"}, {"min": 16, "max": 64, "off": 0},
                              "--backend-opt n=1: expected 0 (off) or an integer in [16, 64]")):
        with pytest.raises(BackendUnavailable) as e:
            option_int(opts, "n", 0, **kw)
        assert str(e.value) == expect
    # a variable set to garbage is refused and named as the variable; an empty one is unset
    monkeypatch.setenv("LLMC_T_N", "-4")
    with pytest.raises(BackendUnavailable, match=r"^LLMC_T_N=-4 \(the environment variable for --backend-opt n\)"):
        option_int(None, "n", 0, env="LLMC_T_N")
    monkeypatch.setenv("LLMC_T_F", "maybe")
    with pytest.raises(BackendUnavailable, match="LLMC_T_F=maybe .*expected on or off"):
        option_flag(None, "f", True, env="LLMC_T_F")
    monkeypatch.setenv("LLMC_T_F", "")
    assert option_flag(None, "f", True, env="LLMC_T_F") is True
    assert option_choice({"m": "1"}, "m", ("on", "off"), "off", aliases={"1": "on"}) == "on"


@pytest.mark.parametrize("env, value, expect", [
    ("LLMC_CUDNN_WORKSPACE_MIB", "nan", "expected an integer in [0, 1048576]"),
    ("LLMC_CUDNN_WORKSPACE_MIB", "-1", "expected an integer in [0, 1048576]"),
    ("LLMC_CUDNN_WORKSPACE_MIB", "99999999999999", "expected an integer in [0, 1048576]"),
    ("LLMC_FP8_DGELU", "maybe", "expected on or off"),
    ("LLMC_CUBLASLT_TUNE", "2", "expected on or off"),
    ("LLMC_TF32", "x", "expected on or off"),
    ("LLMC_FP8_SCALING", "later", "expected one of current, delayed"),
    ("LLMC_FP8_CLASSIFIER", "forward", "expected one of off, backward, on"),
    ("LLMC_P2P", "maybe", "expected on or off"),
    ("LLMC_P2P_REDUCE", "2", "expected on or off"),
    ("LLMC_P2P_COPIES", "sometimes", "expected on or off"),
])
def test_cuda_options_and_variables_are_checked_before_any_device(monkeypatch, env, value, expect):
    """The cuda plugin parses every option and variable first (without a GPU, too): a bad one is named, not the
    missing driver, and never read as its default."""
    cuda = pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    monkeypatch.setenv(env, value)
    with pytest.raises(BackendUnavailable) as e:
        cuda.CudaPlugin().create(dtype="fp8")
    assert str(e.value).startswith(f"{env}={value}") and expect in str(e.value), str(e.value)
    monkeypatch.delenv(env)
    with pytest.raises(BackendUnavailable, match=r"^--backend-opt cudnn_workspace_mib=inf: expected an integer"):
        cuda.CudaPlugin().create(options={"cudnn_workspace_mib": "inf"})


@pytest.mark.parametrize("env, value, expect", [
    ("LLMC_OPENCL_TUNE", "garbage", "expected one of on, off, force"),
    ("LLMC_OPENCL_BLAS", "garbage", "expected one of llmc, clblast"),
    ("LLMC_OPENCL_SPLITK", "nan", "expected 0 (off) or an integer in [16, 16777216]"),
    ("LLMC_OPENCL_SPLITK", "1", "expected 0 (off) or an integer in [16, 16777216]"),
    ("LLMC_OPENCL_RED_LS", "0", "expected a power of two in [1, 1024]"),
    ("LLMC_OPENCL_RED_LS", "3", "expected a power of two in [1, 1024]"),
])
def test_opencl_options_and_variables_are_checked(monkeypatch, env, value, expect):
    """Garbage in LLMC_OPENCL_TUNE / _BLAS was read as the default; red_ls=0 or 3 and splitk=1 were taken."""
    ocl = pytest.importorskip("llmc_opencl", reason="llmc-opencl is not installed")
    monkeypatch.setenv(env, value)
    with pytest.raises(BackendUnavailable) as e:
        ocl.OpenCLPlugin().create()
    assert str(e.value).startswith(f"{env}={value}") and expect in str(e.value), str(e.value)
    monkeypatch.delenv(env)
    key = env.removeprefix("LLMC_OPENCL_").lower()
    with pytest.raises(BackendUnavailable) as e:
        ocl.OpenCLPlugin().create(options={key: value})
    assert str(e.value) == f"--backend-opt {key}={value}: {expect}"


def test_cpu_threads_huge_is_refused_not_a_hang():
    p = _llmc("train", "--backend", "cpu", "--model", "d2", "--data", "nothing.bin", "--backend-opt", "threads=100000000")
    _one_line(p, "--backend-opt threads=100000000: expected an integer in [1, 1024]")


def test_backend_opt_given_twice_with_two_values():
    r = run(*TINY, "--data", "x.bin", "--backend-opt", "threads=2", "--backend-opt", "threads=3", ok=False)
    one_line_error(r, "--backend-opt threads is given twice, as '2' and '3'")


# ---- train: sizes, combinations, launch ---------------------------------------------------------------------------

def test_dry_run_with_a_huge_batch_is_refused_not_a_hang():
    p = _llmc("train", "--dry-run", "--model", "d2", "-b", 1000000000000, "-t", 32)
    _one_line(p, "--batch-size must be <= 2147483647")
    p = _llmc("train", "--dry-run", "--model", "d2", "-b", 2147483647, "-t", 1024)
    _one_line(p, "-b 2147483647 -t 1024", "more than the kernels index")
    one_line_error(run("train", "--dry-run", "--model", "llama3-tiny", "--block-size", 10**20, ok=False),
                   "--block-size must be <= 2147483647")


@pytest.mark.parametrize("args, expect", [
    (["--zero", "2", "--overlap", "--gpus", "2"], "--overlap: --zero 2 already reduces"),
    (["--gpus", "2", "--procs", "4"], "are exclusive"),
    (["--gpus", "2", "--procs", "1"], "are exclusive"),
    (["--total-batch-size", "100"], "--total-batch-size 100 is not a multiple of B*T = 2*32 = 64"),
    (["--total-batch-size", "192", "--gpus", "2"], "is not a multiple of B*T*ranks = 2*32*2 = 128"),
    (["--backend-opt", "garbage"], "--backend-opt 'garbage': expected KEY=VALUE"),
    (["--backend", "cpu", "--backend-opt", "nope=1"], "backend 'cpu' has no such option"),
    (["--init-addr", "host:99999"], "--init-addr 'host:99999': expected HOST:PORT, a port in 1..65535"),
    (["--init-addr", "host:1", "--init-file", "f"], "not both"),
])
def test_dry_run_refuses_what_a_run_refuses(args, expect):
    one_line_error(run("train", "--dry-run", "--model", "d2", "-b", 2, "-t", 32, *args, ok=False), expect)


def test_dry_run_counts_the_backends_workspaces_as_their_options_set_them():
    """--dry-run on the cuda backend (planned here without a GPU) adds cuBLASLt's workspace and, for bf16 with cuDNN
    on, cuDNN attention's backward workspace: the whole batch's, or the slice that fits cudnn_workspace_mib when that
    is set; the cpu backend has none. A bad value is one line naming the option."""
    pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    from llmc_cuda import CUBLASLT_WORKSPACE_BYTES
    plan = ["train", "--dry-run", "--model", "d12", "-b", 64, "-t", 1024]
    key = "cuda: cuDNN attention workspace (cudnn_workspace_mib)"

    def rows(*args) -> dict[str, str]:
        out = run(*plan, *args).output
        return {c[0].strip(): c[1].strip() for c in (ln.strip("│┃ ").split("│") for ln in out.splitlines())
                if len(c) == 2}

    cuda = rows("--backend", "cuda")
    assert cuda["cuda: cuBLASLt workspace"] == f"{CUBLASLT_WORKSPACE_BYTES / 2**30:.2f}"
    assert cuda[key] == "1.50"  # a bf16 score for each of 64 x 12 x 1024 x 1024 query-key pairs, and the statistics
    llama = run("train", "--dry-run", "--backend", "cuda", "--model", "llama3.2-1b", "-b", 8, "-t", 2048).output
    assert "cuDNN attention workspace (cudnn_workspace_mib) │  2.13" in llama  # 8 key/value heads of 64
    assert rows("--backend", "cuda", "--backend-opt", "cudnn_workspace_mib=1024")[key] == "0.75"  # 32 sequences
    assert rows("--backend", "cuda", "--backend-opt", "cudnn_workspace_mib=0")[key] == "0.01"  # 3 heads of one
    assert rows("--backend", "cuda", "--backend-opt", "cudnn_workspace_mib=4096")[key] == "1.50"
    for args in (["--backend-opt", "cudnn=off"], ["--dtype", "fp32"]):
        assert not any("cuDNN" in k for k in rows("--backend", "cuda", *args)), args
    assert not any(k.startswith("cpu:") for k in rows("--backend", "cpu"))
    one_line_error(run(*plan, "--backend", "cuda", "--backend-opt", "cudnn_workspace_mib=-1", ok=False),
                   "--backend-opt cudnn_workspace_mib=-1: expected an integer in [0, 1048576]")


# cuDNN 9.19's deterministic attention backward on an H200 (backends/cuda/bench/attn_plans.py --workspace, 2026-11-28):
# (B, T, n_head, n_kv_head, head_dim) -> the bytes it asked for
CUDNN_WORKSPACES = {(1, 2048, 32, 8, 64): 285475072, (1, 8192, 32, 8, 128): 4430233856, (2, 64, 4, 2, 16): 166144,
                    (3, 1024, 25, 25, 64): 157593856, (2, 96, 4, 2, 64): 462080, (1, 100, 4, 4, 32): 132928}


def test_planned_attention_workspace_is_cudnns_and_follows_the_cap():
    """--dry-run's cuDNN workspace is the bytes cuDNN asked for on the GPU, and under cudnn_workspace_mib the slice
    the backend would run (the batch halved, one sequence, then key/value head groups), or the smallest."""
    pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    from llmc_cuda.options import attention_backward_workspace as whole, planned_attention_workspace as planned
    for shape, nbytes in CUDNN_WORKSPACES.items():
        assert whole(*shape) == nbytes, shape
    one_seq = whole(1, 2048, 32, 8, 64)
    assert planned(8, 2048, 32, 8, 64, None) == whole(8, 2048, 32, 8, 64) > 2 << 30
    assert planned(8, 2048, 32, 8, 64, 512 << 20) == one_seq  # 2,178 -> 1,089 -> 545 -> 272 MiB
    assert planned(8, 2048, 32, 8, 64, 1100 << 20) == whole(4, 2048, 32, 8, 64)
    assert planned(1, 8192, 32, 8, 128, 4096 << 20) == whole(1, 8192, 16, 4, 128)  # two head groups
    assert planned(1, 8192, 32, 8, 128, 0) == whole(1, 8192, 4, 1, 128)  # nothing fits: the smallest


@pytest.mark.parametrize("ranks,p2p,expect", [(1, None, False), (2, None, True), (4, None, False), (8, None, False),
                                               (4, True, True), (2, False, False), (1, True, False)])
def test_peer_memory_is_for_two_ranks_unless_p2p_says(ranks, p2p, expect):
    """Unset, `p2p` moves data through the peers' memory for two ranks only (more measured slower than NCCL's
    all-gather); set, it holds for any number of ranks above one."""
    pytest.importorskip("llmc_cuda", reason="llmc-cuda is not installed")
    from types import SimpleNamespace

    from llmc_cuda.nccl import NCCLCommunicator
    comm = SimpleNamespace(world_size=ranks, backend=SimpleNamespace(p2p=p2p, p2p_reduce=True))
    assert NCCLCommunicator.peer_memory.fget(comm) is expect
    comm.peer_memory = expect
    assert NCCLCommunicator.peer_reduce.fget(comm) is expect


def test_gpus_refused_before_starting_ranks_that_cannot_reduce(shards):
    r = run(*TINY, "--data", shards, "--gpus", 2, ok=False)
    line = one_line_error(r, "--gpus 2: the cpu backend reduces through MPI", "--procs 2")
    assert "launcher" not in line
    one_line_error(run(*TINY, "--data", shards, "--zero", 2, "--overlap", "--procs", 2, ok=False),
                   "leave --overlap out")


def test_garbage_test_hook_and_init_address_variables(shards, monkeypatch):
    monkeypatch.setenv("LLMC_FAULT_RANK", "x")
    one_line_error(run(*TINY, "--data", shards, "--steps", 1, ok=False), "LLMC_FAULT_RANK=x: expected RANK:STEP")
    monkeypatch.delenv("LLMC_FAULT_RANK")
    monkeypatch.setenv("LLMC_INIT_ADDR", "nohostport")
    one_line_error(run(*TINY, "--data", shards, "--steps", 1, ok=False), "LLMC_INIT_ADDR 'nohostport'")


def test_garbage_checkpoint_delay_hook_is_one_line_before_the_run(shards, monkeypatch):
    for bad in ("x", "nan", "-1", "1e9"):
        monkeypatch.setenv("LLMC_FAULT_CHECKPOINT_DELAY", bad)
        one_line_error(run(*TINY, "--data", shards, "--steps", 1, ok=False),
                       f"LLMC_FAULT_CHECKPOINT_DELAY={bad}: expected seconds")


def test_data_directory_with_glob_characters_in_its_name_is_itself(tmp_path):
    """An existing path is taken as it is: a directory named 'run[1]' is listed, not read as a pattern that
    matches 'run1'."""
    from llmc_cli.formats.shards import has_split, resolve_shards
    odd = tmp_path / "run[1]"
    odd.mkdir()
    write_shard(odd / "tiny_train_000001.bin", phrase_tokens(60))
    (tmp_path / "run1").mkdir()  # what the pattern run[1] would match
    write_shard(tmp_path / "run1" / "other_train_000001.bin", phrase_tokens(60))
    assert resolve_shards(str(odd), split="train") == [str(odd / "tiny_train_000001.bin")]
    assert resolve_shards(str(odd / "tiny_train_000001.bin")) == [str(odd / "tiny_train_000001.bin")]
    assert has_split(odd, "train") and not has_split(odd, "val")
    # a pattern that is not an existing path still globs
    assert resolve_shards(str(tmp_path / "run1" / "*.bin")) == [str(tmp_path / "run1" / "other_train_000001.bin")]


def test_an_existing_init_file_is_not_replaced(shards, tmp_path, monkeypatch, no_rank):
    """Rank 0 writes the id into --init-file and deletes it: a file already there (a user's, a stale id) stays."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    monkeypatch.setenv("LLMC_RANK", "0")
    monkeypatch.setenv("LLMC_WORLD_SIZE", "2")
    r = run(*TINY, "--data", shards, "--steps", 1, "--init-file", mine, ok=False)
    msg = r.output.strip()
    assert r.exit_code == 2 and "\n" not in msg and f"--init-file {mine}: exists" in msg, msg
    assert mine.read_text() == "mine"


def test_out_with_a_users_config_toml_is_refused(shards, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("my own settings\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    one_line_error(run(*TINY, "--data", shards, "--steps", 1, "--out", out, ok=False),
                   f"{out / 'config.toml'} exists and was not written by llmc")
    assert (out / "config.toml").read_text() == "my own settings\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    run(*TINY, "--data", shards, "--steps", 1, "--out", tmp_path / "run")  # llmc's own is replaced on --resume
    run(*TINY, "--data", shards, "--steps", 2, "--out", tmp_path / "run", "--resume")


@pytest.mark.parametrize("line, expect", [
    ("dry-run = 5", "dry-run must be true or false (got 5)"),
    ("overlap = 1", "overlap must be true or false (got 1)"),
    ("shuffle = 1.5", "shuffle must be true or false"),
    ("out = 1979-05-27", "out must be a string"),
    ("backend-opt = [1]", "backend-opt must be a string or a list of strings"),
])
def test_config_values_of_the_wrong_kind(tmp_path, line, expect):
    (tmp_path / "c.toml").write_text(line + "\n")
    one_line_error(run(*TINY, "--data", "x.bin", "--config", tmp_path / "c.toml", ok=False), expect)


def test_run_output_is_not_read_as_markup(shards, tmp_path):
    """A path (or a sampled text) holding '[/x]' was parsed as a rich closing tag: a traceback after the run."""
    out = tmp_path / "run[/x]"
    r = run(*TINY, "--data", shards, "--steps", 1, "--out", out)
    assert f"checkpoint: {out}/step_00000001" in r.output, r.output


# ---- sample ----------------------------------------------------------------------------------------------------

def test_sample_temperature_too_small_and_tokenizer_of_another_model(tmp_path):
    from llmc_test_support import LLAMA_HF_CONFIG
    d = tmp_path / "hf"
    cfg = LLAMA_HF_CONFIG | {"vocab_size": 300}  # a byte tokenizer has 512 ids: not this model's
    write_hf_dir(d, hf_tensors(cfg, np.random.default_rng(0)))
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", d, "--max-new-tokens", 2, ok=False),
                   "a tokenizer of 512 tokens, more than the model's vocabulary of 300")
    r = run("sample", "--backend", "cpu", "--checkpoint", d, "--temperature", "1e-320", ok=False)
    one_line_error(r, "--temperature must be 0 or >= 1e-06 (got 1e-320)")


# ---- bench -----------------------------------------------------------------------------------------------------

def test_bench_refuses_before_running():
    base = ["bench", "kernels", "--backend", "cpu", "--model", "d2", "-b", 1, "-t", 8]
    one_line_error(run(*base, "--only", "", ok=False), "--only: an empty name matches every kernel")
    one_line_error(run(*base[:-4], "-b", 2000000000, "-t", 2, "--block-size", 2, ok=False),
                   "4,000,000,000 tokens a micro-batch")
    one_line_error(run(*base, "--only", "gelu", "--backend-opt", "threads=1", "--backend-opt", "threads=2", ok=False),
                   "given twice")
    # decode draws no plot: said before the benchmark, not after its table
    r = run("bench", "decode", "--backend", "cpu", "--model", "d2", "-t", 64, "--tokens", 2, "--plot", "x.png",
            ok=False)
    one_line_error(r, "--plot: `llmc bench decode` draws no plot")


def test_bench_train_data_path_is_not_markup(tmp_path):
    d = tmp_path / "d[/x]"  # a folder 'x]' inside a folder 'd['
    d.mkdir(parents=True)
    write_shard(d / "t_train_000001.bin", phrase_tokens(40))
    r = run("bench", "train", "--backend", "cpu", "--model", "d2", "-b", 1, "-t", 16, "--steps", 1, "--warmup", 0,
            "--data", d / "*.bin")
    assert f"data: {d / '*.bin'}" in r.output, r.output
