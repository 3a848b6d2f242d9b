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

# relative error (max |got - ref| / max |ref|) above which a kernel is a mismatch, by the backend's dtype
TOLERANCES = {FLOAT32: 1e-4, BFLOAT16: 3e-2, FP8: 1e-1,  # FP8: a matmul's, operands rounded to 3 or 2 mantissa bits
              TF32: 3e-3}  # a float32 matmul on TF32 tensor cores: operands rounded to 10 mantissa bits
DTYPE_BYTES = {FLOAT32: 4, BFLOAT16: 2, INT32: 4}


class BenchError(ValueError):
    """Bad options (unknown backend, impossible shapes); the message is one line."""


# ---------------------------------------------------------------------------------------------------------------
# choosing backends

def resolve_backends(names: Sequence[str], dtype: str | None | Sequence[str | None] = None, plugins=None,
                     options: dict[str, str] | None = None,
                     labels: Sequence[str] | None = None) -> tuple[list[tuple[str, Backend]], list[tuple[str, str]]]:
    """Create the named backends (all usable ones when `names` is empty) computing in `dtype` (None = each
    backend's default; a list: each backend once per dtype, labelled "<name> <labels[i]>"). Returns
    ([(label, backend)], [(name, why it was left out)]). A backend named explicitly that cannot run raises
    BenchError; with no names, unusable backends are only reported.
    `plugins`: a list of `registry.PluginInfo` to choose from (default: `registry.discover()`); `options`:
    backend options (--backend-opt), given to each backend that declares them."""
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
    tags = list(labels) if labels is not None else [None] * len(dtypes)
    plugins = registry.discover() if plugins is None else list(plugins)
    by_name = {p.name: p for p in plugins}
    chosen, skipped = [], []
    wanted = list(dict.fromkeys(names)) if names else [p.name for p in plugins]
    for name in wanted:
        p = by_name.get(name)
        if p is None:
            raise BenchError(f"--backend {name}: not installed (installed: {', '.join(by_name) or 'none'})")
        if p.plugin is None or not p.usable:
            if names:
                raise BenchError(f"--backend {name}: installed but cannot run here: {p.reason}")
            skipped.append((name, p.reason))
            continue
        mine = {k: v for k, v in (options or {}).items() if k in (getattr(p.plugin, "options", {}) or {})}
        for dt, tag in zip(dtypes, tags):
            label = name if tag is None else f"{name} {tag}"
            try:
                chosen.append((label, registry.create_with(p.plugin, None, dt, mine)))
            except BackendUnavailable as e:
                if names:
                    raise BenchError(f"--backend {name}{'' if tag is None else ' --dtype ' + tag}: {e}") from None
                skipped.append((label, str(e)))
    if not chosen:
        raise BenchError("no usable backend to benchmark (see `llmc backends`)")
    declared = {k for name in {label.split()[0] for label, _ in chosen}
                for k in (getattr(by_name[name].plugin, "options", {}) or {})}
    if unknown := sorted(set(options or {}) - declared):
        raise BenchError(f"--backend-opt {unknown[0]}: none of the benchmarked backends has this option "
                         "(see `llmc backends --options`)")
    return chosen, skipped


def reference_backend(backends: Sequence[tuple[str, Backend]], plugins=None) -> Backend | None:
    """The float32 host backend every other is checked against (CAP_REFERENCE): the one in `backends` if it is
    there, else one created from the first usable plugin that offers it."""
    for label, b in backends:
        if CAP_REFERENCE in b.capabilities and b.dtype == FLOAT32:
            return b
    plugins = registry.discover() if plugins is None else plugins
    for p in plugins:
        if p.plugin is not None and p.usable and getattr(p.plugin, "reference", False):
            try:
                return p.plugin.create(dtype=FLOAT32)
            except BackendUnavailable:
                return None
    return None
