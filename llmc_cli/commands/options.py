"""Click parameter types shared by every `llmc` command: numbers are checked when the command line is parsed. The
flag of each field of a workflow's arguments (flag_name) lives in llmc_cli/naming.py, below every layer.

click's own FloatRange lets NaN through (every comparison with NaN is false) and infinity through any open
side, so a float option here is `Real`: finite, then in its range. Integers are `Int`. Every numeric option of
every command takes one of these, so a bad value is one line naming the option (`--lr must be a finite
number (got nan)`), exit 2, before anything is opened or written. Their messages start with "must", which the
command layer prints after the option's name.
"""

from __future__ import annotations

import math
import os
import re

import click

from llmc_cli.models.base import INT32_MAX
from llmc_cli.naming import flag_name
from llmc_cli.training.args import micro_batch_error


class ExistingPath(click.Path):
    """click.Path(exists=True) that tells a path it may not look at (EACCES, ELOOP, a name too long) from one that
    is not there: click says "does not exist" for all of them."""

    def convert(self, value, param, ctx):
        if self.exists and isinstance(value, (str, os.PathLike)):
            try:
                os.stat(value)
            except FileNotFoundError:
                pass  # (click's own words)
            except OSError as e:
                self.fail(f"{click.format_filename(value)!r}: {e.strerror or e}", param, ctx)
        return super().convert(value, param, ctx)


class _Bounded(click.ParamType):
    """`min`/`max`: the option's declared range (in the message of a value outside it); `cap`: a ceiling past which
    a value is nonsense for any option of this kind (an integer the kernels and files hold), said as `<= cap`."""

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False,
                 max_open: bool = False, cap: float | None = None):
        self.min, self.max, self.min_open, self.max_open, self.cap = min, max, min_open, max_open, cap

    def _parse(self, value):
        raise NotImplementedError

    def _range(self) -> str:
        lo, hi = (f"{v:g}" if isinstance(v, float) else str(v) for v in (self.min, self.max))
        if self.min is not None and self.max is not None:
            return f"in {'(' if self.min_open else '['}{lo}, {hi}{')' if self.max_open else ']'}"
        if self.min is not None:
            return f"{'>' if self.min_open else '>='} {lo}"
        return f"{'<' if self.max_open else '<='} {hi}"

    def convert(self, value, param, ctx):
        x = self._parse(value, param, ctx)
        lo, hi = self.min, self.max
        if ((lo is not None and (x < lo or (self.min_open and x == lo)))
                or (hi is not None and (x > hi or (self.max_open and x == hi)))):
            self.fail(f"must be {self._range()} (got {value})", param, ctx)
        if self.cap is not None and x > self.cap:
            self.fail(f"must be <= {self.cap} (got {value})", param, ctx)
        return x


class Real(_Bounded):
    """A finite float, optionally bounded; `min_open`/`max_open` exclude the bound itself."""

    name = "float"

    def _parse(self, value, param, ctx) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"must be a number (got {value!r})", param, ctx)
        if not math.isfinite(x):
            self.fail(f"must be a finite number (got {value})", param, ctx)
        return x


class Int(_Bounded):
    """An integer, optionally bounded (bounds inclusive)."""

    name = "integer"

    def _parse(self, value, param, ctx) -> int:
        if isinstance(value, bool):
            self.fail(f"must be an integer (got {value!r})", param, ctx)
        if isinstance(value, int):
            return value
        try:
            return int(str(value).strip(), 10)
        except ValueError:
            self.fail(f"must be an integer (got {value!r})", param, ctx)


class PowerOfTwo(Int):
    """An integer that is a power of two, in [min, max] (sizes a kernel launch takes: threads per block)."""

    def convert(self, value, param, ctx):
        x = self._parse(value, param, ctx)
        if x < self.min or x > self.max or x & (x - 1):
            self.fail(f"must be a power of two in [{self.min}, {self.max}] (got {value})", param, ctx)
        return x


class ZeroOrReal(Real):
    """0 (the option's "off", e.g. greedy decoding), or a finite float in [min, max]: a positive value so small
    that the arithmetic it feeds overflows (a temperature of 1e-320) is refused rather than computed into NaNs."""

    def convert(self, value, param, ctx):
        x = self._parse(value, param, ctx)
        if x == 0:
            return 0.0
        if x < self.min or (self.max is not None and x > self.max):
            hi = f" and <= {self.max:g}" if self.max is not None else ""
            self.fail(f"must be 0 or >= {self.min:g}{hi} (got {value})", param, ctx)
        return x


class EscapedText(click.ParamType):
    """Non-empty UTF-8 text in which \\n, \\t, \\r and \\\\ are escapes: a shell passes `--stop "\\n\\n"` as
    backslashes, and a newline is what such an option almost always means (llama.cpp reads its stop words so too)."""

    name = "text"
    ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        text = re.sub(r"\\([ntr\\])", lambda m: self.ESCAPES[m.group(1)], value)
        if not text:
            self.fail("must be non-empty text (an empty one would end before the first token)", param, ctx)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in text):  # (bytes that are not UTF-8 arrive as lone surrogates)
            self.fail(f"{value!r} is not UTF-8 text", param, ctx)
        return text


POSITIVE = Int(1, cap=INT32_MAX)  # counts and sizes that cannot be zero: batch size, sequence length, dimensions
COUNT = Int(0, cap=INT32_MAX)     # counts where 0 means "off" or "all"
SEED = Int(0, 2**32 - 1)  # non-negative, and 32 bits: what the device kernels take for stochastic rounding


def check_tokens(B: int, T: int) -> str | None:
    """Why a micro-batch of B sequences of T tokens is refused, in the flags' words (None when it is not)."""
    return micro_batch_error(B, T, flag_name)


def usage_error_line(e: click.UsageError) -> str:
    """click's usage errors as one line: `--lr must be ... (got ...)`, `--dtype: 'x' is not one of ...`."""
    # (a missing one has no message of its own: "SRC: " alone; click's own says "Missing argument 'SRC'.")
    named = isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter)
    msg = e.format_message() if not named else e.message
    param = getattr(e, "param", None)
    if named and param is not None:
        name = max(param.opts, key=len) if getattr(param, "opts", None) else param.name
        if isinstance(param, click.Argument):
            name = param.human_readable_name
        msg = f"{name} {msg}" if msg.startswith("must") else f"{name}: {msg}"
    ctx = getattr(e, "ctx", None)
    where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    if msg.startswith("Got unexpected extra argument") and any(("/" in a or "." in a) for a in _extra_args(msg)):
        # the shell expanded an unquoted glob (--data datasets/x/*train*.bin) into several paths
        where = " (a glob the shell expanded? quote it: --data 'datasets/NAME/*train*.bin')" + where
    return " ".join(msg.split()) + where


def _extra_args(msg: str) -> list[str]:
    inner = msg[msg.find("(") + 1:msg.rfind(")")] if "(" in msg else ""
    return inner.split()
