"""`llmc eval`: mean loss over shards and HellaSwag accuracy of any checkpoint."""

from __future__ import annotations

from contextlib import nullcontext

import click
import numpy as np
from click.core import ParameterSource
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmc_cli.commands.console import (
    BACKEND_OPT_HELP,
    DTYPES,
    backend_options,
    console,
    err_console,
    fail,
    json_text,
    make_backend,
    refuse_empty_paths,
)
from llmc_cli.commands.options import COUNT, POSITIVE
from llmc_cli.commands.sample import load_for_inference
from llmc_cli.data.loader import ValLoader
from llmc_cli.evals import evaluate  # (as a module: tests put a spy in for evaluate_loss)
from llmc_cli.formats.files import CheckpointError, DataError
from llmc_cli.formats.sources import load_config_any, tokenizer_name_for
from llmc_cli.models.base import check_seq_len
from llmc_cli.training.args import TrainArgs

_VAL_BATCHES = TrainArgs(data="").val_batches  # what training validates on: the same first batches, the same loss


class _Quiet:
    """The progress bar's calls, doing nothing (no terminal, or JSON for a machine)."""

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass


def _progress(as_json: bool):
    """A progress bar on stderr when it is a terminal (and the output is not JSON for a machine)."""
    if as_json or not err_console.is_terminal:
        return nullcontext(_Quiet())
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)


def _check_options(data, hellaswag) -> None:
    """Something to evaluate, and --batches / --hellaswag-limit only with what they limit."""
    if data is None and hellaswag is None:
        fail("nothing to evaluate: give --data SHARDS and/or --hellaswag FILE")
    ctx = click.get_current_context()
    for option, name, needs, given in (("--batches", "batches", "--data", data),
                                       ("--hellaswag-limit", "hellaswag_limit", "--hellaswag", hellaswag)):
        if given is None and ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:  # (else ignored unsaid)
            fail(f"{option}: only with {needs}; give {needs} too, or leave {option} out")


def _run(model, loader, batches: int, hs, as_json: bool) -> tuple[dict, int, int]:
    """(scores, batches of loss averaged, HellaSwag examples left unscored for a NaN loss)."""
    result, used, unscored = {}, 0, 0
    try:  # (a model whose arithmetic overflows has a NaN loss, said below once, not numpy's warnings per batch)
        with _progress(as_json) as bar, np.errstate(over="ignore", invalid="ignore"):
            if loader is not None:
                used = evaluate.eval_batches(loader, batches)
                task = bar.add_task("loss", total=used)
                result["loss"] = evaluate.evaluate_loss(model, loader, batches,
                                                        on_batch=lambda done, total: bar.update(task, completed=done))
            if hs is not None:
                task = bar.add_task("hellaswag", total=len(hs.examples))
                scored = hs.evaluate(model, on_example=lambda done, total: bar.update(task, completed=done))
                result |= scored.as_dict()
                unscored = scored.unscored
    except (DataError, ValueError) as e:
        fail(str(e))
    return result, used, unscored


def _report(result: dict, used: int, unscored: int, hs, checkpoint: str, B: int, T: int, as_json: bool) -> None:
    what = (["a loss that is not finite"] if not np.isfinite(result.get("loss", 0.0)) else []) + (
        [f"NaN losses on {unscored} of {len(hs.examples)} HellaSwag examples (so no accuracy)"] if unscored else [])
    if what:  # (exit 0 as for any score: the numbers say what the model does, this line why; JSON has null)
        click.echo(f"warning: --checkpoint: {checkpoint}: {' and '.join(what)}: the model's weights or activations "
                   "overflow", err=True)
    if as_json:
        click.echo(json_text(result | ({"batches": used} if "loss" in result else {})))
        return
    if "loss" in result:
        console.print(f"loss {result['loss']:.6f} over {used} batches of B={B} T={T} ({used * B * T:,} tokens)")
    if hs is not None:
        console.print(f"hellaswag acc_norm {result['hellaswag_acc_norm']:.4f} acc {result['hellaswag_acc']:.4f} "
                      f"({result['hellaswag_examples']} examples)")


@click.command(name="eval")
@click.option("--checkpoint", required=True,
              help="Run directory, step directory, llm.c .bin, or Hugging Face directory.")
@click.option("--data", default=None, help="Shards to evaluate on: a directory (its NAME_val_* shards) or a quoted "
              "glob, e.g. 'datasets/shakespeare/*val*.bin'.")
@click.option("--batches", type=COUNT, default=_VAL_BATCHES, show_default=True,
              help="Batches to average, from the start; 0 = all of them, once. The default is training's "
                   "--val-batches default, so that eval and training's val loss agree at the same -b and -t.")
@click.option("--hellaswag", default=None, type=click.Path(),
              help="HellaSwag eval file (`llmc tokenize hellaswag`, with the checkpoint's tokenizer): report acc "
                   "and acc_norm.")
@click.option("--hellaswag-limit", type=COUNT, default=0, show_default=True,
              help="Score only the first N HellaSwag examples (0 = all).")
@click.option("-b", "--batch-size", type=POSITIVE, default=4, show_default=True)
@click.option("-t", "--seq-len", type=POSITIVE, default=64, show_default=True)
@click.option("--backend", default="auto", show_default=True)
@click.option("--device", default=None)
@click.option("--backend-opt", "backend_opt", multiple=True, metavar="KEY=VALUE", help=BACKEND_OPT_HELP)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help='Print {"loss": ..., "batches": ..., "hellaswag_acc": ..., "hellaswag_acc_norm": ...} as JSON '
                   '("batches": how many the loss averaged).')
def eval_cmd(checkpoint, data, batches, hellaswag, hellaswag_limit, batch_size, seq_len, backend, device, backend_opt,
             dtype, as_json) -> None:
    """Mean loss of a model over the first batches of some shards, in order, and/or its HellaSwag accuracy
    (acc_norm: the ending with the lowest mean loss per token wins, as llm.c and lm-eval-harness score it).
    Shards and eval files record their tokenizer; one of another tokenizer than the checkpoint's is refused.

    \b
    Example:
      llmc eval --checkpoint checkpoints/shakespeare --data 'datasets/shakespeare/*val*.bin' --json
      llmc eval --checkpoint checkpoints/gpt2 --hellaswag datasets/hellaswag/hellaswag_val.bin
    """
    refuse_empty_paths(("checkpoint",), checkpoint=checkpoint, data=data, hellaswag=hellaswag)
    _check_options(data, hellaswag)
    # the data is checked against what the checkpoint records before its weights load (seconds for a large one):
    # a file of another tokenizer than the model's is one line now, not a score on ids that mean other words
    try:
        cfg, tok = load_config_any(checkpoint), tokenizer_name_for(checkpoint)
    except CheckpointError as e:
        fail(f"--checkpoint: {e}")
    except ValueError as e:
        fail(str(e))
    whose = f"the checkpoint {checkpoint}"
    hs = loader = None
    if hellaswag is not None:
        try:
            hs = evaluate.HellaSwag(hellaswag, hellaswag_limit, tokenizer=tok, whose=whose)
        except DataError as e:
            fail(f"--hellaswag: {e}")
    be = make_backend(backend, device, dtype, backend_options(backend_opt))
    if data is not None:
        try:
            loader = ValLoader(data, batch_size, seq_len, vocab_size=cfg.vocab_size)
            evaluate.check_shards_tokenizer(loader, tok, whose)
        except DataError as e:
            fail(f"--data: {e}")
        try:
            check_seq_len(seq_len, cfg.block_size, "-t")
        except ValueError as e:
            fail(str(e))
    model = load_for_inference(checkpoint, be, batch_size if data else 1, seq_len if data else 1)
    result, used, unscored = _run(model, loader, batches, hs, as_json)
    _report(result, used, unscored, hs, checkpoint, batch_size, seq_len, as_json)
