"""`llmc backends`: what is installed and whether it can run here."""

from __future__ import annotations

import json

import click
from rich.markup import escape
from rich.table import Table

from llmc_cli.commands.console import console


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--options", "show_options", is_flag=True,
              help="Also list each backend's settings (give them as --backend-opt KEY=VALUE to train, sample, "
                   "eval and bench).")
def backends(as_json: bool, show_options: bool) -> None:
    """List installed backends, whether each can run here, and why not.

    \b
    Example:
      llmc backends --json
      llmc backends --options
    """
    from llmc_cli.registry import discover
    found = discover()
    if as_json:
        click.echo(json.dumps([{"name": p.name, "usable": p.usable, "reason": p.reason,
                                "distribution": p.distribution,
                                "devices": p.plugin.devices() if (p.plugin and p.usable) else [],
                                "options": dict(getattr(p.plugin, "options", {}) or {})}
                               for p in found], indent=1))
        return
    table = Table(title="llmc backends")
    for col in ("backend", "usable", "device / reason", "distribution"):
        table.add_column(col)
    for p in found:
        table.add_row(p.name, "[green]yes[/]" if p.usable else "[red]no[/]", escape(p.reason), p.distribution)
    console.print(table)
    if show_options:
        opts = Table(title="backend options (--backend-opt KEY=VALUE)")
        for col in ("backend", "option", "values, default, effect"):
            opts.add_column(col)
        for p in found:
            for name, text in (getattr(p.plugin, "options", {}) or {}).items():
                opts.add_row(p.name, name, escape(text))
        console.print(opts)
