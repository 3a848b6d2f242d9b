"""What every command shares: the consoles, the one-line failure, and opening a backend by name."""

from __future__ import annotations

import sys

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8", "auto": None}  # fp8: bf16 with FP8 matmuls


_RANK: dict = {}  # set when this process is one rank of many: {"rank", "world", "comm"} (data parallel)


def fail(msg: str, code: int = 2) -> None:
    """One clear line on stderr and a non-zero exit; nothing on disk is touched after this."""
    who = f" (rank {_RANK['rank']} of {_RANK['world']})" if _RANK else ""
    from rich.markup import (
        escape,  # messages hold paths and pip specs like 'pkg[extra]': not markup
    )
    err_console.print(f"[bold red]error{who}:[/] {escape(msg)}", soft_wrap=True)
    if _RANK.get("comm") is not None:  # the other ranks wait in a collective: take the whole job down
        sys.stderr.flush()
        from llmc_cli.parallel.launch import note_failure
        note_failure(_RANK["rank"], _RANK["world"], msg)
        _RANK["comm"].abort(code)
    sys.exit(code)


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


def one_line(e: BaseException) -> str:
    """An exception as the one line `fail` prints; an OSError names its file and the system's reason."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__



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
