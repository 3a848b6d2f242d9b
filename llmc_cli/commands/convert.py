"""`llmc convert`: a model from any source to an llm.c .bin, llmc's Llama .safetensors, a Hugging Face directory
or a new run directory."""

from __future__ import annotations

import click

from llmc_cli.formats.convert import convert as convert_model
from llmc_cli.formats.files import CheckpointError


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
        cfg, kind, what = convert_model(src, dst, bf16=dtype == "bf16", to=to, force=force)
    except CheckpointError as e:
        fail(str(e))
    from llmc_cli.commands.console import printable  # (names that hold a newline or an escape: one line)
    console.print(printable(f"{src} ({kind}, L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}) -> "
                            f"{dst}: {what}, {dtype}"), markup=False)
