"""Llama 3 through `llmc train / sample / eval / convert` with the same options as GPT-2, on the CPU backend:
run-directory checkpoints and bit-exact --resume, sampling (KV cache == full recomputation) and evaluation from
a run directory and from a Hugging Face directory, fine-tuning from one with --init, and bad input answered by one
clear line and a non-zero exit."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from llmc_test_support import dtype_tol, losses, one_line_error, phrase_tokens, rewind_run, run
from llmc_test_support import LLAMA_HF_CONFIG as CONFIG
from llmc_test_support import hf_tensors, write_hf_dir

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.safetensors import read_safetensors_header
from llmc_cli.formats.safetensors import write_safetensors
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.shards import write_shard
from llmc_cli.inference.decode import KVDecoder
from llmc_cli.models.llama3 import Llama3, Llama3Config, init_parameters, parameter_shapes
from llmc_cli.models.base import split_flat
from llmc_cli.inference.sampling import generate

TRAIN = ["train", "--backend", "cpu", "--model", "llama3-tiny", "-b", 2, "-t", 16, "--val-every", 0,
         "--sample-every", 0]
# an HF Llama whose vocabulary holds a byte-level Llama 3 tokenizer: 256 ranks + 256 specials
HF_CONFIG = CONFIG | {"vocab_size": 512}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    phrase = phrase_tokens(1)
    tokens = phrase_tokens(60)
    write_shard(d / "tiny_val_000000.bin", tokens[:1000])
    write_shard(d / "tiny_train_000001.bin", tokens)
    # Llama 3 shards (uint32 ids) inside the small HF model's vocabulary
    small = np.concatenate([np.roll(phrase % 500, k) for k in range(30)])
    write_shard(d / "l3_val_000000.bin", small[:600], tokenizer="llama3")
    write_shard(d / "l3_train_000001.bin", small, tokenizer="llama3")
    return d


@pytest.fixture(scope="module")
def run_dir(shards, tmp_path_factory):
    """A llama3-tiny run trained from scratch on GPT-2 shards."""
    out = tmp_path_factory.mktemp("llama_run") / "run"
    run(*TRAIN, "--data", shards / "tiny_train*.bin", "--steps", 3, "--out", out)
    return out


def write_byte_tokenizer(path):
    """A tiktoken-format ranks file (Meta's tokenizer.model layout) of the 256 single bytes."""
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    t = hf_tensors(HF_CONFIG, np.random.default_rng(0))
    write_hf_dir(d, t)
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    write_byte_tokenizer(d / "tokenizer.model")
    return d


def test_train_resume_is_bit_exact(shards, tmp_path):
    """6 steps == 3 steps, resume, 3 steps: identical losses (schedule, weight decay, clipping, shuffling on)."""
    common = [*TRAIN, "--data", shards / "tiny_train*.bin", "--steps", 6, "--lr", "1e-3", "--warmup", 2,
              "--lr-decay-frac", "0.1", "--weight-decay", "0.1", "--shuffle"]
    run(*common, "--out", tmp_path / "a", "--log", tmp_path / "a.jsonl")
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--checkpoint-every", 3)
    rewind_run(tmp_path / "b", 3, 6, log=tmp_path / "b.jsonl")  # as if the run died after step 3
    r = run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--resume")
    assert "resumed from" in r.output
    a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert len(a) == 6 and a == b
    step = tmp_path / "a" / "step_00000006"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "model.safetensors", "optimizer.npz", "state.json"]
    state = json.loads((step / "state.json").read_text())
    assert state["family"] == "llama3" and state["tokenizer"] == "gpt2"
    assert state["config"]["n_kv_head"] == 2
    # the final weights of both runs, bit for bit
    cfg_a, pa = ckpt.read_model_file(step / "model.safetensors")
    cfg_b, pb = ckpt.read_model_file(tmp_path / "b" / "step_00000006" / "model.safetensors")
    assert cfg_a == cfg_b and np.array_equal(pa, pb)
    # a resumed Llama run refuses a changed shape like a GPT-2 one
    r = run(*common, "--out", tmp_path / "b", "--resume", "--n-kv-head", 4, "--steps", 7, ok=False)
    one_line_error(r, "--n-kv-head")


def test_model_file_round_trip_and_errors(tmp_path):
    cfg = Llama3Config(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       multiple_of=16, rope_scaling=8.0, rope_original_context=16, tie_embeddings=True)
    p = init_parameters(cfg, 1)
    ckpt.write_model_file(tmp_path / "m.safetensors", cfg, p, tokenizer="gpt2")
    cfg2, p2 = ckpt.read_model_file(tmp_path / "m.safetensors")
    assert cfg2 == cfg and np.array_equal(p2, p)
    ckpt.write_model_file(tmp_path / "h.safetensors", cfg, p, bf16=True)
    assert np.allclose(ckpt.read_model_file(tmp_path / "h.safetensors")[1], p, rtol=2 ** -8, atol=0)
    # a Hugging Face weights file is not an llmc model file: the error says to give its directory
    write_safetensors(tmp_path / "x.safetensors", {"a": np.ones(3, np.float32)})
    with pytest.raises(ckpt.CheckpointError, match="config.json"):
        ckpt.read_model_file(tmp_path / "x.safetensors")
    t = split_flat(p, parameter_shapes(cfg))
    del t["w2"]
    meta = read_safetensors_header(tmp_path / "m.safetensors")[0]["__metadata__"]
    write_safetensors(tmp_path / "y.safetensors", t, metadata=meta)
    with pytest.raises(ckpt.CheckpointError, match="w2 is missing"):
        ckpt.read_model_file(tmp_path / "y.safetensors")


def test_sample_and_eval_from_run_dir(run_dir, shards, tmp_path):
    ev = ["eval", "--backend", "cpu", "--data", shards / "tiny_val*.bin", "--batches", 2, "-b", 2, "-t", 16,
          "--json"]
    loss = json.loads(run(*ev, "--checkpoint", run_dir).stdout)["loss"]
    assert 5 < loss < 12
    step = run_dir / "step_00000003"
    assert json.loads(run(*ev, "--checkpoint", step).stdout)["loss"] == loss
    assert json.loads(run(*ev, "--checkpoint", step / "model.safetensors").stdout)["loss"] == loss
    sm = ["sample", "--backend", "cpu", "--prompt", "Hello", "--max-new-tokens", 6, "--seed", 5, "--top-k", 20]
    s1 = run(*sm, "--checkpoint", run_dir)
    s2 = run(*sm, "--checkpoint", run_dir, "--no-kv-cache")
    assert "KV cache" in s1.stderr and "full recomputation" in s2.stderr
    assert s1.stdout == s2.stdout and s1.stdout.startswith("Hello") and len(s1.stdout) > len("Hello\n")
    # to Hugging Face and back: the same text, the same loss, the GPT-2 tokenizer remembered
    run("convert", run_dir, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["llmc_tokenizer"] == "gpt2"
    assert run(*sm, "--checkpoint", tmp_path / "hf").stdout == s1.stdout
    run("convert", tmp_path / "hf", tmp_path / "m.safetensors")
    assert json.loads(run(*ev, "--checkpoint", tmp_path / "m.safetensors").stdout)["loss"] == loss
    assert run(*sm, "--checkpoint", tmp_path / "m.safetensors").stdout == s1.stdout
    # HellaSwag scoring builds its B=4 model of the checkpoint's family
    exs = [{"label": i % 4, "ctx_tokens": [10 + i, 20, 30], "ending_tokens": [[1], [2, 3], [4], [5, 6, 7]]}
           for i in range(3)]
    hs = write_evalfile(tmp_path / "hs.bin", exs)
    out = json.loads(run("eval", "--backend", "cpu", "--checkpoint", run_dir, "--hellaswag", hs, "--json").stdout)
    assert out["hellaswag_examples"] == 3 and 0 <= out["hellaswag_acc_norm"] <= 1


def test_kv_cache_matches_full_forward(cpu):
    cfg = Llama3Config(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                       rope_scaling=8.0, rope_original_context=16)
    p = init_parameters(cfg, 3)
    p += np.random.default_rng(4).normal(0, 0.3, p.shape).astype(np.float32)
    m = Llama3(cfg, cpu, 1, 24, training=False)
    m.load_parameters(p)
    seq = np.random.default_rng(5).integers(0, cfg.vocab_size, 24).astype(np.int32)
    dec = KVDecoder(m, chunk=8)
    got = {10: dec.feed(seq[:10])}  # a prompt in two chunks, then one token at a time
    for n in range(11, 25):
        got[n] = dec.feed(seq[n - 1:n])
    m.forward(seq[None])
    logits = cpu.download(m.acts["logits"])[0]
    for n, g in got.items():
        assert np.abs(g[0] - logits[n - 1]).max() <= 1e-5 * np.abs(logits[n - 1]).max(), n
    for prompt_len, new in ((1, 23), (20, 4)):  # within the window: the same tokens as recomputation
        prompt = seq[:prompt_len].tolist()
        full = list(generate(m, prompt, new, np.random.default_rng(1), 1.0, kv_cache=False))
        assert list(generate(m, prompt, new, np.random.default_rng(1), 1.0, kv_cache=True)) == full


def test_kv_cache_slides_past_the_window(kv_backend):
    """Past its S slots the cache slides: every token attends to the last S positions, rotary positions go on
    counting, nothing is recomputed. That is sliding-window attention over the whole sequence (the oracle)."""
    import torch
    import torch_llama3
    be = kv_backend
    cfg = Llama3Config(block_size=64, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, multiple_of=16,
                       rope_scaling=8.0, rope_original_context=16)
    p = init_parameters(cfg, 3)
    p += np.random.default_rng(4).normal(0, 0.3, p.shape).astype(np.float32)
    m = Llama3(cfg, be, 1, 8, training=False)
    m.load_parameters(p)
    seq = np.random.default_rng(6).integers(0, cfg.vocab_size, 40).astype(np.int32)
    dec = KVDecoder(m, max_len=8, chunk=4)
    got = {5: dec.feed(seq[:5])}
    for n in range(6, 41):
        got[n] = dec.feed(seq[n - 1:n])
    assert dec.pos == 40
    tol = dtype_tol(be, 1e-4, 5e-2)
    want = torch_llama3.forward(torch.tensor(p, dtype=torch.float64), cfg, torch.tensor(seq[None]).long(),
                                window=8)[0][0].numpy()
    for n, g in got.items():
        assert np.abs(g[0] - want[n - 1]).max() <= tol * np.abs(want[n - 1]).max(), n
    # a first prompt longer than the cache keeps its newest S tokens, at positions 0..S-1
    dec.reset()
    last = dec.feed(seq[:20])
    ref = torch_llama3.forward(torch.tensor(p, dtype=torch.float64), cfg, torch.tensor(seq[None, 12:20]).long())[0]
    assert np.abs(last[0] - ref[0, -1].numpy()).max() <= tol * np.abs(ref[0, -1].numpy()).max()


def test_kv_cache_longer_than_the_model_is_refused(cpu):
    cfg = Llama3Config(block_size=16, vocab_size=96, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, multiple_of=16)
    m = Llama3(cfg, cpu, 1, 16, training=False)
    with pytest.raises(ValueError, match="block size"):
        KVDecoder(m, max_len=17)


def test_hf_llama_dir_sample_and_eval(hf_dir, shards):
    sm = ["sample", "--backend", "cpu", "--checkpoint", hf_dir, "--prompt", "Hi", "--max-new-tokens", 5,
          "--seed", 1]
    r = run(*sm)
    assert r.stdout.startswith("Hi") and "5 tokens" in r.stderr and "KV cache" in r.stderr
    assert run(*sm, "--no-kv-cache").stdout == r.stdout
    ev = ["eval", "--backend", "cpu", "--data", shards / "l3_val*.bin", "--batches", 2, "-b", 2, "-t", 16, "--json"]
    loss = json.loads(run(*ev, "--checkpoint", hf_dir).stdout)["loss"]
    assert 0 < loss < 20
    # without tokenizer.model an HF Llama still evaluates, but cannot sample
    (hf_dir / "tokenizer.model").unlink()
    one_line_error(run(*sm, ok=False), "tokenizer.model")
    assert json.loads(run(*ev, "--checkpoint", hf_dir).stdout)["loss"] == loss


def test_finetune_from_hf_llama_dir(shards, tmp_path):
    """--init from Hugging Face weights of Llama 3's vocabulary, on Llama 3 shards: the run keeps the
    directory's tokenizer.model beside its steps and hands it on to a Hugging Face export."""
    conf = CONFIG | {"vocab_size": 128256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "tie_word_embeddings": True}
    t = hf_tensors(conf, np.random.default_rng(2))
    del t["lm_head.weight"]
    write_hf_dir(tmp_path / "hf", t)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.model")
    ft = tmp_path / "ft"
    r = run("train", "--backend", "cpu", "--init", tmp_path / "hf", "-b", 2, "-t", 16, "--steps", 2,
            "--val-every", 0, "--sample-every", 0, "--data", shards / "l3_train*.bin", "--out", ft)
    assert "L=1 NH=4 C=32 V=128256" in r.output
    assert (ft / "tokenizer.model").read_bytes() == (tmp_path / "hf" / "tokenizer.model").read_bytes()
    assert json.loads((ft / "step_00000002" / "state.json").read_text())["tokenizer"] == "llama3"
    # the prompt goes through the run's tokenizer (<|begin_of_text|> first) and comes back as text
    assert run("sample", "--backend", "cpu", "--checkpoint", ft, "--prompt", "Hi", "--max-new-tokens", 0).stdout \
        == "Hi\n"
    ev = ["eval", "--backend", "cpu", "--data", shards / "l3_val*.bin", "--batches", 2, "-b", 2, "-t", 16, "--json"]
    ft_loss = json.loads(run(*ev, "--checkpoint", ft).stdout)["loss"]
    assert ft_loss != json.loads(run(*ev, "--checkpoint", tmp_path / "hf").stdout)["loss"]
    run("convert", ft, tmp_path / "hf2")
    assert (tmp_path / "hf2" / "tokenizer.model").is_file()
    assert "llmc_tokenizer" not in json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert json.loads(run(*ev, "--checkpoint", tmp_path / "hf2").stdout)["loss"] == ft_loss
    # resuming the fine-tune keeps its tokenizer
    run("train", "--backend", "cpu", "--init", tmp_path / "hf", "-b", 2, "-t", 16, "--steps", 3,
        "--val-every", 0, "--sample-every", 0, "--data", shards / "l3_train*.bin", "--out", ft, "--resume")
    assert json.loads((ft / "step_00000003" / "state.json").read_text())["tokenizer"] == "llama3"


@pytest.mark.parametrize("case", ["neither", "model_type", "missing_shard", "bad_index", "llama_to_bin"])
def test_bad_input_one_line_error(hf_dir, shards, tmp_path, case):
    src = hf_dir
    if case == "neither":
        src = tmp_path / "plain"
        src.mkdir()
        (src / "notes.txt").write_text("not a model")
    elif case == "model_type":
        conf = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps(conf | {"model_type": "bert"}))
    elif case == "missing_shard":
        (hf_dir / "model-00002-of-00002.safetensors").unlink()
    elif case == "bad_index":
        (hf_dir / "model.safetensors.index.json").write_text("{\"weight_map\": 3}")
    expect = {"neither": "not a run directory", "model_type": "'bert'",
              "missing_shard": "model-00002-of-00002.safetensors", "bad_index": "index",
              "llama_to_bin": ".bin"}[case]
    if case == "llama_to_bin":
        one_line_error(run("convert", src, tmp_path / "out.bin", ok=False), expect)
        assert not (tmp_path / "out.bin").exists()
        return
    one_line_error(run("sample", "--backend", "cpu", "--checkpoint", src, ok=False), expect)
    one_line_error(run("eval", "--backend", "cpu", "--checkpoint", src, "--data", shards / "l3_val*.bin",
                       ok=False), expect)
    one_line_error(run("convert", src, tmp_path / "out", ok=False), expect)
    one_line_error(run("train", "--backend", "cpu", "--init", src, "--data", shards / "l3_train*.bin",
                       "--steps", 1, "-b", 2, "-t", 16, ok=False), expect)
    assert not (tmp_path / "out").exists()


def test_dry_run_plans_llama3_8b_without_data():
    """The 8B model's memory is planned on the host, allocating nothing, with no shards at hand."""
    r = run("train", "--model", "llama3-8b", "--dry-run", "-b", 1, "-t", 8192, "--dtype", "bf16")
    assert "8,030,261,248 parameters" in r.output
    for component in ("parameters", "gradients", "optimizer", "activations", "total"):
        assert component in r.output
    # m, v and the fp32 master copy: 12 bytes a parameter
    assert "89.75" in r.output
    # with ZeRO-1 over 2 GPUs a rank holds half of it (what parallel.zero.ShardedAdamW allocates)
    r = run("train", "--model", "llama3-8b", "--dry-run", "-b", 1, "-t", 8192, "--dtype", "bf16", "--gpus", 2,
            "--zero", 1)
    assert "per rank of 2 (--zero 1)" in r.output and "ZeRO-1 shard 1/2" in r.output and "44.87" in r.output
    assert "89.75" not in r.output


def test_memory_plan_shard_is_what_zero_allocates():
    """The plan's optimizer shard equals the state ShardedAdamW allocates on a rank (m, v, master: 3 floats)."""
    from types import SimpleNamespace

    from llmc_cli.models.families import memory_plan
    from llmc_cli.models.llama3 import preset
    from llmc_cli.optim import AdamWConfig
    from llmc_cli.parallel.zero import ShardedAdamW
    from llmc_cli.registry import create_backend
    be = create_backend("cpu")
    cfg = preset("llama3-tiny")
    m = Llama3(cfg, be, 1, 8)
    for W in (2, 3, 7):
        before = be.memory_report().by_tag.get("optimizer", 0)
        ShardedAdamW(be, m.params, m.grads, m.tensor_names(), AdamWConfig(), SimpleNamespace(world_size=W, rank=W - 1))
        allocated = be.memory_report().by_tag.get("optimizer", 0) - before
        (opt,) = [v for k, v in memory_plan(cfg, 1, 8, "float32", world_size=W, zero=1).items()
                  if k.startswith("optimizer")]
        assert opt == (m.num_params // W + m.num_params % W) * 4 * 2 and allocated - opt <= 64, (W, opt, allocated)


def test_train_with_recompute_logs_the_same_losses(run_dir, shards, tmp_path):
    """`--recompute` trains a Llama (once refused): every option logs the losses of keeping the activations, bit
    for bit on the CPU backend (the same kernels recomputed). The run that keeps them (--recompute none, the
    default) is the module's run_dir, of the same options."""
    logs = {"none": losses(run_dir / "log.jsonl")}
    for mode in ("gelu", "layernorm", "gelu+layernorm"):
        log = tmp_path / f"{mode}.jsonl"
        run(*TRAIN, "--data", shards / "tiny_train*.bin", "--steps", 3, "--recompute", mode, "--log", log)
        logs[mode] = losses(log)
    assert len(logs["none"]) == 3
    assert all(v == logs["none"] for v in logs.values()), logs


def test_dry_run_counts_recompute_and_bad_input_is_one_line():
    """--dry-run plans a Llama with --recompute (less activation memory; once a traceback), and refuses in one line
    what training refuses: an unknown --recompute value, a sequence longer than the block size."""
    def gib(r, row):
        cells = next(c for c in (ln.split("│") for ln in r.output.splitlines()) if len(c) > 2 and c[1].strip() == row)
        return float(cells[2])
    base = ["train", "--model", "llama3-8b", "--dry-run", "-b", 1, "-t", 8192, "--dtype", "bf16"]
    plain, less = run(*base), run(*base, "--recompute", "gelu+layernorm")
    assert "--recompute gelu+layernorm" in less.output
    assert gib(less, "activations") < gib(plain, "activations")
    assert gib(less, "parameters") == gib(plain, "parameters")
    one_line_error(run(*base, "--recompute", "swiglu", ok=False), "--recompute", "swiglu")
    one_line_error(run("train", "--model", "llama3-tiny", "--dry-run", "-t", 512, ok=False),
                   "-t 512 is longer than the model's block size 256")


def test_python_api_refuses_unknown_recompute_in_one_line(shards):
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs, TrainError
    from llmc_cli.training.trainer import Trainer
    a = TrainArgs(data=str(shards / "tiny_train*.bin"), model="llama3-tiny", batch_size=2, seq_len=16,
                  recompute="rmsnorm")
    with pytest.raises(TrainError, match="^recompute must be one of none, gelu, layernorm, gelu\\+layernorm"):
        Trainer(a, create_backend("cpu"))
