"""The commands that read a model, given what they should refuse: a --prompt-file that never ends (/dev/zero, a
huge file), shape options that contradict --init's model (ignored silently before), and a --dry-run of --init or
--resume, which planned --model's preset instead of the checkpoint's model; and load_model's B or T below 1."""

import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.models.gpt2 import GPT2Config, init_parameters, num_parameters

CFG = GPT2Config(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m.bin"
    write_model(path, CFG, init_parameters(CFG, 0))
    return path


def test_a_prompt_file_larger_than_any_prompt_is_one_line(model, tmp_path):
    """The file was read whole: 64 GiB (sparse here; /dev/zero never ends) was MemoryError's line at best."""
    huge = tmp_path / "prompt.txt"
    with open(huge, "wb") as f:
        f.truncate(64 * 2**30)
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", model, "--prompt-file", huge, "--max-new-tokens",
                       1, ok=False), "--prompt-file", huge, "MiB")
    ok = tmp_path / "ok.txt"
    ok.write_text("Hello")
    assert run("sample", "--backend", "cpu", "--checkpoint", model, "--prompt-file", ok, "--max-new-tokens", 2,
               "--temperature", 0).output.startswith("Hello")


@pytest.mark.parametrize("option, value", [("--n-layer", 3), ("--n-embd", 32), ("--block-size", 64),
                                           ("--n-kv-head", 1)])
def test_shape_options_that_contradict_init_are_refused(model, shards, tmp_path, option, value):
    """--init's file fixes the model: --n-layer 3 trained its one layer without a word."""
    out = tmp_path / "run"
    for dry in ([], ["--dry-run"]):
        one_line_error(run("train", "--backend", "cpu", "--init", model, option, value, "-b", 1, "-t", 8, "--steps", 1,
                           "--val-every", 0, "--sample-every", 0, "--data", shards / "*train*.bin", "--out", out,
                           *dry, ok=False), "--init", option)
    assert not out.exists()
    run("train", "--backend", "cpu", "--init", model, "--n-layer", 1, "-b", 1, "-t", 8, "--steps", 1,  # agreeing
        "--val-every", 0, "--sample-every", 0, "--data", shards / "*train*.bin")


def test_dry_run_plans_the_model_of_init_and_resume(model, shards, tmp_path):
    n = f"{num_parameters(CFG):,}"  # not d12's 124M, the preset --model defaults to
    r = run("train", "--backend", "cpu", "--init", model, "-b", 1, "-t", 8, "--dry-run")
    assert f"{n} parameters" in r.output, r.output
    rd = tmp_path / "run"
    run("train", "--backend", "cpu", "--init", model, "-b", 1, "-t", 8, "--steps", 1, "--val-every", 0,
        "--sample-every", 0, "--data", shards / "*train*.bin", "--out", rd)
    r = run("train", "--backend", "cpu", "--out", rd, "--resume", "-b", 1, "-t", 8, "--dry-run")
    assert f"{n} parameters" in r.output, r.output
    one_line_error(run("train", "--backend", "cpu", "--init", tmp_path / "none.bin", "--dry-run", ok=False),
                   "--init", "none.bin")


@pytest.mark.parametrize("B, T, bad", [(1, 0, "T"), (0, 8, "B"), (1, -1, "T"), (True, 8, "B"), (1, 2.0, "T")])
def test_load_model_refuses_batch_shapes_below_one(model, B, T, bad):
    """B=0 or T=0 planned an empty model without a word (and -1 was numpy's "negative dimensions")."""
    from llmc_cli.inference.loading import load_model
    from llmc_cli.testing.backends import make_backend
    with pytest.raises(ValueError, match=f"load_model: {bad} must be an integer >= 1"):
        load_model(model, make_backend("cpu"), B, T)


@pytest.mark.parametrize("kw, needle", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1e-320), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-3), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_generate_refuses_sampling_settings_that_sample_garbage(model, kw, needle):
    """The command line checks these; generate() took them: a NaN temperature drew token 0 every time, a negative
    one was greedy, and a NaN or zero top_p or a negative top_k were silently ignored."""
    import numpy as np

    from llmc_cli.inference.loading import load_model
    from llmc_cli.inference.sampling import generate
    from llmc_cli.testing.backends import make_backend
    m = load_model(model, make_backend("cpu"), 1, 16)
    with pytest.raises(ValueError, match=f"^{needle} must be"):
        list(generate(m, [1, 2], 2, np.random.default_rng(0), **kw))
    assert len(list(generate(m, [1, 2], 2, np.random.default_rng(0), temperature=np.float32(0.5),
                             top_k=np.int64(5), top_p=0.9))) <= 2
