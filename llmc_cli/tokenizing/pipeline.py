"""The shard pipeline: documents -> tokens (tokenizer worker processes, workers.py) -> llm.c shards, resumable
through a manifest, with llm.c's val split."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from llmc_cli.formats.files import DataError, DirectoryLock, atomic_write_bytes, read_at_most, sibling_stem
from llmc_cli.formats.shards import read_shard_header, shard_format, write_shard
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
    import glob
    import re

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
        raise DataError(f"{path}: {what}; pass --force to redo the shards")

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
        raise DataError(f"--shard-size must be at least 1 token, got {shard_size}")
    shard_format(tok.name)  # an unknown tokenizer fails here, before anything is written
    out_dir = Path(out_dir)
    # one writer of a corpus' shards and manifest at a time (two runs into one directory would interleave them);
    # other corpora in the same directory are free to run beside it
    with DirectoryLock(out_dir, f".{sibling_stem(src.name)}.lock", "--out-dir", "the output directory", DataError,
                       "give another --out-dir"):
        return _run_locked(src, tok, out_dir, shard_size, workers, val_tokens, val_fraction, force, progress)


def _run_locked(src: Source, tok, out_dir: Path, shard_size: int, workers: int, val_tokens: int | None,
                val_fraction: float, force: bool, progress: ProgressFactory) -> Summary:
    manifest_path = out_dir / f"{src.name}_manifest.json"
    fp = {"source": src.ident, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
          "vocabulary_sha256": tok.vocabulary_sha256,
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
            manifest = json.loads(_manifest_bytes(manifest_path))
        except (OSError, ValueError, RecursionError):  # (not JSON, not UTF-8: refused below as not a manifest)
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
            manifest = None
        if manifest and manifest.get("fingerprint") != fp:
            old = manifest.get("fingerprint") or {}
            diff = sorted(k for k in set(fp) | set(old) if fp.get(k) != old.get(k))
            raise DataError(f"{out_dir} holds {src.name} shards made from other inputs or settings "
                            f"({', '.join(diff)} differ); pass --force to redo them or choose another --out-dir")
        if manifest:
            _check_manifest(manifest_path, manifest, src.name, src.explicit_split)
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
        try:  # (a FIFO under its name is not read: that would wait for a writer forever)
            ours = manifest_path.is_file() and isinstance(
                json.loads(_manifest_bytes(manifest_path)).get("fingerprint"), dict)
        except (OSError, ValueError, AttributeError, RecursionError):
            ours = False
        if not ours:
            raise DataError(f"{manifest_path}: not an llmc tokenize manifest, so llmc will not replace it (even "
                            "with --force); move it or choose another --out-dir")
    for p in stale:
        p.unlink()
    # (input that fails before the first shard leaves nothing behind: the lock's release removes the folders)

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
        if k == len(done):  # the manifest before this run's first shard: a run killed between a shard and the manifest
            save_manifest()  # that lists it leaves shards with a manifest (a resume), never shards alone (refused)
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
                if buffered > val_size:  # (val once a train token follows it: never a val shard and no train)
                    flush(val_size, "val")
                    continue
                if final:  # the whole input fits the val split: refused before any shard is written
                    if val_tokens and not src.explicit_split:
                        raise DataError(f"{src.name}: the input holds {buffered:,} tokens, all of them inside the "
                                        f"val split's {val_size:,} (--val-tokens), so no train shard would be left; "
                                        f"no shard written; pass a --val-tokens below {buffered:,}")
                    raise DataError(f"{src.name}: the input holds {buffered:,} token(s), too few for a val and a "
                                    "train shard; no shard written")
                return
            if buffered >= shard_size:
                flush(shard_size, "train")
            elif final:
                flush(buffered, "train")
            else:
                return

    in_stream = 0  # documents the input holds (skipped ones too): a resume position past them is a lie

    def doc_stream():
        nonlocal in_stream
        for i, (split, text) in enumerate(src.docs()):
            in_stream = i + 1
            if i < skip_doc:
                continue
            yield i, split, text

    def past_the_input(what: str) -> DataError:
        return DataError(f"{manifest_path}: says the next shard starts at token {skip_off:,} of document "
                         f"{skip_doc:,}, but {what}; the input is not the one its shards were made from, or the manifest is "
                         "damaged; pass --force to redo the shards")

    task = None
    workers = max(1, int(workers))
    total = src.total_bytes
    # (a generator: the workers start with its first batch, and closing it ends them)
    with progress(False) as prog, contextlib.closing(encoded(_batches(doc_stream()), workers, tok)) as stream:
        task = prog.add_task(f"tokenize {src.name}", total=total if not done else None,
                             tokens=0, tok_s=0.0, shard=k)
        ntok = 0
        try:
            for idx, splits, arr, lens, nbytes in stream:
                off = 0
                for i, s, ln in zip(idx, splits, lens.tolist()):
                    a = arr[off: off + ln]
                    off += ln
                    start = 0
                    if i == skip_doc and skip_off:
                        if skip_off >= len(a):  # (a shard never ends at a document's end: the next one starts then)
                            raise past_the_input(f"that document has {len(a):,} tokens")
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
            if done and (skip_doc > in_stream or (skip_doc == in_stream and skip_off)):
                raise past_the_input(f"the input holds {in_stream:,} document(s)")
            drain(final=True)
            if not state["shards"]:  # (before any manifest: a rerun must not find an "already complete" empty run)
                raise DataError(f"{src.name}: the input holds no documents, no shards written")
            if not any(s["split"] == "train" for s in state["shards"]):  # (a corpus's own split with no train part)
                n, first = len(state["shards"]), state["shards"][0]["file"]
                raise DataError(f"{src.name}: the input's train part holds no documents, so no train shard was "
                                f"written (only {n} val shard(s), {first}{', ...' if n > 1 else ''}, in {out_dir}, "
                                "its manifest marked unfinished); add train documents and run again with --force")
        except BaseException:  # the error line alone then says what happened (and how to resume)
            prog.discard()
            raise
        state["complete"] = True  # (before the display ends: its last write is the one a closed stderr fails)
        state["val_size"] = val_size
        save_manifest()
    summary.shards = state["shards"]
    summary.seconds = time.perf_counter() - t0
    return summary
