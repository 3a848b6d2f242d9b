"""A step folder's manifest: what the checkpoint holds, so that a reader loads only what was written together.

`step_N/manifest.json` is written last, after every other file of the step, and moves in with the folder:
{"version", "run_id", "step", "family", "files": {name: {"size", "crc32"}}, "state", "data"}. The run's id is made once and
kept in `RUN/run_id`; `data` is the fingerprint of the shards the run read (`data_fingerprint`), when the writer is
given one. Whoever loads a step verifies the files it reads against the manifest and names the one that disagrees:
a state.json, model or optimizer state from another step or run, swapped step folders, a GPT-2 model put into a
Llama run's step. A step folder without a manifest (written before llmc wrote them) loads as it did.

state.json is bound by what makes it this run's state at this step (`state`: a digest of its step, data position,
RNG, update count and family), not by its bytes: its readers say what is wrong with a state edited in place (a
damaged backend_state or recorded option), and one from another step or run differs in those.

The digest is zlib's CRC-32 with the size beside it: it finds files from elsewhere (which is what a manifest is
for, not tampering) at about 4 GiB/s of CPU, where SHA-256 (1.7 GiB/s) more than doubled the load of a 1 GiB model
file on a loaded host. Each file is digested once per process (`_VERIFIED`), however often a command resolves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import zlib
from pathlib import Path

from llmc_cli.formats.files import CheckpointError, atomic_write_bytes, read_at_most
from llmc_cli.formats.rundir import step_dirs, step_of
from llmc_cli.formats.shards import tokenize_manifests

MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
# what differs between two runs' or two steps' states (the recorded options are not: a resume may override one)
STATE_IDENTITY = ("step", "dataloader", "rng", "optimizer_steps", "family")
RUN_ID_FILE = "run_id"
MANIFEST_VERSION = 1
MANIFEST_MAX_BYTES = 16 * 2**20  # a few files and the data's fingerprint (thousands of shards): never a big file
_CHUNK = 8 * 2**20
_VERIFIED: dict[tuple, None] = {}  # (path, inode, size, mtime) of files whose digest matched their manifest


def file_digest(path: str | Path) -> dict:
    """{"size", "crc32"} of a file, read once in chunks."""
    crc = [0]
    size = _chunks(path, lambda view: crc.__setitem__(0, zlib.crc32(view, crc[0])))
    return {"size": size, "crc32": f"{crc[0]:08x}"}


def _chunks(path: str | Path, take) -> int:
    """Hands `take` the whole of a file, a chunk at a time (never all of it in memory); returns its size."""
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            take(view[:n])
            size += n
    return size


def run_id(run_dir: str | Path) -> str:
    """The run's id, made (random) when its first step is written and kept in RUN/run_id. A run whose id file went
    missing takes the id its newest manifest records, so that its earlier steps still load."""
    path = Path(run_dir) / RUN_ID_FILE
    if (known := read_run_id(run_dir)) is not None:
        return known
    for step in reversed(step_dirs(run_dir)):
        recorded = _read_manifest(step / MANIFEST_FILE, quiet=True)
        if recorded is not None and _is_id(recorded.get("run_id")):
            ident = recorded["run_id"]
            break
    else:
        ident = secrets.token_hex(16)
    atomic_write_bytes(path, [ident.encode() + b"\n"])
    return ident


def read_run_id(run_dir: str | Path) -> str | None:
    try:
        raw = read_at_most(Path(run_dir) / RUN_ID_FILE, 256)
    except OSError:
        return None
    ident = raw.decode("ascii", "replace").strip() if raw is not None else None
    return ident if _is_id(ident) else None


def _is_id(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 64 and all(c in "0123456789abcdef" for c in v)


def write_manifest(step_dir: str | Path, ident: str, step: int, family: str, data: dict | None = None) -> None:
    """step_dir/manifest.json for every file already in `step_dir` (call it after the last of them)."""
    step_dir = Path(step_dir)
    files = {p.name: file_digest(p) for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
    body = {"version": MANIFEST_VERSION, "run_id": ident, "step": step, "family": family, "files": files,
            "state": _state_identity(step_dir / STATE_FILE), "data": data}
    atomic_write_bytes(step_dir / MANIFEST_FILE, [json.dumps(body, indent=1, sort_keys=True).encode()])


def step_manifest(step_dir: str | Path) -> dict | None:
    """A step folder's manifest (None: a step written without one); CheckpointError for one llmc cannot read. Its
    "data" is the fingerprint a resume compares with its shards' (data_differences)."""
    return _read_manifest(Path(step_dir) / MANIFEST_FILE)


def _state_identity(path: Path) -> str | None:
    """A digest of what binds a state.json to its run and step (STATE_IDENTITY), None where it is no JSON object."""
    try:
        raw = read_at_most(path, MANIFEST_MAX_BYTES * 4)
        state = json.loads(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict):
        return None
    key = json.dumps({k: state.get(k) for k in STATE_IDENTITY}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def _read_manifest(path: Path, quiet: bool = False) -> dict | None:
    """The manifest at `path`, None where there is none; CheckpointError for one that is not a manifest (None when
    `quiet`)."""
    if not os.path.lexists(path):
        return None
    try:
        raw = read_at_most(path, MANIFEST_MAX_BYTES)
        body = json.loads(raw) if raw is not None else None
    except (OSError, ValueError, RecursionError):
        body = None
    files = body.get("files") if isinstance(body, dict) else None
    if not (isinstance(files, dict) and type(body.get("step")) is int and body.get("version") == MANIFEST_VERSION
            and all(isinstance(v, dict) and type(v.get("size")) is int and isinstance(v.get("crc32"), str)
                    for v in files.values())):
        if quiet:
            return None
        raise CheckpointError(f"{path}: not a step manifest llmc can read (damaged?); move it aside to load the step "
                              "unverified")
    return body


def verify_step_files(step_dir: str | Path, names: tuple[str, ...] | list[str], read: dict | None = None) -> None:
    """Checks the files `names` of a step folder against its manifest (none: nothing to check), naming the first
    that disagrees: a manifest of another step or run, or a file the manifest does not list or lists otherwise.
    `read`: {name: bytes_digest(...)} of files whose bytes the caller already holds (not read a second time)."""
    step_dir = Path(step_dir)
    manifest = step_manifest(step_dir)
    if manifest is None:
        return
    where = step_dir / MANIFEST_FILE
    folder_step = step_of(step_dir.name)
    if folder_step is not None and manifest["step"] != folder_step:
        raise CheckpointError(f"{where}: records step {manifest['step']}, but its folder is {step_dir.name} (step "
                              "folders swapped or renamed); give the folder its own name back")
    ident = read_run_id(step_dir.parent)
    if ident is not None and manifest.get("run_id") != ident:
        raise CheckpointError(f"{where}: from run {str(manifest.get('run_id'))[:32]!r}, not this run directory's "
                              f"({ident}): a step folder of another run")
    for name in names:
        if name == STATE_FILE and isinstance(manifest.get("state"), str):
            if _state_identity(step_dir / name) != manifest["state"]:
                raise CheckpointError(f"{step_dir / name}: its step, data position, RNG or update count differ "
                                      f"from what step {manifest['step']}'s {MANIFEST_FILE} records (another step's or "
                                      "run's state)")
            continue
        _verify_file(step_dir / name, manifest["files"].get(name), manifest["step"], (read or {}).get(name))


def bytes_digest(chunks) -> dict:
    """file_digest of a file whose bytes a reader already holds, in order (an llm.c .bin's header and float32 body):
    verifying it costs the CRC alone, not a second read."""
    crc, size = 0, 0
    for c in chunks:
        view = memoryview(c).cast("B")
        crc, size = zlib.crc32(view, crc), size + len(view)
    return {"size": size, "crc32": f"{crc:08x}"}


def _verify_file(path: Path, want: dict | None, step: int, got: dict | None = None) -> None:
    if want is None:
        raise CheckpointError(f"{path}: not in its step's {MANIFEST_FILE} (put there after step {step} was written: "
                              "another step's, run's or model family's file); remove it or restore the step's own")
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _VERIFIED:
        return
    if st.st_size != want["size"]:
        raise CheckpointError(f"{path}: {st.st_size:,} bytes, but step {step}'s {MANIFEST_FILE} records "
                              f"{want['size']:,} (a file from another step or run, or cut short)")
    if got is None or got["size"] != st.st_size:
        try:
            got = file_digest(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    if got["crc32"] != want["crc32"].lower():
        raise CheckpointError(f"{path}: its content differs from what step {step}'s {MANIFEST_FILE} records (a file "
                              "from another step or run, or damaged)")
    _VERIFIED[key] = None


# ---- the data a run reads ----------------------------------------------------------------------------------------
_SAMPLES = 16  # blocks read from each shard: a corpus tokenized again from other text differs in every one of them
_SAMPLE_BYTES = 4096
SHARD_HEADER_BYTES = 1024


def data_fingerprint(shards: list[str | Path] | tuple[str | Path, ...]) -> dict:
    """What identifies the shards a run reads, cheaply (a few blocks of each, not the whole corpus): each shard's
    name, size and a SHA-256 of its header and of 16 blocks spread over it; and the SHA-256 of each tokenize
    manifest (`*_manifest.json`) beside them. Two fingerprints differ when the shards were tokenized again from
    other text, even under the same names and sizes."""
    out: dict = {"shards": [], "tokenize_manifests": {}}
    for p in map(Path, shards):
        size = os.path.getsize(p)
        h = hashlib.sha256(size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            h.update(f.read(SHARD_HEADER_BYTES))
            for i in range(_SAMPLES):
                f.seek(SHARD_HEADER_BYTES + (max(size - SHARD_HEADER_BYTES - _SAMPLE_BYTES, 0) * i) // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
        out["shards"].append({"name": p.name, "size": size, "sha256": h.hexdigest()})
    for m in tokenize_manifests(shards):
        if m.is_file():
            h = hashlib.sha256()
            _chunks(m, h.update)
            out["tokenize_manifests"][m.name] = h.hexdigest()
    return out


def data_differences(recorded: dict | None, now: dict) -> str | None:
    """What differs between the fingerprint a run recorded and its data's now, as a phrase naming the first shard
    (None: the same, or nothing recorded)."""
    if not isinstance(recorded, dict):
        return None
    was = {s.get("name"): s for s in recorded.get("shards", []) if isinstance(s, dict)}
    for s in now["shards"]:
        old = was.get(s["name"])
        if old is None:
            return f"{s['name']} is not among the shards the run read"
        if old.get("size") != s["size"]:
            return f"{s['name']} is {s['size']:,} bytes, the run read {old.get('size')!s:.20} bytes"
        if old.get("sha256") != s["sha256"]:
            return f"{s['name']} holds other tokens than the run read (tokenized again?)"
    if missing := sorted(set(was) - {s["name"] for s in now["shards"]}):
        return f"{missing[0]} (which the run read) is not among them"
    for name, digest in now["tokenize_manifests"].items():
        if recorded.get("tokenize_manifests", {}).get(name, digest) != digest:
            return f"{name} differs from the tokenize manifest the run read (tokenized again?)"
    return None
