"""A GPT-2 exported to a Hugging Face directory carries its tokenizer: transformers' AutoTokenizer (offline)
encodes exactly as llmc does, and pipeline('text-generation') on the directory continues a prompt, greedily the
same text as `llmc sample --temperature 0`."""

from __future__ import annotations

import numpy as np
import pytest

from llmc_test_support import run

transformers = pytest.importorskip("transformers", reason="the test oracle for exports: pip install transformers")


def test_exported_gpt2_works_in_transformers_offline(tmp_path, monkeypatch):
    from llmc_cli.data.tokenizer import load_tokenizer
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.models.gpt2 import init_parameters, preset
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    cfg = preset("d2", n_embd=64, block_size=128)
    flat = init_parameters(cfg, 3)
    flat += np.random.default_rng(4).normal(0, 0.3, flat.shape).astype(np.float32)  # a non-trivial distribution
    write_model(tmp_path / "m.bin", cfg, flat)
    run("convert", tmp_path / "m.bin", tmp_path / "hf")
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "config.json", "model.safetensors"):
        assert f in names, names

    ours = load_tokenizer("gpt2")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.vocab_size == 50257 and hf_tok.eos_token_id == 50256
    for text in ("ROMEO: Wherefore art thou?", "naïve café — 日本語 😀", "  spaces\n\nand\ttabs 12345 don't"):
        assert hf_tok.encode(text) == ours.encode(text), text

    gen = transformers.pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    out = gen("ROMEO:", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:"), out
    r = run("sample", "--backend", "cpu", "--checkpoint", tmp_path / "m.bin", "--prompt", "ROMEO:",
            "--max-new-tokens", 8, "--temperature", 0)
    assert r.stdout.strip() == out.strip(), (r.stdout, out)  # greedy: the same continuation


def test_exported_llama_tokenizer_json_encodes_like_llmc(tmp_path, monkeypatch):
    """A Llama 3 exported with its tokenizer.model gets tokenizer.json: transformers' fast tokenizer (offline)
    encodes as llmc's tiktoken does, with <|begin_of_text|> in front when asked for special tokens. A toy
    tokenizer stands in for Meta's: GPT-2's first 3,000 ranks in tiktoken's file format, under Llama 3's pattern."""
    import base64

    from llmc_cli.data.tokenizer import gpt2_ranks, load_tokenizer
    from llmc_cli.formats.hf_llama3 import export_hf
    from llmc_cli.models.llama3 import init_parameters, preset
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ranks = {t: r for t, r in gpt2_ranks().items() if r < 3000}
    toy = tmp_path / "tokenizer.model"
    toy.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    ours = load_tokenizer("llama3", toy)
    cfg = preset("llama3-tiny", vocab_size=ours.vocab_size)
    export_hf(tmp_path / "hf", cfg, init_parameters(cfg, 0), tokenizer="llama3", tokenizer_file=toy)
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "tokenizer.model").is_file()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("ROMEO: Wherefore art thou?", "naïve café — 日本語 😀 123456", "  spaces\n\n\tand don't WE'LL"):
        assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text), text
        assert hf_tok.encode(text) == ours.doc_prefix + ours.encode(text)
        assert hf_tok.decode(ours.encode(text)) == text


def test_llama_tokenizer_json_is_read_back(tmp_path):
    """A Hugging Face Llama directory with tokenizer.json and no tokenizer.model (as the hub ships them): llmc reads
    its ranks from tokenizer.json and tokenizes as with Meta's file."""
    import base64

    from llmc_cli.data.tokenizer import gpt2_ranks, load_tokenizer
    from llmc_cli.formats.hf_llama3 import export_hf
    from llmc_cli.formats.sources import tokenizer_for
    from llmc_cli.models.llama3 import init_parameters, preset
    ranks = {t: r for t, r in gpt2_ranks().items() if r < 1000}
    toy = tmp_path / "toy.model"
    toy.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    ours = load_tokenizer("llama3", toy)
    cfg = preset("llama3-tiny", vocab_size=ours.vocab_size)
    export_hf(tmp_path / "hf", cfg, init_parameters(cfg, 0), tokenizer="llama3", tokenizer_file=toy)
    (tmp_path / "hf" / "tokenizer.model").unlink()
    name, path = tokenizer_for(tmp_path / "hf")
    assert (name, path.name) == ("llama3", "tokenizer.json")
    back = load_tokenizer(name, path)
    text = "ROMEO: naïve café — 日本語 😀 don't 12345\n\n"
    assert back.encode(text) == ours.encode(text) and back.vocab_size == ours.vocab_size
    r = run("sample", "--backend", "cpu", "--checkpoint", tmp_path / "hf", "--prompt", "ROMEO:", "--max-new-tokens", 3)
    assert r.exit_code == 0 and r.stdout.startswith("ROMEO:"), r.output
