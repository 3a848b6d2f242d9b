"""`llmc convert`: a model from any source to an llm.c .bin, llmc's Llama .safetensors, a Hugging Face directory
or a new run directory."""

from __future__ import annotations

from pathlib import Path

import click

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.llmc_bin import VERSION_BF16
from llmc_cli.formats.llmc_bin import VERSION_FP32
from llmc_cli.formats.convert import _write_dir_atomically, check_destination
from llmc_cli.formats.hf_gpt2 import export_hf
from llmc_cli.formats.sources import export_run, load_model_any, tokenizer_for
from llmc_cli.models.gpt2 import GPT2Config


@click.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Precision of the written weights.")
@click.option("--to", "to", type=click.Choice(["auto", "run"]), default="auto", show_default=True,
              help="run = write DST as a new run directory (step_00000000/ holding the model, and 'latest'), "
                   "which --checkpoint and --init read; auto = by DST's name as described above.")
@click.option("--force", is_flag=True, help="Replace DST when it is an earlier llmc conversion (a model file or a "
                                            "Hugging Face model directory); anything else is never replaced.")
def convert(src: str, dst: str, dtype: str, to: str = "auto", force: bool = False) -> None:
    """Convert a GPT-2 or Llama 3 between llmc's files, a run directory (its latest checkpoint) and a Hugging
    Face directory. SRC is recognised by content. DST is an llm.c model file when it ends in .bin (GPT-2),
    llmc's Llama model file when it ends in .safetensors (usable with --checkpoint and --init), otherwise a
    Hugging Face directory (config.json + model.safetensors, sharded past 5 GiB; a Llama's tokenizer.model
    is copied along).

    \b
    Example:
      llmc convert checkpoints/shakespeare hf/shakespeare          # run dir -> Hugging Face
      llmc convert hf/shakespeare model.bin --dtype bf16           # Hugging Face -> llm.c (version 5)
      llmc convert hf/gpt2 checkpoints/gpt2 --to run                # Hugging Face -> run directory
      llmc convert hf/Llama-3.2-1B llama.safetensors               # Hugging Face Llama -> llmc
    """
    from llmc_cli.commands.console import console, fail
    try:
        check_destination(src, dst, force)
    except ckpt.CheckpointError as e:
        fail(f"DST: {e}")
    try:
        cfg, params, kind = load_model_any(src)
    except ckpt.CheckpointError as e:
        fail(f"SRC: {e}")
    llama = not isinstance(cfg, GPT2Config)
    tok_name, tok_file = "gpt2", None
    if llama:
        try:
            tok_name, tok_file = tokenizer_for(src)
        except ckpt.CheckpointError:  # a Llama 3 tokenizer that is not there: nothing to copy along
            tok_name = "llama3"
    bf16 = dtype == "bf16"
    d = Path(dst)
    try:
        if to == "run":
            export_run(d, cfg, params, bf16=bf16, tokenizer=tok_name, tokenizer_file=tok_file if llama else None)
            what = f"run directory ({ckpt.step_dir_name(0)}/{ckpt.model_file_name(cfg)}, latest; model only)"
        elif d.suffix in (".bin", ".safetensors"):
            if d.is_dir():
                fail(f"DST: {d} is a directory")
            if d.suffix == ".bin" and llama:
                fail(f"DST: {d}: llm.c's .bin holds GPT-2 only; write a Llama to a .safetensors file (llmc's "
                     f"format) or a directory (Hugging Face)")
            if d.suffix == ".safetensors" and not llama:
                fail(f"DST: {d}: write a GPT-2 to a .bin file (llm.c's format) or a directory (Hugging Face); "
                     f".safetensors files are llmc's Llama format")
            d.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_model_file(d, cfg, params, bf16=bf16, tokenizer=tok_name)
            what = (f"llm.c model file (version {VERSION_BF16 if bf16 else VERSION_FP32})" if not llama
                    else "llmc Llama model file")
        else:
            if d.exists() and not d.is_dir():
                fail(f"DST: {d} exists and is not a directory (name a model file with .bin or .safetensors)")
            if llama:
                from llmc_cli.formats.hf_llama3 import export_hf as export_llama
                _write_dir_atomically(d, lambda out: export_llama(out, cfg, params, bf16=bf16, tokenizer=tok_name,
                                                                  tokenizer_file=tok_file))
            else:
                _write_dir_atomically(d, lambda out: export_hf(out, cfg, params, bf16=bf16))
            what = "Hugging Face directory (config.json, model.safetensors)"
    except OSError as e:  # (the file that failed may be a temporary one beside DST: DST is what the user named)
        fail(f"DST: {d}: {e.strerror or e}")
    except ckpt.CheckpointError as e:
        fail(f"DST: {e}")
    console.print(f"{src} ({kind}, L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}) -> "
                  f"{dst}: {what}, {dtype}")
