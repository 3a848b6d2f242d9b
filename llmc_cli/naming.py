"""How an error names a setting: the command line's flag (`--out`, `-t`, `--zero 2`) while an `llmc` command runs,
the Python argument (`out`, `seq_len`, `zero=2`) otherwise. The layers below the commands raise with `arg(field)`,
so `llmc.Trainer(TrainArgs(...))` is told "resume=True" where `llmc train` is told "--resume"; the command line
switches to its spelling once, at its entry (`flags_named`). Nothing here imports the rest of llmc."""

from __future__ import annotations

import functools
from contextlib import contextmanager

FLAGS = {"batch_size": "-b", "seq_len": "-t"}  # a field whose flag is not --FIELD-NAME

_cli = False  # process-wide, not a contextvar: a thread the command starts (a prefetch, a reader) raises in its words


def flag_name(field: str, value=None, *, short: bool = True) -> str:
    """A field as the command line names it: its flag (`-b`, or `--batch-size` when not `short`;
    `--total-batch-size`), with its value (`-b 4`); an on/off flag given True is the flag alone (`--resume`)."""
    long = "--" + field.replace("_", "-")
    flag = FLAGS.get(field, long) if short else long
    return flag if value is None or value is True else f"{flag} {value}"


def python_name(field: str, value=None) -> str:
    """A field as a Python caller names it (`batch_size`, `batch_size=4`, `resume=True`)."""
    return field if value is None else f"{field}={value!r}"


def arg(field: str, value=None, *, short: bool = True) -> str:
    """`field` (with `value`) in the words of whoever called: a flag under an `llmc` command, else the argument."""
    return flag_name(field, value, short=short) if _cli else python_name(field, value)


@contextmanager
def flags():
    """Errors raised inside name command-line flags (restored on the way out, for commands run in process)."""
    global _cli
    was, _cli = _cli, True
    try:
        yield
    finally:
        _cli = was


def flags_named(command):
    """A command's function whose errors name flags (the `llmc` group does the same for every command)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        with flags():
            return command(*args, **kwargs)
    return run
