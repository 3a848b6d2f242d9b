"""Reading documents out of source files: plain text, JSON lines, JSON and parquet, one document per file or
per record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from llmc_cli.formats.files import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + (".json", ".parquet")


# ----------------------------------------------------------------------------------------------
# reading source files


def _open_text(path: Path):
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for kind, sufs in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("json", (".json",)),
                       ("parquet", (".parquet",))):
        if name.endswith(sufs):
            return kind
    return ""


def expand_inputs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files and directories (searched recursively, sorted) -> the supported input files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) and not f.name.startswith("."))
            if not found:
                raise DataError(f"no input files ({', '.join(SUPPORTED)}) in directory {p}")
            out += found
        elif p.is_file():
            if not _kind(p):
                raise DataError(f"{p}: unsupported input type; expected one of {', '.join(SUPPORTED)} "
                                "(optionally .gz) or a directory of them")
            out.append(p)
        else:
            raise DataError(f"input {p} not found")
    if not out:
        raise DataError("no input files given")
    return out


def _field(obj, text_field: str, where: str) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        v = obj.get(text_field)
        if isinstance(v, str):
            return v
        if text_field in obj:
            raise DataError(f"{where}: field {text_field!r} is {type(v).__name__}, expected a string; "
                            "use --text-field for another field")
        raise DataError(f"{where}: no string field {text_field!r} (fields: {', '.join(map(str, obj))}); "
                        "use --text-field")
    raise DataError(f"{where}: expected an object with a {text_field!r} field or a string, got {type(obj).__name__}")


def iter_file_docs(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file: a .txt file is one document (none when it is empty or blank); .jsonl
    one per line; .json a list (of strings or objects); .parquet one per row of the ``text_field`` column."""
    kind = _kind(path)
    try:
        if kind == "text":
            with _open_text(path) as f:
                text = f.read()
            if text.strip():  # an empty (or blank) file is no document: it would be a lone end-of-text token
                yield text
        elif kind == "jsonl":
            with _open_text(path) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                        yield _field(obj, text_field, f"{path}:{n}")
        elif kind == "json":
            with _open_text(path) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of documents, got {type(data).__name__}")
            for i, obj in enumerate(data):
                yield _field(obj, text_field, f"{path}[{i}]")
        elif kind == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
            try:
                pf = pq.ParquetFile(path)
            except Exception as e:
                raise DataError(f"{path}: not a readable parquet file ({e})") from None
            if text_field not in pf.schema_arrow.names:
                raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                                "use --text-field")
            for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
                for v in batch.column(0).to_pylist():
                    if v is not None:
                        yield v
        else:
            raise DataError(f"{path}: unsupported input type")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _files_ident(files: list[Path]) -> list:
    return [[str(f.resolve()), f.stat().st_size] for f in files]
