"""Model files and run directories.

* llm.c's model .bin: a header of 256 int32 (magic 20240326; version 3 = float32 params, 5 = bfloat16; then
  maxT, V, L, NH, C, Vp) followed by the parameters in llm.c's order. Files written here load in llm.c's
  train_gpt2.c / train_gpt2.cu and the other way round.
* A run directory: `step_NNNNNNNN/` folders (eight digits at least: rundir.step_of) holding model.bin,
  optimizer.npz (float32 moments and master weights), state.json (step, data position, RNG, config) and, written
  last, manifest.json (what the step holds: manifest.py), plus a `latest` file naming the newest complete one and
  `run_id`, the run's own id.
  A Llama run keeps model.safetensors instead of model.bin (llm.c's format has no Llama layout): llmc's own
  tensor names and stacked per-layer shapes, with the family, config and tokenizer in the file's metadata, so
  the file alone rebuilds the model.
* safetensors (the format, read and written here without the `safetensors` package): 8-byte little-endian
  header length, a JSON header {name: {dtype, shape, data_offsets}} (offsets relative to the end of the header,
  which is space-padded to a multiple of 8), then the raw little-endian data. Hugging Face interop (hf.py,
  llama3_hf.py) uses the same reader and writer, single-file or sharded under an index.
  Every file is written under a temporary name, fsynced, then renamed, and `latest` moves last, so a crash at
  any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from llmc_cli.formats.files import (
    CheckpointError,
    atomic_write_bytes,
    fault_delay,
    fsync_dir,
    not_a_file,
    read_at_most,
    replace_dir,
)
from llmc_cli.formats import manifest as mf
from llmc_cli.formats import notes
from llmc_cli.formats.hf import TOKENIZER_FILE
from llmc_cli.formats.rundir import step_dir_name, step_dirs, step_of
from llmc_cli.formats.hf_llama3 import tokenizer_model_bytes
from llmc_cli.formats.llama_file import (
    read_llama_header,
)
from llmc_cli.formats.llmc_bin import (
    HEADER_INTS,
    MODEL_MAGIC,
    VERSION_FP32,
    read_model_tokenizer,
)
from llmc_cli.formats.safetensors import SAFETENSORS_HEADER_MAX, read_safetensors_header
from llmc_cli.formats.shards import SHARD_VOCAB
from llmc_cli.models.families import FAMILIES, GPT2, LLAMA3, family_of
from llmc_cli.models.family import Family
from llmc_cli.models.gpt2 import GPT2Config
from llmc_cli.models.llama3 import Llama3Config
from llmc_cli.naming import arg

# ---- any model file: GPT-2 as llm.c's .bin, Llama as model.safetensors ---------------------------------------
ModelConfig = GPT2Config | Llama3Config
T = TypeVar("T")
MODEL_FILES = ("model.bin", "model.safetensors")


def model_file_name(cfg: ModelConfig) -> str:
    return family_of(cfg).model_file.name


def write_model_file(path: str | Path, cfg: ModelConfig, params: np.ndarray, bf16: bool = False,
                     tokenizer: str = "gpt2") -> None:
    family_of(cfg).model_file.write(path, cfg, params, bf16=bf16, tokenizer=tokenizer)


def _file_family(path: str | Path) -> Family:
    """Whose model file `path` is, by content: llm.c's magic is GPT-2's .bin; a safetensors file names its family
    in the metadata (the family's reader says what is wrong with one that does not)."""
    if not _is_safetensors(path):
        return GPT2
    try:
        meta = read_safetensors_header(path)[0].get("__metadata__")
    except CheckpointError:
        meta = None
    name = meta.get("family") if isinstance(meta, dict) else None
    fam = FAMILIES.get(name) if isinstance(name, str) else None
    # a family whose files are not safetensors (GPT-2's .bin) would read this one as a bad .bin; Llama's reader
    # names the family the metadata claims instead
    return fam if fam is not None and Path(fam.model_file.name).suffix == ".safetensors" else LLAMA3


def read_model_file(path: str | Path) -> tuple[ModelConfig, np.ndarray]:
    """(config, float32 params) of an llm.c .bin or an llmc Llama model.safetensors, told apart by content."""
    return _file_family(path).model_file.read(path)


def read_model_file_config(path: str | Path) -> ModelConfig:
    return _file_family(path).model_file.read_config(path)


def model_file_tokenizer(path: str | Path) -> str:
    """The tokenizer a model file was trained with: llm.c files are GPT-2's unless their header names another (the
    byte-level one), Llama files record theirs."""
    if _is_safetensors(path):
        tok = read_llama_header(path)[1].get("tokenizer", "gpt2")
        return tok if isinstance(tok, str) else "gpt2"
    return read_model_tokenizer(path)


def _is_safetensors(path: str | Path) -> bool:
    """llm.c files start with the int32 magic 20240326; a safetensors file with a small u64 header length."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) != MODEL_MAGIC and Path(path).suffix != ".bin"


# ---- run directories ------------------------------------------------------------------------------------------
def write_run_checkpoint(run_dir: str | Path, step: int, cfg: ModelConfig, params: np.ndarray, bf16: bool,
                         optimizer: dict[str, np.ndarray], state: dict, keep: int = 0,
                         tokenizer_file: str | Path | None = None, data_fingerprint: dict | None = None) -> Path:
    """Writes step_NNNNNNNN/ atomically and then points `latest` at it; keeps the newest `keep` (0 = all).
    The model file is model.bin for GPT-2, model.safetensors for Llama; `tokenizer_file` (a Llama 3
    tokenizer.model the run was started with) is copied once to the run directory, beside the steps. The step's
    manifest (formats/manifest.py), written last, binds its files to the run, the step and `data_fingerprint`
    (manifest.data_fingerprint of the shards the run reads)."""
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}"
    if os.path.lexists(final) and not final.is_dir():  # (replace_dir would move it aside and leave it there)
        raise CheckpointError(f"cannot write the checkpoint {final}: something that is not a checkpoint folder is "
                              "there under its name; llmc will not replace it (move it)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if tokenizer_file is not None and not (run_dir / TOKENIZER_FILE).is_file():
            atomic_write_bytes(run_dir / TOKENIZER_FILE, [tokenizer_model_bytes(tokenizer_file)])
        for stale in run_dir.glob(".step_*.tmp-*"):  # left behind by a killed writer (the run's lock: one writer)
            shutil.rmtree(stale, ignore_errors=True)
        ident = mf.run_id(run_dir)
        tmp.mkdir()
        fault_delay("model")
        write_model_file(tmp / model_file_name(cfg), cfg, params, bf16=bf16,
                         tokenizer=state.get("tokenizer", "gpt2"))
        fault_delay("optimizer")
        with open(tmp / "optimizer.npz", "wb") as f:
            np.savez(f, **optimizer)
            f.flush()
            os.fsync(f.fileno())
        fault_delay("state")
        atomic_write_bytes(tmp / "state.json", [json.dumps(state, indent=1, sort_keys=True).encode()])
        mf.write_manifest(tmp, ident, step, family_of(cfg).name, data_fingerprint)
        fsync_dir(tmp)
        fault_delay("rename")
        replace_dir(tmp, final)  # (rewriting the same step keeps the old one until the new one stands)
        fsync_dir(run_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not stay full of a half checkpoint
        if isinstance(e, OSError):
            where = e.filename or tmp
            earlier = ("the earlier checkpoints are untouched" if any(p.name != final.name for p in _complete_steps(run_dir))
                       else "the run has no earlier checkpoint")
            raise CheckpointError(f"cannot write the checkpoint {final}: {where}: {e.strerror or e}; {earlier}") from None
        raise
    fault_delay("latest")
    try:
        atomic_write_bytes(run_dir / "latest", [final.name.encode() + b"\n"])
    except OSError as e:  # the step is complete; --resume finds the newest complete step without `latest`
        raise CheckpointError(f"{final} was written but {run_dir / 'latest'} could not be updated "
                              f"({e.strerror or e}); it still names the step before") from None
    fault_delay("rotate")
    if keep > 0:  # the step just written always stays (even if a resumed run left newer-named steps behind)
        # (only llmc's own names: a user's step_00000003.bak or step_best beside them is not a checkpoint)
        others = [p for p in step_dirs(run_dir) if p.name != final.name]
        for p in others[:max(len(others) - (keep - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def held_model_digest(model: Path, params: np.ndarray) -> dict:
    """{name: digest} of a float32 llm.c .bin from the bytes just read (its body is `params` as they lie in the file),
    so that its manifest costs a CRC and no second read; {} for other files (read again to be verified)."""
    if model.suffix != ".bin" or params.dtype != np.dtype("<f4"):
        return {}
    header = np.fromfile(model, dtype="<i4", count=HEADER_INTS)
    if header.size != HEADER_INTS or int(header[1]) != VERSION_FP32:
        return {}
    return {model.name: mf.bytes_digest([header, params])}


def _model_in(step_dir: Path) -> Path | None:
    return next((step_dir / f for f in MODEL_FILES if (step_dir / f).is_file()), None)


def _complete_steps(run_dir: Path) -> list[Path]:
    return [p for p in step_dirs(run_dir) if _model_in(p) is not None and all(
        (p / f).is_file() for f in ("optimizer.npz", "state.json"))]


def _newest_complete(run_dir: Path) -> Path | None:
    """The model file of the newest complete step, each looked at once (a step that --keep removes meanwhile is
    passed over, never returned as a model file that is not there)."""
    for p in reversed(step_dirs(run_dir)):
        model = _model_in(p)
        if model is not None and all((p / f).is_file() for f in ("optimizer.npz", "state.json")):
            return model
    return None


RUN_STATE_VERSION = 1
_STATE_KEYS = {"step": int, "dataloader": dict, "rng": dict, "args": dict}


INT64_MAX = 2**63 - 1  # what numpy and the loaders index with: a larger count is no run's (and overflows there)
STEP_MAX = 2**31 - 1  # the most steps `--steps` takes: a state at a later step could never be continued


def _count(v) -> bool:
    return type(v) is int and 0 <= v <= INT64_MAX


def _rng_state(v) -> bool:
    """Does `v` load into numpy's PCG64 (what the trainer restores)? Tried here, where a bad one is one line naming
    state.json: numpy says OverflowError for a state past 128 bits, which no caller expects."""
    try:
        np.random.PCG64().state = v
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError):
        return False
    return True


def _number(v) -> bool:
    import math
    return type(v) in (int, float) and math.isfinite(v)


# what a resume reads besides _STATE_KEYS, each checked for its JSON type before any of it is used
# (key, check, what is expected); absent keys are older checkpoints and keep their defaults
_STATE_FIELDS = (
    ("backend_state", lambda v: isinstance(v, dict), "a JSON object (what the backend carries between steps)"),
    ("rng", _rng_state, "a PCG64 state, as numpy's bit_generator.state gives it"),
    ("optimizer_steps", lambda v: _count(v) and v <= STEP_MAX, f"an integer in [0, {STEP_MAX}]"),
    ("tokens_per_step", lambda v: type(v) is int and v > 0, "a positive integer"),
    ("world_size", lambda v: type(v) is int and v > 0, "a positive integer"),
    ("tokenizer", lambda v: v in SHARD_VOCAB, "'gpt2', 'llama3' or 'bytes'"),
    ("family", lambda v: v in ("gpt2", "llama3"), "'gpt2' or 'llama3'"),
    ("config", lambda v: isinstance(v, dict), "an object"),
    ("outliers", lambda v: isinstance(v, dict) and all(isinstance(v.get(k, []), list) and all(
        _number(x) for x in v.get(k, [])) for k in ("loss", "norm")) and _count(v.get("bad_streak", 0)),
     "an object of 'loss' and 'norm' number lists and a 'bad_streak' count"),
)
_LOADER_FIELDS = {"version": _count, "epoch": _count, "shard": _count, "sample": _count, "num_shards": _count,
                  "B": _count, "T": _count, "world_size": _count, "seed": _count,
                  "shard_file": lambda v: isinstance(v, str), "shuffle": lambda v: type(v) is bool}
_LOADER_REQUIRED = ("version", "epoch", "shard", "sample")  # the position itself; the rest is compared if there


LATEST_MAX_BYTES = 4096
STATE_MAX_BYTES = 64 * 2**20


def resolve_checkpoint(path: str | Path, note_as: str | None = "using") -> Path:
    """A run directory (its `latest`), a step directory or a model file -> the model file to load (its reader then
    checks it against its step's manifest: manifest.verify_step_files).

    A `latest` that names no step with a model (garbage, `../x`, a step since removed; a crash between moving a step
    aside and writing `latest`) falls back to the newest complete step, and says so (notes.note) with `note_as` for
    what is done with it ("resuming from"); None says nothing (a caller that only looks, before the reader that
    loads it)."""
    path = Path(path)
    if path.is_file():
        _check_model_file_kind(path)
        return path
    latest = path / "latest"
    if latest.is_file():
        try:
            raw = read_at_most(latest, LATEST_MAX_BYTES)  # a step's name: never a big file put there
        except OSError as e:
            raise CheckpointError(f"{path}/latest: unreadable ({e})") from None
        name = raw.decode("utf-8", "backslashreplace").strip() if raw is not None else None
        step = path / (name or "")
        if name is None or step_of(name) is None or (model := _model_in(step)) is None:
            if (newest := _newest_complete(path)) is not None:
                _fell_back(latest, _latest_names(name, step), newest.parent, note_as)
                return newest
            what = f"is a file of over {LATEST_MAX_BYTES} bytes" if name is None else f"points to {name!r}"
            raise CheckpointError(f"{path}/latest {what}, which is not a step directory with a model.bin or "
                                  "model.safetensors")
        return model
    if os.path.lexists(latest) and (newest := _newest_complete(path)) is not None:  # (no `latest`: a crash's, quiet)
        _fell_back(latest, f"is {not_a_file(latest)}, not a file naming a step", newest.parent, note_as)
        return newest
    if path.is_dir() and (model := _model_in(path)) is not None:
        return model
    if path.is_dir() and (newest := _newest_complete(path)) is not None:  # killed before its first `latest`
        return newest
    steps = [p.name for p in step_dirs(path)] if path.is_dir() else []
    if steps:  # (a run killed while writing its first checkpoint, or step folders made by hand)
        raise CheckpointError(f"{path}: a run directory with no complete checkpoint: no step folder "
                              f"({', '.join(steps[:3])}{', ...' if len(steps) > 3 else ''}) holds a model with "
                              f"optimizer.npz and state.json, and there is no 'latest'")
    raise CheckpointError(f"{path}: not a model file, a run directory with 'latest', or a step directory "
                          f"(model.bin or model.safetensors)")


def read_resolved(path: str | Path, read: Callable[[Path], T], note_as: str | None = "using") -> T:
    """`read(model_file)` of the step `path` resolves to, resolved once and held; where the step is gone when it is
    read (a live run's `--keep` removed it meanwhile), resolved afresh and read once more, and then one line."""
    path = Path(path)
    retried = False
    while True:
        model = resolve_checkpoint(path, note_as)
        try:
            return read(model)
        except (CheckpointError, OSError):
            if model == path or os.path.lexists(model):  # (a file given by name, or still there: its own error)
                raise
            if retried:
                raise CheckpointError(f"{path}: {model.parent.name} was removed while it was read, as was the step "
                                      f"read before it (a live run pruning its steps with {arg('keep')}); try again") \
                    from None
            retried = True


def _latest_names(name: str | None, step: Path) -> str:
    """What is wrong with the step a `latest` names, which is not one to load."""
    if name is None:
        return f"is a file of over {LATEST_MAX_BYTES} bytes"
    if not name:
        return "is empty"
    if step_of(name) is None:
        return f"names {name!r}, not a step folder of the run"
    if not os.path.lexists(step):
        return f"names {name}, which does not exist"
    return f"names {name}, which holds no model.bin or model.safetensors"


def _fell_back(latest: Path, why: str, step: Path, note_as: str | None) -> None:
    if note_as:  # the documented recovery after a crash, but a `latest` naming another step must not pass unsaid
        notes.note(f"{latest} {why}; {note_as} the newest complete step, {step.name}")


def _check_model_file_kind(path: Path) -> None:
    """Refuses, in one line that says what was expected, a file that is neither an llm.c .bin (its magic) nor a
    safetensors file (a header length that fits the file, then JSON): a run's state.json or optimizer.npz given
    where a model belongs was read as a safetensors header of absurd length. A .bin keeps its reader's own
    message (a wrong magic number)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return  # (the reader that follows says what is wrong)
    if path.suffix == ".bin" or len(head) >= 4 and int(np.frombuffer(head[:4], "<i4")[0]) == MODEL_MAGIC:
        return
    # a safetensors header (JSON, which may begin with white space or a BOM) is what follows the length: a file
    # cut short still has it, and its reader then says it is truncated
    if len(head) >= 8 and int(np.frombuffer(head[:8], "<u8")[0]) <= SAFETENSORS_HEADER_MAX and \
            head[8:].lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")[:1] in (b"{", b""):
        return
    hint = ""
    if step_of(path.parent.name) is not None and _model_in(path.parent) is not None:
        hint = f"; its folder {path.parent} is a step directory: give that, or its model file {_model_in(path.parent)}"
    raise CheckpointError(f"{path}: not a model file: expected an llm.c .bin (magic {MODEL_MAGIC}), a "
                          f"model.safetensors, a run or step directory, or a Hugging Face directory{hint}")


def check_finite(path: str | Path, params: np.ndarray, what: str = "weights") -> None:
    """Refuses weights holding NaN or inf (a diverged run's, or a damaged file): they would only sample
    garbage, evaluate to nan and train nowhere."""
    bad = int(np.size(params) - np.count_nonzero(np.isfinite(params)))
    if bad:
        raise CheckpointError(f"{path}: {bad:,} of {np.size(params):,} {what} are NaN or inf (a diverged or damaged "
                              "checkpoint); llmc will not use them")


def read_run_checkpoint(path: str | Path) -> tuple[ModelConfig, np.ndarray, dict[str, np.ndarray], dict]:
    """(config, float32 params, optimizer arrays, state) of a run directory's latest (or a step directory)."""
    return read_resolved(path, _read_step, "resuming from")


def _read_step(model_path: Path) -> tuple[ModelConfig, np.ndarray, dict[str, np.ndarray], dict]:
    step_dir = model_path.parent
    try:
        cfg, params = read_model_file(model_path)
    except OSError as e:
        raise CheckpointError(f"{e.filename or model_path}: cannot read it ({e.strerror or e})") from None
    check_finite(model_path, params)
    # each file's own checks say what is wrong with it; the step's manifest then says whether it is the step's own
    mf.verify_step_files(step_dir, [model_path.name], held_model_digest(model_path, params))
    state_path, opt_path = step_dir / "state.json", step_dir / "optimizer.npz"
    for p in (state_path, opt_path):
        if not os.path.lexists(p):
            raise CheckpointError(f"{p}: missing, so {step_dir} cannot be resumed (it holds only a model)")
        if not p.is_file():  # (a directory or a FIFO there is not read: it is named for what it is)
            raise CheckpointError(f"{p}: {not_a_file(p)} where a file belongs, so {step_dir} cannot be resumed")
    state = read_run_state(state_path)
    fam = family_of(cfg)
    if state.get("family", fam.name) != fam.name:  # (the state of another run's model, or a damaged one)
        raise CheckpointError(f"{state_path}: 'family' is {state['family']!r} but {model_path.name} beside it holds a "
                              f"{fam.label} model; not this checkpoint's run state")
    opt = read_optimizer_state(opt_path, params.size)
    mf.verify_step_files(step_dir, [state_path.name, opt_path.name])
    return cfg, params, opt, state


def read_run_state(state_path: str | Path) -> dict:
    """state.json of a step directory, checked for its version and the fields a resume needs."""
    state_path = Path(state_path)
    try:
        raw = read_at_most(state_path, STATE_MAX_BYTES)  # kilobytes (options, RNG, data position)
        if raw is None:
            raise CheckpointError(f"{state_path}: over {STATE_MAX_BYTES // 2**20} MiB, not an llmc run state")
        state = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (ValueError: also an integer of over 4300 digits, past int())
        raise CheckpointError(f"{state_path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a JSON object (an llmc run state), got {type(state).__name__}")
    version = state.get("version", RUN_STATE_VERSION)  # checkpoints from before the field are version 1
    if type(version) is not int or version != RUN_STATE_VERSION:  # (true == 1 in Python)
        raise CheckpointError(f"{state_path}: unsupported run state version {version!r} "
                              f"(expected {RUN_STATE_VERSION})")
    for key, typ in _STATE_KEYS.items():
        if not isinstance(state.get(key), typ) or isinstance(state.get(key), bool):
            raise CheckpointError(f"{state_path}: missing or bad '{key}' (expected a JSON {typ.__name__}; "
                                  "not an llmc run state?)")
    if not 0 <= state["step"] <= STEP_MAX:
        raise CheckpointError(f"{state_path}: step {state['step']!s:.80} is out of range (0 to {STEP_MAX}; a damaged run "
                              "state)")
    for key, ok, want in _STATE_FIELDS:
        if key in state and not ok(state[key]):
            raise CheckpointError(f"{state_path}: '{key}' must be {want} (got {state[key]!r:.80})")
    for key, ok in _LOADER_FIELDS.items():
        if (key in _LOADER_REQUIRED or key in state["dataloader"]) and not ok(state["dataloader"].get(key)):
            raise CheckpointError(f"{state_path}: dataloader '{key}' is {state['dataloader'].get(key, 'missing')!r:.80}, "
                                  "not what the data loader wrote (a damaged run state)")
    return state


def read_optimizer_state(opt_path: str | Path, n: int) -> dict[str, np.ndarray]:
    """optimizer.npz: float32 arrays 'm' and 'v' (and 'master' for bf16 runs), each of `n` values."""
    opt_path = Path(opt_path)
    try:
        opt = _read_npz(opt_path, n)
    except CheckpointError:
        raise
    except Exception as e:  # BadZipFile, EOFError, zlib.error, ValueError: all mean a damaged file
        raise CheckpointError(f"{opt_path}: unreadable optimizer state, expected an .npz archive "
                              f"({type(e).__name__}: {e})") from None
    for k in ("m", "v"):
        if k not in opt:
            raise CheckpointError(f"{opt_path}: no '{k}' array (has: {', '.join(opt) or 'nothing'})")
    for k, a in opt.items():
        check_finite(f"{opt_path} ('{k}')", a, "values")
    if (neg := int(np.count_nonzero(opt["v"] < 0))):  # (a mean of squares: sqrt(v) would be NaN at the first step)
        raise CheckpointError(f"{opt_path}: {neg:,} of {opt['v'].size:,} values of 'v' (Adam's second moment) are "
                              "negative (a damaged optimizer state); llmc will not use them")
    return opt


def _read_npz(path: Path, n: int) -> dict[str, np.ndarray]:
    """The float32 arrays of an .npz archive, each read only after its .npy header says it holds `n` of them:
    np.load allocates whatever shape a header claims (a few bytes can claim terabytes) before it finds the data
    short. Reading stops at n values, however far a member would inflate."""
    from numpy.lib import format as npy
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            key = info.filename.removesuffix(".npy")
            if key == info.filename or key in out:
                raise ValueError(f"'{info.filename}' is " + ("not an .npy array" if key == info.filename else
                                                             "in the archive twice"))
            if info.file_size > 4 * n + 2**16:  # (the archive's own word, before anything is inflated)
                raise ValueError(f"'{info.filename}' inflates to {info.file_size:,} bytes, more than {n:,} float32 "
                                 "values")
            with zf.open(info) as f:
                version = npy.read_magic(f)
                read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                shape, fortran, dtype = read_header(f)
                if dtype != np.float32:
                    raise CheckpointError(f"{path}: '{key}' is {dtype}, expected float32")
                if (count := int(np.prod(shape, dtype=object))) != n:
                    raise CheckpointError(f"{path}: '{key}' has {count} values, the model has {n} parameters")
                raw = f.read(4 * n)
                if len(raw) != 4 * n or f.read(1):  # (reading to the end checks the member's CRC)
                    raise ValueError(f"'{info.filename}' holds {'less' if len(raw) < 4 * n else 'more'} data than "
                                     f"its header's {n:,} float32 values")
            a = np.frombuffer(raw, np.dtype("<f4")).reshape(shape, order="F" if fortran else "C")
            out[key] = a.reshape(-1).astype(np.float32)  # (C order, native float32, writable)
    return out
