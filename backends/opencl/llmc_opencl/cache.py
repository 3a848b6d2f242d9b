"""The per-device cache files of the probe and the tuner: where each lives, read and written whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmc_cli.kernels import cache_root, read_cache_json, write_cache_file


def cache_file(env: str, name: str) -> Path:
    """Where a per-device cache lives: $`env`, else `name` in llmc's cache folder (kernels.cache_root)."""
    p = os.environ.get(env)
    return Path(p) if p else cache_root() / name


def load_cache(path: Path) -> dict:
    """A JSON cache file's contents ({} when absent or damaged)."""
    return read_cache_json(path)


def save_cache(data: dict, path: Path) -> None:
    write_cache_file(path, json.dumps(data, indent=1, sort_keys=True))  # (a failure is ignored)
