"""Any model source, recognised by content: an llm.c .bin, llmc's Llama .safetensors, a run or step directory,
a Hugging Face GPT-2 or Llama directory; and the tokenizer each was trained with."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import special_file
from llmc_cli.formats.manifest import run_id, verify_step_files, write_manifest
from llmc_cli.formats.rundir import step_dirs
from llmc_cli.formats.hf_llama3 import tokenizer_model_bytes
from llmc_cli.formats.hf import (
    LLMC_TOKENIZER_KEY,
    hf_model_type,
    is_hf_dir,
    read_config_json,
)
from llmc_cli.models.families import family_of, family_of_hf
from llmc_cli.naming import arg


# ---- any model source -----------------------------------------------------------------------------------------
def load_model_any(path: str | Path) -> tuple[ckpt.ModelConfig, np.ndarray, str]:
    """(config, float32 params, kind) from a model file ("llmc": llm.c .bin or llmc's Llama model.safetensors),
    a run or step directory ("run") or a Hugging Face GPT-2 or Llama directory ("hf"), recognised by content.
    Raises CheckpointError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise ckpt.CheckpointError(f"{path}: no such file or directory")
    try:
        if is_hf_dir(path):
            importer, _ = _hf_readers(path)
            cfg, params = importer(path)
            ckpt.check_finite(path, params)
            kind = "hf"
        else:
            cfg, params, _ = _read_resolved(path, _read_step_model)  # (checked for NaN there, before the manifest)
            kind = "llmc" if path.is_file() else "run"
    except OSError as e:  # no permission, a directory where a file belongs, an I/O error
        raise ckpt.CheckpointError(f"{e.filename or path}: cannot read it ({e.strerror or e})") from None
    return cfg, params, kind


def load_model_and_tokenizer_name(path: str | Path) -> tuple[ckpt.ModelConfig, np.ndarray, str]:
    """(config, float32 params, tokenizer name) of any model source, both from the one step a run directory
    resolves to (a live run may move on between two resolutions)."""
    path = Path(path)
    if not path.exists() or is_hf_dir(path):
        cfg, params, _ = load_model_any(path)
        return cfg, params, tokenizer_name_for(path)
    try:
        cfg, params, model = _read_resolved(path, _read_step_model)
        return cfg, params, ckpt.model_file_tokenizer(model)
    except OSError as e:
        raise ckpt.CheckpointError(f"{e.filename or path}: cannot read it ({e.strerror or e})") from None


def _read_step_model(model: Path) -> tuple[ckpt.ModelConfig, np.ndarray, Path]:
    """A model file's (config, params, path), its reader's own checks first, then its step's manifest (whose file
    it is)."""
    cfg, params = ckpt.read_model_file(model)
    ckpt.check_finite(model, params)
    verify_step_files(model.parent, [model.name], ckpt.held_model_digest(model, params))
    return cfg, params, model


def load_config_any(path: str | Path) -> ckpt.ModelConfig:
    """The model config alone (cheap: no parameters read)."""
    if is_hf_dir(path):
        _, read_config = _hf_readers(path)
        return read_config(path)
    return _read_resolved(path, ckpt.read_model_file_config)


def _hf_readers(path: Path):
    """(load, read_config) of the family whose model_type this Hugging Face directory's config.json names."""
    hf = family_of_hf(hf_model_type(path)).hf  # (hf_model_type refused types without a family)
    return hf.load, hf.read_config


def tokenizer_name_for(path: str | Path) -> str:
    """The name of the tokenizer ("gpt2", "llama3") a model source was trained with, from what it records alone:
    llm.c files and GPT-2 directories are GPT-2's; a Llama says (its file's metadata, or a Hugging Face
    directory's llmc_tokenizer key; a Hugging Face Llama without one is Llama 3's). Needs no tokenizer file, so a
    Llama whose tokenizer.model is elsewhere still evaluates on data of its vocabulary."""
    path = Path(path)
    if is_hf_dir(path):
        if hf_model_type(path) == "gpt2" or read_config_json(path).get(LLMC_TOKENIZER_KEY) == "gpt2":
            return "gpt2"
        return "llama3"
    return _read_resolved(path, ckpt.model_file_tokenizer)


def tokenizer_for(path: str | Path) -> tuple[str, Path | None]:
    """(tokenizer name, its ranks file or None) that a model source was trained with: GPT-2's for llm.c files
    and GPT-2 directories; for Llama, what its run recorded (a from-scratch run on GPT-2 shards says "gpt2"),
    or a Hugging Face directory's tokenizer.model (Meta's tiktoken format) or tokenizer.json. A Llama 3 tokenizer
    whose file is not there is an error naming the files expected."""
    path = Path(path)
    name = tokenizer_name_for(path)
    if name != "llama3":
        return name, None
    if is_hf_dir(path):
        where = [path]
    else:
        model_file = _resolve(path)
        where = [model_file.parent, model_file.parent.parent]  # the step directory, then its run directory
    for d in where:  # Meta's tokenizer.model first, else Hugging Face's tokenizer.json (the same ranks)
        for name in (ckpt.TOKENIZER_FILE, "tokenizer.json"):
            if (d / name).is_file() or special_file(d / name):  # (a device or FIFO there: its reader names it)
                return "llama3", d / name
    raise ckpt.CheckpointError(f"{path}: a Llama 3 model needs its tokenizer, {ckpt.TOKENIZER_FILE} (Meta's "
                               f"tiktoken-format ranks) or tokenizer.json (Hugging Face's), expected in "
                               f"{' or '.join(str(d) for d in where)}")




def _read_resolved(path: str | Path, read):
    """read(model file) of an llmc source (a model file, a run or step directory), through checkpoint.read_resolved:
    one step, held while it is read, tried once more if a live run removed it meanwhile."""
    _check_llmc_source(Path(path))
    return ckpt.read_resolved(path, read)


def _resolve(path: str | Path) -> Path:
    _check_llmc_source(Path(path))
    return ckpt.resolve_checkpoint(path)


def _check_llmc_source(path: Path) -> None:
    if path.is_dir() and not (path / "latest").is_file() and not any((path / f).is_file() for f in ckpt.MODEL_FILES) \
            and not step_dirs(path):  # (a run's step folders: resolve_checkpoint says what they lack)
        raise ckpt.CheckpointError(f"{path}: not a run directory (no 'latest'), a step directory (no model.bin or "
                                   f"model.safetensors) or a Hugging Face directory (no config.json)")


def export_run(out_dir: str | Path, cfg, params: np.ndarray, bf16: bool = False, tokenizer: str = "gpt2",
               tokenizer_file: str | Path | None = None) -> Path:
    """A new run directory holding the model alone: step_00000000/<model file> and `latest` pointing at it
    (plus a Llama's tokenizer.model beside the steps). It samples, evaluates, converts and serves as --init like
    any run; resuming it says that it holds only a model (no optimizer state).

    Written beside, as `.<name>.tmp-<pid>`, and renamed into place whole: a run killed half-way (SIGKILL, SIGTERM,
    a full disk) leaves no half run under the name (which the retry would refuse as a run directory), and what it
    left beside is removed by the next export to that name."""
    import os

    from llmc_cli.formats.files import fsync_dir, write_dir_beside
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ckpt.CheckpointError(f"{out}: exists and is not an empty directory ({arg('to', 'run')} writes a new run)")
    ranks = None if tokenizer_file is None else tokenizer_model_bytes(tokenizer_file)  # (before any write)

    def fill(tmp: Path) -> None:
        step = tmp / ckpt.step_dir_name(0)
        step.mkdir(parents=True)
        if ranks is not None:
            ckpt.atomic_write_bytes(tmp / ckpt.TOKENIZER_FILE, [ranks])
        ckpt.write_model_file(step / ckpt.model_file_name(cfg), cfg, params, bf16=bf16, tokenizer=tokenizer)
        write_manifest(step, run_id(tmp), 0, family_of(cfg).name)
        ckpt.atomic_write_bytes(tmp / "latest", [step.name.encode() + b"\n"])

    def rename_in(tmp: Path, out: Path) -> None:
        try:  # (over an empty directory the rename succeeds; over one that another process filled meanwhile, not)
            os.replace(tmp, out)
        except OSError:
            if out.is_dir() and any(out.iterdir()):
                raise ckpt.CheckpointError(f"{out}: was filled by another process while this one wrote the run; "
                                           "nothing was changed") from None
            raise
        fsync_dir(out.parent)

    write_dir_beside(out, fill, rename_in)
    return out
