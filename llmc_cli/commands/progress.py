"""What `llmc train` prints as a run goes: the lines at its start, one line a step (with a live bar on a terminal),
and how often a step waited for its data and the memory at the end; every line fits the console's width (an
80-column terminal's, or a pipe's: COLUMNS, else 80)."""

from __future__ import annotations

import textwrap
import time
from contextlib import nullcontext

from rich.progress import BarColumn, Progress, TextColumn

from llmc_cli.commands.console import console, printable, terminal_text
from llmc_cli.models.families import flops_per_token


def say(text: str) -> None:
    """A line of the run as it is: paths, device names and sampled text may hold '[...]', which is not markup, and
    an escape sequence or a carriage return, which is shown escaped (nothing sent to the terminal). Newlines and
    tabs stay: a sample is text of several lines. A line of one row wider than the console breaks after its "; "
    (a skipped step's note), never between words: a checkpoint's path stays on the row that names it."""
    if "\n" in text or "\t" in text:
        console.print(terminal_text(text), markup=False)
    else:
        console.print(wrapped(text, between_words=False), markup=False)


def wrapped(line: str, between_words: bool = True) -> str:
    """A line of facts (shards, buffers, options) as lines that fit the console's width, the later ones indented:
    broken after a "; " where it can, else between words (unless not `between_words`); a word longer than the width
    (a path) is kept whole. What would break a line or drive the terminal in it is shown escaped (`printable`)."""
    width, rows = console.width, []
    for part in printable(line).split("; "):
        if rows and len(rows[-1]) + 2 + len(part) <= width:
            rows[-1] += "; " + part
            continue
        if rows:
            rows[-1] += ";"
        indent = "  " if rows else ""
        rows += (textwrap.wrap(part, width=width, initial_indent=indent, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False) if between_words else []) or [indent + part]
    return "\n".join(rows)


def wrapped_items(head: str, items: list[str]) -> str:
    """`head` and then the items (options such as "--lr 0.001": never broken inside one) separated by spaces, as
    lines that fit the console's width, the later ones indented; shown escaped as `wrapped` does."""
    rows = [printable(head)]
    for item in map(printable, items):
        if len(rows[-1]) + 1 + len(item) <= console.width or rows[-1].strip() == "":
            rows[-1] += " " + item
        else:
            rows.append("  " + item)
    return "\n".join(rows)


def start_lines(trainer, args, backend, comm, rank_info) -> None:
    """The run as it starts: backend, model, batch, data, memory, where its weights came from (a resume, --init) or
    that it saves none (no --out), and the ranks of a data-parallel run."""
    cfg = trainer.cfg
    for line in (f"backend: {backend.describe()} ({backend.matmul_dtype or backend.dtype})",
                 f"model: L={cfg.n_layer} NH={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size} (padded "
                 f"{cfg.padded_vocab_size}) maxT={cfg.block_size}, {trainer.model.num_params:,} params",
                 f"batch: B={args.batch_size} T={args.seq_len}, {trainer.tokens_per_step} tokens/step, grad "
                 f"accumulation {trainer.grad_accum}"):
        console.print(wrapped(line), markup=False)
    console.print(wrapped(trainer.data_line()), markup=False)
    console.print(wrapped(trainer.memory_line()), markup=False)
    if trainer.start_step:
        say(f"resumed from {args.out} at step {trainer.start_step}")
    elif args.init:
        say(f"init: {args.init} ({trainer.family.label}, {trainer.model.num_params:,} params)")
    if not args.out:
        console.print("no --out: this run saves no checkpoint")
    if comm.world_size > 1:
        console.print(wrapped(_parallel_line(trainer, args, comm, rank_info)), markup=False)


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


# what a step line may add to its own (step, loss, ms, tok/s, ETA), most wanted first, as far as the width allows
EXTRAS = ("norm", "lr", "tokens", "mfu", "elapsed")
_SLACK = 6  # columns kept free when the extras are chosen, so that a longer number later does not drop one


def _fit(fields: list[tuple[str | None, str]], shown: list[str], width: int) -> tuple[str, list[str]]:
    """The fields (name: an extra's, or None for one always shown) joined by " | ", with the extras in `shown` that
    fit in `width` columns, dropped from the least wanted; (the line, the extras it shows)."""
    shown = [e for e in shown if any(name == e for name, _ in fields)]
    while True:
        line = " | ".join(text for name, text in fields if name is None or name in shown)
        if len(line) <= width or not shown:
            return line, shown
        shown = shown[:-1]


class StepLines:
    """One line a step, and on a terminal a live bar beneath them; used as a context manager, which shows and
    removes the bar. Both fit the console's width: the step, loss, step time, tok/s and ETA always (`step N/M | loss
    L | ... | X ms | Y tok/s | ...`, as bench/train_median.py reads it), and as the width allows the grad norm, the
    learning rate, the tokens seen, MFU and the time elapsed. The ETA is computed once a step and shown in both."""

    def __init__(self, trainer, args, backend, comm):
        self.steps, self.first, self.world = args.steps, trainer.start_step, comm.world_size
        self.tokens_per_step = trainer.tokens_per_step
        self.peak, self.per_token = backend.peak_flops(), flops_per_token(trainer.cfg, args.seq_len)
        self.t_start = time.monotonic()
        self.line_extras = self.bar_extras = None  # (chosen at the first step, with room to spare)
        self.bar, self.task = None, None
        if console.is_terminal and not console.quiet and self.steps > self.first:  # (a file or a pipe: lines alone)
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(bar_width=None),
                                TextColumn("{task.fields[facts]}", markup=False), console=console, transient=True,
                                expand=True)
            self.task = self.bar.add_task("train", total=self.steps - self.first, facts=f"{self.first}/{self.steps}")

    def __enter__(self):
        return (self.bar if self.bar is not None else nullcontext()).__enter__()

    def __exit__(self, *exc):
        return (self.bar if self.bar is not None else nullcontext()).__exit__(*exc)

    def __call__(self, r: dict) -> None:
        elapsed = time.monotonic() - self.t_start
        done = r["step"] - self.first
        eta = _clock(elapsed / done * (self.steps - r["step"]) if done > 0 else 0.0)
        seen = _count(r["step"] * self.tokens_per_step)
        mfu = r["tok_per_s"] / self.world * self.per_token / self.peak if self.peak else None  # per device
        mfu = [("mfu", f"MFU {mfu:.1%}")] if mfu is not None else []
        skipped = [(None, "skipped")] if r.get("skipped") else []
        width = console.width
        fields = [(None, f"step {r['step']:5d}/{self.steps}"), (None, f"loss {_num(r['loss'], '.6f')}"),
                  ("norm", f"norm {_num(r['norm'], '.4f')}"), ("lr", f"lr {_num(r['lr'], '.2e')}"),
                  (None, f"{r['ms']:.1f} ms"), (None, f"{r['tok_per_s']:.0f} tok/s"), ("tokens", f"{seen} tokens"),
                  ("elapsed", f"{_clock(elapsed)} elapsed"), (None, f"ETA {eta}"), *mfu, *skipped]
        if self.line_extras is None:
            self.line_extras = _fit(fields, list(EXTRAS), width - _SLACK)[1]
        line, self.line_extras = _fit(fields, self.line_extras, width)
        console.print(line, markup=False)
        if self.bar is not None:
            self._update_bar(r, done, eta, seen, mfu, elapsed, width)

    def _update_bar(self, r: dict, done: int, eta: str, seen: str, mfu: list, elapsed: float, width: int) -> None:
        """The live bar's facts: the step, loss and ETA always, then the rate, tokens seen, MFU and elapsed time as
        the width leaves room beside "train" and a bar of at least 10 columns."""
        fields = [(None, f"{r['step']}/{self.steps}"), (None, f"loss {_num(r['loss'], '.4f')}"),
                  ("rate", f"{r['tok_per_s']:,.0f} tok/s"), ("tokens", f"{seen} tokens"), *mfu,
                  ("elapsed", f"{_clock(elapsed)} elapsed"), (None, f"ETA {eta}")]
        room = width - len("train") - 10 - 2  # (a space between the columns)
        if self.bar_extras is None:
            self.bar_extras = _fit(fields, ["rate", "tokens", "mfu", "elapsed"], room - _SLACK)[1]
        facts, self.bar_extras = _fit(fields, self.bar_extras, room)
        self.bar.update(self.task, completed=done, facts=facts)


def end_lines(trainer, args) -> None:
    """The run as it ends: how often a step waited for its data, and the memory (the kernels' scratch is sized by
    the first steps)."""
    console.print(wrapped(data_waits_line(trainer.feed, args.prefetch)), markup=False)
    console.print(wrapped(trainer.memory_line("memory at the end")), markup=False)


def data_waits_line(feed, prefetch: bool) -> str:
    """How often a step waited for its batch (a Feed's counts, this process's steps)."""
    if not prefetch:
        return f"data: {feed.batches} batches read inside the steps ({feed.wait_s:.2f} s; --no-prefetch)"
    return f"data: waited for {feed.waits} of {feed.batches} batches ({feed.wait_s:.2f} s; read ahead in a thread)"
