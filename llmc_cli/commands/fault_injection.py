"""A test hook, loaded only when LLMC_FAULT_RANK is set: LLMC_FAULT_RANK=R:STEP makes rank R fail after STEP, which
tests the launchers' shutdown of the other ranks."""

from __future__ import annotations

import os
from typing import Callable

from llmc_cli.commands.console import fail

ENV = "LLMC_FAULT_RANK"


def fault_spec() -> tuple[int, int] | None:
    """(rank, step) from LLMC_FAULT_RANK, checked before anything starts."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    rank, sep, step = spec.partition(":")
    if not (sep and rank.strip().isdigit() and step.strip().isdigit()):
        fail(f"{ENV}={spec}: expected RANK:STEP, two integers >= 0 (a test hook; unset it)")
    return int(rank), int(step)


def failing(on_step: Callable[[dict], None], rank: int, fault: tuple[int, int]) -> Callable[[dict], None]:
    """`on_step`, then on rank `fault[0]` a failure (exit 7) once a step >= `fault[1]` is done."""

    def step_then_fail(r: dict) -> None:
        on_step(r)
        if fault[0] == rank and r["step"] >= fault[1]:
            fail(f"injected failure after step {r['step']} ({ENV}={fault[0]}:{fault[1]})", code=7)
    return step_then_fail
