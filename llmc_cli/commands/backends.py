"""`llmc backends`: what is installed and whether it can run here."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from llmc_cli.commands.console import console, json_text


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--options", "show_options", is_flag=True,
              help="Also list each backend's settings (give them as --backend-opt KEY=VALUE to train, sample, "
                   "eval and bench).")
@click.option("--prepare", is_flag=True,
              help="Compile each usable backend's kernels into its cache now (install.sh does this), so that the "
                   "first run starts at once.")
def backends(as_json: bool, show_options: bool, prepare: bool) -> None:
    """List installed backends, whether each can run here, and why not.

    \b
    Example:
      llmc backends --json
      llmc backends --options
      llmc backends --prepare
    """
    from llmc_cli.registry import discover
    found = discover()
    if prepare:
        _prepare(found, as_json)
        return
    if as_json:
        click.echo(json_text([{"name": p.name, "usable": p.usable, "reason": p.reason,
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


def _prepare(found, as_json: bool) -> None:
    """Each usable backend's `prepare()`, one line each; a failure is reported and the others still run."""
    import time
    from llmc_cli.commands.console import err_console
    out, failed = [], False
    for p in found:
        if not (p.usable and p.plugin):
            out.append({"name": p.name, "prepared": False, "line": f"skipped: {p.reason}"})
            continue
        t0 = time.monotonic()
        with err_console.status(f"preparing {p.name} ..."):
            try:
                line, ok = p.plugin.prepare(), True
            except Exception as e:  # noqa: BLE001  (one backend's failure is its line, not the command's end)
                line, ok = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False
        failed |= not ok
        out.append({"name": p.name, "prepared": ok, "line": line, "seconds": round(time.monotonic() - t0, 2)})
    if as_json:
        click.echo(json_text(out, indent=1))
    else:
        for r in out:
            took = f" ({r['seconds']:.1f} s)" if "seconds" in r else ""
            console.print(f"{r['name']}: {escape(r['line'])}{took}")
    if failed:
        raise SystemExit(1)
