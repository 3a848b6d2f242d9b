"""Issue 9: HellaSwag scoring (checked by hand against PyTorch per-token losses), sampling (determinism, top-p,
KV cache == full recomputation), and the eval / sample / train command-line surface."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch_gpt2
from llmc_test_support import run

from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.shards import write_shard
from llmc_cli.evals.evaluate import HellaSwag, render_example
from llmc_cli.inference.decode import KVDecoder
from llmc_cli.models.gpt2 import GPT2, GPT2Config, init_parameters
from llmc_cli.inference.sampling import choose_token, generate
from llmc_cli.training.args import TrainArgs

SMALL = GPT2Config(block_size=40, vocab_size=97, n_layer=2, n_head=4, n_embd=32)


def params_for(cfg: GPT2Config, seed: int, sharpen: float = 20.0) -> np.ndarray:
    """GPT-2 init plus noise, so biases and layernorms are not trivial and the model has opinions."""
    p = init_parameters(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    n = cfg.padded_vocab_size * cfg.n_embd
    p[n:] += rng.normal(0, 0.05, p.size - n).astype(np.float32)
    p[:cfg.vocab_size * cfg.n_embd] *= sharpen  # sharper logits: per-token losses differ clearly between endings
    return p


# ---- HellaSwag ------------------------------------------------------------------------------------------------
def examples(cfg: GPT2Config, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ctx = rng.integers(0, cfg.vocab_size, rng.integers(2, 9)).tolist()
        ends = [rng.integers(0, cfg.vocab_size, rng.integers(1, 7)).tolist() for _ in range(4)]
        out.append({"label": 0, "ctx_tokens": ctx, "ending_tokens": ends})
    return out


def oracle_ending_losses(flat: np.ndarray, cfg: GPT2Config, ex: dict) -> list[list[float]]:
    """Per-token losses of each ending, one unpadded row at a time, by the PyTorch reference model."""
    out = []
    for end in ex["ending_tokens"]:
        row = torch.tensor([ex["ctx_tokens"] + end])
        logits, _ = torch_gpt2.forward(torch.tensor(flat, dtype=torch.float64), cfg, row[:, :-1])
        logp = torch.log_softmax(logits[0, :, :cfg.vocab_size], dim=-1)
        n = len(ex["ctx_tokens"])
        out.append([-logp[t - 1, row[0, t]].item() for t in range(n, row.shape[1])])
    return out


def test_render_example_masks_the_ending_targets():
    ex = {"label": 1, "ctx_tokens": [1, 2, 3], "ending_tokens": [[4, 5], [6], [7, 8, 9], [10]]}
    x, y, mask = render_example(ex, 6)
    assert x[0].tolist() == [1, 2, 3, 4, 0, 0] and y[0].tolist() == [2, 3, 4, 5, 0, 0]
    assert mask[0].tolist() == [False, False, True, True, False, False]
    assert mask[1].tolist() == [False, False, True, False, False, False]
    assert mask[2].tolist() == [False, False, True, True, True, False]
    # rows longer than T+1 lose context from the left
    x, y, mask = render_example(ex, 3)
    assert x[2].tolist() == [3, 7, 8] and y[2].tolist() == [7, 8, 9] and mask[2].all()


def test_hellaswag_acc_norm_by_hand(cpu, tmp_path):
    cfg = SMALL
    flat = params_for(cfg, 1)
    exs = examples(cfg, 6, 2)
    # expected scores, by hand from the oracle's per-token losses
    sums, means = [], []
    for ex in exs:
        per_token = oracle_ending_losses(flat, cfg, ex)
        sums.append([sum(t) for t in per_token])
        means.append([sum(t) / len(t) for t in per_token])
    # labels chosen so that the two scores disagree somewhere (where they can): acc != acc_norm
    for i, ex in enumerate(exs):
        ex["label"] = int(np.argmin(means[i])) if i % 2 == 0 else int(np.argmin(sums[i]))
    want = sum(int(np.argmin(s)) == ex["label"] for s, ex in zip(sums, exs))
    want_norm = sum(int(np.argmin(m)) == ex["label"] for m, ex in zip(means, exs))
    assert want != want_norm or all(np.argmin(s) == np.argmin(m) for s, m in zip(sums, means))

    path = write_evalfile(tmp_path / "hs.bin", exs)
    hs = HellaSwag(path)
    model = GPT2(cfg, cpu, 1, 8, training=False)
    model.load_parameters(flat)
    for ex, s, m in zip(exs, sums, means):
        got_s, got_m = hs.score(model, ex)
        np.testing.assert_allclose(got_s, s, rtol=1e-5)
        np.testing.assert_allclose(got_m, m, rtol=1e-5)
    r = hs.evaluate(model)
    assert (r.n, r.correct, r.correct_norm) == (6, want, want_norm)
    assert r.acc_norm == want_norm / 6

    # the command line: --hellaswag with --json, alone and with --data
    write_model(tmp_path / "m.bin", cfg, flat)
    out = json.loads(run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--hellaswag", path,
                         "--json").stdout)
    assert out == {"hellaswag_acc": want / 6, "hellaswag_acc_norm": want_norm / 6, "hellaswag_examples": 6}
    write_shard(tmp_path / "v_val_000000.bin", np.arange(400) % cfg.vocab_size)
    out = json.loads(run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--hellaswag", path,
                         "--hellaswag-limit", 2, "--data", tmp_path / "v_val_*.bin", "-t", 16, "--json").stdout)
    assert set(out) == {"loss", "batches", "hellaswag_acc", "hellaswag_acc_norm", "hellaswag_examples"}
    assert out["hellaswag_examples"] == 2 and out["loss"] > 0
    text = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--hellaswag", path).output
    assert "acc_norm" in text


def test_hellaswag_during_training_is_logged(tmp_path):
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    write_model(tmp_path / "init.bin", cfg, init_parameters(cfg, 0))
    write_shard(tmp_path / "t_train_000000.bin", np.random.default_rng(0).integers(0, 50257, 3000))
    hs = write_evalfile(tmp_path / "hs.bin", examples(GPT2Config(vocab_size=50257), 3, 5))
    run("train", "--backend", "cpu", "--init", tmp_path / "init.bin", "-b", 2, "-t", 16, "--steps", 4,
        "--data", tmp_path / "t_train_*.bin", "--val-every", 0, "--sample-every", 0, "--hellaswag", hs,
        "--hellaswag-every", 2, "--log", tmp_path / "log.jsonl")
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    hs_recs = [r for r in recs if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in hs_recs] == [0, 2, 4]
    assert all(0 <= r["hellaswag_acc_norm"] <= 1 and r["hellaswag_examples"] == 3 for r in hs_recs)
    assert len([r for r in recs if "loss" in r]) == 4


# ---- sampling -------------------------------------------------------------------------------------------------
def small_model(backend, T: int, seed: int = 3) -> GPT2:
    m = GPT2(SMALL, backend, 1, T, training=False)
    m.load_parameters(params_for(SMALL, seed, sharpen=3.0))
    return m


def test_top_p_and_top_k_restrict_the_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert {choose_token(logits, rng, top_p=0.5) for _ in range(200)} == {0}
    assert {choose_token(logits, rng, top_p=0.7) for _ in range(400)} == {0, 1}
    assert {choose_token(logits, rng, top_p=0.9) for _ in range(400)} == {0, 1, 2}
    assert {choose_token(logits, rng, top_k=2) for _ in range(400)} == {0, 1}
    assert choose_token(logits, rng, temperature=0) == 0


def test_sampling_is_deterministic_with_a_seed(cpu):
    m = small_model(cpu, 32)
    a = list(generate(m, [1, 2, 3], 20, np.random.default_rng(7), top_k=10, top_p=0.9))
    b = list(generate(m, [1, 2, 3], 20, np.random.default_rng(7), top_k=10, top_p=0.9))
    c = list(generate(m, [1, 2, 3], 20, np.random.default_rng(8), top_k=10, top_p=0.9))
    assert a == b and len(a) == 20 and a != c


@pytest.mark.parametrize("prompt_len,new", [(1, 23), (7, 17), (20, 4)])  # up to the window's 24 positions
def test_kv_cache_generation_equals_full_recomputation(cpu, prompt_len, new):
    m = small_model(cpu, 24)
    prompt = np.random.default_rng(prompt_len).integers(0, SMALL.vocab_size, prompt_len).tolist()
    for temperature in (0.0, 1.0):
        full = list(generate(m, prompt, new, np.random.default_rng(1), temperature, kv_cache=False))
        kv = list(generate(m, prompt, new, np.random.default_rng(1), temperature, kv_cache=True))
        assert kv == full and len(kv) == new


def test_kv_cache_logits_match_full_forward(cpu):
    m = small_model(cpu, 32)
    seq = np.random.default_rng(4).integers(0, SMALL.vocab_size, 30).astype(np.int32)
    dec = KVDecoder(m, chunk=8)
    got = {}
    got[10] = dec.feed(seq[:10])           # a prompt in two chunks
    for n in range(11, 31):                # then one token at a time
        got[n] = dec.feed(seq[n - 1:n])
    buf = np.zeros((1, 32), np.int32)
    buf[0, :30] = seq
    m.forward(buf)
    logits = cpu.download(m.acts["logits"])[0, :, :SMALL.vocab_size]
    for n, g in got.items():
        ref = logits[n - 1]
        assert np.abs(g[0] - ref).max() <= 1e-5 * np.abs(ref).max(), n
    # past its 32 positions the cache refills from its newest half (GPT-2's positions are absolute): the logits
    # are those of a full forward over the tokens it holds, which restart at position 0
    for n in range(31, 60):
        seq = np.append(seq, np.int32(n % SMALL.vocab_size))
        g = dec.feed(seq[-1:])
        held = dec.history[0]
        assert dec.pos == held.size <= 32 and np.array_equal(held, seq[-held.size:])
        buf[0, :held.size], buf[0, held.size:] = held, 0
        m.forward(buf)
        ref = cpu.download(m.acts["logits"])[0, held.size - 1, :SMALL.vocab_size]
        assert np.abs(g[0] - ref).max() <= 1e-5 * np.abs(ref).max(), n
    assert dec.refills == 2


def test_kv_cache_past_the_window_on_every_backend(kv_backend, cpu):
    """Decoding far past the window gives the CPU reference's logits on every backend with a KV cache."""
    m_ref, m = small_model(cpu, 16), small_model(kv_backend, 16)
    seq = np.random.default_rng(9).integers(0, SMALL.vocab_size, 50).astype(np.int32)
    d_ref, d = KVDecoder(m_ref, chunk=4), KVDecoder(m, chunk=4)
    tol = 1e-4 if kv_backend.dtype == "float32" else 5e-2
    for n in range(1, 51):
        want, got = d_ref.feed(seq[n - 1:n]), d.feed(seq[n - 1:n])
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), n


def _generated(m, monkeypatch, on_device: bool, **kw):
    """generate's tokens and the generator's next draw after them (or the error's text), the tokens drawn where
    the backend draws them (CAP_SAMPLING) or, with on_device False, by the host's choose_token."""
    from llmc_cli.inference import decode
    from llmc_cli.inference.sampling import NonFiniteLogits
    rng = np.random.default_rng(11)
    with monkeypatch.context() as mp:
        if not on_device:
            mp.setattr(decode, "samples_on_device", lambda model: False)
        try:
            return list(generate(m, [1, 2, 3], 40, rng, **kw)), rng.random()
        except NonFiniteLogits as e:
            return str(e), rng.random()


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_tokens_drawn_on_the_device_are_the_hosts(kv_backend, monkeypatch, temperature):
    """A backend that draws tokens itself gives generate() the tokens choose_token gives from the same logits and
    generator: past the window too (GPT-2's cache refills), up to a stop token, and logits that are not finite
    refused alike, the generator left as the host leaves it."""
    from llmc_cli.inference.decode import samples_on_device
    m = small_model(kv_backend, 16)
    if not samples_on_device(m):
        pytest.skip(f"backend '{kv_backend.name}' does not draw tokens itself")
    host = _generated(m, monkeypatch, False, temperature=temperature)
    assert _generated(m, monkeypatch, True, temperature=temperature) == host and len(host[0]) == 40
    stop = host[0][17]
    kw = dict(temperature=temperature, stop_token=stop)
    assert _generated(m, monkeypatch, True, **kw) == _generated(m, monkeypatch, False, **kw)
    p = params_for(SMALL, 3)
    p[:] = np.nan
    m.load_parameters(p)
    refused = _generated(m, monkeypatch, False, temperature=temperature)
    assert "not finite (97 of 97" in refused[0]
    assert _generated(m, monkeypatch, True, temperature=temperature) == refused


def test_sample_command(tmp_path):
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=16)
    p = init_parameters(cfg, 0)
    p[cfg.padded_vocab_size * cfg.n_embd:] += np.random.default_rng(0).normal(0, 0.05, p.size - cfg.padded_vocab_size
                                                                               * cfg.n_embd).astype(np.float32)
    write_model(tmp_path / "m.bin", cfg, p)
    (tmp_path / "prompt.txt").write_text("Hello there")
    common = ["sample", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--max-new-tokens", 12,
              "--seed", 3, "--top-p", 0.95, "--num-samples", 2]
    r = run(*common, "--prompt-file", tmp_path / "prompt.txt")
    assert r.stdout.count("--- sample") == 2 and r.stdout.count("Hello there") == 2
    assert "tok/s" in r.stderr and "KV cache" in r.stderr and "tok/s" not in r.stdout
    r2 = run(*common, "--prompt", "Hello there", "--no-kv-cache")
    assert r2.stdout == r.stdout and "full recomputation" in r2.stderr
    # the Hugging Face export of the same model samples the same text
    run("convert", tmp_path / "m.bin", tmp_path / "hf")
    r3 = run(*[a if a != tmp_path / "m.bin" else tmp_path / "hf" for a in common], "--prompt", "Hello there")
    assert r3.stdout == r.stdout
    bad = run(*common, "--prompt", "x", "--prompt-file", tmp_path / "prompt.txt", ok=False)
    assert bad.exit_code == 2 and bad.output.startswith("error:")
    bad = run(*common, "--prompt-file", tmp_path / "missing.txt", ok=False)
    assert bad.exit_code == 2 and bad.output.strip().startswith("error:") and "\n" not in bad.output.strip()


def test_bad_hellaswag_file_is_one_line_error(tmp_path):
    cfg = GPT2Config(block_size=32, vocab_size=97, n_layer=1, n_head=2, n_embd=16)
    write_model(tmp_path / "m.bin", cfg, init_parameters(cfg, 0))
    write_shard(tmp_path / "shard.bin", np.arange(100))  # a token shard, not an eval file
    for args in (["--hellaswag", tmp_path / "shard.bin"], ["--hellaswag", tmp_path / "none.bin"], []):
        r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", *args, ok=False)
        msg = r.output.strip()
        assert r.exit_code == 2 and msg.startswith("error:") and "\n" not in msg, msg
    # token ids beyond the model's vocabulary
    hs = write_evalfile(tmp_path / "hs.bin", examples(GPT2Config(vocab_size=50257), 2, 1))
    r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--hellaswag", hs, ok=False)
    assert r.exit_code == 2 and "vocabulary" in r.output


def test_new_commands_show_an_example():
    for cmd in ("eval", "sample", "convert", "plot"):
        assert "Example:" in run(cmd, "--help").output


# ---- acceptance gaps (issue 9): eval over every batch, stop at end-of-text, streaming ------------------------
def test_eval_averages_training_s_validation_batches_by_default_and_all_with_0(tmp_path):
    """No --batches: the mean over the first --val-batches (20) batches, as training validates; --batches 0: over
    all batches of all shards, checked against the PyTorch reference on the windows by hand; --batches 1 is the
    first batch alone. --json says how many batches the loss averaged."""
    cfg = SMALL
    flat = params_for(cfg, 5, sharpen=2.0)
    write_model(tmp_path / "m.bin", cfg, flat)
    rng = np.random.default_rng(9)
    shards = [rng.integers(0, cfg.vocab_size, n) for n in (500, 300)]
    for i, toks in enumerate(shards):
        write_shard(tmp_path / f"v_val_{i:06d}.bin", toks)
    B, T = 2, 16
    per_batch = []
    for toks in shards:
        for i in range((len(toks) - 1) // (B * T)):
            w = torch.tensor(toks[i * B * T: (i + 1) * B * T + 1].astype(np.int64))
            _, loss = torch_gpt2.forward(torch.tensor(flat, dtype=torch.float64), cfg, w[:-1].view(B, T),
                                         w[1:].view(B, T))
            per_batch.append(loss.item())
    assert len(per_batch) == 15 + 9  # more than any small default would take
    common = ["eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--data", tmp_path / "v_val_*.bin",
              "-b", B, "-t", T, "--json"]
    every = json.loads(run(*common, "--batches", 0).stdout)
    assert every["loss"] == pytest.approx(np.mean(per_batch), rel=1e-5) and every["batches"] == 24
    default = json.loads(run(*common).stdout)
    assert TrainArgs(data="").val_batches == 20
    assert default["loss"] == pytest.approx(np.mean(per_batch[:20]), rel=1e-5) and default["batches"] == 20
    first = json.loads(run(*common, "--batches", 1).stdout)
    assert first["loss"] == pytest.approx(per_batch[0], rel=1e-5) and first["batches"] == 1


def eot_model(cfg: GPT2Config, eot: int) -> np.ndarray:
    """A GPT-2 that always predicts `eot`: the final layernorm outputs its bias (weight 0), which is eot's
    embedding row (the only non-zero row of the tied wte)."""
    from llmc_cli.models.gpt2 import parameter_shapes
    from llmc_cli.models.base import split_flat
    p = init_parameters(cfg, 0)
    t = split_flat(p, parameter_shapes(cfg))  # views into p
    t["wte"][:] = 0
    t["wte"][eot] = np.linspace(0.5, 1.5, cfg.n_embd)
    t["lnfw"][:] = 0
    t["lnfb"][:] = t["wte"][eot]
    return p


def test_generation_stops_at_the_stop_token(cpu):
    m = small_model(cpu, 32)
    for kv in (False, True):
        full = list(generate(m, [1, 2, 3], 12, np.random.default_rng(0), temperature=0, kv_cache=kv))
        k = 4
        stop = full[k]
        cut = full.index(stop)  # the first time it would have been generated
        got = list(generate(m, [1, 2, 3], 12, np.random.default_rng(0), temperature=0, stop_token=stop,
                            kv_cache=kv))
        assert got == full[:cut] and stop not in got


def test_sample_command_stops_at_end_of_text(tmp_path):
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    write_model(tmp_path / "eot.bin", cfg, eot_model(cfg, 50256))
    for extra in ([], ["--no-kv-cache"], ["--temperature", 0]):
        r = run("sample", "--backend", "cpu", "--checkpoint", tmp_path / "eot.bin", "--prompt", "Hi",
                "--max-new-tokens", 20, "--num-samples", 2, *extra)
        assert r.stdout.count("Hi\n") == 2 and "<|endoftext|>" not in r.stdout
        assert r.stderr.startswith("0 tokens in"), r.stderr


def test_sample_command_streams_token_by_token(tmp_path, monkeypatch):
    """Text reaches stdout while tokens are still being generated, not after the sample is complete."""
    import click

    import llmc_cli.inference.sampling as sample_mod
    cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    write_model(tmp_path / "m.bin", cfg, init_parameters(cfg, 0))
    events = []
    real_generate, real_echo = sample_mod.generate, click.echo

    def generate_spy(*a, **k):
        for t in real_generate(*a, **k):
            events.append("token")
            yield t
        events.append("done")

    def echo_spy(message=None, *a, **k):
        if message:
            events.append("echo")
        return real_echo(message, *a, **k)
    monkeypatch.setattr(sample_mod, "generate", generate_spy)
    monkeypatch.setattr(click, "echo", echo_spy)
    run("sample", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--prompt", "Hello",
        "--max-new-tokens", 10, "--seed", 1)
    gen = events[events.index("token"):events.index("done")]
    assert gen.count("token") == 10 and gen.count("echo") >= 5, events


def test_eval_and_validation_say_how_many_batches_they_averaged(tmp_path, shards):
    from llmc_test_support import TINY
    from llmc_cli.models.gpt2 import preset
    cfg = preset("d2", n_embd=64)
    write_model(tmp_path / "m.bin", cfg, init_parameters(cfg, 0))
    r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--data", shards, "-b", 2, "-t", 16,
            "--batches", 3)
    assert "over 3 batches of B=2 T=16 (96 tokens)" in r.output, r.output
    r = run(*TINY, "--data", shards, "--steps", 1, "--val-every", 1, "--val-batches", 2)
    assert "val loss" in r.output and "(2 batches of B=2 T=32)" in r.output, r.output


def test_eval_by_default_agrees_with_training_s_validation(tmp_path, shards):
    """Training's last val loss and `eval` of its checkpoint at the same -b and -t, both at their defaults: the
    same first batches of the same shards, so the same number."""
    import re

    from llmc_test_support import TINY
    r = run(*TINY, "--data", shards, "--steps", 2, "--val-every", 2, "--out", tmp_path / "run")
    val = re.search(r"step 2: val loss ([\d.]+) \((\d+) batches", r.output)
    assert val and int(val[2]) == TrainArgs(data="").val_batches, r.output
    r = run("eval", "--backend", "cpu", "--checkpoint", tmp_path / "run", "--data", shards, "-b", 2, "-t", 32)
    assert r.stdout.startswith(f"loss {val[1]} over {val[2]} batches"), (r.stdout, val[0])


def test_eval_shows_progress_on_a_terminal_within_80_columns(tmp_path, shards, monkeypatch):
    """A terminal's standard error gets a live bar no wider than 80 columns, a pipe's nothing."""
    import io
    import re

    from rich.console import Console

    import llmc_cli.commands.eval as eval_cmd
    from llmc_cli.models.gpt2 import preset
    write_model(tmp_path / "m.bin", preset("d2", n_embd=64), init_parameters(preset("d2", n_embd=64), 0))
    args = ["eval", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--data", shards, "-b", 2, "-t", 16]
    assert run(*args).stderr == ""  # (CliRunner's stderr is no terminal)
    screen = io.StringIO()
    monkeypatch.setattr(eval_cmd, "err_console", Console(file=screen, width=80, force_terminal=True))
    r = run(*args)
    assert r.stdout.startswith("loss ") and "over 20 batches" in r.stdout
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    rows = [row for row in re.split(r"[\r\n]", shown) if row.strip()]
    assert any("loss" in row and "20/20" in row for row in rows), rows
    assert all(len(row) <= 80 and "…" not in row for row in rows), rows


def _choose_by_numpy(logits, rng, temperature, top_k, top_p):
    """The definition choose_token keeps: numpy's weighted choice after a full stable sort for top-p."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.size:
        x = np.where(x < np.partition(x, -top_k)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        keep = np.zeros(p.size, bool)
        keep[order[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


@pytest.mark.parametrize("V", [7, 1000, 50257])
def test_choose_token_draws_what_numpy_choice_draws(V):
    r = np.random.default_rng(V)
    for trial in range(40):
        logits = (r.normal(size=V) * r.choice([0.1, 1.0, 8.0])).astype(np.float32)
        if trial % 5 == 0:
            logits[: V // 2] = logits[0]  # ties at the top-p boundary: lower ids first
        kw = dict(temperature=float(r.choice([0.7, 1.0])), top_k=int(r.choice([0, 5])),
                  top_p=float(r.choice([1.0, 0.9, 0.5])))
        assert choose_token(logits, np.random.default_rng(trial), **kw) == \
            _choose_by_numpy(logits, np.random.default_rng(trial), **kw), (trial, kw)
