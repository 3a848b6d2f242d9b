"""The inference and evaluation API given bad arguments (an adversarial pass): token ids past a model's vocabulary
are refused at the API's edge (on OpenCL they read past the embedding table: a segfault), and load_model, generate,
ValLoader, evaluate_loss and HellaSwag raise one clear error naming the argument, never a deep numpy error or a value
quietly truncated (B=4.7 -> 4), ignored (vocab_size NaN, stop_token "x") or overflowed (T=np.uint8(255))."""

from __future__ import annotations

import numpy as np
import pytest
from llmc_test_support import cpu_with, one_line_error, run

from llmc_cli.data.loader import DataLoader, ValLoader
from llmc_cli.evals.evaluate import HellaSwag, evaluate_loss
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.files import DataError
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.shards import write_shard
from llmc_cli.inference.loading import load_model
from llmc_cli.inference.sampling import generate
from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters
from llmc_cli.registry import create_backend

SMALL = GPT2Config(block_size=256, vocab_size=1000, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A model of vocabulary 1000 (an llm.c .bin) and GPT-2 shards, whose ids go up to 50256."""
    d = tmp_path_factory.mktemp("small")
    write_model(d / "small_v1000.bin", SMALL, init_parameters(SMALL, 0))
    rng = np.random.default_rng(0)
    write_shard(d / "gpt_val_000000.bin", rng.integers(0, 50257, 3000))
    ok = d / "ok"
    ok.mkdir()
    write_shard(ok / "ok_val_000000.bin", rng.integers(0, 1000, 3000))  # ids the model has
    return d


def test_shards_with_ids_past_the_vocabulary_are_a_data_error_naming_the_shard(backend, small):
    """The reported segfault: evaluate_loss of a vocab-1000 model on GPT-2 shards (exit 139 on OpenCL, an
    IndexError on cpu), the loader made without vocab_size."""
    m = load_model(small / "small_v1000.bin", backend, B=4, T=64)
    with pytest.raises(DataError) as e:
        evaluate_loss(m, ValLoader(str(small), 4, 64), 1)
    msg = str(e.value)
    assert "gpt_val_000000.bin" in msg and "vocab size 1,000" in msg and "\n" not in msg, msg
    with pytest.raises(DataError, match="gpt_val_000000.bin"):  # a loader told a larger vocabulary than the model's
        evaluate_loss(m, ValLoader(str(small), 4, 64, vocab_size=50257), 1)
    loss = evaluate_loss(m, ValLoader(str(small / "ok"), 4, 64), np.int64(2))
    assert np.isfinite(loss) and loss > 0


@pytest.mark.parametrize("bad", [-1, 1000, 60000, 2**31, 2**31 + 5])
def test_forward_refuses_ids_outside_the_vocabulary(backend, bad):
    m = GPT2(SMALL, backend, 2, 8, training=False)
    m.load_parameters(init_parameters(SMALL, 0))
    x = np.arange(16, dtype=np.int64).reshape(2, 8)
    y = x.copy()
    x[1, 3] = bad
    with pytest.raises(ValueError, match=f"^inputs: token id {bad} is outside the model's vocabulary 0..999$"):
        m.forward(x, y)
    with pytest.raises(ValueError, match=f"^targets: token id {bad} is outside"):
        m.forward(y, x)
    for wrong, needle in ((np.zeros((2, 4), np.int32), r"shape \(2, 4\), expected \(B, T\) = \(2, 8\)"),
                          (np.zeros((2, 8), np.float32), "float32 values")):
        with pytest.raises(ValueError, match=needle):
            m.forward(wrong)
    m.forward(y.astype(np.int32), y)  # in range: fine
    assert np.isfinite(m.mean_loss())


def test_eval_command_on_shards_of_a_larger_vocabulary_stays_one_line(small):
    one_line_error(run("eval", "--backend", "cpu", "--checkpoint", small / "small_v1000.bin", "--data", small,
                       "-b", 4, "-t", 64, "--batches", 1, ok=False), "--data", "gpt_val_000000.bin", "1,000")


def test_load_model_takes_numpy_integers_and_refuses_the_rest(small):
    cpu = create_backend("cpu")
    m = load_model(small / "small_v1000.bin", cpu, B=np.int16(2), T=np.uint8(255))
    assert (m.B, m.T) == (2, 255) and type(m.B) is int and type(m.T) is int
    for kw, needle in ((dict(B=1.5), "B must be an integer >= 1"), (dict(B=None), "B must be an integer >= 1"),
                       (dict(T=np.float32(8)), "T must be an integer >= 1"), (dict(B=True), "B must be"),
                       (dict(B=2**31, T=2), "more than the kernels index")):
        with pytest.raises(ValueError, match=needle):
            load_model(small / "small_v1000.bin", cpu, **kw)
    with pytest.raises(ValueError, match="backend must be a Backend"):
        load_model(small / "small_v1000.bin", None)


@pytest.fixture(scope="module")
def model1(small):
    return load_model(small / "small_v1000.bin", create_backend("cpu"), 1, 16)


@pytest.mark.parametrize("kw, needle", [
    (dict(max_new_tokens=1.5), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 0"),
    (dict(prompt=[[1, 2, 3]]), r"the prompt must be one sequence of token ids.*\(1, 3\)"),
    (dict(prompt=[[1, 2], [3]]), "the prompt must be one sequence of token ids"),
    (dict(prompt="hello"), "the prompt must be a list of token ids"),
    (dict(rng=None), "rng must be a numpy Generator"),
    (dict(rng=0), "rng must be a numpy Generator"),
    (dict(vocab_limit=0), r"vocab_limit must be None .* 1\.\.1000"),
    (dict(vocab_limit=1001), "vocab_limit must be"),
    (dict(vocab_limit=2.5), "vocab_limit must be"),
    (dict(stop_token="x"), "stop_token must be None or a token id 0..999"),
    (dict(stop_token=-1), "stop_token must be None or a token id"),
    (dict(stop_token=1000), "stop_token must be"),
    (dict(stop_token=50, vocab_limit=50), "stop_token must be None or a token id 0..49"),
    (dict(stop_token=True), "stop_token must be"),
    (dict(temperature=True), "temperature must be"),
    (dict(top_p=True), "top_p must be"),
    (dict(kv_cache="no"), "kv_cache must be"),
])
def test_generate_names_a_bad_argument(model1, kw, needle):
    args = dict(prompt=[1, 2], max_new_tokens=2, rng=np.random.default_rng(0)) | kw
    with pytest.raises(ValueError, match=needle) as e:
        list(generate(model1, args.pop("prompt"), args.pop("max_new_tokens"), args.pop("rng"), **args))
    assert "\n" not in str(e.value)


def test_generate_takes_numpy_scalars(model1):
    a = list(generate(model1, np.array([1, 2]), np.int64(4), np.random.default_rng(0), top_k=np.int32(5),
                      temperature=0, vocab_limit=np.int64(1000)))
    b = list(generate(model1, [1, 2], 4, np.random.default_rng(0), top_k=5, temperature=0))
    assert a == b and len(a) == 4
    stop = a[1]
    got = list(generate(model1, [1, 2], 4, np.random.default_rng(0), top_k=5, temperature=0,
                        stop_token=np.int64(stop)))
    assert got == a[:a.index(stop)]  # matched as the int it holds


@pytest.mark.parametrize("kw, needle", [
    (dict(B=4.7), "B must be an integer >= 1 (got 4.7)"), (dict(B=float("nan")), "B must be an integer"),
    (dict(T=np.float64(8)), "T must be an integer"), (dict(rank=1.5, world_size=2), "rank must be an integer"),
    (dict(world_size=2.5), "world_size must be an integer"), (dict(B=True), "B must be"),
    (dict(vocab_size=float("nan")), "vocab_size must be an integer >= 1"),
    (dict(vocab_size=0), "vocab_size must be an integer >= 1"),
    (dict(B=2**20, T=2**12), "more than a shard can hold"),
])
def test_val_loader_names_a_bad_argument(small, kw, needle):
    args = dict(B=4, T=8) | kw
    with pytest.raises(DataError) as e:
        ValLoader(str(small / "ok"), args.pop("B"), args.pop("T"), **args)
    assert needle in str(e.value), str(e.value)
    with pytest.raises(DataError, match="shuffle must be True or False"):
        DataLoader(str(small / "ok"), 4, 8, shuffle="no")
    for shards in (None, 5, []):
        with pytest.raises(DataError, match="shards must be a directory, a glob or a list of shard paths"):
            ValLoader(shards, 4, 8)


def test_val_loader_takes_numpy_integers(small):
    loader = ValLoader(str(small / "ok"), np.int64(4), np.uint16(8), rank=np.int8(1), world_size=np.int32(2),
                       vocab_size=np.int64(1000))
    assert (loader.B, loader.T, loader.rank, loader.world_size, loader.vocab_size) == (4, 8, 1, 2, 1000)
    assert all(type(v) is int for v in (loader.B, loader.T, loader.rank, loader.world_size, loader.vocab_size))


def test_evaluate_loss_names_a_bad_argument(small):
    cpu = create_backend("cpu")
    m = load_model(small / "small_v1000.bin", cpu, B=4, T=64)
    loader = ValLoader(str(small / "ok"), 4, 64)
    for batches in (float("nan"), 1.5, -1, True, None):
        with pytest.raises(ValueError, match="batches must be an integer >= 0"):
            evaluate_loss(m, loader, batches)
    with pytest.raises(ValueError, match="the loader's batches are B=4 T=32 but the model is planned for B=4 T=64"):
        evaluate_loss(m, ValLoader(str(small / "ok"), 4, 32), 1)
    with pytest.raises(ValueError, match="loader must be a ValLoader"):
        evaluate_loss(m, str(small / "ok"), 1)
    with pytest.raises(ValueError, match="model must be a model"):
        evaluate_loss(None, loader, 1)


def test_hellaswag_limit_is_a_count(small, tmp_path):
    rng = np.random.default_rng(0)
    exs = [{"label": 0, "ctx_tokens": rng.integers(0, 1000, 4).tolist(),
            "ending_tokens": [rng.integers(0, 1000, 3).tolist() for _ in range(4)]} for _ in range(3)]
    path = write_evalfile(tmp_path / "hs.bin", exs)
    for limit in (1.5, float("nan"), -1, True, "2"):
        with pytest.raises(ValueError, match="limit must be an integer >= 0"):
            HellaSwag(path, limit=limit)
    assert len(HellaSwag(path, limit=np.int64(2)).examples) == 2 and len(HellaSwag(path).examples) == 3
    m = load_model(small / "small_v1000.bin", create_backend("cpu"), 1, 16)
    assert HellaSwag(path, limit=np.int64(2)).evaluate(m).n == 2


# ---- backends whose capabilities say what they cannot do -------------------------------------------------------
@pytest.mark.parametrize("caps", [None, "kv_cache,graphs", ("kv_cache",)])
def test_load_model_refuses_capabilities_that_are_not_a_set(small, caps):
    with pytest.raises(ValueError, match="liar backend's capabilities must be a set of names"):
        load_model(small / "small_v1000.bin", cpu_with(caps), 1, 16)


def test_a_kv_cache_without_attention_decode_is_one_line_naming_both(small):
    be = cpu_with(frozenset({"kv_cache"}), lacks=("attention_decode",))
    m = load_model(small / "small_v1000.bin", be, 1, 16)
    with pytest.raises(ValueError) as e:
        list(generate(m, [1, 2], 3, np.random.default_rng(0)))
    msg = str(e.value)
    assert "liar backend's attention_decode is not implemented" in msg and "\n" not in msg, msg
    assert len(list(generate(m, [1, 2], 3, np.random.default_rng(0), kv_cache=False))) == 3  # without: fine
