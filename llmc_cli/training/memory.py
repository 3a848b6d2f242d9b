"""Memory a run needs: a plan that cannot fit is refused before anything is allocated, and an allocation that
fails says in one line what the plan asks for, what the device has, and what to lower."""

from __future__ import annotations

from llmc_cli.models.families import family_of, memory_plan
from llmc_cli.naming import arg, arg_both


# ---- before allocating ------------------------------------------------------------------------------------------
def host_memory() -> int | None:
    """The host's memory and swap in bytes (/proc/meminfo); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            sizes = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(sizes[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal") if k in sizes) or None
    except (OSError, ValueError):
        return None


def _device_total(backend) -> int | None:
    """The device's memory where the backend reports it (None: its buffers live on the host)."""
    try:
        return backend.memory_report().device_total or None
    except Exception:  # noqa: BLE001  (a report that fails says nothing about the plan; the run finds out itself)
        return None


def plan_refusal(backend, cfg, B: int, T: int, recompute: str = "none", world_size: int = 1, zero: int = 0,
                 overlap: bool = False) -> str | None:
    """Why the run cannot fit, from its plan alone (None when it may). Only what cannot fit is refused: the plan of
    one rank against the device's total memory, or, where the buffers live on the host, against the host's memory
    and swap; the host also holds the float32 weights that initialising or loading makes."""
    plan = memory_plan(cfg, B, T, getattr(backend, "matmul_dtype", None) or backend.dtype, recompute=recompute,
                       world_size=world_size, zero=zero, overlap=overlap)
    total, acts, weights = sum(plan.values()), plan["activations"], family_of(cfg).num_parameters(cfg) * 4
    device = _device_total(backend)
    if device is not None and total > device:
        where, have, need, fixed = "the device has", device, total, total - acts
    else:
        host = host_memory()
        need = weights + (total if device is None else 0)
        if host is None or need <= host:
            return None
        where, have, fixed = "the host has (memory and swap)", host, need - (acts if device is None else 0)
    if fixed > have:  # (what B and T do not change)
        remedy = f"use a smaller model ({arg('model')}, {arg('n_layer')}, {arg('n_embd')})"
    else:
        remedy = f"lower {arg('batch_size')} or {arg('seq_len')} ({arg('total_batch_size')} keeps the step size)"
        if recompute != "gelu+layernorm":
            remedy += f", or recompute activations ({arg('recompute', 'gelu+layernorm')})"
    return (f"the run needs {need / 2**30:.2f} GiB on {arg('backend')} {getattr(backend, 'name', '?')} (B={B} "
            f"T={T}) but {where} {have / 2**30:.2f} GiB; {remedy}; `llmc train --dry-run` shows the plan")


# ---- out of memory ----------------------------------------------------------------------------------------------
def out_of_memory_message(e: BaseException, backend, cfg, B: int, T: int, recompute: str = "none",
                          world_size: int = 1, zero: int = 0, overlap: bool = False) -> str:
    """One line: what the plan asks for (of one rank, for `world_size` ranks under ZeRO-`zero`), what the device
    has free (when it says), and what to lower."""
    asked = None
    try:
        asked = sum(memory_plan(cfg, B, T, getattr(backend, "matmul_dtype", None) or backend.dtype,
                                recompute=recompute, world_size=world_size, zero=zero, overlap=overlap).values())
    except Exception:
        pass
    parts = [f"out of memory on {arg('backend')} {getattr(backend, 'name', '?')} planning B={B} T={T}"]
    if asked:
        parts.append(f"the run needs {asked / 2**30:.2f} GiB")
    try:
        r = backend.memory_report()
        held = f"{r.allocated / 2**30:.2f} GiB allocated when it failed"
        if r.device_free is not None:
            held += f", {r.device_free / 2**30:.2f} GiB free"
            if r.device_total:
                held += f" of {r.device_total / 2**30:.2f} GiB"
        parts.append(held)
    except Exception:
        pass
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    more = "" if recompute == "gelu+layernorm" else f", or recompute activations ({arg('recompute', 'gelu+layernorm')})"
    return ("; ".join(parts) + f" ({detail}); lower {arg_both('batch_size')} (keep the step size with "
            f"{arg('total_batch_size')}) or {arg_both('seq_len')}{more}; `llmc train --dry-run` shows the plan")
