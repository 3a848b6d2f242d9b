"""The lines `llmc train` prints about a run: which shards it reads, and the memory its buffers hold."""

from __future__ import annotations

import os
from pathlib import Path


def data_line(train_loader, val_loader) -> str:
    """Which shards the run reads: what a directory or a glob resolved to (paths under the working directory
    relative to it, as they were most likely given, and short enough to leave the line room)."""
    def part(what: str, loader) -> str:
        f = [_shown(name) for name in loader.files]
        where = f[0] if len(f) == 1 else f"{f[0]} .. {Path(f[-1]).name}"
        return f"{what} {len(f)} shard(s), {loader.num_tokens:,} tokens ({where})"
    val = part("val", val_loader) if val_loader is not None else "val: none"
    return f"data: {part('train', train_loader)}; {val}"


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies under it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # (another drive)
        return str(path)
    return str(path) if rel.startswith("..") else rel


def memory_line(backend, label: str = "memory") -> str:
    """The backend's buffers by tag, their total, and the device's size and free memory where it says."""
    r = backend.memory_report()
    parts = [f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(r.by_tag.items())]
    line = f"{label}: {', '.join(parts)}; total {r.allocated / 2**20:.1f} MiB"
    if r.cached:
        line += f"; allocator cache {r.cached / 2**20:.1f} MiB"
    if r.device_total:
        free = f", free {r.device_free / 2**30:.1f} GiB" if r.device_free is not None else ""
        line += f" (device {r.device_total / 2**30:.1f} GiB{free})"
    return line
