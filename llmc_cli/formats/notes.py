"""Notes: what a reader did in place of what it was asked, which must not happen without a word (a run directory's
`latest` naming no usable step, read from the newest complete step instead). The commands print each on stderr as
`note: ...` (llmc_cli/commands/main.py sets `sink`); the Python API stays quiet unless its caller sets one."""

from __future__ import annotations

from typing import Callable

sink: Callable[[str], None] | None = None
_said: set[str] = set()  # a command resolves one run directory several times: each note is said once


def note(message: str) -> None:
    """`message` to the sink, once per command."""
    if sink is not None and message not in _said:
        _said.add(message)
        sink(message)


def listen(to: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Notes go to `to` from now on (None: nowhere), each said once again; returns the sink that was set."""
    global sink
    was, sink = sink, to
    _said.clear()
    return was
