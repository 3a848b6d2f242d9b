"""Eval files and shards say which tokenizer made them, and `llmc eval` (and the Python API, and evaluations during
training) refuse a model of another tokenizer: one line naming the file and both tokenizers, exit status 2. The
models here have a 512-token vocabulary, so every id of every file fits each of them: only the recorded tokenizer
tells them apart (a Llama 3 scored on GPT-2 ids, or the reverse, would otherwise give a number without complaint)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llmc_test_support import one_line_error, run

from llmc_cli.data.loader import ValLoader
from llmc_cli.evals.evaluate import HellaSwag, evaluate_loss
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.files import DataError
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.shards import write_shard
from llmc_cli.formats.sources import export_run
from llmc_cli.inference.loading import load_model
from llmc_cli.models import gpt2, llama3

V = 512
GPT2_CFG = gpt2.GPT2Config(block_size=32, vocab_size=V, n_layer=1, n_head=2, n_embd=16)
LLAMA_CFG = llama3.Llama3Config(block_size=32, vocab_size=V, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                                multiple_of=16, ffn_dim_multiplier=None, rope_scaling=None)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same ids as a GPT-2 and a Llama 3 eval file and val shard, and three checkpoints: an llm.c GPT-2 .bin
    (gpt2), a Llama run recording llama3, and a Llama run recording gpt2 (a Llama trained on GPT-2 shards)."""
    d = tmp_path_factory.mktemp("eval_tok")
    rng = np.random.default_rng(0)
    exs = [{"label": i % 4, "ctx_tokens": rng.integers(0, V, 5).tolist(),
            "ending_tokens": [rng.integers(0, V, 1 + j).tolist() for j in range(4)]} for i in range(3)]
    tokens = np.tile(rng.integers(0, V, 40), 20)
    out = {}
    for tok in ("gpt2", "llama3"):
        out[f"hs_{tok}"] = write_evalfile(d / f"hs_{tok}.bin", exs, tokenizer=tok)
        (d / tok).mkdir()
        out[f"val_{tok}"] = write_shard(d / tok / f"{tok}_val_000000.bin", tokens, tokenizer=tok)
    write_model(d / "gpt2.bin", GPT2_CFG, gpt2.init_parameters(GPT2_CFG, 0))
    out["model_gpt2"] = d / "gpt2.bin"
    for tok in ("gpt2", "llama3"):  # (no tokenizer.model: evaluating pre-tokenized data needs none)
        out[f"llama_{tok}"] = export_run(d / f"llama_{tok}", LLAMA_CFG, llama3.init_parameters(LLAMA_CFG, 1),
                                         tokenizer=tok)
    return out


MODELS = {"model_gpt2": "gpt2", "llama_gpt2": "gpt2", "llama_llama3": "llama3"}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_eval_scores_files_of_the_checkpoints_tokenizer(files, model):
    tok = MODELS[model]
    out = json.loads(run("eval", "--backend", "cpu", "--checkpoint", files[model], "--hellaswag", files[f"hs_{tok}"],
                         "--data", files[f"val_{tok}"].parent, "-b", 2, "-t", 16, "--json").stdout)
    assert out["hellaswag_examples"] == 3 and 0 <= out["hellaswag_acc_norm"] <= 1 and 0 < out["loss"] < 20


@pytest.mark.parametrize("model", sorted(MODELS))
def test_eval_refuses_files_of_another_tokenizer(files, model):
    mine = MODELS[model]
    other = "llama3" if mine == "gpt2" else "gpt2"
    ev = ["eval", "--backend", "cpu", "--checkpoint", files[model], "-b", 2, "-t", 16]
    hs = files[f"hs_{other}"]
    msg = one_line_error(run(*ev, "--hellaswag", hs, ok=False), f"--hellaswag: {hs}: tokenized with {other}, but "
                         f"the checkpoint {files[model]} uses the {mine} tokenizer")
    assert f"llmc tokenize hellaswag --tokenizer {mine}" in msg
    shard = files[f"val_{other}"]
    one_line_error(run(*ev, "--data", shard.parent, ok=False),
                   f"--data: {shard}: tokenized with {other}, but the checkpoint {files[model]} uses the {mine} "
                   "tokenizer")
    # with a good file beside the bad one: refused all the same, before anything is scored
    r = run(*ev, "--data", shard.parent, "--hellaswag", files[f"hs_{mine}"], "--json", ok=False)
    one_line_error(r, str(shard))
    # a Hugging Face directory of the model says the same (its config.json records the tokenizer)
    if model.startswith("llama"):
        run("convert", files[model], files[model].parent / f"{model}_hf")
        one_line_error(run("eval", "--backend", "cpu", "--checkpoint", files[model].parent / f"{model}_hf",
                           "--hellaswag", hs, ok=False), f"tokenized with {other}", f"uses the {mine} tokenizer")


def test_python_api_refuses_another_tokenizer(files, cpu):
    """load_model records the checkpoint's tokenizer on the model; HellaSwag and evaluate_loss check it."""
    model = load_model(files["llama_llama3"], cpu, B=2, T=16)
    assert model.tokenizer == "llama3" and load_model(files["model_gpt2"], cpu).tokenizer == "gpt2"
    hs = HellaSwag(files["hs_gpt2"])  # (the model is not known yet: the file alone reads)
    assert hs.tokenizer == "gpt2"
    with pytest.raises(DataError, match=f"^{files['hs_gpt2']}: tokenized with gpt2, but the model uses the llama3 "
                                        "tokenizer"):
        hs.evaluate(model)
    with pytest.raises(DataError, match=f"^{files['hs_gpt2']}: tokenized with gpt2, but the model uses the llama3"):
        HellaSwag(files["hs_gpt2"], tokenizer="llama3")
    loader = ValLoader(files["val_gpt2"], 2, 16, vocab_size=V)
    with pytest.raises(DataError, match=f"^{files['val_gpt2']}: tokenized with gpt2, but the model uses the llama3"):
        evaluate_loss(model, loader, 1)
    # the same files score the model of their tokenizer, and a model whose tokenizer is unknown (built by hand)
    assert 0 <= HellaSwag(files["hs_llama3"], tokenizer="llama3").evaluate(model).acc_norm <= 1
    assert evaluate_loss(model, ValLoader(files["val_llama3"], 2, 16), 1) > 0
    bare = llama3.Llama3(LLAMA_CFG, cpu, 2, 16, training=False)
    bare.load_parameters(ckpt.read_model_file(files["llama_llama3"] / "step_00000000" / "model.safetensors")[1])
    assert bare.tokenizer is None and evaluate_loss(bare, loader, 1) > 0


def test_training_refuses_eval_data_of_another_tokenizer(files, shards, tmp_path):
    """Evaluations during a run are of the run's tokenizer (its training data's): a HellaSwag file or val shards
    of another are refused before the first step, not when the first evaluation comes round."""
    tiny = ["train", "--backend", "cpu", "--model", "d2", "--n-embd", 16, "-b", 2, "-t", 16, "--steps", 2,
            "--val-every", 1, "--sample-every", 0, "--data", shards / "*train*.bin"]
    hs = files["hs_llama3"]
    one_line_error(run(*tiny, "--hellaswag", hs, "--hellaswag-every", 1, "--log", tmp_path / "a.jsonl", ok=False),
                   f"--hellaswag: {hs}: tokenized with llama3, but the run uses the gpt2 tokenizer")
    assert not (tmp_path / "a.jsonl").exists() or "loss" not in (tmp_path / "a.jsonl").read_text()
    run(*tiny, "--hellaswag", files["hs_gpt2"], "--hellaswag-every", 1)
    # Llama 3 training shards and GPT-2 val shards, on a model whose vocabulary holds both
    big = llama3.Llama3Config(**{**LLAMA_CFG.__dict__, "vocab_size": 128256, "tie_embeddings": True})
    init = export_run(tmp_path / "init", big, llama3.init_parameters(big, 2), tokenizer="llama3")
    l3 = tmp_path / "l3"
    write_shard(l3 / "l3_train_000001.bin", np.arange(2000) % 1000, tokenizer="llama3")
    val = files["val_gpt2"]
    args = ["train", "--backend", "cpu", "--init", init, "-b", 2, "-t", 16, "--steps", 1, "--val-every", 1,
            "--sample-every", 0, "--data", l3 / "l3_train_000001.bin"]
    one_line_error(run(*args, "--val-data", val, ok=False),
                   f"--val-data: {val}: tokenized with gpt2, but the run uses the llama3 tokenizer")
    run(*args, "--val-data", files["val_llama3"], "--log", tmp_path / "b.jsonl")
    assert any("val_loss" in json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines())


def test_hellaswag_tokenized_with_the_models_own_tokenizer_scores(tmp_path):
    """`llmc tokenize hellaswag --checkpoint RUN` then `llmc eval --hellaswag`: a Llama run scores the file made
    with its tokenizer.model and refuses llm.c's GPT-2 file of the same examples."""
    import base64
    ranks = tmp_path / "tokenizer.model"  # a byte-level Llama-3-style ranks file (offline)
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    run_dir = export_run(tmp_path / "run", LLAMA_CFG, llama3.init_parameters(LLAMA_CFG, 3), tokenizer="llama3",
                         tokenizer_file=ranks)
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("".join(json.dumps({"ctx": f"ctx {i}", "label": i % 4, "endings": ["a", "bb", "c d", "e"]}) + "\n"
                           for i in range(3)))
    out = tmp_path / "hs"
    run("tokenize", "hellaswag", "--local", src, "--out-dir", out, "--checkpoint", run_dir)
    run("tokenize", "hellaswag", "--local", src, "--out-dir", out)
    ev = ["eval", "--backend", "cpu", "--checkpoint", run_dir, "--json"]
    assert json.loads(run(*ev, "--hellaswag", out / "hellaswag_val_llama3.bin").stdout)["hellaswag_examples"] == 3
    one_line_error(run(*ev, "--hellaswag", out / "hellaswag_val.bin", ok=False),
                   f"{out / 'hellaswag_val.bin'}: tokenized with gpt2", "uses the llama3 tokenizer")
