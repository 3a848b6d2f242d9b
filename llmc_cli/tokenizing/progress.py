"""How the tokenize workflow reports progress without printing: the command hands in a factory of progress
displays (a rich one on a terminal); library callers get a silent one."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Protocol


class Progress(Protocol):
    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int: ...
    def update(self, task: int, **kw: Any) -> None: ...
    def advance(self, task: int, n: float) -> None: ...
    def discard(self) -> None: ...  # the run failed: the display goes, the error line alone says what happened


ProgressFactory = Callable[[bool], ContextManager[Progress]]  # bytes_only -> a display


class _Silent:
    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        return 0

    def update(self, task: int, **kw: Any) -> None:
        pass

    def advance(self, task: int, n: float) -> None:
        pass

    def discard(self) -> None:
        pass


@contextmanager
def silent(bytes_only: bool = False) -> Iterator[Progress]:
    yield _Silent()
