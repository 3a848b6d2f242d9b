"""`llmc sample`, `llmc eval` and the API under them (generate, choose_token, HellaSwag), each case as
found:

* a model whose arithmetic overflows (finite weights, NaN or infinite logits) sampled token 0 forever ('!!!!!'),
  exit 0, under numpy's RuntimeWarnings; now one line naming --checkpoint, exit 2 (generate: NonFiniteLogits);
* HellaSwag on such a model reported acc 0.0 (np.argmin picks the first NaN, as if ending 0 were chosen); now its
  accuracies are NaN (null in --json) and one warning line says why; a loss that is not finite is said the same way;
* `llmc sample` printed nothing while the model wrote bytes that are not UTF-8 (it waited for a decoded text not
  ending in U+FFFD, decoding all of it again per token); now an incremental decoder holds back only an
  unfinished character;
* HellaSwag(None) or HellaSwag(5) read files named 'None' and '5'; evaluate(on_example=5) was a TypeError
  traceback; generate(temperature=Fraction(1, 2)) a TypeError from numpy; choose_token of no logits or of a 2-D
  array a numpy error or a flattened draw.
"""

from __future__ import annotations

import base64
import json
from fractions import Fraction

import numpy as np
import pytest
from llmc_test_support import LLAMA_HF_CONFIG, hf_tensors, one_line_error, run, write_hf_dir

from llmc_cli.evals.evaluate import HellaSwag
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.inference.loading import load_model
from llmc_cli.inference.sampling import NonFiniteLogits, choose_token, generate
from llmc_cli.models.gpt2 import GPT2Config, init_parameters

CFG = GPT2Config(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A GPT-2 of finite weights whose logits overflow float32: token embeddings of ~1e37 (tied to the output
    head) times a final layernorm whose bias is 100."""
    p = init_parameters(CFG, 0)
    n = CFG.padded_vocab_size * CFG.n_embd
    p[:n] = (np.random.default_rng(0).standard_normal(n) * 1e37).astype(np.float32)
    p[-CFG.n_embd:] = 100.0
    path = tmp_path_factory.mktemp("overflow") / "m.bin"
    write_model(path, CFG, p)
    return path


@pytest.fixture(scope="module")
def hs_file(tmp_path_factory):
    exs = [{"label": i % 4, "ctx_tokens": [1 + i, 2, 3], "ending_tokens": [[4, 5], [6], [7, 8, 9], [10]]}
           for i in range(3)]
    return write_evalfile(tmp_path_factory.mktemp("hs") / "hs.bin", exs)


@pytest.fixture
def cpu_backend():
    from llmc_cli.registry import create_backend
    return create_backend("cpu")


@pytest.mark.parametrize("extra", [[], ["--no-kv-cache"], ["--temperature", "0"], ["--top-p", "0.5"]])
def test_sample_of_a_model_whose_logits_overflow_is_one_line(overflowing, extra):
    r = run("sample", "--backend", "cpu", "--checkpoint", overflowing, "--max-new-tokens", 4, *extra, ok=False)
    msg = one_line_error(r, "--checkpoint", str(overflowing), "not finite", "at new token 1")
    assert "!!" not in r.output and "Warning" not in r.output, msg


def test_generate_and_choose_token_refuse_logits_that_are_not_finite(overflowing, cpu_backend):
    m = load_model(overflowing, cpu_backend, 1, 32)
    with pytest.raises(NonFiniteLogits, match="not finite"), np.errstate(over="ignore", invalid="ignore"):
        list(generate(m, [1, 2], 3, np.random.default_rng(0)))
    for logits in (np.full(5, np.nan), np.array([np.inf, 0.0, 1.0]), np.full(4, -np.inf)):
        for temperature in (0.0, 1.0):
            with pytest.raises(NonFiniteLogits):
                choose_token(logits, np.random.default_rng(0), temperature=temperature)


@pytest.mark.parametrize("logits", [np.zeros(0), np.zeros((2, 3))])
def test_choose_token_refuses_logits_that_are_not_one_vector(logits):
    with pytest.raises(ValueError, match="one vector"):
        choose_token(logits, np.random.default_rng(0))


def test_hellaswag_of_an_overflowing_model_has_no_accuracy(overflowing, hs_file, cpu_backend):
    r = run("eval", "--backend", "cpu", "--checkpoint", overflowing, "--hellaswag", hs_file, "--json")
    assert json.loads(r.stdout) == {"hellaswag_acc": None, "hellaswag_acc_norm": None, "hellaswag_examples": 3}
    warning = r.stderr.strip()
    assert warning.startswith("warning: --checkpoint:") and "\n" not in warning, r.stderr
    assert "3 of 3 HellaSwag examples" in warning and "RuntimeWarning" not in r.stderr
    # the API the same: unscored examples, NaN accuracies
    with np.errstate(over="ignore", invalid="ignore"):
        res = HellaSwag(hs_file).evaluate(load_model(overflowing, cpu_backend, 1, 1))
    assert res.unscored == 3 and np.isnan(res.acc) and np.isnan(res.acc_norm)


def test_eval_loss_of_an_overflowing_model_is_said_once(overflowing, shards):
    r = run("eval", "--backend", "cpu", "--checkpoint", overflowing, "--data", shards, "-t", 32, "--batches", 2)
    assert r.stdout.startswith("loss nan"), r.output
    assert r.stderr.strip().startswith("warning: --checkpoint:") and "not finite" in r.stderr
    assert r.stderr.count("\n") == 1 and "RuntimeWarning" not in r.stderr, r.stderr


def test_a_sound_model_has_no_warning(gpt2_model, hs_file, shards):
    r = run("eval", "--backend", "cpu", "--checkpoint", gpt2_model, "--hellaswag", hs_file, "--data", shards,
            "-t", 32, "--batches", 1, "--json")
    out = json.loads(r.stdout)
    assert 0 <= out["hellaswag_acc"] <= 1 and out["loss"] > 0 and r.stderr == ""


@pytest.fixture(scope="module")
def invalid_utf8_model(tmp_path_factory):
    """A Llama whose greedy token is always id 0, which its byte tokenizer makes byte 0xFF (never UTF-8)."""
    d = tmp_path_factory.mktemp("ff") / "hf"
    cfg = LLAMA_HF_CONFIG | {"vocab_size": 512}
    t = hf_tensors(cfg, np.random.default_rng(0))
    t["lm_head.weight"][:] = 0  # every logit 0: argmax is id 0
    write_hf_dir(d, t)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer.model").write_text("".join(f"{base64.b64encode(bytes([255 - i])).decode()} {i}\n"
                                               for i in range(256)))
    return d


def test_sample_streams_bytes_that_are_not_utf8_as_they_come(invalid_utf8_model, monkeypatch):
    import click
    shown: list[str] = []
    echo = click.echo

    def spy(message=None, *a, **k):
        shown.append("" if message is None else str(message))
        return echo(message, *a, **k)
    monkeypatch.setattr(click, "echo", spy)
    r = run("sample", "--backend", "cpu", "--checkpoint", invalid_utf8_model, "--temperature", 0,
            "--max-new-tokens", 8)
    assert r.stdout == "\ufffd" * 8 + "\n"
    assert sum(s == "\ufffd" for s in shown) >= 7, shown  # one per token, not all at the end


@pytest.mark.parametrize("path", [None, 5, b"hs.bin"])
def test_hellaswag_path_must_be_a_path(path):
    with pytest.raises(ValueError, match="path must be"):
        HellaSwag(path)


def test_hellaswag_on_example_must_be_callable(gpt2_model, hs_file, cpu_backend):
    with pytest.raises(ValueError, match="on_example must be a function"):
        HellaSwag(hs_file).evaluate(load_model(gpt2_model, cpu_backend, 1, 1), on_example=5)


def test_generate_takes_any_real_temperature(gpt2_model, cpu_backend):
    m = load_model(gpt2_model, cpu_backend, 1, 32)
    a = list(generate(m, [1, 2], 4, np.random.default_rng(3), temperature=Fraction(1, 2), top_p=Fraction(9, 10)))
    b = list(generate(m, [1, 2], 4, np.random.default_rng(3), temperature=0.5, top_p=0.9))
    assert a == b


def test_a_second_generate_on_one_model_does_not_corrupt_the_first(gpt2_model, cpu_backend):
    """One model has one key/value cache: a generator resumed after another began on the model went on from the
    other's context (other tokens, silently); now it stops with one line."""
    m = load_model(gpt2_model, cpu_backend, 1, 32)
    first = generate(m, [1, 2, 3], 6, np.random.default_rng(0), temperature=0)
    next(first)
    assert len(list(generate(m, [7, 8, 9, 10], 3, np.random.default_rng(0), temperature=0))) == 3
    with pytest.raises(ValueError, match="another generate"):
        list(first)
    # one after the other, and without the cache, as before
    a = list(generate(m, [1, 2, 3], 6, np.random.default_rng(0), temperature=0))
    assert a == list(generate(m, [1, 2, 3], 6, np.random.default_rng(0), temperature=0))
    first = generate(m, [1, 2, 3], 6, np.random.default_rng(0), temperature=0, kv_cache=False)
    got = [next(first)]
    list(generate(m, [7, 8, 9, 10], 3, np.random.default_rng(0), temperature=0, kv_cache=False))
    assert got + list(first) == a


def test_a_prompt_files_byte_order_mark_is_not_prompt(gpt2_model, tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfHello")
    (tmp_path / "plain.txt").write_bytes(b"Hello")
    args = ["sample", "--backend", "cpu", "--checkpoint", gpt2_model, "--max-new-tokens", 4, "--prompt-file"]
    with_bom = run(*args, tmp_path / "bom.txt").stdout
    assert with_bom == run(*args, tmp_path / "plain.txt").stdout and with_bom.startswith("Hello")


@pytest.mark.parametrize("args, option", [
    (["sample", "--checkpoint", ""], "--checkpoint"),
    (["eval", "--checkpoint", "", "--hellaswag", "HS"], "--checkpoint"),
    (["eval", "--checkpoint", "M", "--hellaswag", ""], "--hellaswag"),
    (["eval", "--checkpoint", "M", "--data", ""], "--data"),
    (["sample", "--checkpoint", "M", "--prompt-file", ""], "--prompt-file"),
])
def test_an_empty_path_is_not_the_working_directory(gpt2_model, hs_file, tmp_path, monkeypatch, args, option):
    """`--checkpoint ''` (an unset shell variable) loaded the model in the working directory, silently."""
    (tmp_path / "model.bin").write_bytes(gpt2_model.read_bytes())
    monkeypatch.chdir(tmp_path)
    args = [{"M": gpt2_model, "HS": hs_file}.get(a, a) for a in args]
    one_line_error(run(*args, "--backend", "cpu", "--max-new-tokens" if args[0] == "sample" else "--json",
                       *([2] if args[0] == "sample" else []), ok=False), option, "empty path")


def test_load_model_of_an_empty_path_is_refused(gpt2_model, tmp_path, monkeypatch, cpu_backend):
    (tmp_path / "model.bin").write_bytes(gpt2_model.read_bytes())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="checkpoint must be a path"):
        load_model("", cpu_backend)
