"""Programs built once per context and cached, each first proven buildable in a child process (probe.py)."""

from __future__ import annotations

from llmc_cli.kernels import BackendUnavailable

from . import probe, sources

# (context pointer, source file, options) -> (program, {kernel name: Kernel})
_PROGRAMS: dict[tuple, tuple] = {}


def build_program(ctx, name: str, options: str = ""):
    """(program, kernels) for `name` built for `ctx` with `options`; built once per context and cached."""
    import pyopencl as cl  # (optional: the plugin loads without it, to say why it cannot run)
    key = (ctx.int_ptr, name, options)
    hit = _PROGRAMS.get(key)
    if hit is not None:
        return hit
    src = sources.source(name)
    for d in ctx.devices:  # (built in a child process first: a failed build can abort this one at exit)
        why = probe.build_verdicts(d, [(name, options)])[f"{name} {options}"]
        if why:
            raise BackendUnavailable(f"OpenCL {d.name.strip()}: cannot build {name} ({options or 'no options'}): "
                                     f"{why}")
    try:
        prg = cl.Program(ctx, src).build(options=options)
    except Exception as e:  # noqa: BLE001  (the build log's first error, not pyopencl's status words)
        dev = ", ".join(d.name.strip() for d in ctx.devices)
        raise BackendUnavailable(f"OpenCL {dev}: cannot build {name}: {probe.first_error_line(e)}") from None
    sigs = sources.signatures(src)
    built = set(prg.get_info(cl.program_info.KERNEL_NAMES).split(";"))
    if not built >= set(sigs):  # (a compiler that dropped a kernel it could not lower, and said nothing)
        dev = ", ".join(d.name.strip() for d in ctx.devices)
        raise BackendUnavailable(f"OpenCL {dev}: cannot build {name} ({options or 'no options'}): gave no kernel "
                                 f"{', '.join(sorted(set(sigs) - built))}")
    kernels = {}
    for kname, dts in sigs.items():
        k = cl.Kernel(prg, kname)
        k.set_scalar_arg_dtypes(dts)
        kernels[kname] = k
    _PROGRAMS[key] = (prg, kernels)
    return prg, kernels


def bo(a):
    """(base buffer, element offset) of an Array or view."""
    return a.base_data, a.offset // a.dtype.itemsize
