"""`llmc train --config FILE.toml` and OUT/config.toml: a file of options read as the command's defaults, each value
checked as the command line's, and the options a run resolved written back in the same form."""

from __future__ import annotations

import json
import os
import select
import stat
from pathlib import Path

import click

from llmc_cli.commands.console import fail, one_line
from llmc_cli.formats.files import atomic_write_bytes

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

CONFIG_MAX_BYTES = 1 << 20  # a --config file larger than this is not a file of options
CONFIG_FILE = "config.toml"
CONFIG_HEADER = "# the options of this run, as `llmc train --config` reads them\n"
NOT_RECORDED = {"dry_run", "resume", "gpus", "procs", "init_file", "init_addr"}  # how this run starts, not what it is


def read_config_bytes(value: str) -> bytes:
    """--config's bytes: a regular file, or a pipe (`--config <(...)`) read until its writer closes it, as `cat`
    would; a device (/dev/zero never ends) or more than CONFIG_MAX_BYTES is not a file of options (ValueError)."""
    fd = os.open(value, os.O_RDONLY | os.O_NONBLOCK)  # (looked at before reading: a device is refused unread)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise ValueError(f"{value}: not a regular file (a TOML file of options)")
        waits = select.poll() if stat.S_ISFIFO(st.st_mode) else None
        if waits is not None:  # read from this same descriptor: a writer's bytes are in the pipe from its first write
            waits.register(fd, select.POLLIN)
        chunks, size = [], 0
        while size <= CONFIG_MAX_BYTES:
            if waits is not None:
                waits.poll()  # its writer's bytes, or its end (a FIFO no writer has opened yet is waited for)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # (a writer holds it open and has written nothing yet)
                continue
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise ValueError(f"{value}: more than {CONFIG_MAX_BYTES:,} bytes is not a file of options")
    finally:
        os.close(fd)


def parse_toml(value: str) -> dict:
    """The TOML file `value` as a dict; a ValueError of one line naming the file otherwise."""
    try:
        raw = read_config_bytes(value)
    except OSError as e:
        raise ValueError(f"{value}: {e.strerror or e}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, bytes that are not UTF-8, "a = [[[[..." nested
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise ValueError(f"{value}: not valid TOML ({why})") from None


def read_options(value: str, ctx: click.Context) -> dict:
    """The options a TOML file gives, by option name, each value checked as the command line's; a ValueError of
    one line naming the file and the key otherwise."""
    data = parse_toml(value)
    names = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    options, spelt = {}, {}
    for key, v in data.items():
        name = key.replace("-", "_")
        if name not in names or name == "config":
            raise ValueError(f"{value}: {key!r} is not an option of `llmc train`")
        if name in spelt:  # (TOML refuses a key twice, but not `overfit-batch` beside `overfit_batch`: the last won)
            raise ValueError(f"{value}: {spelt[name]!r} and {key!r} are the same option; give it once")
        spelt[name] = key
        opt = names[name]
        if opt.multiple and isinstance(v, str):  # one string for a list of one
            v = [v]
        try:
            checked_value(opt, key, v, ctx)
        except ValueError as e:
            raise ValueError(f"{value}: {e}") from None
        options[name] = v
    return options


def load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--config FILE.toml: its keys (option names, - or _) become this command's defaults, so flags given on the
    command line still win; a key that is not an option, or a value of the wrong kind, is one line naming it."""
    if value is None:
        return None
    try:
        defaults = read_options(value, ctx)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def checked_value(opt: click.Option, key: str, v, ctx: click.Context):
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


def is_llmcs_config(path: Path) -> bool | None:
    """Whether OUT/config.toml is one llmc wrote (its first line); None when there is none. Looked at before it is
    opened: a FIFO there would wait for a writer forever."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file() or path.is_symlink():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(len(CONFIG_HEADER.encode()))
    except OSError as e:
        fail(f"--out: {path}: {e.strerror or e}")
    return path.is_file() and not path.is_symlink() and head == CONFIG_HEADER.encode()


def check_config_target(path: Path) -> None:
    """OUT/config.toml is replaced at the start of every run: only when llmc wrote it (its first line)."""
    if is_llmcs_config(path) is False:
        fail(f"--out: {path} exists and was not written by llmc; llmc replaces only its own config.toml, so move it "
             "or give another --out; nothing was changed")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(json.dumps(str(x)) for x in v) + "]"
    return json.dumps(str(v))


def write_config(path: Path, ctx: click.Context) -> None:
    """The options this run resolved (defaults, --config, flags, what a resume took from the run), as TOML that
    --config reads back."""
    lines = [CONFIG_HEADER]
    for p in ctx.command.params:
        v = ctx.params.get(p.name) if p.name else None
        if not isinstance(p, click.Option) or p.name in NOT_RECORDED or v is None or v == ():
            continue
        name = p.name.replace('_', '-')
        if any(0xD800 <= ord(c) <= 0xDFFF for c in (str(v) if not isinstance(v, (list, tuple)) else "".join(v))):
            # a path with bytes that are not UTF-8: a TOML string cannot hold it, and `--config` would refuse the
            # whole file over one "\udcff"
            lines.append(f"# {name}: a name that is not UTF-8, which TOML cannot hold; give --{name} itself\n")
            continue
        lines.append(f"{name} = {_toml_value(v)}\n")
    try:
        atomic_write_bytes(path, "".join(lines).encode())
    except OSError as e:
        fail(one_line(e))
