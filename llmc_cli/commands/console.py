"""What every command shares: the consoles, the one-line failure, and opening a backend by name."""

from __future__ import annotations

import os
import re
import sys

from rich.console import Console



class _Stderr:
    """sys.stderr, whichever it is at the moment, for rich's consoles: once it cannot be written (its reader gone,
    `2>&1 | head` or a closed terminal: EPIPE or EIO; or full, `2>/dev/full`), what follows goes to /dev/null. rich would otherwise end the command with exit 1
    where its own status was due (and point standard output at /dev/null), and a tokenize run that had written
    every shard left its manifest unfinished."""

    def _retry(self, op: str, *a):
        try:
            return getattr(sys.stderr, op)(*a)
        except OSError as e:
            # its reader gone (EPIPE, EIO), or nothing more fits (a full disk, 2>/dev/full): nothing can be said
            # any more, and the command still ends with its own status, not a traceback about its error line
            if e.errno is None:
                raise
            try:
                fd = sys.stderr.fileno()
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
            except (OSError, ValueError, AttributeError):
                return None
            return getattr(sys.stderr, op)(*a)

    def write(self, text: str):
        return self._retry("write", text)

    def flush(self) -> None:
        self._retry("flush")

    def __getattr__(self, name: str):  # (isatty, fileno, encoding: rich asks)
        return getattr(sys.stderr, name)


STDERR = _Stderr()
PLAIN_WIDTH = 80  # what a console lays its tables out in when the environment gives no usable width
WIDTH_RANGE = (20, 10_000)  # COLUMNS outside it lays nothing out usefully: 0 printed no table at all


def console_size() -> dict[str, int]:
    """The width (and height) a rich console is made with where COLUMNS (LINES) is set but unusable: 0, a few
    columns or garbage laid the result out in nothing (`COLUMNS=0 llmc backends` printed no line). Empty where the
    environment's value is usable or absent (rich then asks the terminal, or takes 80)."""
    size = {}
    for var, key, low, fallback in (("COLUMNS", "width", WIDTH_RANGE[0], PLAIN_WIDTH), ("LINES", "height", 1, 25)):
        raw = os.environ.get(var)
        if raw is not None and not (raw.isdigit() and low <= int(raw) <= WIDTH_RANGE[1]):
            size[key] = fallback
    return size


console = Console(highlight=False, soft_wrap=True, **console_size())
err_console = Console(file=STDERR, highlight=False, **console_size())

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8", "auto": None}  # fp8: bf16 with FP8 matmuls


_RANK: dict = {}  # set when this process is one rank of many: {"rank", "world", "comm"} (data parallel)


# what would break a line or drive a terminal: C0/C1 controls, DEL, Unicode's line and paragraph separators, and
# the lone surrogates that stand for a file name's bytes that are not UTF-8 (surrogateescape)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    o = ord(c)
    if 0xDC80 <= o <= 0xDCFF:  # a byte that is not UTF-8, as surrogateescape keeps it: shown as that byte
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: str) -> str:
    """`text` as one line that prints on any terminal: a file name may hold a newline, an escape sequence or bytes
    that are not UTF-8, which an error line shows as Python does in a repr (`\\n`, `\\x1b`, `\\xff`)."""
    return _UNPRINTABLE.sub(_escaped, text)


def terminal_text(text: str) -> str:
    """Text of several lines as `printable` shows each: newlines and tabs stay, while an escape sequence or a
    carriage return (a path's, or a model's output, which can hold any bytes) is shown escaped instead of driving
    the terminal."""
    return "\n".join("\t".join(map(printable, line.split("\t"))) for line in text.split("\n"))


STDOUT_CLOSED: list = []  # what a command asked to happen when standard output's reader goes (when_stdout_closes)


def when_stdout_closes(callback) -> None:
    """From now on, a closed standard output (`llmc train | head`) calls `callback` once and what is printed after it
    goes nowhere, in place of ending the command (a training run stops after its step, with a checkpoint)."""
    STDOUT_CLOSED.append(callback)


def fail(msg: str, code: int = 2) -> None:
    """One clear line on stderr and a non-zero exit; nothing on disk is touched after this."""
    who = f" (rank {_RANK['rank']} of {_RANK['world']})" if _RANK else ""
    from rich.markup import (
        escape,  # messages hold paths and pip specs like 'pkg[extra]': not markup
    )
    msg = printable(msg)  # one line whatever the names in it hold
    err_console.print(f"[bold red]error{who}:[/] {escape(msg)}", soft_wrap=True)
    if _RANK.get("comm") is not None:  # the other ranks wait in a collective: take the whole job down
        sys.stderr.flush()
        from llmc_cli.parallel.launch import note_failure
        note_failure(_RANK["rank"], _RANK["world"], msg)
        _RANK["comm"].abort(code)
    sys.exit(code)


def refuse_empty_paths(required: tuple[str, ...] = (), **paths: str | None) -> None:
    """One line for a path option given as '' (`--checkpoint "$UNSET"`): an empty path is falsy, taken as the option
    left out, or the working directory to the file system, where a model was loaded without a word. Options by
    keyword, '_' for '-'; those in `required` cannot be left out."""
    for name, value in paths.items():
        if value == "":
            fail(f"--{name.replace('_', '-')}: an empty path; give a path"
                 + ("" if name in required else ", or leave the option out"))


def backend_options(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """--backend-opt KEY=VALUE (repeatable) as a dict; one line naming the bad one otherwise."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--backend-opt {pair!r}: expected KEY=VALUE, e.g. --backend-opt tune=off (see `llmc backends "
                 "--options`)")
        key, value = key.strip(), value.strip()
        if key in out and out[key] != value:  # which one was meant? (the same twice is harmless)
            fail(f"--backend-opt {key} is given twice, as {out[key]!r} and {value!r}; give it once")
        out[key] = value
    return out


BACKEND_OPT_HELP = ("A backend setting KEY=VALUE (repeatable); `llmc backends --options` lists each backend's, "
                    "e.g. --backend-opt tune=off.")


def make_backend(name: str, device: str | None, dtype: str, options: dict[str, str] | None = None):
    from llmc_cli.kernels import BackendUnavailable
    from llmc_cli.registry import create_backend
    try:
        return create_backend(name, device=device, dtype=DTYPES[dtype], options=options)
    except BackendUnavailable as e:
        msg = str(e)
        if "No module named" in msg and "pip install" not in msg:  # say what to install, once
            mod = msg.split("No module named", 1)[1].strip(" '\"").split("'")[0].split(".")[0]
            msg += f" (pip install {pip_name(mod, _distribution_of(name))})"
        fail(f"--backend {name}{f' --device {device}' if device else ''}: {msg}")
    except Exception as e:  # a driver error while opening the device: one line, not a traceback
        fail(f"--backend {name}{f' --device {device}' if device else ''}: cannot start "
             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


def json_text(obj, indent: int | None = None) -> str:
    """`obj` as strict JSON for stdout: json.dumps writes a NaN or an infinity as a bare NaN / Infinity, which no
    JSON reader but Python's takes, so those become null (a model whose loss overflowed has no loss)."""
    import json
    import math

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def one_line(e: BaseException) -> str:
    """An exception as the one line `fail` prints; an OSError names its file and the system's reason."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{printable(str(e.filename))}: " if e.filename else ""
        return f"{where}{e.strerror}"
    text = str(e)
    if not text:
        return type(e).__name__
    if type(e).__module__.startswith("llmc") and isinstance(e, ValueError):
        # llmc's own bad-input errors are written as one line: a newline in one is in a name it quotes
        return printable(text)
    return text.splitlines()[0]  # a driver's or a library's text: its first line says what went wrong



# ---- missing optional packages ----------------------------------------------------------------------------------
PIP_NAMES = {"pyarrow": "pyarrow", "datasets": "datasets", "safetensors": "safetensors", "torch": "torch",
             "tiktoken": "tiktoken", "hypothesis": "hypothesis", "huggingface_hub": "huggingface_hub",
             "transformers": "transformers", "whisper": "--no-deps openai-whisper", "mpi4py": "mpi4py"}


def _distribution_of(backend: str) -> str | None:
    from llmc_cli.registry import discover
    return next((p.distribution for p in discover() if p.name == backend), None)


def pip_name(module: str, distribution: str | None = None) -> str:
    """What to `pip install` for a missing `module`: a backend's own requirement naming it (from its
    distribution's metadata, extras kept: the fuller install), else the table above, else the module's name."""
    if distribution:
        import re
        from importlib.metadata import PackageNotFoundError, requires
        try:
            reqs = requires(distribution) or []
        except PackageNotFoundError:
            reqs = []
        norm = module.replace("_", "-").lower()
        found = []
        for r in reqs:
            spec = r.split(";")[0].strip()
            name = re.split(r"[\[<>=!~ ]", spec, maxsplit=1)[0].replace("_", "-").lower()
            if name == norm or name.startswith(norm + "-"):
                found.append(re.split(r"[<>=!~ ]", spec, maxsplit=1)[0])
        if found:
            best = max(found, key=lambda f: "[" in f)
            return f"'{best}'" if "[" in best else best
    return PIP_NAMES.get(module, module)


def missing_package_message(e: ModuleNotFoundError) -> str:
    mod = (e.name or str(e)).split(".")[0]
    pip = PIP_NAMES.get(mod, mod)
    return f"this needs the optional package '{mod}', which is not installed: pip install {pip}"
