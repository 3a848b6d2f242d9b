"""What `llmc train` prints as a run goes: the lines at its start, one line a step (with a live bar on a terminal),
and how often a step waited for its data at the end."""

from __future__ import annotations

import time
from contextlib import nullcontext

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmc_cli.commands.console import console, terminal_text
from llmc_cli.models.families import flops_per_token


def say(text: str) -> None:
    """A line of the run as it is: paths, device names and sampled text may hold '[...]', which is not markup, and
    an escape sequence or a carriage return, which is shown escaped (nothing sent to the terminal). Newlines and
    tabs stay: a sample is text of several lines."""
    console.print(terminal_text(text), markup=False)


def start_lines(trainer, args, backend, comm, rank_info) -> None:
    """The run as it starts: backend, model, batch, data, memory, where its weights came from (a resume, --init) or
    that it saves none (no --out), and the ranks of a data-parallel run."""
    cfg = trainer.cfg
    say(f"backend: {backend.describe()} ({backend.matmul_dtype or backend.dtype})")
    console.print(f"model: L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size} "
                  f"(padded {cfg.padded_vocab_size}) maxT={cfg.block_size}, {trainer.model.num_params:,} params")
    console.print(f"batch: B={args.batch_size} T={args.seq_len}, {trainer.tokens_per_step} tokens/step, "
                  f"grad accumulation {trainer.grad_accum}")
    say(trainer.data_line())
    console.print(trainer.memory_line())
    if trainer.start_step:
        say(f"resumed from {args.out} at step {trainer.start_step}")
    elif args.init:
        say(f"init: {args.init} ({trainer.family.label}, {trainer.model.num_params:,} params)")
    if not args.out:
        console.print("no --out: this run saves no checkpoint")
    if comm.world_size > 1:
        console.print(_parallel_line(trainer, args, comm, rank_info))


def _parallel_line(trainer, args, comm, rank_info) -> str:
    how = ("reduced layer by layer into the ranks' shards on every micro-step" if args.zero == 2
           else "copied layer by layer to their owners during the backward pass (copy engines)"
           if getattr(trainer.reducer, "by_copies", False)
           else "reduced layer by layer during the backward pass" if trainer.reducer is not None
           else "reduced after the backward pass")
    peer = ""
    if getattr(trainer.opt, "peer_memory", False):
        peer = ("; the all-gather written by the update into the other ranks' memory (peer access)"
                + (", the reduce-scatter read from it" if getattr(trainer.opt, "peer_reduce", False) else ""))
    return (f"data parallel: {comm.world_size} ranks ({rank_info.source}), {comm.name} ({getattr(comm, 'how', '')}), "
            f"ZeRO-{args.zero}, B={args.batch_size} per rank, gradients {how}{peer}")


def _count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(v, f: str) -> str:
    return "nan" if v is None else format(v, f)  # (non-finite values log as null)


class StepLines:
    """One line a step (elapsed, ETA, tokens seen, MFU), and on a terminal a live bar beside them; used as a
    context manager, which shows and removes the bar."""

    def __init__(self, trainer, args, backend, comm):
        self.steps, self.first, self.world = args.steps, trainer.start_step, comm.world_size
        self.tokens_per_step = trainer.tokens_per_step
        self.peak, self.per_token = backend.peak_flops(), flops_per_token(trainer.cfg, args.seq_len)
        self.t_start = time.monotonic()
        self.bar, self.task = None, None
        if console.is_terminal and not console.quiet and self.steps > self.first:  # (a file or a pipe: lines alone)
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]} | {task.fields[rate]} tok/s | "
                                           "{task.fields[seen]} tokens{task.fields[mfu]}"),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                                transient=True)
            self.task = self.bar.add_task("train", total=self.steps - self.first, loss="-", rate="-", seen="-",
                                          mfu="")

    def __enter__(self):
        return (self.bar if self.bar is not None else nullcontext()).__enter__()

    def __exit__(self, *exc):
        return (self.bar if self.bar is not None else nullcontext()).__exit__(*exc)

    def __call__(self, r: dict) -> None:
        elapsed = time.monotonic() - self.t_start
        done = r["step"] - self.first
        eta = elapsed / done * (self.steps - r["step"]) if done > 0 else 0.0
        seen = r["step"] * self.tokens_per_step
        mfu = r["tok_per_s"] / self.world * self.per_token / self.peak if self.peak else None  # per device
        console.print(f"step {r['step']:5d}/{self.steps} | loss {_num(r['loss'], '.6f')} | norm "
                      f"{_num(r['norm'], '.4f')} | lr {_num(r['lr'], '.2e')} | {r['ms']:.1f} ms | "
                      f"{r['tok_per_s']:.0f} tok/s | {_count(seen)} tokens | {_clock(elapsed)} elapsed, ETA "
                      f"{_clock(eta)}" + (f" | MFU {mfu:.1%}" if mfu is not None else "")
                      + (" | skipped" if r.get("skipped") else ""))
        if self.bar is not None:
            self.bar.update(self.task, completed=done, loss=_num(r["loss"], ".4f"), rate=f"{r['tok_per_s']:,.0f}",
                            seen=_count(seen), mfu=f" MFU {mfu:.1%}" if mfu is not None else "")


def data_waits_line(feed, prefetch: bool) -> str:
    """How often a step waited for its batch (a Feed's counts, this process's steps)."""
    if not prefetch:
        return f"data: {feed.batches} batches read inside the steps ({feed.wait_s:.2f} s; --no-prefetch)"
    return (f"data: waited for {feed.waits} of {feed.batches} batches ({feed.wait_s:.2f} s in all; read ahead in a "
            "background thread)")
