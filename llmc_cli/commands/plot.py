"""`llmc plot`: training curves from run logs (the JSON lines `llmc train --log` writes) into one PNG.

Train records carry step, loss, norm, lr, ms, tok_per_s; validation records step and val_loss; HellaSwag records
hellaswag_acc_norm. matplotlib is optional (`pip install 'llmc[plot]'`).
"""

from __future__ import annotations

import click

from llmc_cli.charts import PlotError, default_png, plot_runs
from llmc_cli.commands.options import Real


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", default=None, type=click.Path(),
              help="PNG file to write, a .png name (the picture is always a PNG)  [default: RUN/plot.png for one "
                   "run, ./plot.png for several]")
@click.option("--x", "x", type=click.Choice(["step", "tokens"]), default="step", show_default=True,
              help="Horizontal axis.")
@click.option("--smooth", type=Real(0, 1, max_open=True), default=0.0, show_default=True,
              help="EMA factor in [0, 1) applied to train loss, grad norm and tok/s (0 = raw).")
def plot(runs, out, x, smooth) -> None:
    """Plot loss (train and val), learning rate, grad norm and tok/s of one or more runs into a PNG.
    Each RUN is a run directory holding log.jsonl or a .jsonl log written by `llmc train --log`.

    \b
    Example:
      llmc plot checkpoints/run1 checkpoints/run2/log.jsonl --smooth 0.9 --x tokens --out curves.png
    """
    from llmc_cli.commands.console import console, fail, printable
    try:
        path = plot_runs(list(runs), out if out is not None else default_png(list(runs)), x, smooth)
    except PlotError as e:
        fail(str(e))
    console.print(printable(f"wrote {path}"), markup=False)
