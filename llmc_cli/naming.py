"""How an error names a setting: the command line's flag (`--out`, `-t`, `--zero 2`) while an `llmc` command runs,
the Python argument (`out`, `seq_len`, `zero=2`) otherwise. The layers below the commands raise with `arg(field)`,
so `llmc.Trainer(TrainArgs(...))` is told "resume=True" where `llmc train` is told "--resume"; the command line
switches to its spelling once, at its entry (`flags`). Nothing here imports the rest of llmc."""

from __future__ import annotations

from contextlib import contextmanager

FLAGS = {"batch_size": "-b", "seq_len": "-t", "channels": "-c"}  # a field whose flag is not --FIELD-NAME

_cli = False  # process-wide, not a contextvar: a thread the command starts (a prefetch, a reader) raises in its words


def flag_name(field: str, value=None, *, short: bool = True) -> str:
    """A field as the command line names it: its flag (`-b`, or `--batch-size` when not `short`;
    `--total-batch-size`), with its value (`-b 4`); an on/off flag is the flag alone, given True (`--resume`) or
    False (`--no-graphs`); a repeatable option given a list is the flag once per item (`--backend a --backend b`)."""
    long = "--" + field.replace("_", "-")
    flag = FLAGS.get(field, long) if short else long
    if value is False:
        return "--no-" + long[2:]
    if isinstance(value, (list, tuple)):
        return " ".join(f"{flag} {v}" for v in value)
    return flag if value is None or value is True else f"{flag} {value}"


def python_name(field: str, value=None) -> str:
    """A field as a Python caller names it (`batch_size`, `batch_size=4`, `resume=True`)."""
    return field if value is None else f"{field}={value!r}"


def arg(field: str, value=None, *, short: bool = True, cli: str | None = None) -> str:
    """`field` (with `value`) in the words of whoever called: a flag under an `llmc` command, else the argument.
    `cli`: the command line's field where the Python argument has another name (`T` is `seq_len` there: `-t`)."""
    return flag_name(cli or field, value, short=short) if _cli else python_name(field, value)


def arg_both(field: str, value=None, *, cli: str | None = None) -> str:
    """A field with a short flag as the command line names it both ways (`-b/--batch-size`, `-t/--seq-len 64`);
    Python: its name (`seq_len`, `T=64`). `cli` as for `arg`."""
    if not _cli:
        return python_name(field, value)
    short, long = flag_name(cli or field), flag_name(cli or field, short=False)
    both = short if short == long else f"{short}/{long}"
    return both if value is None else f"{both} {value}"


@contextmanager
def flags():
    """Errors raised inside name command-line flags (restored on the way out, for commands run in process)."""
    global _cli
    was, _cli = _cli, True
    try:
        yield
    finally:
        _cli = was

