"""`llmc train`: the options parsed, checked once (train_options), a Trainer run, and what it did reported: one
line on failure, with the command that resumes it where there is a checkpoint."""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import click

from llmc_cli.commands.console import BACKEND_OPT_HELP, DTYPES, console, fail, one_line, printable, when_stdout_closes
from llmc_cli.commands.data_parallel import check_launch, join_ranks, launch_ranks
from llmc_cli.commands.dry_run import dry_run
from llmc_cli.commands.options import COUNT, POSITIVE, SEED, Real
from llmc_cli.commands.progress import StepLines, end_lines, say, start_lines, wrapped, wrapped_items
from llmc_cli.commands.resume import has_checkpoint, options_from_run, resume_command
from llmc_cli.commands.train_config import CONFIG_FILE, load_config, write_config
from llmc_cli.commands.train_options import check_init_model, check_inputs, check_outputs, train_args
from llmc_cli.data.tokenizer import load_tokenizer
from llmc_cli.formats.files import DataError, fault_delay_seconds
from llmc_cli.kernels import BackendUnavailable
from llmc_cli.models.base import RECOMPUTE
from llmc_cli.optim import AdamWConfig
from llmc_cli.training.args import TrainArgs, TrainDiverged, TrainError
from llmc_cli.training.signals import StopSignals, TrainAborted
from llmc_cli.training.trainer import Trainer

_ARGS, _OPT = TrainArgs(data=""), AdamWConfig()  # the defaults live in the library, stated once


@click.command()
@click.option("--config", type=click.Path(dir_okay=False), default=None, is_eager=True, expose_value=False,
              callback=load_config,
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
              "captured graphs. Off by default: on two NVLink-connected H200s and H100s it measured 0.2-1.5 % slower "
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
    ctx = click.get_current_context()
    taken = options_from_run(o, ctx) if o["resume"] and o["out"] else []  # said once the run has started
    check_inputs(o)
    ranks = check_launch(o)
    args = train_args(o, ctx, ranks)
    check_init_model(args, ctx)
    if o["dry_run"]:
        return dry_run(o, args, ranks)
    if not args.data:
        fail("--data: give a glob of training shards, e.g. --data 'datasets/shakespeare/*train*.bin'")
    check_outputs(args)
    fault = _test_hooks()  # checked before any rank starts
    launch_ranks(o, ctx)  # (--gpus N / --procs N: exits with the ranks' status)
    backend, comm, rank_info = join_ranks(o)
    trainer = _trainer(args, backend, comm)
    if taken:
        console.print(wrapped_items(f"options from {args.out}:", taken), markup=False)
    if args.out and rank_info.rank == 0:
        write_config(Path(args.out) / CONFIG_FILE, ctx)
    try:
        _train_run(trainer, args, backend, comm, rank_info, fault)
    finally:
        try:
            trainer.close()
        finally:
            try:  # nothing queued may still touch the other ranks' memory that comm.close() unmaps
                backend.synchronize()
            except Exception:  # noqa: BLE001  (the error that stopped the run is the one to report)
                pass
            comm.close()


def _test_hooks():
    """The test hooks' settings, checked before any rank starts: LLMC_FAULT_CHECKPOINT_DELAY, and LLMC_FAULT_RANK,
    whose module loads only when it is set. Returns what wraps a step's callback to fail as asked, or None."""
    try:
        fault_delay_seconds()
    except ValueError as e:
        fail(str(e))
    if not os.environ.get("LLMC_FAULT_RANK", "").strip():
        return None
    from llmc_cli.commands import fault_injection  # a test hook: kept out of the production path
    return partial(fault_injection.failing, fault=fault_injection.fault_spec())


def _trainer(args: TrainArgs, backend, comm) -> Trainer:
    """The run's Trainer, with the tokenizer of its shards for the samples it prints (optional: a run needs none)."""
    try:
        tok = load_tokenizer("gpt2")
        decode, eot = tok.decode, tok.eot
    except Exception:  # noqa: BLE001  (sampling during training is optional)
        decode, eot = None, None
    try:
        trainer = Trainer(args, backend, say=say, decode=decode, eot=eot, comm=comm)
    except (TrainError, DataError, ValueError, OSError) as e:
        fail(one_line(e))
    if trainer.tokenizer != "gpt2":  # Llama 3 shards: samples need Meta's ranks, from --init's directory
        try:
            tok = load_tokenizer(trainer.tokenizer, trainer.tokenizer_file)
            trainer.decode, trainer.eot, trainer.sample_prompt = tok.decode, tok.eot, tok.doc_prefix
        except Exception:  # noqa: BLE001
            trainer.decode = None
    return trainer


def _train_run(trainer, args, backend, comm, rank_info, fault=None) -> None:
    """Runs the trainer under the stop signals, printing its steps (rank 0), then says how it ended: exit 0, 75 when
    stopped with a checkpoint, 130 with nothing saved, 3 when it diverged, 2 on an error."""
    start_lines(trainer, args, backend, comm, rank_info)
    lines = StepLines(trainer, args, backend, comm)
    on_step = lines if comm.rank == 0 else _quiet
    if fault is not None:
        on_step = fault(on_step, comm.rank)
    how = resume_command(click.get_current_context())
    closed: list[bool] = []  # hours of training outweigh the lines that tell of them: stop as on a signal
    try:
        with StopSignals() as stop, lines:
            trainer.stop_requested = lambda: stop.requested
            when_stdout_closes(lambda: (closed.append(True), stop.request("a closed standard output")))
            trainer.run(on_step=on_step)
            if comm.world_size > 1:  # no rank gives up its handlers while rank 0 still writes the last checkpoint: a
                comm.barrier()       # signal would then kill that rank, and mpiexec or the launcher rank 0 mid-write
    except TrainAborted as e:
        where = (f"; {args.out} keeps its last complete checkpoint, resume with: {how}" if has_checkpoint(args.out)
                 else f"; {args.out} holds no complete checkpoint yet: the same command starts the run again"
                 if args.out else "; nothing was saved (no --out)")
        fail(f"aborted by a second {e.signame}{where}", code=130)
    except TrainDiverged as e:
        fail(str(e), code=3)
    except (TrainError, DataError, ValueError, OSError, BackendUnavailable) as e:  # (a kernel that fails to build)
        fail(_failure_line(e, trainer, how))
    end_lines(trainer, args)
    if trainer.stopped:
        _stopped(trainer.stopped, args.out, how, bool(closed))


def _quiet(r: dict) -> None:
    """A step of a rank other than 0: rank 0 speaks for the run."""


def _failure_line(e: BaseException, trainer, how: str) -> str:
    """The error that stopped the run, and what became of the checkpoint of its last completed step."""
    msg = one_line(e)
    if trainer.rescued is not None:
        return msg + f"; checkpoint {trainer.rescued} written (the last completed step), resume with: {how}"
    if trainer.rescue_error == msg:  # (the failed write was that checkpoint: its second try, said once)
        msg += "; a second try at that checkpoint failed the same way"
    elif trainer.rescue_error:
        msg += f"; the checkpoint of the last completed step could not be written either ({trainer.rescue_error})"
    return msg + trainer.last_good()


def _stopped(st: dict, out: str | None, how: str, closed: bool) -> None:
    """A run stopped by a signal or a closed standard output: exit 75 with its checkpoint and the command that
    resumes it, or 130 with nothing saved (no --out). With standard output closed the lines go to stderr."""
    if out:
        said = f"stopped by {st['signal']} after step {st['step']}; checkpoint {st['checkpoint']} written. Resume with:"
        if closed:  # (the resume command must reach the user somewhere)
            sys.stderr.write(f"{printable(said)}\n  {printable(how)}\n")
        else:
            say(f"{said}\n  {how}")
        sys.exit(75)
    said = (f"stopped by {st['signal']} after step {st['step']}; nothing can be saved without --out DIR, so this "
            "run cannot be resumed")
    if closed:
        sys.stderr.write(printable(said) + "\n")
    else:
        console.print(wrapped(said), markup=False)
    sys.exit(130)
