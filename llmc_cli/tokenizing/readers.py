"""Reading documents out of source files: plain text, JSON lines, JSON and parquet, one document per file or
per record."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

from llmc_cli.formats.files import DataError, special_file
from llmc_cli.naming import arg

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + (".json", ".parquet")


# ----------------------------------------------------------------------------------------------
# reading source files


def _is_gz(path: Path) -> bool:
    return path.name.lower().endswith(".gz")  # (as _kind reads it: `a.txt.GZ` is gzip too)


def _open_text(path: Path):
    # utf-8-sig: a byte-order mark some editors put first is no text (it would become tokens of its own, and it
    # makes json refuse the first line)
    if _is_gz(path):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, "r", encoding="utf-8-sig")


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if _is_gz(path) else open(path, "rb")


JSONL_LINE_MAX_BYTES = 256 << 20  # one document that large is read and parsed whole (several times its size in
# memory); a longer "line" is more likely a file that is not JSON Lines (no newline at all)


def _decoded(path: Path, raw: bytes, at: int, line: int | None = None) -> str:
    """`raw` (found at byte `at` of the file's text) as UTF-8; where it is not, the line names the byte of the whole
    file (and the line), not of a decoder's chunk."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(path, e, at, line) from None


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a JSON Lines file, split at "\n" only: JSON allows a lone "\r" between its tokens,
    which universal newlines would take for the end of a line. A line over JSONL_LINE_MAX_BYTES is refused before it
    is held whole."""
    with _open_bytes(path) as f:
        at = 0
        for n in itertools.count(1):
            raw = f.readline(JSONL_LINE_MAX_BYTES + 1)
            if not raw:
                return
            if len(raw) > JSONL_LINE_MAX_BYTES:
                raise DataError(f"{path}:{n}: a line longer than {JSONL_LINE_MAX_BYTES >> 20} MiB; one document per "
                                "line is expected (is this a JSON Lines file?)")
            start = 3 if n == 1 and raw.startswith(b"\xef\xbb\xbf") else 0  # (a byte-order mark: no text)
            yield n, _decoded(path, raw[start:], at + start, n)
            at += len(raw)


def _whole_text(path: Path) -> str:
    """A text file's content, with universal newlines ("\r\n" and a lone "\r" read as "\n", as Python's text
    mode and nanoGPT's prepare scripts read it) and without a byte-order mark."""
    with _open_bytes(path) as f:
        raw = f.read()
    start = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    text = _decoded(path, raw[start:] if start else raw, start)
    del raw
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def not_utf8(path: Path, e: UnicodeDecodeError, at: int = 0, line: int | None = None) -> DataError:
    """The one line for a file that does not decode as UTF-8, naming UTF-16/32 when its byte-order mark says so.
    `at`: where the bytes that failed start in the file's text (a line's offset); `line`: their line number."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    enc = next((name for bom, name in _BOMS if head.startswith(bom)), None)
    if enc and not _is_gz(path):
        return DataError(f"{path}: {enc} text (it starts with a {enc} byte-order mark); convert it to UTF-8")
    where = f"{path}:{line}" if line is not None else str(path)
    of = " of its decompressed text" if _is_gz(path) else ""
    return DataError(f"{where}: not UTF-8 text ({e.reason} at byte {at + e.start}{of})")


def regular_file(path: str | os.PathLike, what: str = "input", pipe_ok: bool = False) -> Path:
    """`path` itself when it is a regular file (or a link to one). A device or a socket is refused: reading one
    never ends (/dev/zero). So is a FIFO, unless `pipe_ok` (a file read once from start to end, as
    `--local <(curl ...)` or `/dev/stdin` hand it): inputs that are split among workers, seeked or resumed need a
    file."""
    path = Path(path)
    if (kind := special_file(path)) and not (pipe_ok and kind == "a FIFO"):
        raise DataError(f"{what} {path} is {kind}, not a regular file; give a file")
    return path


def checked_text(v: str, where: str) -> str:
    """A document string that is valid Unicode: JSON's \\uD800-style escapes decode to lone surrogates, which
    no tokenizer can encode as UTF-8."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: the text holds a lone surrogate {v[e.start]!r} at character {e.start} (not "
                        "valid Unicode; a broken \\u escape?)") from None
    return v


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for kind, sufs in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("json", (".json",)),
                       ("parquet", (".parquet",))):
        if name.endswith(sufs):
            return kind
    return ""


def _files_under(top: Path) -> Iterator[Path]:
    """Every entry below `top` that is not a directory (links to directories not followed: a loop would never end).
    A directory that cannot be listed is an error naming it, where Path.rglob skips it: its files would be missing
    from the corpus without a word."""
    def unreadable(e: OSError):
        raise DataError(f"{e.filename}: cannot list this input directory ({e.strerror or e}); its files would be "
                        "left out of the corpus")
    for folder, _, names in os.walk(top, onerror=unreadable):
        for n in names:
            yield Path(folder) / n


def files_in(top: Path, wanted: Callable[[Path], bool], exclude: str | os.PathLike | None = None) -> list[Path]:
    """The files below the directory `top` whose names `wanted` accepts (not hidden ones, nor `exclude`), sorted. One
    such name that is no regular file (a FIFO, a socket, a device, a link to nothing) is refused, naming it: left out
    without a word, its documents would be missing from the corpus, and a FIFO cannot be split among workers."""
    skip = Path(exclude).resolve() if exclude is not None else None
    found = []
    for f in _files_under(top):
        if f.name.startswith(".") or not wanted(f) or (skip is not None and f.name == skip.name
                                                       and f.resolve() == skip):
            continue
        if not f.is_file():
            what = special_file(f) or ("a link to nothing" if f.is_symlink() else "no longer there")
            raise DataError(f"input {f} is {what}, not a regular file; give a file there or move it out of {top}")
        found.append(f)
    return sorted(found)


def expand_inputs(paths: Iterable[str | os.PathLike], exclude: str | os.PathLike | None = None) -> list[Path]:
    """Files and directories (searched recursively, sorted) -> the supported input files. `exclude` (the run's
    manifest) is never found in a directory: written into an input directory, it would become an input of the
    rerun, which then no longer matches the manifest it resumes from."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = files_in(p, _kind, exclude)
            if not found:
                raise DataError(f"no input files ({', '.join(SUPPORTED)}) in directory {p}")
            out += found
        elif p.is_file():
            if not _kind(p):
                raise DataError(f"{p}: unsupported input type; expected one of {', '.join(SUPPORTED)} "
                                "(text and JSON optionally .gz) or a directory of them")
            if _kind(p) == "parquet" and _is_gz(p):  # (pyarrow would call it "not a parquet file")
                raise DataError(f"{p}: a gzipped parquet file; parquet compresses its own pages, so gunzip it "
                                "first")
            out.append(p)
        elif p.exists():
            regular_file(p)
        else:
            raise DataError(f"input {p} not found")
    if not out:
        raise DataError("no input files given")
    seen: set[Path] = set()  # a file named twice (`corpus/ corpus/a.txt`, a link to it) is one input, not two copies
    return [f for f in out if not ((r := f.resolve()) in seen or seen.add(r))]


def _field(obj, text_field: str, where: str, remedy: str | None = None) -> str:
    """A document's text: `obj` itself, or its `text_field`. `remedy` ends the line of a document without it (default:
    the --text-field option of the commands that have one; a command without it passes its own)."""
    if isinstance(obj, str):
        return checked_text(obj, where)
    if isinstance(obj, dict):
        v = obj.get(text_field)
        if isinstance(v, str):
            return checked_text(v, where)
        if text_field in obj:
            raise DataError(f"{where}: field {text_field!r} is {type(v).__name__}, expected a string; "
                            f"{remedy or 'use ' + arg('text_field') + ' for another field'}")
        raise DataError(f"{where}: no string field {text_field!r} (fields: {', '.join(map(str, obj))}); "
                        f"{remedy or 'use ' + arg('text_field')}")
    raise DataError(f"{where}: expected an object with a {text_field!r} field or a string, got {type(obj).__name__}")


def _json_line(line: str, where: str, hint: str = ""):
    """One line's JSON value; a line that is not JSON, or nested past Python's stack, is a DataError naming `where`."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}){hint}") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None


def iter_file_docs(path: Path, text_field: str = "text", remedy: str | None = None) -> Iterator[str]:
    """The documents of one input file: a .txt file is one document (none when it is empty or blank); .jsonl
    one per line; .json a list (of strings or objects); .parquet one per row of the ``text_field`` column.
    `remedy`: what a line about a missing or mistyped field advises (default: --text-field)."""
    kind = _kind(path)
    readers = {"text": _text_docs, "jsonl": _jsonl_docs, "json": _json_docs, "parquet": _parquet_docs}
    if kind not in readers:
        raise DataError(f"{path}: unsupported input type")
    try:
        yield from readers[kind](path, text_field, remedy)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # (click would print EOFError as "Aborted!")
        raise DataError(f"{path}: truncated or corrupt gzip file ({e or type(e).__name__})") from None


def _text_docs(path: Path, text_field: str, remedy: str | None) -> Iterator[str]:
    text = _whole_text(path)
    if text.strip():  # an empty (or blank) file is no document: it would be a lone end-of-text token
        yield text


def _jsonl_docs(path: Path, text_field: str, remedy: str | None) -> Iterator[str]:
    for n, line in _text_lines(path):
        if line.strip():
            hint = ("; a JSON array (one document list) belongs in a .json file"
                    if n == 1 and line.lstrip().startswith("[") else "")
            obj = _json_line(line, f"{path}:{n}", hint)
            if isinstance(obj, list):
                raise DataError(f"{path}:{n}: a JSON array, not one document per line; a list of "
                                "documents belongs in a .json file")
            yield _field(obj, text_field, f"{path}:{n}", remedy)


def _json_docs(path: Path, text_field: str, remedy: str | None) -> Iterator[str]:
    with _open_text(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except RecursionError:
            raise DataError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of documents, got {type(data).__name__}")
    for i, obj in enumerate(data):
        yield _field(obj, text_field, f"{path}[{i}]", remedy)


def _parquet_docs(path: Path, text_field: str, remedy: str | None) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # (optional: only parquet inputs need it)
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if (k := len(pf.schema_arrow.get_all_field_indices(text_field))) > 1:
        raise DataError(f"{path}: {k} columns are named {text_field!r}; which one holds the text is ambiguous "
                        f"(columns: {', '.join(pf.schema_arrow.names)})")
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        f"{remedy or 'use ' + arg('text_field')}")
    _check_text_column(path, text_field, pf.schema_arrow.field(text_field).type, remedy)
    batches = pf.iter_batches(columns=[text_field], batch_size=1024)
    while True:
        try:  # a damaged page is found only when read: name this file, not the output directory
            batch = next(batches, None)
        except (OSError, ValueError) as e:
            if isinstance(e, UnicodeDecodeError):
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{path}: corrupt parquet data ({msg})") from None
        if batch is None:
            break
        for v in batch.column(0).to_pylist():
            if v is not None:
                yield v


def iter_hellaswag(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(label, context, the 4 endings) of each example of a HellaSwag .jsonl (rowanz/hellaswag), typed strictly:
    a label of 1.7 or true, or endings given as one string, would otherwise become an example nobody wrote."""
    path = regular_file(path, arg("local"), pipe_ok=True)
    try:
        # (lines as every JSON Lines input is read: split at "\n" only, a lone "\r" being JSON's blank, and a line
        # of gigabytes refused before it is held whole)
        for n, line in _text_lines(path):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            ex = _json_line(line, where)
            if not isinstance(ex, dict) or not {"ctx", "endings", "label"} <= set(ex):
                raise DataError(f"{where}: not a HellaSwag example with ctx, endings and label")
            label, ctx, endings = ex["label"], ex["ctx"], ex["endings"]
            # (Hugging Face's copy writes the label as a string: "2" is taken, 1.7 and true are not)
            if isinstance(label, str) and label.strip().isascii() and label.strip().isdigit():
                label = int(label)
            if isinstance(label, bool) or not isinstance(label, int):
                raise DataError(f"{where}: not a HellaSwag example: label {label!r} is not an integer")
            if not isinstance(ctx, str):
                raise DataError(f"{where}: not a HellaSwag example: ctx is {type(ctx).__name__}, expected a string")
            if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
                raise DataError(f"{where}: not a HellaSwag example: endings must be a list of strings")
            if len(endings) != 4:
                raise DataError(f"{where}: not a HellaSwag example: {len(endings)} endings, expected 4")
            if not 0 <= label < 4:
                raise DataError(f"{where}: not a HellaSwag example: label {label}, expected 0..3 (the ending that "
                                "is right)")
            yield label, checked_text(ctx, where), [checked_text(e, where) for e in endings]
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # (a .gz of it is read as its text)
        raise DataError(f"{path}: truncated or corrupt gzip file ({e or type(e).__name__})") from None


def _check_text_column(path: Path, name: str, t, remedy: str | None = None) -> None:
    import pyarrow as pa  # (optional: only parquet inputs need it)

    if pa.types.is_dictionary(t):
        t = t.value_type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)
            or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t))):
        raise DataError(f"{path}: column {name!r} holds {t}, expected strings; "
                        f"{remedy or 'use ' + arg('text_field') + ' for another column'}")


def _files_ident(files: list[Path]) -> list:
    """Each input's path, size and modification time (ns): a resume of an input edited in place, even to the same
    size, is refused rather than finished from the new text."""
    return [[str(f.resolve()), (st := f.stat()).st_size, st.st_mtime_ns] for f in files]
