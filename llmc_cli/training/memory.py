"""Out of memory while planning a model: one line saying what the plan asks for, what the device has, and what
to lower."""

from __future__ import annotations


# ---- out of memory ----------------------------------------------------------------------------------------------
def out_of_memory_message(e: BaseException, backend, cfg, B: int, T: int, recompute: str = "none",
                          world_size: int = 1, zero: int = 0, overlap: bool = False) -> str:
    """One line: what the plan asks for (of one rank, for `world_size` ranks under ZeRO-`zero`), what the device
    has free (when it says), and what to lower."""
    asked = None
    try:
        from llmc_cli.models.families import memory_plan
        asked = sum(memory_plan(cfg, B, T, getattr(backend, "matmul_dtype", None) or backend.dtype,
                                recompute=recompute, world_size=world_size, zero=zero, overlap=overlap).values())
    except Exception:
        pass
    parts = [f"out of memory on --backend {getattr(backend, 'name', '?')} planning B={B} T={T}"]
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
    more = "" if recompute == "gelu+layernorm" else ", or recompute activations (--recompute gelu+layernorm)"
    return ("; ".join(parts) + f" ({detail}); lower -b/--batch-size (keep the step size with "
            f"--total-batch-size) or -t/--seq-len{more}; `llmc train --dry-run` shows the plan")
