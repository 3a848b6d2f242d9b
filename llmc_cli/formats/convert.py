"""Converting a model between llmc's files, run directories and Hugging Face directories, never over anything
llmc did not write."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import replace_dir

# ---- llmc convert ---------------------------------------------------------------------------------------------
_HF_FILES = re.compile(r"config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                       r"model-\d{5}-of-\d{5}\.safetensors|tokenizer\.model")


def _is_llmc_output(path: Path) -> bool:
    """Is `path` something `llmc convert` itself writes: an llm.c model .bin, an llmc Llama .safetensors, or a
    Hugging Face model directory holding nothing but a model's files?"""
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        return "config.json" in names and all(_HF_FILES.fullmatch(n) and (path / n).is_file() for n in names)
    try:
        if path.suffix == ".bin":
            ckpt.read_model_header(path)
        else:
            ckpt.read_llama_header(path)
    except (ckpt.CheckpointError, OSError):
        return False
    return True


def check_destination(src: str | Path, dst: str | Path, force: bool) -> None:
    """`convert` writes a new destination; with `force` it may replace an earlier output of its own kind, but
    never the source, a data file or anything else of the user's, and never anything in a run directory."""
    from llmc_cli.formats.rundir import is_run_dir, step_folder_of
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise ckpt.CheckpointError(f"{dst} is the source itself; write the conversion somewhere else")
    if (step := step_folder_of(dst)) is not None:
        raise ckpt.CheckpointError(f"{dst} is inside the checkpoint {step}: llmc writes there only when training")
    if is_run_dir(dst) or (dst.parent.is_dir() and is_run_dir(dst.parent) and dst.name in ("latest", ".lock")):
        raise ckpt.CheckpointError(f"{dst} belongs to a run directory, not an empty directory: llmc writes there "
                                   "only when training")
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise ckpt.CheckpointError(f"{dst} exists; llmc convert writes only new destinations (add --force to replace "
                                   f"an earlier conversion); nothing was changed")
    if not _is_llmc_output(dst):
        raise ckpt.CheckpointError(f"{dst} exists and is not an llmc model file or Hugging Face model directory, so "
                                   f"llmc will not replace it, even with --force; nothing was changed")


def _write_dir_atomically(dst: Path, write) -> None:
    """`write(tmp)` fills a temporary sibling directory, which then takes `dst`'s place (the old one is
    dropped only after the new one stands), so a failure leaves `dst` as it was."""
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
