"""Model files and run directories.

* llm.c's model .bin: a header of 256 int32 (magic 20240326; version 3 = float32 params, 5 = bfloat16; then
  maxT, V, L, NH, C, Vp) followed by the parameters in llm.c's order. Files written here load in llm.c's
  train_gpt2.c / train_gpt2.cu and the other way round.
* A run directory: `step_NNNNNNNN/` folders holding model.bin, optimizer.npz (float32 moments and master weights)
  and state.json (step, data position, RNG, config), plus a `latest` file naming the newest complete one.
  Every file is written under a temporary name, fsynced, then renamed, and `latest` moves last, so a crash at
  any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .dataloader import atomic_write_bytes, fsync_dir
from .gpt2 import GPT2Config, num_parameters
from .reliability import fault_delay

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


# ---- run directories ------------------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def write_run_checkpoint(run_dir: str | Path, step: int, cfg: GPT2Config, params: np.ndarray, bf16: bool,
                         optimizer: dict[str, np.ndarray], state: dict, keep: int = 0) -> Path:
    """Writes step_NNNNNNNN/ atomically and then points `latest` at it; keeps the newest `keep` (0 = all)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}"
    for stale in run_dir.glob(".step_*.tmp-*"):  # left behind by a killed writer (one writer per run dir)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    fault_delay("model")
    write_model(tmp / "model.bin", cfg, params, bf16=bf16)
    fault_delay("optimizer")
    opt_path = tmp / "optimizer.npz"
    with open(opt_path, "wb") as f:
        np.savez(f, **optimizer)
        f.flush()
        os.fsync(f.fileno())
    fault_delay("state")
    atomic_write_bytes(tmp / "state.json", [json.dumps(state, indent=1, sort_keys=True).encode()])
    fsync_dir(tmp)
    fault_delay("rename")
    if final.exists():  # rewriting the same step: move the old one aside first, drop it after
        old = run_dir / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(run_dir)
    fault_delay("latest")
    atomic_write_bytes(run_dir / "latest", [final.name.encode() + b"\n"])
    fault_delay("rotate")
    if keep > 0:
        steps = sorted(p for p in run_dir.glob("step_*") if p.is_dir())
        for p in steps[:-keep]:
            shutil.rmtree(p)
    return final


def _complete_steps(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("step_*") if p.is_dir() and all(
        (p / f).is_file() for f in ("model.bin", "optimizer.npz", "state.json")))


RUN_STATE_VERSION = 1
_STATE_KEYS = {"step": int, "dataloader": dict, "rng": dict, "args": dict}


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (its `latest`), a step directory or a model .bin -> the model .bin to load."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "latest").is_file():
        try:
            name = (path / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}/latest: unreadable ({e})") from None
        step = path / name
        if "/" in name or "\\" in name or not name.startswith("step_") or not (step / "model.bin").is_file():
            complete = _complete_steps(path)  # a crash between moving a step aside and `latest`: newest complete
            if complete:
                return complete[-1] / "model.bin"
            raise CheckpointError(f"{path}/latest points to {name!r}, which is not a step directory with a model.bin")
        return step / "model.bin"
    if (path / "model.bin").is_file():
        return path / "model.bin"
    raise CheckpointError(f"{path}: not a model .bin, a run directory with 'latest', or a step directory")


def read_run_checkpoint(path: str | Path) -> tuple[GPT2Config, np.ndarray, dict[str, np.ndarray], dict]:
    """(config, float32 params, optimizer arrays, state) of a run directory's latest (or a step directory)."""
    model_path = resolve_checkpoint(path)
    step_dir = model_path.parent
    cfg, params, _ = read_model(model_path)
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
    return opt
