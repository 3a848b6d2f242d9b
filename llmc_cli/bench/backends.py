"""Which backends a benchmark compares, and which one serves as the reference for the errors."""

from __future__ import annotations

from typing import Sequence

from llmc_cli import registry
from llmc_cli.kernels import (
    BFLOAT16,
    CAP_REFERENCE,
    FLOAT32,
    FP8,
    INT32,
    TF32,
    Backend,
    BackendUnavailable,
)
from llmc_cli.naming import arg

# relative error (max |got - ref| / max |ref|) above which a kernel is a mismatch, by the backend's dtype
TOLERANCES = {FLOAT32: 1e-4, BFLOAT16: 3e-2, FP8: 1e-1,  # FP8: a matmul's, operands rounded to 3 or 2 mantissa bits
              TF32: 3e-3}  # a float32 matmul on TF32 tensor cores: operands rounded to 10 mantissa bits
DTYPE_BYTES = {FLOAT32: 4, BFLOAT16: 2, INT32: 4}


class BenchError(ValueError):
    """Bad options (unknown backend, impossible shapes); the message is one line."""


# ---------------------------------------------------------------------------------------------------------------
# choosing backends

def _pick(found) -> dict:
    """name -> the plugin a name stands for: where two distributions register one name, the first usable one (as
    `registry.usable_plugin` takes), else the first."""
    by_name: dict = {}
    for p in found:
        have = by_name.get(p.name)
        if have is None or (not (have.usable and have.plugin is not None) and p.usable and p.plugin is not None):
            by_name[p.name] = p
    return by_name


def failure_line(e: BaseException) -> str:
    """An exception a backend raised, as the one line a report shows."""
    text = registry.one_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _named(name: str) -> str:
    """A backend of resolve_backends' `names` as its caller gave it (`--backend cuda` on the command line)."""
    return f"{arg('names', cli='backend')} {name}"


def _not_installed(name: str, installed: list[str]) -> None:
    """The BenchError for a --backend no plugin answers to."""
    listed = f"installed: {', '.join(installed) or 'none'}"
    if not name.strip():
        raise BenchError(f"{arg('names', cli='backend')}: an empty name; give one of the installed backends ({listed})")
    if "," in name:  # (a list in one option: each backend is an option of its own)
        raise BenchError(f"{_named(name)}: not installed ({listed}); give one backend per {arg('names', cli='backend')}"
                         f", e.g. {arg('names', ['cpu', 'opencl'], cli='backend')}")
    raise BenchError(f"{_named(name)}: not installed ({listed})")


def _create(plugin, name: str, tag: str | None, dtype, options: dict, named: bool, chosen: list, skipped: list,
            failed: list) -> None:
    """One backend of a usable plugin into `chosen`, labelled "<name> <tag>"; a failure raises BenchError when the
    backend was `named`, else is a line in `skipped` (unavailable) or `failed` (the plugin broke its word)."""
    label = name if tag is None else f"{name} {tag}"
    try:
        chosen.append((label, registry.create_with(plugin, None, dtype, options)))
    except registry.PluginError as e:  # probed usable, then broke the contract: a failure, not a skip
        if named:
            raise BenchError(f"{_named(label)}: {e}") from None
        failed.append((label, str(e)))
    except BackendUnavailable as e:
        if named:
            raise BenchError(f"{_named(name)}{'' if tag is None else ' ' + arg('dtype') + ' ' + tag}: {e}") from None
        skipped.append((label, str(e)))
    except Exception as e:  # noqa: BLE001  (a plugin's bug in create(): its line, the others still run)
        if named:
            raise BenchError(f"{_named(label)}: cannot start ({failure_line(e)})") from None
        failed.append((label, f"cannot start ({failure_line(e)})"))


def resolve_backends(names: Sequence[str], dtype: str | None | Sequence[str | None] = None, plugins=None,
                     options: dict[str, str] | None = None,
                     labels: Sequence[str] | None = None,
                     failed: list[tuple[str, str]] | None = None,
                     ) -> tuple[list[tuple[str, Backend]], list[tuple[str, str]]]:
    """Create the named backends (all usable ones when `names` is empty) computing in `dtype` (None = each
    backend's default; a list: each backend once per dtype, labelled "<name> <labels[i]>"). Returns
    ([(label, backend)], [(name, why it was left out)]). A backend named explicitly that cannot run raises
    BenchError; with no names, unusable backends are only reported, and one whose plugin said it could run but
    whose create() then failed (raised, or returned no working Backend) goes into `failed` (label, why), or into
    the skipped ones where `failed` is None.
    `plugins`: a list of `registry.PluginInfo` to choose from (default: the named plugins, or
    `registry.discover()`); `options`: backend options (--backend-opt), given to each backend that declares them."""
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
    tags = list(labels) if labels is not None else [None] * len(dtypes)
    given = plugins is not None
    if not given:  # a named backend loads and probes only its own plugin: another one's hang is not this run's
        plugins = registry.plugins_named(names) if names else registry.discover()
    plugins = list(plugins)
    by_name = _pick(plugins)
    chosen, skipped = [], []
    wanted = list(dict.fromkeys(names)) if names else list(by_name)
    for name in wanted:
        p = by_name.get(name)
        if p is None:
            _not_installed(name, list(by_name) if given else (registry.installed_names() or list(by_name)))
        if p.plugin is None or not p.usable:
            if names:
                raise BenchError(f"{_named(name)}: installed but cannot run here: {registry.one_line(p.reason)}")
            skipped.append((name, registry.one_line(p.reason)))
            continue
        mine = {k: v for k, v in (options or {}).items() if k in (getattr(p.plugin, "options", {}) or {})}
        for dt, tag in zip(dtypes, tags):
            _create(p.plugin, name, tag, dt, mine, bool(names), chosen, skipped,
                    failed if failed is not None else skipped)
    if not chosen:
        if failed:
            raise BenchError("no backend to benchmark: " + "; ".join(f"{n}: {r}" for n, r in failed))
        raise BenchError("no usable backend to benchmark (see `llmc backends`)")
    declared = {k for name in {label.split()[0] for label, _ in chosen}
                for k in (getattr(by_name[name].plugin, "options", {}) or {})}
    if unknown := sorted(set(options or {}) - declared):
        raise BenchError(f"{arg('options', cli='backend_opt')} {unknown[0]}: none of the benchmarked backends has this "
                         "option (see `llmc backends --options`)")
    return chosen, skipped


# the plugin whose backend is the reference wherever it can run: llmc's own numpy backend (a plugin announcing
# `reference` is the reference only where no cpu backend can serve)
REFERENCE_PLUGIN = "cpu"


def _is_reference(b: Backend) -> bool:
    return CAP_REFERENCE in b.capabilities and b.dtype == FLOAT32


def choose_reference(backends: Sequence[tuple[str, Backend]], plugins=None) -> tuple[str, Backend] | None:
    """(name, backend) every other is checked against: the cpu backend (float32 on the host, CAP_REFERENCE), the
    benchmarked one or one created for the purpose; only where it cannot serve, another backend announcing
    CAP_REFERENCE (benchmarked, then created from a plugin declaring `reference`). None when nothing serves."""
    mine = [(label, b) for label, b in backends if label.split()[0] == REFERENCE_PLUGIN and _is_reference(b)]
    if mine:
        return REFERENCE_PLUGIN, mine[0][1]
    if plugins is None:  # the cpu plugin alone first: probing every plugin is for when it is not there
        found = _reference_from(registry.plugins_named([REFERENCE_PLUGIN]))
        if found is not None:
            return found
    else:
        found = _reference_from([p for p in plugins if p.name == REFERENCE_PLUGIN])
        if found is not None:
            return found
    for label, b in backends:
        if _is_reference(b):
            return label.split()[0], b
    return _reference_from(registry.discover() if plugins is None else plugins)


def _reference_from(plugins) -> tuple[str, Backend] | None:
    """The first usable plugin of `plugins` declaring `reference` whose create(dtype=float32) gives a reference
    backend; a plugin that fails at that is passed over."""
    for p in plugins:
        if p.plugin is not None and p.usable and getattr(p.plugin, "reference", False):
            try:
                b = registry.create_with(p.plugin, None, FLOAT32, None)
            except Exception:  # noqa: BLE001, S112  (BackendUnavailable or a broken plugin: try the next)
                continue
            if _is_reference(b):
                return p.name, b
    return None


def reference_backend(backends: Sequence[tuple[str, Backend]], plugins=None) -> Backend | None:
    """The backend of `choose_reference` (None when nothing serves)."""
    ref = choose_reference(backends, plugins)
    return None if ref is None else ref[1]
