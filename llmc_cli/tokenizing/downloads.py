"""Downloads for the corpora that live on the network. Offline they fail fast, in one line that names --local."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Iterator

from llmc_cli.formats.files import DataError, atomic_file
from llmc_cli.naming import arg
from llmc_cli.tokenizing.progress import ProgressFactory, silent

URLS = {
    "tinyshakespeare": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    "tinystories": "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz",
    "hellaswag": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl",
}


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
                        f"pass it with {arg('local')} PATH")


def download(url: str, dest: Path, progress: ProgressFactory = silent) -> Path:
    """Fetch ``url`` to ``dest`` (skipped when dest exists) through urllib, atomically."""
    import http.client
    import urllib.error
    import urllib.request

    if dest.is_file():
        return dest
    _probe(url)
    try:
        with atomic_file(dest, ".part") as tmp, urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            length = (r.headers.get("Content-Length") or "").strip()  # (one that is not a number: unknown)
            total = int(length) if length.isascii() and length.isdigit() and int(length) else None
            with progress(True) as prog:
                task = prog.add_task(f"download {dest.name}", total=total)
                got = 0
                try:
                    while chunk := r.read(1 << 20):
                        f.write(chunk)
                        got += len(chunk)
                        prog.advance(task, len(chunk))
                    if total is not None and got != total:  # (http.client ends a cut-off body quietly, as if whole)
                        raise DataError(f"download of {url} ended after {got:,} of {total:,} bytes; run the command "
                                        f"again, or download it elsewhere and pass it with {arg('local')} PATH")
                except BaseException:  # the error line alone then says what happened, not a bar left above it
                    prog.discard()
                    raise
    except http.client.HTTPException as e:  # a chunked body cut off (IncompleteRead), an answer that is not HTTP
        raise DataError(f"download of {url} failed (not a whole HTTP answer: {type(e).__name__}); run the command "
                        f"again, or download it elsewhere and pass it with {arg('local')} PATH") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise DataError(f"download of {url} failed ({getattr(e, 'reason', e)}); download it elsewhere "
                        f"and pass it with {arg('local')} PATH") from None
    return dest


def hf_check(repo: str):
    """Fail fast, before anything is written, when a Hugging Face dataset cannot be streamed: `datasets`
    missing, or the hub unreachable. Returns ``datasets.load_dataset``."""
    import urllib.parse
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"  # (an empty variable is an unset one)
    try:  # (urllib reads a port past 65535 or a broken [IPv6] host with a ValueError)
        u = urllib.parse.urlparse(endpoint)
        ok = bool(u.hostname) and u.scheme in ("http", "https") and (u.port is None or u.port > 0)
    except ValueError:
        ok = False
    if not ok:
        raise DataError(f"HF_ENDPOINT={endpoint!r}: expected the hub's URL, such as https://huggingface.co")
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError(f"streaming {repo} needs Hugging Face datasets: pip install 'llmc[hf]' "
                        f"(or download its parquet files and pass {arg('local')} PATH)") from None
    _probe(endpoint)
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
        raise DataError(f"cannot stream {repo} ({config}): {msg}; pass local files with {arg('local')} PATH") from None
