"""Backend discovery: every backend is a plugin found through the entry-point group ``llmc.backends``.

The engine never imports a backend by name; a third party can ship `llmc-metal` with one entry point and it
shows up in `llmc backends` and `--backend metal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points

from llmc_cli.kernels import CAP_FP8, FLOAT32, FP8, Backend, BackendPlugin, BackendUnavailable

GROUP = "llmc.backends"


@dataclass
class PluginInfo:
    name: str
    plugin: BackendPlugin | None
    usable: bool
    reason: str          # the device found, or why it cannot run here
    distribution: str


def discover() -> list[PluginInfo]:
    """Every installed backend with whether it can run here, highest priority first."""
    found = []
    for ep in entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            obj = ep.load()
            plugin = obj() if isinstance(obj, type) else obj
        except Exception as e:  # a broken plugin must not take the others down
            found.append(PluginInfo(ep.name, None, False, f"failed to load: {type(e).__name__}: {e}", dist))
            continue
        try:
            usable, reason = plugin.probe()
        except Exception as e:
            usable, reason = False, f"probe failed: {type(e).__name__}: {e}"
        found.append(PluginInfo(ep.name, plugin, usable, reason, dist))
    found.sort(key=lambda p: (-(p.plugin.priority if p.plugin else -1), p.name))
    return found


def check_option_names(plugin: BackendPlugin, options: dict[str, str] | None) -> None:
    """BackendUnavailable for the first of `options` the plugin does not declare (the values are its own to check)."""
    known = getattr(plugin, "options", {}) or {}
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        have = ", ".join(known) or "none"
        raise BackendUnavailable(f"--backend-opt {unknown[0]}: backend '{plugin.name}' has no such option "
                                 f"(options: {have}; see `llmc backends --options`)")


def create_with(plugin: BackendPlugin, device: str | None, dtype: str | None, options: dict[str, str] | None) -> Backend:
    try:
        if not options:  # plugins written before options existed keep working
            return plugin.create(device=device, dtype=dtype)
        check_option_names(plugin, options)
        return plugin.create(device=device, dtype=dtype, options=dict(options))
    except BackendUnavailable as e:
        if dtype == FP8 and f"'{CAP_FP8}'" not in str(e):  # say what fp8 asks of a backend, whatever it said
            raise BackendUnavailable(f"{e} (fp8 needs a backend with the '{CAP_FP8}' capability: FP8 matmuls)") from None
        raise


def usable_plugin(name: str = "auto") -> BackendPlugin:
    """The plugin called `name` (or the best usable one for "auto"), probed usable here; BackendUnavailable says
    why not."""
    plugins = discover()
    if name == "auto":
        usable = [p for p in plugins if p.usable and p.plugin is not None]
        if not usable:
            raise BackendUnavailable("no usable backend installed (see `llmc backends`)")
        return usable[0].plugin
    for p in plugins:
        if p.name == name:
            if p.plugin is None or not p.usable:
                raise BackendUnavailable(f"backend '{name}' is installed but cannot run here: {p.reason}")
            return p.plugin
    names = ", ".join(p.name for p in plugins) or "none"
    raise BackendUnavailable(f"unknown backend '{name}' (installed: {names})")


def create_backend(name: str = "auto", device: str | None = None, dtype: str | None = None,
                   options: dict[str, str] | None = None) -> Backend:
    """The backend called `name` (or the best usable one for "auto") with the plugin's `options`;
    BackendUnavailable says why not."""
    return create_with(usable_plugin(name), device, dtype, options)


def load_plugin(name: str) -> BackendPlugin | None:
    """The plugin registered as `name`, loaded but not probed (None when no such entry point loads)."""
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            try:
                obj = ep.load()
            except Exception:
                return None
            return obj() if isinstance(obj, type) else obj
    return None


def default_dtype(name: str = "auto") -> str:
    """The dtype `create(dtype=None)` would give for backend `name` ("auto": the best usable one), without
    creating it (what `--dry-run` plans with); float32 when nothing answers."""
    if name == "auto":
        usable = [p.plugin for p in discover() if p.usable and p.plugin is not None]
        plugin = usable[0] if usable else None
    else:
        plugin = load_plugin(name)
    return getattr(plugin, "default_dtype", FLOAT32) if plugin is not None else FLOAT32
