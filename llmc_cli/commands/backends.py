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
    from llmc_cli.registry import discover, one_line
    found = discover()
    if prepare:
        _prepare(found, as_json)
        return
    same = _same_names(found)
    if as_json:
        click.echo(json_text([{"name": p.name, "usable": p.usable, "reason": one_line(p.reason),
                                "distribution": p.distribution, **_devices(p),
                                "options": _options(p), "same_name": same.get(p.name, [])}
                               for p in found], indent=1))
        return
    table = Table(title="llmc backends")
    for col in ("backend", "usable", "device / reason", "distribution"):
        table.add_column(col)
    for p in found:
        table.add_row(escape(p.name), "[green]yes[/]" if p.usable else "[red]no[/]", escape(one_line(p.reason)),
                      escape(p.distribution))
    console.print(table)
    for name in dict.fromkeys(p.name for p in found if p.name in same):
        dists = [p.distribution for p in found if p.name == name]
        console.print(f"[yellow]{len(dists)} plugins are registered as '{escape(name)}' ({escape(', '.join(dists))}): "
                      f"--backend {escape(name)} takes the first usable one listed[/]")
    if show_options:
        opts = Table(title="backend options (--backend-opt KEY=VALUE)")
        for col in ("backend", "option", "values, default, effect"):
            opts.add_column(col)
        for p in found:
            for name, text in _options(p).items():
                opts.add_row(escape(p.name), escape(name), escape(text))
        console.print(opts)


def _same_names(found) -> dict[str, list[str]]:
    """name -> the distributions registering it, for the names more than one plugin is registered as (the one a
    --backend NAME takes is the first usable: say that there are two rather than show one silently)."""
    by: dict[str, list[str]] = {}
    for p in found:
        by.setdefault(p.name, []).append(p.distribution)
    return {n: d for n, d in by.items() if len(d) > 1}


def _options(p) -> dict[str, str]:
    """The plugin's declared options as one-line strings (discovery checked their types; a stand-in PluginInfo
    a tool built may hold anything)."""
    from llmc_cli.registry import one_line
    opts = getattr(p.plugin, "options", None) if p.plugin is not None else None
    if not isinstance(opts, dict):
        return {}
    return {one_line(k, 80): one_line(v, 2000) for k, v in opts.items()}


def _devices(p) -> dict:
    """{"devices": [names]} for a usable plugin, plus "devices_error" (one line) when devices() failed or answered
    something other than a list of names."""
    from llmc_cli.registry import one_line, quiet_stdout
    if not (p.plugin and p.usable):
        return {"devices": []}
    try:
        with quiet_stdout():
            got = p.plugin.devices()
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  (a plugin's failure is its row's, not the command's)
        return {"devices": [], "devices_error": f"devices() failed: {type(e).__name__}: {one_line(e)}"}
    if not isinstance(got, (list, tuple)):
        return {"devices": [], "devices_error": f"devices() must return a list of str, not {type(got).__name__}"}
    return {"devices": [one_line(d) for d in got]}


def _prepare(found, as_json: bool) -> None:
    """Each usable backend's `prepare()`, one line each; a failure is reported and the others still run."""
    import time

    from llmc_cli.commands.console import err_console
    from llmc_cli.registry import one_line, quiet_stdout
    out, failed = [], False
    for p in found:
        if not (p.usable and p.plugin):
            out.append({"name": p.name, "prepared": False, "line": f"skipped: {one_line(p.reason)}"})
            continue
        t0 = time.monotonic()
        with err_console.status(f"preparing {escape(p.name)} ..."), quiet_stdout():
            try:
                line, ok = one_line(p.plugin.prepare()), True
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as e:  # noqa: BLE001  (one backend's failure, SystemExit too, is its line)
                line, ok = f"failed: {type(e).__name__}: {one_line(e)}", False
        failed |= not ok
        out.append({"name": p.name, "prepared": ok, "line": line, "seconds": round(time.monotonic() - t0, 2)})
    if as_json:
        click.echo(json_text(out, indent=1))
    else:
        for r in out:
            took = f" ({r['seconds']:.1f} s)" if "seconds" in r else ""
            console.print(f"{escape(r['name'])}: {escape(r['line'])}{took}")
    if failed:
        raise SystemExit(1)
