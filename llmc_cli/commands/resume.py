"""`llmc train --out RUN --resume` is the run it continues: the options it takes from the run directory, and the
command line that resumes a run (said when a run stops) or starts it on other ranks."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import click
from click.core import ParameterSource

from llmc_cli.commands.console import fail
from llmc_cli.commands.train_config import CONFIG_FILE, checked_value, is_llmcs_config, parse_toml
from llmc_cli.formats import checkpoint as ckpt

GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)  # an option typed for this run
LAUNCH_OPTIONS = ("gpus", "procs")
_OPTIM_KEYS = ("lr", "beta1", "beta2", "weight_decay", "grad_clip")
_RUN_DIR_PATHS = ("log", "tensorboard")  # what a run writes, and may write inside its run directory


def child_args(ctx: click.Context, drop=LAUNCH_OPTIONS) -> list[str]:
    """The subcommand and the options given explicitly (from click's context), less `drop`."""
    chain, c = [], ctx
    while c is not None and c.parent is not None:
        chain.append(c.info_name)
        c = c.parent
    parts = list(reversed(chain))
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name is None or p.name in drop:
            continue
        if ctx.get_parameter_source(p.name) not in GIVEN:
            continue
        val = ctx.params.get(p.name)
        flag = max(p.opts, key=len)
        if p.is_flag:
            if val:
                parts.append(flag)
            elif p.secondary_opts:
                parts.append(max(p.secondary_opts, key=len))
        elif p.multiple:
            for v in val or ():
                parts += [flag, str(v)]
        elif val is not None:
            parts += [flag, str(val)]
    return parts


def resume_command(ctx: click.Context) -> str:
    """The command line that was run (the options given explicitly) with --out and --resume: a resume takes every
    other option from the run directory, those a --config file gave included."""
    parts = ["llmc"] + child_args(ctx, drop=())
    if "--out" not in parts and ctx.params.get("out"):
        parts += ["--out", str(ctx.params["out"])]
    if "--resume" not in parts:
        parts.append("--resume")
    return shlex.join(parts)


def has_checkpoint(out: str | None) -> bool:
    """Whether the run directory holds a checkpoint to resume (an abort before the first one has none)."""
    if not out:
        return False
    try:
        ckpt.resolve_checkpoint(out, note_as=None)
        return True
    except (ckpt.CheckpointError, OSError):
        return False


def _path_inside(path: str, folder) -> Path | None:
    """`path` relative to `folder` when it lies inside it (as written: both as the run recorded them), else None."""
    if not isinstance(folder, str) or not folder:
        return None
    p, d = Path(os.path.normpath(path)), Path(os.path.normpath(folder))
    if p.is_absolute() != d.is_absolute() or p == d:
        return None
    try:
        return p.relative_to(d)
    except ValueError:
        return None


def _recorded(out: str) -> tuple[dict, dict] | None:
    """What the run in `out` recorded, as {option: (value, the file that says it)}, and its own args: its newest
    complete checkpoint's state.json first, then OUT/config.toml for what a checkpoint does not hold (the backend,
    its device, options and dtype). None where there is no checkpoint (the trainer says what is wrong)."""
    try:
        step = ckpt.resolve_checkpoint(out, note_as=None).parent  # (the trainer's read says a fallback)
        args = ckpt.read_run_state(step / "state.json").get("args") or {}
    except (ckpt.CheckpointError, OSError):
        return None
    state = step / "state.json"
    optim = args.get("optim") or {}
    if not isinstance(optim, dict):
        fail(f"--resume: {state}: args 'optim' must be a JSON object (got {optim!r:.80}), not what llmc wrote (a "
             "damaged run state)")
    values = {k: (v, state) for k, v in (dict(args) | {k: v for k, v in optim.items() if k in _OPTIM_KEYS}).items()}
    config = Path(out) / CONFIG_FILE
    if is_llmcs_config(config):
        try:
            toml = parse_toml(str(config))
        except ValueError as e:
            fail(f"--resume: {e} (a damaged run state; fix it or delete {CONFIG_FILE})")
        for key, v in toml.items():
            values.setdefault(key.replace("-", "_"), (v, config))
    return values, args


def options_from_run(o: dict, ctx: click.Context) -> list[str]:
    """`--resume` continues the run as it was: every option not given on this command line takes the value the
    run recorded (options given must agree where they fix the model or the step, which the trainer checks).
    Returns the options taken, as flags, for the log."""
    recorded = _recorded(o["out"])
    if recorded is None:
        return []
    values, args = recorded
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    taken = []
    for key, (value, where) in values.items():
        if key in ("optim", "resume", "out") or key not in o or key not in options or value is None:
            continue
        if ctx.get_parameter_source(key) in GIVEN:
            continue  # (given here: what the run recorded is not used, damaged or not)
        if key == "zero" and type(value) is int:
            value = str(value)
        try:  # checked as the command line's own values are: a damaged state.json's NaN or -5 is refused here
            value = checked_value(options[key], key, value, ctx)
        except ValueError as e:
            fail(f"--resume: {where}: its recorded {e} (a damaged run state; give --{key.replace('_', '-')} to "
                 "override it)")
        if key in _RUN_DIR_PATHS and (inside := _path_inside(value, args.get("out"))) is not None:
            # a file of the run directory itself (its log.jsonl): that of the directory resumed now, which may be a
            # copy or a move of the one recorded; the original (another run's, or gone) is never trimmed or added to
            value = str(Path(o["out"]) / inside)
        if key == "log" and Path(value) == Path(o["out"]) / "log.jsonl":
            continue  # the run directory's own log: what a run with --out uses anyway
        if o[key] != value:
            o[key] = value
            ctx.params[key] = value  # (what config.toml records: the options in effect, not click's defaults)
            flag = "--" + key.replace("_", "-")
            taken.append(flag if value is True else " ".join(f"{flag} {v}" for v in value)
                         if isinstance(value, tuple) else f"{flag} {value}")
    return taken
