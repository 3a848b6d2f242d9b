"""Model files and run directories.

* llm.c's model .bin: a header of 256 int32 (magic 20240326; version 3 = float32 params, 5 = bfloat16; then
  maxT, V, L, NH, C, Vp) followed by the parameters in llm.c's order. Files written here load in llm.c's
  train_gpt2.c / train_gpt2.cu and the other way round.
* A run directory: `step_NNNNNNNN/` folders holding model.bin, optimizer.npz (float32 moments and master weights)
  and state.json (step, data position, RNG, config), plus a `latest` file naming the newest complete one.
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
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from pathlib import Path

import numpy as np

from llmc_cli.data.loader import atomic_write_bytes, fsync_dir, replace_dir
from llmc_cli.models.base import split_flat
from llmc_cli.models import llama3 as llama3_spec
from llmc_cli.models.gpt2 import GPT2Config, num_parameters
from llmc_cli.models.llama3 import Llama3Config
from llmc_cli.training.guard import fault_delay

MODEL_MAGIC = 20240326
VERSION_FP32 = 3
VERSION_BF16 = 5
HEADER_INTS = 256


class CheckpointError(ValueError):
    """A model file or run directory that cannot be used; the message names the file and the problem."""


# ---- bfloat16 on the host (no dependency): round to nearest even, as the GPUs do -------------------------------
def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint32(0x7FC0), rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---- llm.c model .bin -----------------------------------------------------------------------------------------
def model_header(cfg: GPT2Config, version: int) -> np.ndarray:
    h = np.zeros(HEADER_INTS, dtype=np.int32)
    h[:8] = [MODEL_MAGIC, version, cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
             cfg.padded_vocab_size]
    return h


def write_model(path: str | Path, cfg: GPT2Config, params: np.ndarray, bf16: bool = False) -> None:
    """Writes float32 `params` as llm.c's version 3 file, or rounded to bfloat16 as version 5."""
    if params.size != num_parameters(cfg):
        raise ValueError(f"{path}: {params.size} parameters do not fit the config ({num_parameters(cfg)})")
    header = model_header(cfg, VERSION_BF16 if bf16 else VERSION_FP32)
    body = float32_to_bf16_bits(params) if bf16 else np.ascontiguousarray(params, dtype=np.float32)
    atomic_write_bytes(path, [header.tobytes(), body.tobytes()])


def read_model_header(path: str | Path) -> tuple[GPT2Config, int]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such model file")
    raw = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if raw.size < HEADER_INTS:
        raise CheckpointError(f"{path}: truncated header ({raw.size * 4} bytes, expected {HEADER_INTS * 4})")
    if raw[0] != MODEL_MAGIC:
        raise CheckpointError(f"{path}: bad magic {raw[0]} (expected {MODEL_MAGIC}, an llm.c GPT-2 model file)")
    version = int(raw[1])
    if version not in (VERSION_FP32, VERSION_BF16):
        raise CheckpointError(f"{path}: unsupported version {version} (expected {VERSION_FP32} float32 or "
                              f"{VERSION_BF16} bfloat16)")
    cfg = GPT2Config(block_size=int(raw[2]), vocab_size=int(raw[3]), n_layer=int(raw[4]), n_head=int(raw[5]),
                     n_embd=int(raw[6]))
    try:
        cfg.validate()
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if int(raw[7]) != cfg.padded_vocab_size:
        raise CheckpointError(f"{path}: padded vocab {raw[7]} (expected {cfg.padded_vocab_size} for vocab "
                              f"{cfg.vocab_size})")
    return cfg, version


def read_model(path: str | Path) -> tuple[GPT2Config, np.ndarray, int]:
    """(config, float32 parameters, version) from an llm.c model file."""
    cfg, version = read_model_header(path)
    n = num_parameters(cfg)
    itemsize = 2 if version == VERSION_BF16 else 4
    expected = HEADER_INTS * 4 + n * itemsize
    size = os.path.getsize(path)
    if size != expected:
        raise CheckpointError(f"{path}: {size} bytes, expected {expected} for this config "
                              f"({'truncated' if size < expected else 'trailing data'})")
    body = np.fromfile(path, dtype=np.uint16 if itemsize == 2 else np.float32, offset=HEADER_INTS * 4, count=n)
    params = bf16_bits_to_float32(body) if itemsize == 2 else body
    return cfg, params, version


# ---- safetensors ----------------------------------------------------------------------------------------------
ST_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                      metadata: dict[str, str] | None = None) -> None:
    """float32 arrays -> one safetensors file in `dtype` (F32, or BF16 rounded to nearest even), atomically."""
    if dtype not in ("F32", "BF16"):
        raise ValueError(f"safetensors dtype {dtype} (F32 or BF16)")
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, off = [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        raw = (float32_to_bf16_bits(a).astype("<u2") if dtype == "BF16" else a.astype("<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    atomic_write_bytes(path, [np.uint64(len(h)).astype("<u8").tobytes(), h, *blobs])


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header dict, byte offset where the data starts)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short for a safetensors file")
            n = int(np.frombuffer(head, "<u8")[0])
            if n > 100 * 2**20:
                raise CheckpointError(f"{path}: header length {n} is implausible (not a safetensors file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw)
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise CheckpointError(f"{path}: the header is not JSON (not a safetensors file)") from None
    return header, 8 + n


def read_safetensors(path: str | Path, names: set[str] | None = None) -> dict[str, np.ndarray]:
    """name -> float32 array (F32, BF16, F16), for every tensor or only those in `names`."""
    path = Path(path)
    header, start = read_safetensors_header(path)
    size = path.stat().st_size
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            if not isinstance(info, dict):
                raise CheckpointError(f"{path}: tensor {name} has no dtype/shape/data_offsets entry")
            dt = ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
            if dt is None:
                raise CheckpointError(f"{path}: tensor {name} has dtype {info.get('dtype')} "
                                      f"(supported: {', '.join(ST_DTYPES)})")
            offs, shape = info.get("data_offsets"), info.get("shape")
            if not (isinstance(offs, list) and len(offs) == 2 and isinstance(shape, list)
                    and all(type(v) is int and v >= 0 for v in offs + shape) and offs[0] <= offs[1]):
                raise CheckpointError(f"{path}: tensor {name} has a bad shape {shape!r} or data_offsets "
                                      f"{offs!r} (non-negative integers expected)")
            b, e = offs
            shape = tuple(shape)
            if start + e > size or e - b != int(np.prod(shape, dtype=object)) * dt.itemsize:
                raise CheckpointError(f"{path}: tensor {name} data out of bounds or of the wrong size")
            f.seek(start + b)
            a = np.frombuffer(f.read(e - b), dtype=dt).reshape(shape)
            out[name] = bf16_bits_to_float32(a) if info["dtype"] == "BF16" else a.astype(np.float32)
    return out


# ---- llmc's Llama model file (model.safetensors in a run directory) ------------------------------------------
LLMC_FORMAT = "llmc"


def write_llama_model(path: str | Path, cfg: Llama3Config, params: np.ndarray, bf16: bool = False,
                      tokenizer: str = "gpt2") -> None:
    """Parameters under llmc's names (wte, wqkv, ...; per-layer tensors stacked), config in the metadata."""
    n = llama3_spec.num_parameters(cfg)
    if params.size != n:
        raise ValueError(f"{path}: {params.size} parameters do not fit the config ({n})")
    meta = {"format": LLMC_FORMAT, "family": "llama3", "config": json.dumps(asdict(cfg)), "tokenizer": tokenizer}
    write_safetensors(path, split_flat(np.asarray(params, np.float32), llama3_spec.parameter_shapes(cfg)),
                      "BF16" if bf16 else "F32", meta)


def read_llama_header(path: str | Path) -> tuple[Llama3Config, dict]:
    """(config, metadata) of an llmc Llama model file, without reading the parameters."""
    header, _ = read_safetensors_header(path)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != LLMC_FORMAT:
        raise CheckpointError(f"{path}: not an llmc model file (no llmc metadata); for Hugging Face weights give "
                              f"the directory holding config.json")
    if meta.get("family") != "llama3":
        raise CheckpointError(f"{path}: model family {meta.get('family')!r} (expected 'llama3')")
    try:
        fields = json.loads(meta["config"])
        known = {f.name for f in dataclass_fields(Llama3Config)}
        if not isinstance(fields, dict) or set(fields) - known:
            raise ValueError(f"unknown fields {sorted(set(fields) - known) if isinstance(fields, dict) else fields}")
        cfg = Llama3Config(**fields)
        cfg.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad Llama config in the metadata ({type(e).__name__}: {e})") from None
    return cfg, meta


def read_llama_model(path: str | Path) -> tuple[Llama3Config, np.ndarray]:
    cfg, _ = read_llama_header(path)
    tensors = read_safetensors(path)
    flat = np.empty(llama3_spec.num_parameters(cfg), np.float32)
    for name, view in split_flat(flat, llama3_spec.parameter_shapes(cfg)).items():
        a = tensors.get(name)
        if a is None:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        if a.shape != view.shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {a.shape}, the config says {view.shape}")
        view[...] = a
    return cfg, flat


# ---- any model file: GPT-2 as llm.c's .bin, Llama as model.safetensors ---------------------------------------
ModelConfig = GPT2Config | Llama3Config
MODEL_FILES = ("model.bin", "model.safetensors")
TOKENIZER_FILE = "tokenizer.model"  # Meta's tiktoken-format Llama 3 ranks, as Hugging Face directories hold it


def model_file_name(cfg: ModelConfig) -> str:
    return "model.bin" if isinstance(cfg, GPT2Config) else "model.safetensors"


def write_model_file(path: str | Path, cfg: ModelConfig, params: np.ndarray, bf16: bool = False,
                     tokenizer: str = "gpt2") -> None:
    if isinstance(cfg, GPT2Config):
        write_model(path, cfg, params, bf16=bf16)  # llm.c's format has no tokenizer field: GPT-2's, always
    else:
        write_llama_model(path, cfg, params, bf16=bf16, tokenizer=tokenizer)


def read_model_file(path: str | Path) -> tuple[ModelConfig, np.ndarray]:
    """(config, float32 params) of an llm.c .bin or an llmc Llama model.safetensors, told apart by content."""
    if _is_safetensors(path):
        return read_llama_model(path)
    cfg, params, _ = read_model(path)
    return cfg, params


def read_model_file_config(path: str | Path) -> ModelConfig:
    if _is_safetensors(path):
        return read_llama_header(path)[0]
    return read_model_header(path)[0]


def model_file_tokenizer(path: str | Path) -> str:
    """The tokenizer a model file was trained with: llm.c files are GPT-2's, Llama files record theirs."""
    if _is_safetensors(path):
        tok = read_llama_header(path)[1].get("tokenizer", "gpt2")
        return tok if isinstance(tok, str) else "gpt2"
    return "gpt2"


def _is_safetensors(path: str | Path) -> bool:
    """llm.c files start with the int32 magic 20240326; a safetensors file with a small u64 header length."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) != MODEL_MAGIC and Path(path).suffix != ".bin"


# ---- run directories ------------------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def write_run_checkpoint(run_dir: str | Path, step: int, cfg: ModelConfig, params: np.ndarray, bf16: bool,
                         optimizer: dict[str, np.ndarray], state: dict, keep: int = 0,
                         tokenizer_file: str | Path | None = None) -> Path:
    """Writes step_NNNNNNNN/ atomically and then points `latest` at it; keeps the newest `keep` (0 = all).
    The model file is model.bin for GPT-2, model.safetensors for Llama; `tokenizer_file` (a Llama 3
    tokenizer.model the run was started with) is copied once to the run directory, beside the steps."""
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if tokenizer_file is not None and not (run_dir / TOKENIZER_FILE).is_file():
            atomic_write_bytes(run_dir / TOKENIZER_FILE, [Path(tokenizer_file).read_bytes()])
        for stale in run_dir.glob(".step_*.tmp-*"):  # left behind by a killed writer (the run's lock: one writer)
            shutil.rmtree(stale, ignore_errors=True)
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
        fsync_dir(tmp)
        fault_delay("rename")
        replace_dir(tmp, final)  # (rewriting the same step keeps the old one until the new one stands)
        fsync_dir(run_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not stay full of a half checkpoint
        if isinstance(e, OSError):
            where = e.filename or tmp
            raise CheckpointError(f"cannot write the checkpoint {final}: {where}: {e.strerror or e}; "
                                  "the earlier checkpoints are untouched") from None
        raise
    fault_delay("latest")
    try:
        atomic_write_bytes(run_dir / "latest", [final.name.encode() + b"\n"])
    except OSError as e:  # the step is complete; --resume finds the newest complete step without `latest`
        raise CheckpointError(f"{final} was written but {run_dir / 'latest'} could not be updated "
                              f"({e.strerror or e}); it still names the step before") from None
    fault_delay("rotate")
    if keep > 0:  # the step just written always stays (even if a resumed run left newer-named steps behind)
        others = sorted(p for p in run_dir.glob("step_*") if p.is_dir() and p.name != final.name)
        for p in others[:max(len(others) - (keep - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def _model_in(step_dir: Path) -> Path | None:
    return next((step_dir / f for f in MODEL_FILES if (step_dir / f).is_file()), None)


def _complete_steps(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("step_*") if p.is_dir() and _model_in(p) is not None and all(
        (p / f).is_file() for f in ("optimizer.npz", "state.json")))


RUN_STATE_VERSION = 1
_STATE_KEYS = {"step": int, "dataloader": dict, "rng": dict, "args": dict}


def _count(v) -> bool:
    return type(v) is int and v >= 0


def _number(v) -> bool:
    import math
    return type(v) in (int, float) and math.isfinite(v)


# what a resume reads besides _STATE_KEYS, each checked for its JSON type before any of it is used
# (key, check, what is expected); absent keys are older checkpoints and keep their defaults
_STATE_FIELDS = (
    ("optimizer_steps", _count, "a non-negative integer"),
    ("tokens_per_step", lambda v: type(v) is int and v > 0, "a positive integer"),
    ("world_size", lambda v: type(v) is int and v > 0, "a positive integer"),
    ("tokenizer", lambda v: v in ("gpt2", "llama3"), "'gpt2' or 'llama3'"),
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


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (its `latest`), a step directory or a model file -> the model file to load."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "latest").is_file():
        try:
            name = (path / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}/latest: unreadable ({e})") from None
        step = path / name
        if "/" in name or "\\" in name or not name.startswith("step_") or _model_in(step) is None:
            complete = _complete_steps(path)  # a crash between moving a step aside and `latest`: newest complete
            if complete:
                return _model_in(complete[-1])
            raise CheckpointError(f"{path}/latest points to {name!r}, which is not a step directory with a "
                                  f"model.bin or model.safetensors")
        return _model_in(step)
    if path.is_dir() and (model := _model_in(path)) is not None:
        return model
    if path.is_dir() and (complete := _complete_steps(path)):  # killed before its first `latest` was written
        return _model_in(complete[-1])
    raise CheckpointError(f"{path}: not a model file, a run directory with 'latest', or a step directory "
                          f"(model.bin or model.safetensors)")


def check_finite(path: str | Path, params: np.ndarray, what: str = "weights") -> None:
    """Refuses weights holding NaN or inf (a diverged run's, or a damaged file): they would only sample
    garbage, evaluate to nan and train nowhere."""
    bad = int(np.size(params) - np.count_nonzero(np.isfinite(params)))
    if bad:
        raise CheckpointError(f"{path}: {bad:,} of {np.size(params):,} {what} are NaN or inf (a diverged or damaged "
                              "checkpoint); llmc will not use them")


def read_run_checkpoint(path: str | Path) -> tuple[ModelConfig, np.ndarray, dict[str, np.ndarray], dict]:
    """(config, float32 params, optimizer arrays, state) of a run directory's latest (or a step directory)."""
    model_path = resolve_checkpoint(path)
    step_dir = model_path.parent
    try:
        cfg, params = read_model_file(model_path)
    except OSError as e:
        raise CheckpointError(f"{e.filename or model_path}: cannot read it ({e.strerror or e})") from None
    check_finite(model_path, params)
    state_path, opt_path = step_dir / "state.json", step_dir / "optimizer.npz"
    for p in (state_path, opt_path):
        if not p.is_file():
            raise CheckpointError(f"{p}: missing, so {step_dir} cannot be resumed (it holds only a model)")
    state = read_run_state(state_path)
    opt = read_optimizer_state(opt_path, params.size)
    return cfg, params, opt, state


def read_run_state(state_path: str | Path) -> dict:
    """state.json of a step directory, checked for its version and the fields a resume needs."""
    state_path = Path(state_path)
    try:
        state = json.loads(state_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{state_path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a JSON object (an llmc run state), got {type(state).__name__}")
    version = state.get("version", RUN_STATE_VERSION)  # checkpoints from before the field are version 1
    if version != RUN_STATE_VERSION:
        raise CheckpointError(f"{state_path}: unsupported run state version {version!r} "
                              f"(expected {RUN_STATE_VERSION})")
    for key, typ in _STATE_KEYS.items():
        if not isinstance(state.get(key), typ) or isinstance(state.get(key), bool):
            raise CheckpointError(f"{state_path}: missing or bad '{key}' (expected a JSON {typ.__name__}; "
                                  "not an llmc run state?)")
    if state["step"] < 0:
        raise CheckpointError(f"{state_path}: negative step {state['step']}")
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
        with np.load(opt_path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("not an .npz archive")
            opt = {k: z[k] for k in z.files}
    except Exception as e:  # BadZipFile, EOFError, zlib.error, ValueError: all mean a damaged file
        raise CheckpointError(f"{opt_path}: unreadable optimizer state, expected an .npz archive "
                              f"({type(e).__name__}: {e})") from None
    for k in ("m", "v"):
        if k not in opt:
            raise CheckpointError(f"{opt_path}: no '{k}' array (has: {', '.join(opt) or 'nothing'})")
    for k, a in opt.items():
        if a.dtype != np.float32:
            raise CheckpointError(f"{opt_path}: '{k}' is {a.dtype}, expected float32")
        if a.size != n:
            raise CheckpointError(f"{opt_path}: '{k}' has {a.size} values, the model has {n} parameters")
        check_finite(f"{opt_path} ('{k}')", a, "values")
    return opt
