"""Converting a model between llmc's files, run directories and Hugging Face directories, never over anything
llmc did not write."""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DirectoryLock, non_folder_above, sibling_stem, write_dir_beside
from llmc_cli.formats.sources import export_run, load_model_any, tokenizer_for
from llmc_cli.models.families import FAMILIES, family_of
from llmc_cli.naming import arg

_HF_FILES = re.compile(r"config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                       r"model-\d{5}-of-\d{5}\.safetensors|tokenizer\.model|vocab\.json|merges\.txt|"
                       r"tokenizer_config\.json|special_tokens_map\.json|tokenizer\.json")


def _is_llmc_output(path: Path) -> bool:
    """Is `path` something `llmc convert` itself writes: an llm.c model .bin, an llmc Llama .safetensors, or a
    Hugging Face model directory holding nothing but a model's files?"""
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        return "config.json" in names and all(_HF_FILES.fullmatch(n) and (path / n).is_file() for n in names)
    if not path.is_file():  # a FIFO, a device, a link to nothing: never an output (and reading a FIFO would block)
        return False
    try:
        ckpt.read_model_file_config(path)
    except (ckpt.CheckpointError, OSError):
        return False
    return True


def check_destination(src: str | Path, dst: str | Path, force: bool) -> None:
    """`convert` writes a new destination; with `force` it may replace an earlier output of its own kind, but
    never the source, a data file or anything else of the user's, and never anything in a run directory."""
    from llmc_cli.formats.rundir import check_outside_checkpoints, is_run_dir
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise ckpt.CheckpointError(f"{dst} is the source itself; write the conversion somewhere else")
    if src.exists():  # (a new file among the source's would change it; a source inside DST would be replaced)
        rs, rd = Path(os.path.realpath(src)), Path(os.path.realpath(dst))  # (a loop of links: as it is)
        if rs.is_dir() and rs in rd.parents:
            raise ckpt.CheckpointError(f"{dst} is inside the source {src}; write the conversion outside it; "
                                       "nothing was changed")
        if rd in rs.parents:
            raise ckpt.CheckpointError(f"{dst} holds the source {src}; write the conversion somewhere else; "
                                       "nothing was changed")
    # (creating the folders would fail on a file among them with "File exists", naming neither)
    if (above := non_folder_above(dst)) is not None:
        raise ckpt.CheckpointError(f"{dst}: {above} is not a directory; nothing was changed")
    check_outside_checkpoints(dst, "DST", ckpt.CheckpointError)
    if is_run_dir(dst) or (dst.parent.is_dir() and is_run_dir(dst.parent) and dst.name in ("latest", ".lock")):
        raise ckpt.CheckpointError(f"{dst} belongs to a run directory, not an empty directory: only training writes "
                                   f"there (even with {arg('force', True)}); give another destination; nothing was "
                                   "changed")
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise ckpt.CheckpointError(f"{dst} exists; llmc convert writes only new destinations (add "
                                   f"{arg('force', True)} to replace an earlier conversion); nothing was changed")
    if not _is_llmc_output(dst):
        raise ckpt.CheckpointError(f"{dst} exists and is not an llmc model file or Hugging Face model directory, so "
                                   f"llmc will not replace it, even with {arg('force', True)}; nothing was changed")


def convert(src: str | Path, dst: str | Path, bf16: bool = False, to: str = "auto", force: bool = False):
    """Converts the model at `src` (any source, by content) to `dst`: a new run directory (`to="run"`), the
    family's model file when `dst` ends in that file's suffix, else a Hugging Face directory (written beside and
    swapped in). Returns (config, source kind, what was written). CheckpointError messages start with SRC: or
    DST: (the path the user named, never a temporary one).

    One conversion to a destination at a time: a second `convert` to the same DST while one runs is refused
    (`DST.parent/.DST.lock`), rather than both passing the check for a new destination and the later one replacing
    the other's output unasked, or failing half-way on the other's rename."""
    for name, path in (("SRC", src), ("DST", dst)):
        if os.fspath(path) == "":  # (Path("") is ".": the working directory, read or written unasked)
            raise ckpt.CheckpointError(f"{name}: an empty path; give a model file or directory")
    d = Path(os.path.abspath(dst))  # ("." or "..": the lock beside the folder they name)
    try:
        lock = DirectoryLock(d.parent, f".{sibling_stem(d.name)}.lock", "DST", "its directory", ckpt.CheckpointError,
                             "give another destination", label=str(dst))
        above = next((p for p in d.parents if p.exists() or p.is_symlink()), None)
        if d.name and (above is None or above.is_dir()):  # (a file among DST's folders: check_destination names it)
            lock.acquire()
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"DST: {e}") from None
    try:
        return _convert(src, dst, bf16, to, force)
    finally:
        lock.release()


# names of files of other formats: DST with one would become a Hugging Face directory under a file's name
_FILE_SUFFIXES = (".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".npz", ".npy", ".onnx", ".h5", ".pkl", ".pickle",
                  ".json", ".txt", ".tar", ".zip", ".gz")


def check_destination_name(dst: str | Path, to: str) -> None:
    """DST's name must say what is written there: a model file only under its suffix (in any case: `m.BIN` is a
    .bin), a directory (a run, a Hugging Face model) never under a model file's or another format's suffix."""
    suffix = Path(dst).suffix.lower()
    if to == "run" and suffix in MODEL_SUFFIXES:
        raise ckpt.CheckpointError(f"{dst}: {arg('to', 'run')} writes a run directory, not a {suffix} model file; "
                                   f"give a directory name, or leave out {arg('to', 'run')} for a model file; nothing "
                                   "was changed")
    if to != "run" and suffix in _FILE_SUFFIXES:
        raise ckpt.CheckpointError(f"{dst}: llmc writes a model to {' or '.join(MODEL_SUFFIXES)} or a Hugging Face "
                                   f"directory, not a {suffix} file; give one of those names; nothing was changed")


def _convert(src: str | Path, dst: str | Path, bf16: bool, to: str, force: bool):
    try:
        check_destination_name(dst, to)
        check_destination(src, dst, force)
    except ckpt.CheckpointError as e:  # (the checkpoint check's "DST PATH ...": named once, as "DST: PATH ...")
        msg = str(e)
        raise ckpt.CheckpointError(f"DST: {msg[4:] if msg.startswith(f'DST {dst} ') else msg}") from None
    try:
        cfg, params, kind = load_model_any(src)
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"SRC: {e}") from None
    fam = family_of(cfg)
    try:
        tok_name, tok_file = tokenizer_for(src)
    except ckpt.CheckpointError:  # a tokenizer file that is not there: nothing to copy along
        tok_name, tok_file = fam.tokenizer, None
    if tok_file is not None:  # one that is there but unreadable is SRC's fault, said before anything is written
        from llmc_cli.data.tokenizer import llama3_ranks
        from llmc_cli.formats.files import DataError
        try:
            llama3_ranks(tok_file)
        except (DataError, OSError) as e:
            raise ckpt.CheckpointError(f"SRC: {e}") from None
    d = Path(dst)
    suffix = Path(fam.model_file.name).suffix
    if tok_name not in HF_TOKENIZERS and to != "run" and d.suffix.lower() not in MODEL_SUFFIXES:
        raise ckpt.CheckpointError(f"DST: a Hugging Face directory has no {tok_name} tokenizer that transformers "
                                   f"reads; convert SRC to a {suffix} file or {arg('to', 'run')} instead; nothing "
                                   "was changed")
    try:
        if to == "run":
            export_run(d, cfg, params, bf16=bf16, tokenizer=tok_name, tokenizer_file=tok_file)
            return cfg, kind, f"run directory ({ckpt.step_dir_name(0)}/{fam.model_file.name}, latest; model only)"
        if d.suffix.lower() in MODEL_SUFFIXES:
            if d.is_dir():
                raise ckpt.CheckpointError(f"{d} is a directory")
            if d.suffix.lower() != suffix:
                raise ckpt.CheckpointError(f"{d}: a {fam.label} model is written to a {suffix} file "
                                           f"({fam.model_file.label(bf16)}) or a directory (Hugging Face)")
            d.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_model_file(d, cfg, params, bf16=bf16, tokenizer=tok_name)
            return cfg, kind, fam.model_file.label(bf16)
        if d.exists() and not d.is_dir():
            raise ckpt.CheckpointError(f"{d} exists and is not a directory (name a model file with "
                                       f"{' or '.join(MODEL_SUFFIXES)})")
        write_dir_beside(d, lambda out: fam.hf.save(out, cfg, params, bf16=bf16, tokenizer=tok_name,
                                                    tokenizer_file=tok_file))
        return cfg, kind, "Hugging Face directory (config.json, model.safetensors)"
    except OSError as e:  # (the file that failed may be a temporary one beside DST: DST is what the user named)
        raise ckpt.CheckpointError(f"DST: {d}: {e.strerror or e}") from None
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"DST: {e}") from None


HF_TOKENIZERS = ("gpt2", "llama3")  # the tokenizers a Hugging Face export writes beside the weights
MODEL_SUFFIXES = tuple(Path(f.model_file.name).suffix for f in FAMILIES.values())
