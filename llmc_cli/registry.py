"""Backend discovery: every backend is a plugin found through the entry-point group ``llmc.backends``.

The engine never imports a backend by name; a third party can ship `llmc-metal` with one entry point and it
shows up in `llmc backends` and `--backend metal`.

Plugins are third-party code running inside every command, so nothing one does may take a command down: a plugin
that fails to import (SystemExit included), declares attributes of the wrong type, prints to standard output,
answers its probe out of contract or never answers it is listed as unusable with one line saying why, and the
others work as before. A command that names its backend loads and probes only the plugins of that name.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, redirect_stdout
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from llmc_cli.kernels import (
    BFLOAT16,
    CAP_FP8,
    FLOAT32,
    FP8,
    Backend,
    BackendPlugin,
    BackendUnavailable,
)

GROUP = "llmc.backends"
PROBE_TIMEOUT_ENV = "LLMC_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 20.0  # seconds: a first CUDA or OpenCL initialisation takes a few; a hang never ends
PLUGIN_DTYPES = (FLOAT32, BFLOAT16, FP8)  # what `create(dtype=...)` may be asked for, so what default_dtype may be
BUFFER_DTYPES = (FLOAT32, BFLOAT16)  # what a created Backend may compute in (fp8 runs on bfloat16 buffers)
REASON_MAX = 400  # characters of a reason line: a plugin's message is shown in a table cell


class PluginError(BackendUnavailable):
    """A plugin broke the contract (create() returned something that is not a Backend, raised SystemExit...);
    the message is one line. A BackendUnavailable, so commands report it as they report any backend that cannot
    run, while the conformance kit fails it where it skips an honest BackendUnavailable."""


@dataclass
class PluginInfo:
    name: str
    plugin: BackendPlugin | None
    usable: bool
    reason: str          # the device found, or why it cannot run here (one line)
    distribution: str
    # the plugin broke the contract (failed to load, a bad attribute, a probe that raised, hung or answered out of
    # contract), as against a correct plugin whose probe says it cannot run here: the kit fails the first, skips
    # the second
    broken: bool = False


# ---------------------------------------------------------------------------------------------------------------
# running plugin code

def one_line(text: object, limit: int = REASON_MAX) -> str:
    """`text` as one printable line of at most `limit` characters: runs of whitespace (newlines included) become
    one space and control characters (an escape sequence) are shown escaped, as in a repr, so that a plugin's
    message can neither break a table row nor drive the terminal."""
    try:
        s = text if isinstance(text, str) else str(text)
    except Exception:  # noqa: BLE001  (an object whose __str__ raises still gets a line)
        s = f"<{type(text).__name__}>"
    s = " ".join(s.split())
    s = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in s)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _short(obj: object, limit: int = 80) -> str:
    """A short repr of a value a plugin gave, for a message about it."""
    try:
        r = repr(obj)
    except Exception:  # noqa: BLE001
        r = f"<{type(obj).__name__}>"
    return f"{type(obj).__name__} {one_line(r, limit)}"


def _failure(what: str, e: BaseException) -> str:
    text = one_line(e)
    return f"{what} failed: {type(e).__name__}" + (f": {text}" if text else "")


def probe_timeout() -> float:
    """Seconds a plugin's import or probe may take before it is reported unusable: LLMC_PROBE_TIMEOUT, a finite
    number above 0 (default DEFAULT_PROBE_TIMEOUT; a bad value is named on stderr once and the default used,
    since discovery runs inside every command and must not fail it)."""
    raw = os.environ.get(PROBE_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        if not _WARNED:
            _WARNED.append(raw)
            print(f"warning: {PROBE_TIMEOUT_ENV}={one_line(raw, 60)}: expected seconds, a finite number above 0; "
                  f"using {DEFAULT_PROBE_TIMEOUT:g}", file=sys.stderr)
        return DEFAULT_PROBE_TIMEOUT
    return min(value, threading.TIMEOUT_MAX)


_WARNED: list[str] = []
# what did not answer in time, by (stage, entry point): (its thread, where it leaves its answer, the line saying
# so). A thread cannot be stopped, so it is not started again: a later discovery in the same process takes its
# answer if it has come since (a slow import), or says at once that it has not
_STUCK: dict[tuple, tuple[threading.Thread, dict, str]] = {}


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """Python-level prints go to standard error meanwhile: a plugin that prints while it loads, probes or creates
    its backend must not corrupt a command's --json on standard output."""
    target = sys.stderr if sys.stderr is not None else open(os.devnull, "w")  # noqa: SIM115
    with redirect_stdout(target):
        yield


def _passes(e: BaseException) -> bool:
    """Exceptions a plugin's failure never swallows: the user's Ctrl-C, and a generator being closed."""
    return isinstance(e, (KeyboardInterrupt, GeneratorExit))


def _bounded(fn: Callable[[], Any], what: str, key: tuple, timeout: float) -> tuple[bool, Any]:
    """fn() in a daemon thread, waited for at most `timeout` seconds: (True, its value) or (False, one line
    saying why not: "<what> failed: ..." when it raised, SystemExit included, or "<what> did not answer within N
    s"). A hung plugin then costs a command `timeout` seconds once, not the command."""
    if key in _STUCK:
        thread, box, line = _STUCK[key]
        if thread.is_alive():
            return False, line
        del _STUCK[key]
        return _answer(box, what)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (SystemExit too: a plugin must not end the command)
            box["error"] = e

    t = threading.Thread(target=run, name=f"llmc-plugin-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        line = f"{what} did not answer within {timeout:g} s ({PROBE_TIMEOUT_ENV} sets the limit)"
        _STUCK[key] = (t, box, line)
        return False, line
    return _answer(box, what)


def _answer(box: dict, what: str) -> tuple[bool, Any]:
    if "error" in box:
        if _passes(box["error"]):
            raise box["error"]
        return False, _failure(what, box["error"])
    return True, box.get("value")


# ---------------------------------------------------------------------------------------------------------------
# checking what a plugin declares and answers

def plugin_problem(plugin: object) -> str | None:
    """Why `plugin` breaks the contract's declarations (BackendPlugin's class attributes), or None. A bad one
    would break sorting, --json or option checks in every command, so it is caught here, once."""
    if not isinstance(plugin, BackendPlugin):
        return (f"not a backend plugin ({_short(plugin)}): the entry point must name a subclass of "
                "llmc_cli.kernels.BackendPlugin or an instance of one")
    try:
        name = plugin.name
        priority = plugin.priority
        dtype = plugin.default_dtype
        reference = getattr(plugin, "reference", False)
        options = getattr(plugin, "options", {})
    except Exception as e:  # noqa: BLE001  (a property that raises)
        return _failure("reading its attributes", e)
    if not isinstance(name, str) or not name:
        return f"name must be a non-empty str (got {_short(name)})"
    if (isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Real)
            or not math.isfinite(float(priority))):
        return f"priority must be a finite number (got {_short(priority)})"
    if not isinstance(dtype, str) or dtype not in PLUGIN_DTYPES:
        return f"default_dtype must be one of {', '.join(PLUGIN_DTYPES)} (got {_short(dtype)})"
    if not isinstance(reference, (bool, np.bool_)):
        return f"reference must be a bool (got {_short(reference)})"
    if options is None:
        return None
    if not isinstance(options, Mapping):
        return f"options must be a dict of option name -> one line of help (got {_short(options)})"
    for k, v in options.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return f"options must map str to str (got {_short(k)} -> {_short(v)})"
    return None


def probe_answer(answer: object) -> tuple[bool, str, bool]:
    """A probe's answer as (usable, one-line reason, broken): the contract is (bool, str); anything else is
    unusable, with what it was."""
    if (isinstance(answer, (tuple, list)) and len(answer) == 2 and isinstance(answer[0], (bool, np.bool_))
            and isinstance(answer[1], str)):
        return bool(answer[0]), one_line(answer[1]), False
    return False, f"probe() must answer (usable: bool, reason: str), not {_short(answer)}", True


def check_backend(backend: object) -> Backend:
    """`backend`, which a plugin's create() returned, if it is a Backend whose declarations the engine can read;
    PluginError otherwise (capabilities that are not a set of str break every capability test)."""
    if not isinstance(backend, Backend):
        raise PluginError(f"create() returned {_short(backend)}, not a llmc_cli.kernels.Backend")
    try:
        caps, dtype = backend.capabilities, backend.dtype
    except Exception as e:  # noqa: BLE001
        raise PluginError(_failure("reading the backend's capabilities and dtype", e)) from None
    if not isinstance(caps, (set, frozenset)) or not all(isinstance(c, str) for c in caps):
        raise PluginError(f"the backend's capabilities must be a set or frozenset of str (got {_short(caps)})")
    if not isinstance(dtype, str) or dtype not in BUFFER_DTYPES:
        raise PluginError(f"the backend's dtype must be one of {', '.join(BUFFER_DTYPES)} (got {_short(dtype)})")
    return backend


def _priority(p: PluginInfo) -> float:
    """The sort key's priority; a plugin that did not load (or a stand-in without a valid one) sorts below 0."""
    prio = getattr(p.plugin, "priority", -1) if p.plugin is not None else -1
    try:
        prio = float(prio)
    except (TypeError, ValueError):
        return -math.inf
    return prio if math.isfinite(prio) else -math.inf


# ---------------------------------------------------------------------------------------------------------------
# discovery

def _entry_points() -> list:
    """The group's entry points (what tests replace to install fake plugins without pip)."""
    return list(entry_points(group=GROUP))


def _ep_key(ep) -> tuple:
    return (getattr(ep, "name", "?"), getattr(ep, "value", "?"))


def _distribution(ep) -> str:
    try:
        return str(ep.dist.name) if ep.dist is not None and ep.dist.name else "?"
    except Exception:  # noqa: BLE001  (a damaged dist-info)
        return "?"


def load_entry(ep, timeout: float | None = None) -> tuple[BackendPlugin | None, str]:
    """The plugin an entry point names, imported (bounded by the probe timeout) and instantiated, its
    declarations checked: (plugin, "") or (None, one line saying why not)."""
    def load() -> object:
        obj = ep.load()
        if isinstance(obj, type):
            if not issubclass(obj, BackendPlugin):  # do not call an arbitrary class
                return obj
            obj = obj()
        return obj

    ok, got = _bounded(load, "import", ("load", *_ep_key(ep)), probe_timeout() if timeout is None else timeout)
    if not ok:  # ("failed to load: ModuleNotFoundError: ..." is what commands turn into a pip install line)
        return None, got.replace("import failed:", "failed to load:", 1)
    if (why := plugin_problem(got)) is not None:
        return None, why
    return got, ""


def probe_plugin(plugin: BackendPlugin, key: tuple, timeout: float | None = None) -> tuple[bool, str, bool]:
    """(usable, one-line reason, broken) from the plugin's probe, bounded by the probe timeout."""
    ok, got = _bounded(plugin.probe, "probe", ("probe", *key), probe_timeout() if timeout is None else timeout)
    if not ok:
        return False, got, True
    usable, reason, broken = probe_answer(got)
    if not broken and (why := plugin_problem(plugin)) is not None:  # a probe may set priority (opencl does)
        return False, f"after probe(): {why}", True
    return usable, reason, broken


def _examine(ep, probe: bool) -> PluginInfo:
    dist = _distribution(ep)
    plugin, why = load_entry(ep)
    if plugin is None:
        return PluginInfo(ep.name, None, False, why, dist, broken=True)
    if not probe:
        return PluginInfo(ep.name, plugin, False, "not probed", dist)
    usable, reason, broken = probe_plugin(plugin, _ep_key(ep))
    return PluginInfo(ep.name, None if broken else plugin, usable, reason, dist, broken=broken)


def _discover(only: Collection[str] | None, probe: bool = True) -> list[PluginInfo]:
    found = []
    try:
        eps = _entry_points()
    except Exception:  # noqa: BLE001  (damaged installed metadata: no plugin rather than no command)
        eps = []
    with quiet_stdout():
        for ep in eps:
            if only is None or ep.name in only:
                found.append(_examine(ep, probe))
    # (after the probes: a probe may lower its plugin's priority, as opencl's does on a CPU device)
    found.sort(key=lambda p: (-_priority(p), p.name))
    return found


# the names a command asked for (None: all), so that `discover()` stays the one function tools and tests replace (a
# callable without arguments) while a named --backend loads and probes no other plugin
_ONLY: ContextVar[frozenset[str] | None] = ContextVar("llmc_registry_only", default=None)


def discover() -> list[PluginInfo]:
    """Every installed backend with whether it can run here, highest priority first. Each import and probe runs
    with standard output sent to standard error and waits at most `probe_timeout()` seconds."""
    return _discover(_ONLY.get())


def plugins_named(names: Collection[str]) -> list[PluginInfo]:
    """The installed plugins called any of `names` (every one, where two distributions register the same name),
    probed, highest priority first; no other plugin is imported or probed, so a broken one cannot hold up a
    command that did not ask for it."""
    wanted = frozenset(names)
    token = _ONLY.set(wanted)
    try:
        found = discover()
    finally:
        _ONLY.reset(token)
    return [p for p in found if p.name in wanted]


def installed_names() -> list[str]:
    """The names registered in the group, without importing any plugin."""
    try:
        return list(dict.fromkeys(str(ep.name) for ep in _entry_points()))
    except Exception:  # noqa: BLE001  (damaged metadata: the names are only for a message)
        return []


def check_option_names(plugin: BackendPlugin, options: dict[str, str] | None) -> None:
    """BackendUnavailable for the first of `options` the plugin does not declare (the values are its own to check)."""
    known = getattr(plugin, "options", {}) or {}
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        have = ", ".join(known) or "none"
        raise BackendUnavailable(f"--backend-opt {unknown[0]}: backend '{plugin.name}' has no such option "
                                 f"(options: {have}; see `llmc backends --options`)")


def create_with(plugin: BackendPlugin, device: str | None, dtype: str | None, options: dict[str, str] | None) -> Backend:
    """plugin.create(...), checked (PluginError for what is not a usable Backend, or a SystemExit from it); an
    Exception from create() itself is the caller's to report."""
    try:
        with quiet_stdout():  # (a plugin that prints while it opens its device: --json stays clean)
            if not options:  # plugins written before options existed keep working
                backend = plugin.create(device=device, dtype=dtype)
            else:
                check_option_names(plugin, options)
                backend = plugin.create(device=device, dtype=dtype, options=dict(options))
    except BackendUnavailable as e:
        if dtype == FP8 and f"'{CAP_FP8}'" not in str(e):  # say what fp8 asks of a backend, whatever it said
            raise BackendUnavailable(f"{e} (fp8 needs a backend with the '{CAP_FP8}' capability: FP8 matmuls)") from None
        raise
    except Exception:
        raise
    except BaseException as e:  # SystemExit and the like from a plugin: its failure, not the command's end
        if _passes(e):
            raise
        raise PluginError(_failure("create()", e)) from None
    return check_backend(backend)


def _unusable(name: str, found: list[PluginInfo]) -> BackendUnavailable:
    if len(found) == 1:
        return BackendUnavailable(f"backend '{name}' is installed but cannot run here: {found[0].reason}")
    each = "; ".join(f"{p.distribution}: {p.reason}" for p in found)
    return BackendUnavailable(f"backend '{name}' is installed {len(found)} times, none can run here ({each})")


def usable_plugin(name: str = "auto") -> BackendPlugin:
    """The plugin called `name` (or the best usable one for "auto"), probed usable here; BackendUnavailable says
    why not. Where two distributions register `name`, the usable one (the higher priority of two usable)."""
    if name == "auto":
        usable = [p for p in discover() if p.usable and p.plugin is not None]
        if not usable:
            raise BackendUnavailable("no usable backend installed (see `llmc backends`)")
        return usable[0].plugin
    found = plugins_named([name])
    if not found:
        names = ", ".join(installed_names()) or "none"
        raise BackendUnavailable(f"unknown backend '{name}' (installed: {names})")
    for p in found:
        if p.usable and p.plugin is not None:
            return p.plugin
    raise _unusable(name, found)


def create_backend(name: str = "auto", device: str | None = None, dtype: str | None = None,
                   options: dict[str, str] | None = None) -> Backend:
    """The backend called `name` (or the best usable one for "auto") with the plugin's `options`;
    BackendUnavailable says why not."""
    return create_with(usable_plugin(name), device, dtype, options)


def load_plugin(name: str) -> BackendPlugin | None:
    """The plugin registered as `name`, loaded but not probed (None when no such entry point loads). Where two
    distributions register `name`, they are probed and the usable one is taken, as `usable_plugin` does."""
    loaded = [p for p in _discover(frozenset({name}), probe=False) if p.plugin is not None]
    if len(loaded) > 1:
        probed = [p for p in plugins_named([name]) if p.plugin is not None]
        return next((p.plugin for p in probed if p.usable), probed[0].plugin if probed else loaded[0].plugin)
    return loaded[0].plugin if loaded else None


def planned_scratch(plugin: BackendPlugin, dtype: str, options: dict[str, str] | None,
                    attention: tuple[int, int, int, int, int]) -> dict[str, int]:
    """`plugin.planned_scratch` for `--dry-run`, given the model's attention shape when its signature takes one (a
    plugin written before that argument existed keeps working): names to byte counts. BackendUnavailable passes
    (a bad option value); anything else the plugin raises or returns is a one-line PluginError."""
    fn = plugin.planned_scratch
    try:
        args, kw = _scratch_arguments(fn, dtype, options, attention)
        out = fn(*args, **kw)
    except BackendUnavailable:
        raise
    except BaseException as e:  # noqa: BLE001  (SystemExit too: a plugin must not end the command)
        if _passes(e):
            raise
        raise PluginError(f"planned_scratch() failed: {type(e).__name__}: {one_line(e, 200)}") from None
    if not isinstance(out, Mapping) or not all(
            isinstance(k, str) and isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0
            for k, v in out.items()):
        raise PluginError(f"planned_scratch() returned {_short(out)}, not names to byte counts")
    return {one_line(k, 80): int(v) for k, v in out.items()}


def _scratch_arguments(fn, dtype, options, attention) -> tuple[tuple, dict]:
    """The arguments `fn` takes: `attention` by name (or by position, where only that binds) when its signature has
    room for it, else (dtype, options) alone, as the contract had it before `attention`."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # (a callable without a signature: called the old way)
        return (dtype, options), {}
    for args, kw in (((dtype, options), {"attention": attention}), ((dtype, options, attention), {})):
        try:
            sig.bind(*args, **kw)
            return args, kw
        except TypeError:
            continue
    return (dtype, options), {}


def default_dtype(name: str = "auto") -> str:
    """The dtype `create(dtype=None)` would give for backend `name` ("auto": the best usable one), without
    creating it (what `--dry-run` plans with); float32 when nothing answers."""
    if name == "auto":
        usable = [p.plugin for p in discover() if p.usable and p.plugin is not None]
        plugin = usable[0] if usable else None
    else:
        plugin = load_plugin(name)
    dtype = getattr(plugin, "default_dtype", FLOAT32) if plugin is not None else FLOAT32
    return dtype if dtype in PLUGIN_DTYPES else FLOAT32
