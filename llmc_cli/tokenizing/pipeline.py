"""The shard pipeline: documents -> tokens (tokenizer worker processes, workers.py) -> llm.c shards, resumable
through a manifest, with llm.c's val split."""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from llmc_cli.formats.files import DataError, DirectoryLock, atomic_write_bytes, read_at_most, sibling_stem
from llmc_cli.formats.shards import read_shard_header, shard_format, write_shard
from llmc_cli.naming import arg
from llmc_cli.tokenizing.progress import ProgressFactory, silent
from llmc_cli.tokenizing.sources import Source
from llmc_cli.tokenizing.workers import encoded

BATCH_BYTES = 1 << 20  # text handed to a worker per task
BATCH_DOCS = 1024


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
    pat = re.compile(re.escape(name) + r"_(val|train)_\d{6}\.bin$")
    # (the name escaped: `[x]` is a character class to glob, and would miss the very shards it names)
    return (sorted(p for p in out_dir.glob(f"{glob.escape(name)}_*.bin") if pat.match(p.name)) if out_dir.is_dir()
            else [])


def _check_manifest(path: Path, m: dict, name: str | None = None, explicit_split: bool = False) -> None:
    """The fields a resume reads, typed: a manifest damaged or edited by hand is one line naming the field, not a
    traceback or a resume from a position that is none (a negative offset dropped tokens without a word). With
    `name`, the shards must also be the ones a run writes, in its order: shard i named NAME_SPLIT_i, val before
    train (only shard 0 val where the corpus has no split of its own), positions never going back; a shard listed
    twice, a file of another name, or a second val shard were otherwise kept as finished shards."""
    def bad(what: str):
        raise DataError(f"{path}: {what}; pass {arg('force', True)} to redo the shards")

    shards = m.get("shards", [])
    if not isinstance(shards, list):
        bad(f"'shards' is {type(shards).__name__}, expected a list")
    for i, sh in enumerate(shards):
        if not isinstance(sh, dict):
            bad(f"shards[{i}] is {type(sh).__name__}, expected an object")
        f = sh.get("file")
        if not isinstance(f, str) or not f or f != Path(f).name:  # (a path would point outside the directory)
            bad(f"shards[{i}].file is {f!r}, expected a file name")
        if sh.get("split") not in ("val", "train"):
            bad(f"shards[{i}].split is {sh.get('split')!r}, expected 'val' or 'train'")
        for k in ("tokens", "next_doc", "next_offset"):
            v = sh.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                bad(f"shards[{i}].{k} is {v!r}, expected a whole number >= 0")
    last = (0, 0)
    for i, sh in enumerate(shards if name is not None else []):
        if sh["file"] != _shard_name(name, sh["split"], i):
            bad(f"shards[{i}].file is {sh['file']!r}, expected {_shard_name(name, sh['split'], i)!r}")
        prev = shards[i - 1]["split"] if i else None
        if sh["split"] == "val" and (prev == "train" or (prev is not None and not explicit_split)):
            bad(f"shards[{i}] is a val shard after {'a train shard' if prev == 'train' else 'the first shard'}")
        if not explicit_split and i == 0 and sh["split"] != "val":
            bad("shards[0] is a train shard; the first shard is the val split")
        if (sh["next_doc"], sh["next_offset"]) < last:
            bad(f"shards[{i}] ends at document {sh['next_doc']} token {sh['next_offset']}, before the shard ahead of "
                "it")
        last = (sh["next_doc"], sh["next_offset"])
    vs = m.get("val_size")
    if vs is not None and (isinstance(vs, bool) or not isinstance(vs, int) or vs < 1):
        bad(f"val_size is {vs!r}, expected a whole number >= 1 or null")
    if not isinstance(m.get("complete", False), bool):
        bad(f"complete is {m.get('complete')!r}, expected true or false")


MANIFEST_MAX_BYTES = 1 << 30  # a manifest lists every input file (~100 bytes each): ten million of them fit; a
# bigger file is no manifest llmc wrote


def _manifest_bytes(path: Path) -> bytes:
    """A manifest's bytes, read only up to MANIFEST_MAX_BYTES: a stray big (or sparse) file under its name is
    refused as not a manifest, never read whole. ValueError when it is longer."""
    raw = read_at_most(path, MANIFEST_MAX_BYTES)
    if raw is None:
        raise ValueError(f"{path}: larger than {MANIFEST_MAX_BYTES >> 20} MiB")
    return raw


def run_pipeline(src: Source, tok, out_dir: Path, shard_size: int, workers: int = 1,
                 val_tokens: int | None = None, val_fraction: float = 0.1, force: bool = False,
                 progress: ProgressFactory = silent) -> Summary:
    """Tokenize ``src`` into shards under ``out_dir``; resumable through ``<name>_manifest.json``.

    Val split: the corpus' own (``src.explicit_split``); else the first ``val_tokens`` tokens; else
    (default) the first shard, except for corpora of at most two shards' worth of tokens, where the first
    ``ceil(val_fraction * total)`` tokens are val.
    """
    if shard_size < 1:
        raise DataError(f"{arg('shard_size')} must be at least 1 token, got {shard_size}")
    shard_format(tok.name)  # an unknown tokenizer fails here, before anything is written
    out_dir = Path(out_dir)
    # one writer of a corpus' shards and manifest at a time (two runs into one directory would interleave them);
    # other corpora in the same directory are free to run beside it
    with DirectoryLock(out_dir, f".{sibling_stem(src.name)}.lock", arg("out_dir"), "the output directory", DataError,
                       f"give another {arg('out_dir')}"):
        return _run_locked(src, tok, out_dir, shard_size, workers, val_tokens, val_fraction, force, progress)


def _run_locked(src: Source, tok, out_dir: Path, shard_size: int, workers: int, val_tokens: int | None,
                val_fraction: float, force: bool, progress: ProgressFactory) -> Summary:
    manifest_path = out_dir / f"{src.name}_manifest.json"
    fp = _fingerprint(src, tok, shard_size, val_tokens, val_fraction)
    summary = Summary(src.name, out_dir)
    t0 = time.perf_counter()
    manifest, done = _resume_point(manifest_path, fp, src, out_dir, force)
    if manifest and manifest.get("complete") and len(done) == len(manifest.get("shards", [])):
        summary.shards, summary.resumed = done, len(done)
        summary.seconds = time.perf_counter() - t0
        return summary
    _remove_stale(out_dir, src.name, manifest_path, manifest, done, force)
    # (input that fails before the first shard leaves nothing behind: the lock's release removes the folders)
    val_size = manifest.get("val_size") if (manifest and done) else None
    writer = _ShardWriter(src, tok.name, out_dir, manifest_path, shard_size, fp, done, val_size,
                          val_tokens, val_fraction, summary)
    _write_shards(writer, src, tok, workers, progress, t0)
    summary.shards = writer.state["shards"]
    summary.seconds = time.perf_counter() - t0
    return summary


def _fingerprint(src: Source, tok, shard_size: int, val_tokens: int | None, val_fraction: float) -> dict:
    """What the shards depend on: a resume under another fingerprint is refused."""
    fp = {"source": src.ident, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
          "vocabulary_sha256": tok.vocabulary_sha256,
          "shard_size": shard_size, "explicit_split": src.explicit_split,
          "val_tokens": None if src.explicit_split else val_tokens,
          "val_fraction": None if (src.explicit_split or val_tokens) else val_fraction, "layout": 1}
    return json.loads(json.dumps(fp))


def _resume_point(manifest_path: Path, fp: dict, src: Source, out_dir: Path,
                  force: bool) -> tuple[dict | None, list[dict]]:
    """(the manifest of an earlier run of the same fingerprint, or None; its shards still intact, in order)."""
    if not manifest_path.is_file() or force:
        return None, []
    try:
        manifest = json.loads(_manifest_bytes(manifest_path))
    except (OSError, ValueError, RecursionError):  # (not JSON, not UTF-8: refused below as not a manifest)
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
        return None, []
    if manifest.get("fingerprint") != fp:
        old = manifest.get("fingerprint") or {}
        diff = sorted(k for k in set(fp) | set(old) if fp.get(k) != old.get(k))
        raise DataError(f"{out_dir} holds {src.name} shards made from other inputs or settings "
                        f"({', '.join(diff)} differ); pass {arg('force', True)} to redo them or choose another "
                        f"{arg('out_dir')}")
    if manifest:
        _check_manifest(manifest_path, manifest, src.name, src.explicit_split)
    done: list[dict] = []
    for sh in manifest.get("shards", []):
        try:
            ok = read_shard_header(out_dir / sh["file"]).num_tokens == sh["tokens"]
        except DataError:
            ok = False
        if not ok:
            break
        done.append(sh)
    return manifest or None, done


def _remove_stale(out_dir: Path, name: str, manifest_path: Path, manifest: dict | None, done: list[dict],
                  force: bool) -> None:
    """Remove this corpus' shards that the resume does not keep, once sure that each (and a manifest in the way)
    is llmc's own: a file of the user's under such a name stays, and the run is refused."""
    stale = [p for p in _existing_shards(out_dir, name) if p.name not in {d["file"] for d in done}]
    if stale and not force and manifest is None:
        raise DataError(f"{out_dir} already has {len(stale)} {name} shard(s) (e.g. {stale[0].name}) without a "
                        f"manifest to resume from; pass {arg('force', True)} to overwrite them or choose another "
                        f"{arg('out_dir')}")
    for p in stale:  # --force replaces llm.c shards only: a file of the user's under a shard's name stays
        try:
            read_shard_header(p)
        except DataError:
            raise DataError(f"{p}: not an llm.c token shard, so llmc will not replace it (even with "
                            f"{arg('force', True)}); move it or choose another {arg('out_dir')}") from None
    if manifest_path.exists() and manifest is None:
        try:  # (a FIFO under its name is not read: that would wait for a writer forever)
            ours = manifest_path.is_file() and isinstance(
                json.loads(_manifest_bytes(manifest_path)).get("fingerprint"), dict)
        except (OSError, ValueError, AttributeError, RecursionError):
            ours = False
        if not ours:
            raise DataError(f"{manifest_path}: not an llmc tokenize manifest, so llmc will not replace it (even "
                            f"with {arg('force', True)}); move it or choose another {arg('out_dir')}")
    for p in stale:
        p.unlink()


class _ShardWriter:
    """Tokens in, shards out: buffers the documents' tokens and writes every shard they fill, each followed by a
    manifest that lists it and where in the input the next one starts."""

    def __init__(self, src: Source, tokenizer: str, out_dir: Path, manifest_path: Path, shard_size: int, fp: dict,
                 done: list[dict], val_size: int | None, val_tokens: int | None, val_fraction: float,
                 summary: Summary):
        self.src, self.tokenizer, self.out_dir, self.manifest_path = src, tokenizer, out_dir, manifest_path
        self.shard_size, self.val_tokens, self.val_fraction = shard_size, val_tokens, val_fraction
        self.summary, self.done = summary, done
        self.state = {"fingerprint": fp, "shards": list(done), "complete": False, "val_size": val_size}
        summary.resumed = len(done)
        self.skip_doc, self.skip_off = (done[-1]["next_doc"], done[-1]["next_offset"]) if done else (0, 0)
        self.k = len(done)
        self.pieces: collections.deque[_Piece] = collections.deque()
        self.buffered = 0
        self.next_doc = self.skip_doc  # index of the next document the stream will deliver
        self.val_size = val_size if val_size is not None else (
            val_tokens if (val_tokens and not src.explicit_split) else None)
        self.on_shard = lambda k: None

    def save_manifest(self) -> None:
        atomic_write_bytes(self.manifest_path, json.dumps(self.state, indent=1).encode())

    def add(self, doc: int, split: str | None, a: np.ndarray) -> None:
        """Document `doc`'s tokens (past the resume point)."""
        start = 0
        if doc == self.skip_doc and self.skip_off:
            if self.skip_off >= len(a):  # (a shard never ends at a document's end: the next one starts then)
                raise self.past_the_input(f"that document has {len(a):,} tokens")
            a, start = a[self.skip_off:], self.skip_off
        if len(a):
            self.pieces.append(_Piece(doc, start, split, a))
            self.buffered += len(a)
        self.next_doc = doc + 1

    def past_the_input(self, what: str) -> DataError:
        return DataError(f"{self.manifest_path}: says the next shard starts at token {self.skip_off:,} of document "
                         f"{self.skip_doc:,}, but {what}; the input is not the one its shards were made from, or the "
                         f"manifest is damaged; pass {arg('force', True)} to redo the shards")

    def _take(self, n: int) -> np.ndarray:
        """The first n buffered tokens, out of the buffer."""
        take, got = [], 0
        while got < n:
            pc = self.pieces[0]
            need = n - got
            if len(pc.arr) <= need:
                take.append(pc.arr), self.pieces.popleft()
                got += len(pc.arr)
            else:
                take.append(pc.arr[:need])
                self.pieces[0] = _Piece(pc.doc, pc.start + need, pc.split, pc.arr[need:])
                got += need
        self.buffered -= n
        return np.concatenate(take) if len(take) != 1 else take[0]

    def flush(self, n: int, split: str) -> None:
        arr = self._take(n)
        fname = _shard_name(self.src.name, split, self.k)
        if self.k == len(self.done):  # the manifest before this run's first shard: a run killed between a shard
            self.save_manifest()      # and the manifest that lists it leaves shards with a manifest (a resume)
        write_shard(self.out_dir / fname, arr, self.tokenizer)
        nd, no = (self.pieces[0].doc, self.pieces[0].start) if self.pieces else (self.next_doc, 0)
        self.state["shards"].append({"file": fname, "split": split, "tokens": int(n), "next_doc": nd,
                                     "next_offset": no})
        self.state["val_size"] = self.val_size
        self.save_manifest()
        self.summary.new_tokens += n
        self.k += 1
        self.on_shard(self.k)

    def drain(self, final: bool) -> None:
        """Write every shard the buffer can fill (all of it when final)."""
        step = self._next_of_explicit_split if self.src.explicit_split else self._next_shard
        while self.buffered > 0 and step(final):
            pass

    def _next_of_explicit_split(self, final: bool) -> bool:
        """Write the next shard of a corpus with its own split, if the buffer holds it; whether it did."""
        split = self.pieces[0].split or "train"
        n_split = 0
        for pc in self.pieces:  # tokens of the head split available
            if pc.split != self.pieces[0].split:
                break
            n_split += len(pc.arr)
        if n_split >= self.shard_size:
            self.flush(self.shard_size, split)
        elif n_split < self.buffered or final:
            self.flush(n_split, split)
        else:
            return False
        return True

    def _next_shard(self, final: bool) -> bool:
        """Write the next shard (val first, then train), if the buffer holds it; whether it did."""
        if self.k == 0:
            return self._val_shard(final)
        if self.buffered >= self.shard_size:
            self.flush(self.shard_size, "train")
        elif final:
            self.flush(self.buffered, "train")
        else:
            return False
        return True

    def _val_shard(self, final: bool) -> bool:
        if self.val_size is None:
            if final:  # a small corpus: val is a fraction of it (leaving train at least 1 token)
                self.val_size = max(1, min(math.ceil(self.val_fraction * self.buffered), self.buffered - 1))
            elif self.buffered > 2 * self.shard_size:
                self.val_size = self.shard_size
            else:
                return False
        if self.buffered > self.val_size:  # (val once a train token follows it: never a val shard and no train)
            self.flush(self.val_size, "val")
            return True
        if final:  # the whole input fits the val split: refused before any shard is written
            name, buffered = self.src.name, self.buffered
            if self.val_tokens and not self.src.explicit_split:
                raise DataError(f"{name}: the input holds {buffered:,} tokens, all inside the val split's "
                                f"{self.val_size:,}, so no train shard; no shard written; pass a {arg('val_tokens')} "
                                f"below {buffered:,}")
            raise DataError(f"{name}: the input holds {buffered:,} token(s), too few for a val and a train shard; "
                            "no shard written")
        return False

    def finish(self) -> None:
        """After the last document: the rest of the buffer to shards, the manifest marked complete."""
        name, shards = self.src.name, self.state["shards"]
        self.drain(final=True)
        if not shards:  # (before any manifest: a rerun must not find an "already complete" empty run)
            raise DataError(f"{name}: the input holds no documents, no shards written")
        if not any(s["split"] == "train" for s in shards):  # (a corpus's own split with no train part)
            n, first = len(shards), shards[0]["file"]
            raise DataError(f"{name}: the input's train part holds no documents, so no train shard was written "
                            f"(only {first}{', ...' if n > 1 else ''} in {self.out_dir}); add train documents and run "
                            f"again with {arg('force', True)}")


def _write_shards(w: _ShardWriter, src: Source, tok, workers: int, progress: ProgressFactory, t0: float) -> None:
    """Feed the source's documents, tokenized by the workers, through `w` with a progress display."""
    in_stream = 0  # documents the input holds (skipped ones too): a resume position past them is a lie

    def doc_stream():
        nonlocal in_stream
        for i, (split, text) in enumerate(src.docs()):
            in_stream = i + 1
            if i < w.skip_doc:
                continue
            yield i, split, text

    total = src.total_bytes
    # (a generator: the workers start with its first batch, and closing it ends them)
    with progress(False) as prog, \
            contextlib.closing(encoded(_batches(doc_stream()), max(1, int(workers)), tok)) as stream:
        task = prog.add_task(f"tokenize {src.name}", total=total if not w.done else None,
                             tokens=0, tok_s=0.0, shard=w.k)
        w.on_shard = lambda k: prog.update(task, shard=k)
        ntok = 0
        try:
            for idx, splits, arr, lens, nbytes in stream:
                off = 0
                for i, s, ln in zip(idx, splits, lens.tolist()):
                    w.add(i, s, arr[off: off + ln])
                    off += ln
                ntok += int(arr.size)
                w.summary.input_bytes += nbytes
                el = max(time.perf_counter() - t0, 1e-9)
                prog.update(task, advance=nbytes, tokens=ntok, tok_s=ntok / el)
                w.drain(final=False)
            if w.done and (w.skip_doc > in_stream or (w.skip_doc == in_stream and w.skip_off)):
                raise w.past_the_input(f"the input holds {in_stream:,} document(s)")
            w.finish()
        except BaseException:  # the error line alone then says what happened (and how to resume)
            prog.discard()
            raise
        w.state["complete"] = True  # (before the display ends: its last write is the one a closed stderr fails)
        w.state["val_size"] = w.val_size
        w.save_manifest()
