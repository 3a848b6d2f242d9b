"""`llmc train`: options in, a Trainer run, one line out on failure; also the data-parallel launch and --dry-run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

if TYPE_CHECKING:  # (for an annotation)
    from llmc_cli.kernels import BackendPlugin

from llmc_cli.commands.console import (
    _RANK,
    BACKEND_OPT_HELP,
    DTYPES,
    backend_options,
    console,
    err_console,
    fail,
    make_backend,
    one_line,
    printable,
    refuse_empty_paths,
    when_stdout_closes,
)
from llmc_cli.commands.options import COUNT, POSITIVE, SEED, Real
from llmc_cli.models.base import RECOMPUTE
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs

_ARGS, _OPT = TrainArgs(data=""), AdamWConfig()  # the defaults live in the library, stated once
CONFIG_MAX_BYTES = 1 << 20  # a --config file larger than this is not a file of options


def _read_config_bytes(value: str, ctx: click.Context, param: click.Parameter) -> bytes:
    """--config's bytes: a regular file, or a pipe (`--config <(...)`) read until its writer closes it, as `cat`
    would; a device (/dev/zero never ends) or more than CONFIG_MAX_BYTES is not a file of options."""
    import os
    import stat
    fd = os.open(value, os.O_RDONLY | os.O_NONBLOCK)  # (looked at before reading: a device is refused unread)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise click.BadParameter(f"{value}: not a regular file (a TOML file of options)", ctx, param)
        if stat.S_ISFIFO(st.st_mode):  # a FIFO opened without blocking reads as empty until its writer comes
            os.close(fd)
            fd = -1
            fd = os.open(value, os.O_RDONLY)
        chunks, size = [], 0
        while size <= CONFIG_MAX_BYTES:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise click.BadParameter(f"{value}: more than {CONFIG_MAX_BYTES:,} bytes is not a file of options", ctx,
                                 param)
    finally:
        if fd >= 0:
            os.close(fd)


def _load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--config FILE.toml: its keys (option names, - or _) become this command's defaults, so flags given on the
    command line still win; a key that is not an option, or a value of the wrong kind, is one line naming it."""
    if value is None:
        return None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(_read_config_bytes(value, ctx, param).decode("utf-8"))
    except OSError as e:
        raise click.BadParameter(f"{value}: {e.strerror or e}", ctx, param) from None
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, bytes that are not UTF-8, "a = [[[[..." nested
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise click.BadParameter(f"{value}: not valid TOML ({why})", ctx, param) from None
    names = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    defaults, spelt = {}, {}
    for key, v in data.items():
        name = key.replace("-", "_")
        if name not in names or name == "config":
            raise click.BadParameter(f"{value}: {key!r} is not an option of `llmc train`", ctx, param)
        if name in spelt:  # (TOML refuses a key twice, but not `overfit-batch` beside `overfit_batch`: the last won)
            raise click.BadParameter(f"{value}: {spelt[name]!r} and {key!r} are the same option; give it once", ctx,
                                     param)
        spelt[name] = key
        opt = names[name]
        if opt.multiple and isinstance(v, str):  # one string for a list of one
            v = [v]
        try:
            _checked_value(opt, key, v, ctx)
        except ValueError as e:
            raise click.BadParameter(f"{value}: {e}", ctx, param) from None
        defaults[name] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _checked_value(opt: click.Option, key: str, v, ctx: click.Context):
    """A value for `opt` that came from a file (a --config TOML, a run's state.json), not from the command line,
    checked as click checks the command line's (its kind, then its type's range) and converted by that type;
    ValueError `KEY must be ...` otherwise, for the caller to prefix with the file's name."""
    if isinstance(v, (dict, list)) and not opt.multiple:
        raise ValueError(f"{key} must be a single value, not a {type(v).__name__}")
    if opt.multiple:  # a list of strings
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{key} must be a string or a list of strings, e.g. {key} = [\"threads=2\"]")
        return tuple(v)
    if opt.is_flag:  # true / false, nothing else (click would read 5 or 1.5 with a traceback)
        if not isinstance(v, bool):
            raise ValueError(f"{key} must be true or false (got {v!r})")
        return v
    kind = {"integer": "an integer", "float": "a number"}.get(opt.type.name, "a string")
    # a date, a time, true for a number, or a number for a path (click would pass log = 5 on as 5)
    if isinstance(v, bool) or not isinstance(v, (str, int, float)) or (isinstance(opt.type, click.Path)
                                                                      and not isinstance(v, str)):
        raise ValueError(f"{key} must be {kind} (got {v!r})")
    try:  # the option's own range: NaN, a negative count, 1e30 steps
        return opt.type.convert(v, opt, ctx)
    except click.BadParameter as e:
        raise ValueError(f"{key} {e.message}" if e.message.startswith("must") else f"{key}: {e.message}") from None
    except (TypeError, ValueError, OverflowError):  # a number where a path belongs (log = 5), inf for -t
        raise ValueError(f"{key} must be {kind} (got {v!r})") from None


@click.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None, is_eager=True, expose_value=False,
              callback=_load_config,
              help="A TOML file of options (keys are option names, e.g. model = \"d12\", batch-size = 64); flags "
                   "given here override it; the options a run used are written to OUT/config.toml.")
@click.option("--backend", default="auto", show_default=True, help="Backend name (see `llmc backends`) or auto.")
@click.option("--device", default=None, help="Backend-specific device selector (default: the backend's best).")
@click.option("--backend-opt", "backend_opt", multiple=True, metavar="KEY=VALUE", help=BACKEND_OPT_HELP)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="auto", show_default=True,
              help="Compute dtype; auto = the backend's default (fp32 on cpu/opencl, bf16 on cuda); fp8 = bf16 with "
                   "the layers' matmuls in FP8 (cuda, compute capability 8.9+; checkpoints stay bf16).")
@click.option("--data", default=None,
              help="Training shards: a directory (its NAME_train_* shards, and its NAME_val_* shards validate "
                   "unless --val-data is given) or a quoted glob, e.g. 'datasets/shakespeare/*train*.bin' "
                   "(required unless --dry-run).")
@click.option("--val-data", default=None, help="Validation shards: a directory (its NAME_val_* shards) or a quoted "
              "glob  [default: --data's directory's val shards, if it is a directory]")
@click.option("--model", default=_ARGS.model, show_default=True,
              help="Preset: GPT-2 d2, d6, d12 (124M), d24, d36, d48; Llama 3 llama3-tiny, llama3.2-1b, "
                   "llama3.2-3b, llama3.1-8b.")
@click.option("--init", "init", default=None, type=click.Path(),
              help="Start from these weights instead: an llm.c .bin, a run directory, or a Hugging Face GPT-2 / "
                   "Llama directory (fine-tuning).")
@click.option("--n-layer", type=POSITIVE, default=None, help="Override the preset's layer count.")
@click.option("--n-head", type=POSITIVE, default=None, help="Override the preset's head count.")
@click.option("--n-embd", type=POSITIVE, default=None, help="Override the preset's channels.")
@click.option("--n-kv-head", type=POSITIVE, default=None, help="Llama: key/value heads (grouped-query attention).")
@click.option("--block-size", type=POSITIVE, default=None, help="Max sequence length in tokens (default: the preset's).")
@click.option("--recompute", type=click.Choice(list(RECOMPUTE)), default=_ARGS.recompute, show_default=True,
              help="Recompute these activations in backward instead of keeping one per layer (less memory, more "
                   "compute; same gradients). gelu: GPT-2's GELU output, Llama's SwiGLU output; layernorm: "
                   "GPT-2's layernorm outputs, Llama's RMSNorm outputs.")
@click.option("--dry-run", is_flag=True, help="Print parameter count and planned memory by component (the "
              "backend's library workspaces included), then exit.")
@click.option("-b", "--batch-size", type=POSITIVE, default=_ARGS.batch_size, show_default=True, help="Micro-batch size (sequences).")
@click.option("-t", "--seq-len", type=POSITIVE, default=_ARGS.seq_len, show_default=True, help="Sequence length (tokens).")
@click.option("--total-batch-size", type=POSITIVE, default=None,
              help="Tokens per optimizer step; a multiple of B*T (gradient accumulation). Default B*T.")
@click.option("--steps", type=COUNT, default=_ARGS.steps, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=Real(0), default=_OPT.lr, show_default=True, help="Peak learning rate.")
@click.option("--warmup", type=COUNT, default=_ARGS.warmup, show_default=True, help="Linear warmup (steps).")
@click.option("--lr-decay-frac", type=Real(0, 1), default=_ARGS.lr_decay_frac, show_default=True,
              help="Final LR as a fraction of --lr, reached by cosine decay (1.0 = constant, llm.c -q).")
@click.option("--weight-decay", type=Real(0), default=_OPT.weight_decay, show_default=True, help="AdamW decay (matrices only).")
@click.option("--grad-clip", type=Real(0), default=_OPT.grad_clip, show_default=True, help="Global grad-norm clip (0 = off).")
@click.option("--beta1", type=Real(0, 1, max_open=True), default=_OPT.beta1, show_default=True)
@click.option("--beta2", type=Real(0, 1, max_open=True), default=_OPT.beta2, show_default=True)
@click.option("--seed", type=SEED, default=_ARGS.seed, show_default=True, help="Seed for init, shuffling, sampling.")
@click.option("--overfit-batch", is_flag=True, help="Train on the first batch every step (llm.c -a 1).")
@click.option("--graphs/--no-graphs", default=_ARGS.graphs, show_default=True,
              help="Where the backend can capture graphs (cuda): after a few steps each micro-step's kernels are "
                   "captured once and replayed (one launch instead of hundreds); the same bits either way.")
@click.option("--prefetch/--no-prefetch", default=_ARGS.prefetch, show_default=True,
              help="Read the next batches in a background thread while a step computes, and copy each to the device "
                   "on a side stream where the backend can (cuda); the end of the run says how many batches a step "
                   "still waited for. The same bits either way.")
@click.option("--shuffle", is_flag=True, help="Shuffle shards and sample positions per epoch (seeded).")
@click.option("--val-every", type=COUNT, default=_ARGS.val_every, show_default=True, help="Validate every N steps (0 = off).")
@click.option("--val-batches", type=COUNT, default=_ARGS.val_batches, show_default=True, help="Batches per validation.")
@click.option("--sample-every", type=COUNT, default=_ARGS.sample_every, show_default=True, help="Sample every N steps (0 = off).")
@click.option("--sample-tokens", type=COUNT, default=_ARGS.sample_tokens, show_default=True, help="Tokens per sample.")
@click.option("--checkpoint-every", type=COUNT, default=_ARGS.checkpoint_every, show_default=True,
              help="Write a checkpoint every N steps (0 = by time only), with --out; always one at the end.")
@click.option("--checkpoint-minutes", type=Real(0), default=_ARGS.checkpoint_minutes, show_default=True,
              help="Also write one whenever this many minutes have passed since the last (0 = off), so a crash "
                   "loses at most that much.")
@click.option("--keep", type=COUNT, default=_ARGS.keep, show_default=True,
              help="Keep the newest N complete checkpoints (0 = all); the newest is never deleted.")
@click.option("--skip-loss-z", type=Real(0), default=_ARGS.skip_loss_z, show_default=True,
              help="Skip the update when the loss is this many std devs above the last 128 steps' (0 = off).")
@click.option("--skip-grad-z", type=Real(0), default=_ARGS.skip_grad_z, show_default=True,
              help="Same for the grad norm (0 = off). Non-finite steps are always skipped.")
@click.option("--max-bad-steps", type=COUNT, default=_ARGS.max_bad_steps, show_default=True,
              help="Stop (exit 3) after this many consecutive skipped / non-finite steps (0 = never).")
@click.option("--out", default=None, type=click.Path(), help="Run directory for checkpoints, e.g. checkpoints/run1.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--log", default=None, type=click.Path(), help="Write one JSON object per step to this file  [default: OUT/log.jsonl with --out]")
@click.option("--hellaswag", default=None, type=click.Path(),
              help="HellaSwag eval file (`llmc tokenize hellaswag`, of the training data's tokenizer) to score "
                   "during training.")
@click.option("--tensorboard", default=None, type=click.Path(file_okay=False),
              help="Also write TensorBoard event files (train/val/eval scalars) into this directory (view them with "
                   "`tensorboard --logdir DIR`: pip install tensorboard).")
@click.option("--hellaswag-every", type=COUNT, default=_ARGS.hellaswag_every, show_default=True,
              help="Score --hellaswag every N steps and at the end (0 = off); acc_norm goes to the log.")
@click.option("--gpus", type=COUNT, default=0, help="Data parallel on N GPUs of this machine: starts N processes "
              "(one per GPU, reducing through the backend's own communicator). Under mpirun/srun leave it out: the ranks "
              "come from the launcher.")
@click.option("--procs", type=COUNT, default=0, help="Data parallel over N MPI processes (mpiexec -n N; for the "
              "cpu/OpenCL backends). Needs pip install 'llmc[mpi]'.")
@click.option("--zero", type=click.Choice(["0", "1", "2"]), default=str(_ARGS.zero), show_default=True,
              help="Data parallel: 1 = ZeRO-1, the optimizer state sharded over the ranks (reduce-scatter + "
              "all-gather); 2 = ZeRO-2, the gradients sharded too (each layer's reduced into its owners' shards as "
              "the backward pass goes; a rank holds 1/N of them plus one layer's).")
@click.option("--overlap/--no-overlap", default=_ARGS.overlap, show_default=True,
              help="Data parallel: reduce each layer's gradients as soon as the backward pass has made them final, "
              "beside the layers still to come (on the communicator's own stream where it has one, as the cuda "
              "backend's does, or as copies to the owners where the backend moves them so); such runs replay no "
              "captured graphs. Off by default: on two NVLink-connected H200s and H100s it measured 0.2-1.5 %% slower "
              "than one reduction after the backward pass (the collectives' kernels take SMs from the matmuls, and "
              "even copy engines' traffic slowed them); try it where the link is slow.")
@click.option("--init-file", default=None, type=click.Path(),
              help="Multi-node without MPI: a path on a shared file system through which rank 0 hands out the device "
              "communicator's id (fresh per run; cuda).")
@click.option("--init-addr", default=None, help="Multi-node without MPI: HOST:PORT where rank 0 listens and "
              "hands out the device communicator's id (cuda).")
def train(**o) -> None:
    """Train a GPT-2 or a Llama 3, from scratch (--model) or from weights (--init).

    \b
    Example:
      llmc tokenize shakespeare
      llmc train --backend cpu --model d6 -b 4 -t 64 --steps 100 \\
          --data 'datasets/shakespeare/*train*.bin' --val-data 'datasets/shakespeare/*val*.bin' \\
          --out checkpoints/shakespeare
      llmc train --backend cpu --model llama3-tiny -b 4 -t 64 --steps 100 \\
          --data 'datasets/shakespeare/*train*.bin' --out checkpoints/llama-tiny
      llmc train --model llama3-8b --dry-run -b 1 -t 8192 --dtype bf16

    \b
    Exit status:
      0    finished
      2    bad options or files, or an error that stopped the run (one line; with --out the last
           completed step is checkpointed first)
      3    --max-bad-steps non-finite or skipped steps in a row
      75   stopped by SIGINT, SIGTERM, SIGHUP or a closed standard output after writing a checkpoint: continue
           with --resume
      130  stopped by a signal with nothing saved (no --out, or a second signal during the checkpoint)
    """
    import os

    from llmc_cli.data.tokenizer import load_tokenizer
    from llmc_cli.formats.files import DataError
    from llmc_cli.formats.rundir import LOCK_FILE, RunDirError, check_out, check_outside_checkpoints
    from llmc_cli.formats.runlog import LogError, check_log
    from llmc_cli.optim import AdamWConfig
    from llmc_cli.training.args import TrainArgs, TrainError
    from llmc_cli.training.trainer import Trainer

    refuse_empty_paths(**{k: o.get(k) for k in ("out", "init", "log", "tensorboard", "hellaswag", "val_data", "data",
                                                  "init_file")})
    if o["hellaswag"]:  # checked now: a bad eval file is one line before anything runs, not after the banner
        from llmc_cli.formats.evalfile import read_evalfile
        try:
            read_evalfile(o["hellaswag"])
        except DataError as e:
            fail(f"--hellaswag: {e}")
    _check_combination(o)
    _check_init_model(o, click.get_current_context())
    if o.pop("dry_run"):
        return dry_run(o)
    taken = _options_from_run(o) if (o["resume"] and o["out"]) else []  # said once the run has started
    _check_combination(o)  # again with what --resume took from the run
    if not o["data"]:
        fail("--data: give a glob of training shards, e.g. --data 'datasets/shakespeare/*train*.bin'")
    if o["out"] and not o["log"]:  # a run directory keeps its own log, so `llmc plot RUN` finds it
        o["log"] = str(Path(o["out"]) / "log.jsonl")
    try:  # said before any rank starts; the trainer checks again under the run directory's lock
        if o["out"]:  # a run directory is continued only on purpose: a fresh run must not clobber its checkpoints
            check_out(o["out"], o["resume"])
            _check_config_target(Path(o["out"]) / CONFIG_FILE)
        if o["log"]:
            check_log(o["log"])
            if o["out"] and os.path.realpath(o["log"]) in {os.path.realpath(Path(o["out"]) / n)
                                                           for n in (LOCK_FILE, "latest", CONFIG_FILE)}:
                fail(f"--log {o['log']}: a file of the run directory's own (its lock, `latest` or {CONFIG_FILE}); "
                     "give another path, or leave --log out for OUT/log.jsonl")
        if o["tensorboard"]:
            check_outside_checkpoints(o["tensorboard"], "--tensorboard")
            if os.path.lexists(o["tensorboard"]) and not os.path.isdir(o["tensorboard"]):  # (before --out is made)
                fail(f"--tensorboard {o['tensorboard']}: not a directory; give a directory llmc may create or "
                     "write event files in")
    except (RunDirError, LogError) as e:
        fail(str(e))
    # data parallel (issue 7): start the ranks here, or take this process's place among them
    from llmc_cli.parallel import comm as comm_mod
    gpus, procs, init_file, init_addr = o.pop("gpus"), o.pop("procs"), o.pop("init_file"), o.pop("init_addr")
    o["zero"] = int(o["zero"])
    fault = _fault_spec()  # the test hooks' settings, checked before any rank starts
    try:
        from llmc_cli.formats.files import fault_delay_seconds
        fault_delay_seconds()
    except ValueError as e:
        fail(str(e))
    if gpus > 1:
        _check_gpus(o["backend"], gpus)
    if gpus > 1 or procs > 1:
        from llmc_cli.parallel.launch import launch_gpus, launch_mpi
        args = child_args(click.get_current_context())
        from rich.markup import escape

        def say(msg: str) -> None:  # the supervisor's own lines; rank 0's output owns stdout
            err_console.print(f"llmc launcher: {escape(msg)}", soft_wrap=True)
        sys.exit(launch_gpus(args, gpus, say=say) if gpus > 1 else launch_mpi(args, procs, say=say))
    try:
        rank_info = comm_mod.discover()
    except comm_mod.CommError as e:
        fail(str(e))
    if rank_info.world_size > 1:
        _RANK.update(rank=rank_info.rank, world=rank_info.world_size)
        _check_init_file(init_file, rank_info.rank)
        console.quiet = rank_info.rank != 0  # rank 0 speaks for the run
        if o["device"] is None:
            comm_mod.pin_local_device(rank_info)  # one GPU per rank, by rank on the node
    backend = make_backend(o.pop("backend"), o.pop("device"), o.pop("dtype"), backend_options(o.pop("backend_opt")))
    try:
        comm = comm_mod.create(backend, rank_info, init_file=init_file, init_addr=init_addr)
    except comm_mod.CommError as e:
        fail(str(e))
    if comm.world_size > 1:
        _RANK["comm"] = comm
        _abort_on_uncaught(comm)
    optim = AdamWConfig(lr=o.pop("lr"), beta1=o.pop("beta1"), beta2=o.pop("beta2"),
                        weight_decay=o.pop("weight_decay"), grad_clip=o.pop("grad_clip"))
    args = TrainArgs(optim=optim, init=o.pop("init"), **o)
    try:
        tok = load_tokenizer("gpt2")
        decode, eot = tok.decode, tok.eot
    except Exception:  # sampling during training is optional; the run does not need a tokenizer
        decode, eot = None, None
    try:
        trainer = Trainer(args, backend, say=_say, decode=decode, eot=eot, comm=comm)
    except (TrainError, DataError, ValueError, OSError) as e:
        fail(one_line(e))
    if taken:
        _say(f"options from {args.out}: {' '.join(taken)}")
    if args.out and rank_info.rank == 0:
        _write_config(Path(args.out) / CONFIG_FILE, click.get_current_context())
    try:
        _train_run(trainer, args, backend, comm, rank_info, load_tokenizer, fault)
    finally:
        try:
            trainer.close()
        finally:
            try:  # nothing queued may still touch the other ranks' memory that comm.close() unmaps
                backend.synchronize()
            except Exception:  # noqa: BLE001  (the error that stopped the run is the one to report)
                pass
            comm.close()


def _train_run(trainer, args, backend, comm, rank_info, load_tokenizer, fault=None) -> None:
    from llmc_cli.formats.files import DataError
    from llmc_cli.kernels import BackendUnavailable
    from llmc_cli.training.args import TrainError
    if trainer.tokenizer != "gpt2":  # Llama 3 shards: samples need Meta's ranks, from --init's directory
        try:
            tok = load_tokenizer(trainer.tokenizer, trainer.tokenizer_file)
            trainer.decode, trainer.eot, trainer.sample_prompt = tok.decode, tok.eot, tok.doc_prefix
        except Exception:
            trainer.decode = None
    cfg = trainer.cfg
    _say(f"backend: {backend.describe()} ({backend.matmul_dtype or backend.dtype})")
    console.print(f"model: L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size} "
                  f"(padded {cfg.padded_vocab_size}) maxT={cfg.block_size}, {trainer.model.num_params:,} params")
    console.print(f"batch: B={args.batch_size} T={args.seq_len}, {trainer.tokens_per_step} tokens/step, "
                  f"grad accumulation {trainer.grad_accum}")
    _say(trainer.data_line())
    console.print(trainer.memory_line())
    if trainer.start_step:
        _say(f"resumed from {args.out} at step {trainer.start_step}")
    if comm.world_size > 1:
        console.print(f"data parallel: {comm.world_size} ranks ({rank_info.source}), {comm.name} "
                      f"({getattr(comm, 'how', '')}), ZeRO-{args.zero}, B={args.batch_size} per rank, gradients "
                      + ("reduced layer by layer into the ranks' shards on every micro-step" if args.zero == 2
                         else "copied layer by layer to their owners during the backward pass (copy engines)"
                         if getattr(trainer.reducer, "by_copies", False)
                         else "reduced layer by layer during the backward pass" if trainer.reducer is not None
                         else "reduced after the backward pass")
                      + ("; the all-gather written by the update into the other ranks' memory (peer access)"
                         + (", the reduce-scatter read from it" if getattr(trainer.opt, "peer_reduce", False) else "")
                         if getattr(trainer.opt, "peer_memory", False) else ""))

    import time

    from llmc_cli.models.families import flops_per_token
    t_start, first = time.monotonic(), trainer.start_step
    peak = backend.peak_flops()
    per_token = flops_per_token(cfg, args.seq_len)
    bar, task = _live_progress(args.steps, first)

    def show(r: dict) -> None:
        num = lambda v, f: "nan" if v is None else format(v, f)  # noqa: E731  (non-finite values log as null)
        elapsed = time.monotonic() - t_start
        done = r["step"] - first
        eta = elapsed / done * (args.steps - r["step"]) if done > 0 else 0.0
        seen = r["step"] * trainer.tokens_per_step
        mfu = r["tok_per_s"] / comm.world_size * per_token / peak if peak else None  # per device
        console.print(f"step {r['step']:5d}/{args.steps} | loss {num(r['loss'], '.6f')} | norm {num(r['norm'], '.4f')} | "
                      f"lr {num(r['lr'], '.2e')} | {r['ms']:.1f} ms | {r['tok_per_s']:.0f} tok/s | "
                      f"{_count(seen)} tokens | {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
                      + (f" | MFU {mfu:.1%}" if mfu is not None else "") + (" | skipped" if r.get("skipped") else ""))
        if bar is not None:
            bar.update(task, completed=done, loss=num(r["loss"], ".4f"), rate=f"{r['tok_per_s']:,.0f}",
                       seen=_count(seen), mfu=f" MFU {mfu:.1%}" if mfu is not None else "")
    from llmc_cli.training.signals import StopSignals, TrainAborted
    from llmc_cli.training.args import TrainDiverged
    how = resume_command(click.get_current_context())
    try:
        with StopSignals() as stop, (bar if bar is not None else _nothing()):
            trainer.stop_requested = lambda: stop.requested
            closed: list[bool] = []  # hours of training outweigh the lines that tell of them: stop as on a signal
            when_stdout_closes(lambda: (closed.append(True), stop.request("a closed standard output")))
            trainer.run(on_step=_fault_hook(comm, show, fault))
            if comm.world_size > 1:  # no rank gives up its handlers while rank 0 still writes the last checkpoint: a
                comm.barrier()       # signal would then kill that rank, and mpiexec or the launcher rank 0 mid-write
    except TrainAborted as e:
        where = (f"; {args.out} keeps its last complete checkpoint, resume with: {how}" if _has_checkpoint(args.out)
                 else f"; {args.out} holds no complete checkpoint yet: the same command starts the run again"
                 if args.out else "; nothing was saved (no --out)")
        fail(f"aborted by a second {e.signame}{where}", code=130)
    except TrainDiverged as e:
        fail(str(e), code=3)
    except (TrainError, DataError, ValueError, OSError, BackendUnavailable) as e:  # (a kernel that fails to build)
        msg = one_line(e)
        if trainer.rescued is not None:
            msg += f"; checkpoint {trainer.rescued} written (the last completed step), resume with: {how}"
        elif trainer.rescue_error == msg:  # (the failed write was that checkpoint: its second try, said once)
            msg += "; a second try at that checkpoint failed the same way"
        elif trainer.rescue_error:
            msg += f"; the checkpoint of the last completed step could not be written either ({trainer.rescue_error})"
        fail(msg + ("" if trainer.rescued is not None else trainer.last_good()))
    console.print(data_waits_line(trainer.feed, args.prefetch))
    console.print(trainer.memory_line("memory at the end"))  # (the kernels' scratch is sized by the first steps)
    if trainer.stopped:
        st = trainer.stopped
        if args.out:
            said = f"stopped by {st['signal']} after step {st['step']}; checkpoint {st['checkpoint']} written. Resume with:"
            if closed:  # (the resume command must reach the user somewhere)
                sys.stderr.write(f"{printable(said)}\n  {printable(how)}\n")
            else:
                _say(f"{said}\n  {how}")
            sys.exit(75)
        said = (f"stopped by {st['signal']} after step {st['step']}; nothing can be saved without --out DIR, so this "
                "run cannot be resumed")
        if closed:
            sys.stderr.write(printable(said) + "\n")
        else:
            console.print(said, markup=False)
        sys.exit(130)


def _has_checkpoint(out: str | None) -> bool:
    """Whether the run directory holds a checkpoint to resume (an abort before the first one has none)."""
    if not out:
        return False
    from llmc_cli.formats import checkpoint as ckpt
    try:
        ckpt.resolve_checkpoint(out, note_as=None)
        return True
    except (ckpt.CheckpointError, OSError):
        return False


def data_waits_line(feed, prefetch: bool) -> str:
    """How often a step waited for its batch (a Feed's counts, this process's steps)."""
    if not prefetch:
        return f"data: {feed.batches} batches read inside the steps ({feed.wait_s:.2f} s; --no-prefetch)"
    return (f"data: waited for {feed.waits} of {feed.batches} batches ({feed.wait_s:.2f} s in all; read ahead in a "
            "background thread)")


def _abort_on_uncaught(comm) -> None:
    """One rank's traceback must not leave the others waiting in a collective forever."""
    previous = sys.excepthook

    def hook(tp, value, tb):
        previous(tp, value, tb)
        sys.stderr.write(f"llmc: rank {comm.rank} of {comm.world_size} failed ({tp.__name__}); stopping all ranks\n")
        sys.stderr.flush()
        from llmc_cli.parallel.launch import note_failure
        note_failure(comm.rank, comm.world_size, f"{tp.__name__}: {value}")
        comm.abort(1)
    sys.excepthook = hook


def _fault_spec() -> tuple[int, int] | None:
    """LLMC_FAULT_RANK=R:STEP (a test hook: rank R fails after STEP), checked before anything starts."""
    import os
    spec = os.environ.get("LLMC_FAULT_RANK", "").strip()
    if not spec:
        return None
    rank, sep, step = spec.partition(":")
    if not (sep and rank.strip().isdigit() and step.strip().isdigit()):
        fail(f"LLMC_FAULT_RANK={spec}: expected RANK:STEP, two integers >= 0 (a test hook; unset it)")
    return int(rank), int(step)


def _fault_hook(comm, show, fault: tuple[int, int] | None = None):
    """on_step for every rank: rank 0 prints; `fault` (LLMC_FAULT_RANK=R:STEP) makes rank R fail after STEP
    (tests the launchers' shutdown)."""

    def on_step(r: dict) -> None:
        if comm.rank == 0:
            show(r)
        if fault and fault[0] == comm.rank and r["step"] >= fault[1]:
            fail(f"injected failure after step {r['step']} (LLMC_FAULT_RANK={fault[0]}:{fault[1]})", code=7)
    return on_step


def _say(text: str) -> None:
    """A line of the run as it is: paths, device names and sampled text may hold '[...]', which is not markup, and
    an escape sequence or a carriage return, which is shown escaped (nothing sent to the terminal). Newlines and
    tabs stay: a sample is text of several lines."""
    from llmc_cli.commands.console import terminal_text
    console.print(terminal_text(text), markup=False)


def _check_combination(o: dict) -> None:
    """What the options say together, refused in one line before any rank starts or any plan is printed (the
    trainer checks again in each rank, where a refusal would reach the user once per rank)."""
    from llmc_cli.commands.options import check_tokens
    gpus, procs, zero = o["gpus"], o["procs"], int(o["zero"])
    if gpus and procs:
        fail("--gpus N (one process per GPU) and --procs N (MPI processes) are exclusive: give one of them")
    if zero == 2 and o["overlap"]:
        fail("--overlap: --zero 2 already reduces each layer's gradients during the backward pass (into the ranks' "
             "shards, on the compute stream); leave --overlap out")
    B, T = o["batch_size"], o["seq_len"]
    if (why := check_tokens(B, T)) is not None:
        fail(why)
    ranks = max(gpus, procs, 1)
    total = o["total_batch_size"]
    if total is not None and total % (B * T * ranks):
        what = f"B*T*ranks = {B}*{T}*{ranks}" if ranks > 1 else f"B*T = {B}*{T}"
        fail(f"--total-batch-size {total} is not a multiple of {what} = {B * T * ranks}")
    if o["init_file"] and o["init_addr"]:
        fail("give --init-file PATH or --init-addr HOST:PORT (how rank 0 hands out the communicator's id), not both")
    import os
    for where, addr in (("--init-addr", o["init_addr"]), ("LLMC_INIT_ADDR", os.environ.get("LLMC_INIT_ADDR"))):
        if addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                fail(f"{where} {addr!r}: expected HOST:PORT, a port in 1..65535 (rank 0's address, reachable by "
                     "every rank)")
            break


def _check_init_model(o: dict, ctx: click.Context) -> None:
    """--init gives the model, weights and shape: a --model given beside it that names another model (a Llama preset
    for GPT-2 weights, d6 for d12's) was ignored silently, a run of another model than the one asked for. Only a
    --model typed on this command line: a --config or a run's config.toml records the default beside --init."""
    from click.core import ParameterSource
    if not o["init"] or o["resume"] or ctx.get_parameter_source("model") is not ParameterSource.COMMANDLINE:
        return
    from llmc_cli.formats.sources import load_config_any
    from llmc_cli.models.families import family_for, family_of
    from llmc_cli.training.args import SHAPE_OPTIONS, TrainArgs, check_init_shape, model_config
    try:
        have = load_config_any(o["init"])
    except (ValueError, OSError):
        return  # (what is wrong with --init is said where its weights are read)
    given = {k: o.get(k) for k in SHAPE_OPTIONS}
    try:
        family_for(o["model"])
        check_init_shape(o["init"], have, given)  # (a shape option that differs: said as training says it)
    except ValueError as e:
        fail(str(e))
    try:  # the preset with the shape options given, which match --init's now
        want = model_config(TrainArgs(data="", model=o["model"], **{k: v for k, v in given.items() if k != "vocab_size"}))
    except ValueError:  # (d6's 6 heads over --init's 64 channels: not --init's model either)
        want = None
    shape = lambda c: (family_of(c).label, *(getattr(c, k, None) for k in ("n_layer", "n_head", "n_embd")))  # noqa: E731
    if want is None or shape(have) != shape(want):
        label, L, NH, C = shape(have)
        fail(f"--model {o['model']}: --init {o['init']} is another model ({label}, {L} layers, {NH} heads, {C} "
             "channels) and gives the model, its shape and its weights; leave --model out")


def _check_gpus(backend: str, n: int) -> None:
    """--gpus N starts N processes here, one a GPU, that reduce through the backend's own communicator: refused in
    one line, before any starts, for a backend without one (cpu, OpenCL: --procs) or with fewer devices."""
    from llmc_cli.kernels import BackendPlugin, BackendUnavailable
    from llmc_cli.registry import usable_plugin
    try:
        plugin = usable_plugin(backend)
    except BackendUnavailable as e:
        fail(f"--gpus {n}: {e}")
    own = getattr(type(plugin), "communicator", None)
    if own is None or own is BackendPlugin.communicator:
        fail(f"--gpus {n}: the {plugin.name} backend reduces through MPI, so start its ranks with --procs {n} "
             "(or mpirun/srun)")
    try:
        devices = plugin.devices()
    except Exception:  # noqa: BLE001  (the ranks say what is wrong with the device)
        devices = []
    if devices and n > len(devices):
        fail(f"--gpus {n}: the {plugin.name} backend sees {len(devices)} device(s) here ({', '.join(devices)})")


def _check_init_file(init_file: str | None, rank: int) -> None:
    """Rank 0 writes the communicator's id to --init-file (or LLMC_INIT_FILE) and deletes it once every rank is in:
    a path that already exists is a stale id, or a file that is not llmc's, and stays as it is."""
    import os
    path = init_file or os.environ.get("LLMC_INIT_FILE")
    if rank == 0 and path and (os.path.lexists(path)):
        where = "--init-file" if init_file else "LLMC_INIT_FILE"
        fail(f"{where} {path}: exists; rank 0 writes a fresh id there and deletes it once the ranks are in, so give a "
             "path that does not exist yet (a stale one from an earlier run can be deleted); nothing was changed")


CONFIG_FILE = "config.toml"
CONFIG_HEADER = "# the options of this run, as `llmc train --config` reads them\n"


def _check_config_target(path: Path) -> None:
    """OUT/config.toml is replaced at the start of every run: only when llmc wrote it (its first line)."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file() or path.is_symlink():  # (before opening: a FIFO there would wait for a writer forever)
        fail(f"--out: {path} exists and was not written by llmc; llmc replaces only its own config.toml, so move it "
             "or give another --out; nothing was changed")
    try:
        with open(path, "rb") as f:
            head = f.read(len(CONFIG_HEADER.encode()))
    except OSError as e:
        fail(f"--out: {path}: {e.strerror or e}")
    if not path.is_file() or path.is_symlink() or head != CONFIG_HEADER.encode():
        fail(f"--out: {path} exists and was not written by llmc; llmc replaces only its own config.toml, so move it "
             "or give another --out; nothing was changed")


def dry_run(o: dict) -> None:
    """Plans the model's memory on the host, allocating nothing: works for models this machine cannot hold."""
    from llmc_cli.models.families import memory_plan
    from llmc_cli.training.args import TrainArgs, model_config
    plugin, unusable = _check_backend_opt_names(o["backend"], o["backend_opt"])
    source = o["out"] if o["resume"] and o["out"] else o["init"]
    if source:  # the model is the checkpoint's, not --model's preset: its config alone, no weights read
        from llmc_cli.formats.sources import load_config_any
        from llmc_cli.training.args import SHAPE_OPTIONS, check_init_shape
        try:
            cfg = load_config_any(source)
            if not o["resume"]:
                check_init_shape(source, cfg, {k: o.get(k) for k in SHAPE_OPTIONS})
        except ValueError as e:  # (CheckpointError too)
            fail(str(e) if str(e).startswith("--init") else f"--{'resume' if o['resume'] else 'init'}: {e}")
    else:
        try:
            cfg = model_config(TrainArgs(data=o["data"] or "", model=o["model"], n_layer=o["n_layer"],
                                         n_head=o["n_head"], n_embd=o["n_embd"], n_kv_head=o["n_kv_head"],
                                         block_size=o["block_size"]))
        except ValueError as e:
            fail(str(e))
    from llmc_cli.registry import default_dtype
    dtype = DTYPES[o["dtype"]] or default_dtype(o["backend"])
    B, T = o["batch_size"], o["seq_len"]
    if T > cfg.block_size:  # what training would refuse, refused here too
        fail(f"-t {T} is longer than the model's block size {cfg.block_size}")
    ranks = max(o["gpus"], o["procs"], 1)
    try:
        plan = memory_plan(cfg, B, T, dtype, recompute=o["recompute"], world_size=ranks,
                           zero=int(o["zero"]), overlap=bool(o.get("overlap")) and ranks > 1)
    except ValueError as e:
        fail(str(e))
    from llmc_cli.models.families import family_of
    n = family_of(cfg).num_parameters(cfg)
    how = "" if o["recompute"] == "none" else f", --recompute {o['recompute']}"
    per = f", per rank of {ranks} (--zero {int(o['zero'])})" if ranks > 1 else ""
    table = Table(title=f"{source or o['model']}: {n:,} parameters, B={B} T={T}, {dtype}{how}{per}")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    from llmc_cli.kernels import BackendUnavailable
    try:  # the backend's own library workspaces, as its options set them
        scratch = plugin.planned_scratch(dtype, backend_options(o["backend_opt"]) or None) if plugin else {}
    except BackendUnavailable as e:
        fail(f"--backend {plugin.name}: {e}")
    plan |= {f"{plugin.name}: {k}": v for k, v in scratch.items()}
    for k, v in plan.items():
        table.add_row(k, f"{v / 2**30:.2f}")
    table.add_row("total", f"{sum(plan.values()) / 2**30:.2f}")
    console.print(table)
    if unusable:  # (after the plan: a bad option value above is still the one line of a refusal)
        err_console.print(f"note: --backend {o['backend']}: {unusable}; planned as on a machine where it runs",
                          markup=False, soft_wrap=True)


def _check_backend_opt_names(backend: str, pairs) -> tuple[BackendPlugin, str | None]:
    """--dry-run opens no backend, so its --backend-opt are checked here as far as that allows: KEY=VALUE, each
    key once, and a key the backend declares (the values are the backend's planned_scratch checks). Returns the
    plugin the run would take, and why it cannot run here (None where it can); one that is not installed, or does
    not load, is one line (exit 2)."""
    from llmc_cli.kernels import BackendUnavailable
    from llmc_cli.registry import check_option_names, load_plugin, usable_plugin
    opts = backend_options(pairs)
    try:
        plugin = usable_plugin(backend)
    except BackendUnavailable as e:
        # a backend that is installed but cannot run here (no GPU on this laptop) is still planned for, where it
        # can; a name that is no backend, or one that does not load, has nothing to plan with: it planned float32
        # with no workspaces and exited 0, a preflight that passed for a run that cannot start
        plugin = load_plugin(backend) if backend != "auto" else None
        if plugin is None:
            fail(f"--backend {backend}: {e}")
        unusable = one_line(e)
    else:
        unusable = None
    if opts:
        try:
            check_option_names(plugin, opts)
        except BackendUnavailable as e:
            fail(f"--backend {plugin.name}: {e}")
    return plugin, unusable


def resume_command(ctx) -> str:
    """The command line that was run (the options given explicitly, from click's context) plus --resume."""

    parts = ["llmc"] + child_args(ctx, drop=())
    if "--resume" not in parts:
        parts.append("--resume")
    return shlex.join(parts)


LAUNCH_OPTIONS = ("gpus", "procs")


def child_args(ctx, drop=LAUNCH_OPTIONS) -> list[str]:
    """The subcommand and the options given explicitly (from click's context), less `drop`."""
    from click.core import ParameterSource

    chain, c = [], ctx
    while c is not None and c.parent is not None:
        chain.append(c.info_name)
        c = c.parent
    parts = list(reversed(chain))
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name is None or p.name in drop:
            continue
        if ctx.get_parameter_source(p.name) not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
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


_OPTIM_KEYS = ("lr", "beta1", "beta2", "weight_decay", "grad_clip")
_RUN_DIR_PATHS = ("log", "tensorboard")  # what a run writes, and may write inside its run directory


def _path_inside(path: str, folder) -> Path | None:
    """`path` relative to `folder` when it lies inside it (as written: both as the run recorded them), else None."""
    import os
    if not isinstance(folder, str) or not folder:
        return None
    p, d = Path(os.path.normpath(path)), Path(os.path.normpath(folder))
    if p.is_absolute() != d.is_absolute() or p == d:
        return None
    try:
        return p.relative_to(d)
    except ValueError:
        return None


def _options_from_run(o: dict) -> list[str]:
    """`--resume` continues the run as it was: every option not given on this command line takes the value the
    run recorded in its newest complete checkpoint's state.json (options given must agree where they fix the
    model or the step, which the trainer checks). Returns the options taken, as flags, for the log."""
    from click.core import ParameterSource

    from llmc_cli.formats import checkpoint as ckpt
    try:
        step = ckpt.resolve_checkpoint(o["out"], note_as=None).parent  # (the trainer's read says a fallback)
        recorded = ckpt.read_run_state(step / "state.json").get("args") or {}
    except (ckpt.CheckpointError, OSError):
        return []  # the trainer says what is wrong with the run directory
    ctx = click.get_current_context()
    optim = recorded.get("optim") or {}
    if not isinstance(optim, dict):
        fail(f"--resume: {step / 'state.json'}: args 'optim' must be a JSON object (got {optim!r:.80}), not what "
             "llmc wrote (a damaged run state)")
    values = dict(recorded) | {k: v for k, v in optim.items() if k in _OPTIM_KEYS}
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    taken = []
    for key, value in values.items():
        if key in ("optim", "resume", "out") or key not in o or key not in options or value is None:
            continue
        if ctx.get_parameter_source(key) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue  # (given here: what the run recorded is not used, damaged or not)
        if key == "zero" and type(value) is int:
            value = str(value)
        try:  # checked as the command line's own values are: a damaged state.json's NaN or -5 is refused here
            value = _checked_value(options[key], key, value, ctx)
        except ValueError as e:
            fail(f"--resume: {step / 'state.json'}: its recorded {e} (a damaged run state; give --"
                 f"{key.replace('_', '-')} to override it)")
        if key in _RUN_DIR_PATHS and (inside := _path_inside(value, recorded.get("out"))) is not None:
            # a file of the run directory itself (its log.jsonl): that of the directory resumed now, which may be a
            # copy or a move of the one recorded; the original (another run's, or gone) is never trimmed or added to
            value = str(Path(o["out"]) / inside)
        if key == "log" and Path(value) == Path(o["out"]) / "log.jsonl":
            continue  # the run directory's own log: what a run with --out uses anyway
        if o[key] != value:
            o[key] = value
            ctx.params[key] = value  # (what config.toml records: the options in effect, not click's defaults)
            flag = "--" + key.replace("_", "-")
            taken.append(flag if value is True else f"{flag} {value}")
    return taken


def _write_config(path: Path, ctx: click.Context) -> None:
    """The options this run resolved (defaults, --config, flags), as TOML that --config reads back."""
    import json

    from llmc_cli.formats.files import atomic_write_bytes
    skip = {"dry_run", "resume", "gpus", "procs", "init_file", "init_addr"}
    lines = [CONFIG_HEADER]
    for p in ctx.command.params:
        v = ctx.params.get(p.name) if p.name else None
        if not isinstance(p, click.Option) or p.name in skip or v is None or v == ():
            continue
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, (int, float)):
            text = repr(v)
        elif isinstance(v, (list, tuple)):
            text = "[" + ", ".join(json.dumps(str(x)) for x in v) + "]"
        else:
            text = json.dumps(str(v))
        name = p.name.replace('_', '-')
        if any(0xD800 <= ord(c) <= 0xDFFF for c in (str(v) if not isinstance(v, (list, tuple)) else "".join(v))):
            # a path with bytes that are not UTF-8: a TOML string cannot hold it, and `--config` would refuse the
            # whole file over one "\udcff"
            lines.append(f"# {name}: a name that is not UTF-8, which TOML cannot hold; give --{name} itself\n")
            continue
        lines.append(f"{name} = {text}\n")
    try:
        atomic_write_bytes(path, "".join(lines).encode())
    except OSError as e:
        fail(one_line(e))


def _count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _nothing():
    from contextlib import nullcontext
    return nullcontext()


def _live_progress(steps: int, first: int):
    """(a rich progress display on a terminal, its task) or (None, None) when the output is a file or a pipe:
    the step lines alone then say everything (elapsed, ETA, tokens seen, MFU)."""
    if not console.is_terminal or console.quiet or steps <= first:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]} | {task.fields[rate]} tok/s | {task.fields[seen]} tokens"
                              "{task.fields[mfu]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                   console=console, transient=True)
    task = bar.add_task("train", total=steps - first, loss="-", rate="-", seen="-", mfu="")
    return bar, task
