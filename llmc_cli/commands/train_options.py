"""`llmc train`'s options checked once, before any rank starts or anything is written, and turned into the run's
TrainArgs: the paths it reads and writes, --init beside --model, and what the options say together."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import click
from click.core import ParameterSource

from llmc_cli.commands.console import fail, refuse_empty_paths
from llmc_cli.commands.options import flag_name
from llmc_cli.commands.train_config import CONFIG_FILE, check_config_target
from llmc_cli.formats.evalfile import read_evalfile
from llmc_cli.formats.files import DataError
from llmc_cli.formats.rundir import LOCK_FILE, RunDirError, check_out, check_outside_checkpoints
from llmc_cli.formats.runlog import LogError, check_log
from llmc_cli.formats.sources import load_config_any
from llmc_cli.models.families import family_for, family_of
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import SHAPE_OPTIONS, TrainArgs, TrainError, check_init_shape, check_together, model_config

_FIELDS = {f.name for f in fields(TrainArgs)}
_INPUTS = ("data", "val_data")  # recorded absolute: a resume from another working directory reads the same shards


def check_inputs(o: dict) -> None:
    """No path given as '' (taken as left out, or as the working directory); a --hellaswag file readable now, so a
    bad one is one line before anything runs, not after the banner."""
    refuse_empty_paths(**{k: o.get(k) for k in ("out", "init", "log", "tensorboard", "hellaswag", "val_data", "data",
                                                 "init_file")})
    if o["hellaswag"]:
        try:
            read_evalfile(o["hellaswag"])
        except DataError as e:
            fail(f"--hellaswag: {e}")


def train_args(o: dict, ctx: click.Context, ranks: int) -> TrainArgs:
    """The options as the run's TrainArgs: the shard paths made absolute (in what config.toml records too), the log
    OUT/log.jsonl unless given, and what the options say together checked for `ranks` ranks."""
    for key in _INPUTS:  # joined to the working directory, not normalised: link/../b need not be ./b
        if isinstance(o[key], str) and o[key] and not os.path.isabs(o[key]):
            o[key] = ctx.params[key] = os.path.join(os.getcwd(), o[key])
    if o["out"] and not o["log"]:  # a run directory keeps its own log, so `llmc plot RUN` finds it
        o["log"] = str(Path(o["out"]) / "log.jsonl")
    optim = AdamWConfig(lr=o["lr"], beta1=o["beta1"], beta2=o["beta2"], weight_decay=o["weight_decay"],
                        grad_clip=o["grad_clip"])
    given = {k: v for k, v in o.items() if k in _FIELDS}
    args = TrainArgs(**{**given, "data": o["data"] or "", "zero": int(o["zero"]), "optim": optim})
    try:
        check_together(args, ranks, flag_name)
    except TrainError as e:
        fail(str(e))
    return args


def check_init_model(args: TrainArgs, ctx: click.Context) -> None:
    """--init gives the model, weights and shape: a --model given beside it that names another model (a Llama preset
    for GPT-2 weights, d6 for d12's) would be ignored silently, a run of another model than the one asked for. Only a
    --model typed on this command line: a --config or a run's config.toml records the default beside --init."""
    if not args.init or args.resume or ctx.get_parameter_source("model") is not ParameterSource.COMMANDLINE:
        return
    try:
        have = load_config_any(args.init)
    except (ValueError, OSError):
        return  # (what is wrong with --init is said where its weights are read)
    given = {k: getattr(args, k) for k in SHAPE_OPTIONS}
    try:
        family_for(args.model)
        check_init_shape(args.init, have, given)  # (a shape option that differs: said as training says it)
    except ValueError as e:
        fail(str(e))
    try:  # the preset with the shape options given, which match --init's now
        want = model_config(TrainArgs(data="", model=args.model, **{k: v for k, v in given.items()
                                                                    if k != "vocab_size"}))
    except ValueError:  # (d6's 6 heads over --init's 64 channels: not --init's model either)
        want = None
    shape = lambda c: (family_of(c).label, *(getattr(c, k, None) for k in ("n_layer", "n_head", "n_embd")))  # noqa: E731
    if want is None or shape(have) != shape(want):
        label, L, NH, C = shape(have)
        fail(f"--model {args.model}: --init {args.init} is another model ({label}, {L} layers, {NH} heads, {C} "
             "channels) and gives the model, its shape and its weights; leave --model out")


def check_outputs(args: TrainArgs) -> None:
    """What the run writes, said before any rank starts (the trainer checks again under the run directory's lock):
    a run directory is continued only with --resume, and its config.toml replaced only when llmc wrote it; the log
    is none of the run directory's own files; --tensorboard is a directory outside the checkpoints."""
    try:
        if args.out:
            check_out(args.out, args.resume)
            check_config_target(Path(args.out) / CONFIG_FILE)
        if args.log:
            check_log(args.log)
            if args.out and os.path.realpath(args.log) in {os.path.realpath(Path(args.out) / n)
                                                           for n in (LOCK_FILE, "latest", CONFIG_FILE)}:
                fail(f"--log {args.log}: a file of the run directory's own (its lock, `latest` or {CONFIG_FILE}); "
                     "give another path, or leave --log out for OUT/log.jsonl")
        if args.tensorboard:
            check_outside_checkpoints(args.tensorboard, "--tensorboard")
            if os.path.lexists(args.tensorboard) and not os.path.isdir(args.tensorboard):  # (before --out is made)
                fail(f"--tensorboard {args.tensorboard}: not a directory; give a directory llmc may create or "
                     "write event files in")
    except (RunDirError, LogError) as e:
        fail(str(e))
