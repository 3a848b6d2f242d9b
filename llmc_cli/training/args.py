"""What a training run is asked to do (TrainArgs), checked once at the boundary (check_args), and the model it
names (model_config); the errors a run reports (TrainError, TrainDiverged)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from numbers import Real
from typing import Callable

import numpy as np

from llmc_cli.data.loader import DataSetupChanged
from llmc_cli.formats.shards import data_vocab_size
from llmc_cli.models.base import INT32_MAX, check_recompute
from llmc_cli.models.families import family_for, family_of
from llmc_cli.naming import arg
from llmc_cli.optim import AdamWConfig


class TrainError(ValueError):
    """A problem with the run's options or files; the message names the option or file."""


class TrainDiverged(TrainError):
    """--max-bad-steps consecutive steps were non-finite or skipped as outliers: the run stops."""


# options that fix the model's shape or the meaning of a step: a resumed run must not change them
RESUME_FIXED = ("model", "n_layer", "n_head", "n_embd", "n_kv_head", "block_size", "vocab_size", "init",
                "batch_size", "seq_len", "total_batch_size")


@dataclass
class TrainArgs:
    data: str
    val_data: str | None = None
    model: str = "d12"
    init: str | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    n_kv_head: int | None = None           # Llama: key/value heads (grouped-query attention)
    block_size: int | None = None          # None = the preset's (GPT-2: 1024)
    vocab_size: int | None = None          # None = the preset's (GPT-2: 50257)
    batch_size: int = 4
    seq_len: int = 64
    recompute: str = "none"               # none | gelu | layernorm | gelu+layernorm (memory vs compute; models.base)
    total_batch_size: int | None = None   # tokens per optimizer step; None = B*T (no accumulation)
    steps: int = 20
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    warmup: int = 0
    lr_decay_frac: float = 1.0
    seed: int = 1337
    overfit_batch: bool = False
    graphs: bool = True  # replay each micro-step's kernels as one captured graph where the backend can (CAP_GRAPHS)
    prefetch: bool = True  # read batches ahead in a thread; copy them ahead on a side stream (CAP_ASYNC_INPUTS)
    shuffle: bool = False
    val_every: int = 20
    val_batches: int = 20
    sample_every: int = 20
    sample_tokens: int = 64
    checkpoint_every: int = 0             # steps between checkpoints (0 = by time only)
    checkpoint_minutes: float = 30.0      # also one whenever this long has passed since the last (0 = off)
    keep: int = 3                         # newest complete checkpoints kept (0 = all); the newest always stays
    skip_loss_z: float = 0.0              # skip the update when the loss z-score exceeds this (0 = off)
    skip_grad_z: float = 0.0              # same for the grad norm (llm.c's -sl / -sg)
    max_bad_steps: int = 5                # stop after this many consecutive non-finite / skipped steps (0 = never)
    outlier_window: int = 128             # values the outlier detectors remember (llm.c: 128)
    out: str | None = None
    resume: bool = False
    log: str | None = None
    hellaswag: str | None = None          # llm.c HellaSwag eval file, scored every hellaswag_every steps
    hellaswag_every: int = 0
    tensorboard: str | None = None        # also write TensorBoard event files (train/val/eval scalars) into this dir
    zero: int = 0                         # data parallel: 1 = ZeRO-1 (optimizer state sharded over the ranks),
                                          # 2 = ZeRO-2 (the gradients too)
    # data parallel: reduce each layer's gradients during the backward pass. Off by default: on 2xH200 (NVLink)
    # the collectives' kernels beside the backward's matmuls cost more than the reduction they hide (performance.md)
    overlap: bool = False


def model_config(a: TrainArgs):
    """The config of --model with the command line's overrides (GPT2Config or Llama3Config)."""
    family = family_for(a.model)
    over = {k: v for k, v in (("n_layer", a.n_layer), ("n_head", a.n_head), ("n_embd", a.n_embd),
                               ("n_kv_head", a.n_kv_head), ("block_size", a.block_size),
                               ("vocab_size", a.vocab_size or data_vocab_size(a.data))) if v is not None}
    if "n_kv_head" in over and "n_kv_head" not in {f.name for f in fields(family.config_class)}:
        raise ValueError(f"{arg('n_kv_head')} applies to Llama models, not {a.model}")
    cfg = family.preset(a.model, **over)
    cfg.validate()
    return cfg


SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "n_kv_head", "block_size", "vocab_size")


def data_setup_changes(e: DataSetupChanged) -> str:
    """What differs between a run's saved data position and the loader of its resume, by the options that set it:
    the loader's own words (num_shards 2 -> 1) named neither the option to give again nor its value then."""
    said = []
    for key, (then, now) in e.changes.items():
        if key == "num_shards":
            said.append(f"{arg('data')} gives {now} shard(s) where the run read {then}")
        elif key == "shard_file":
            said.append(f"{arg('data')}'s shard {e.shard} (in the order the run reads them) is {now} where the run's was "
                        f"{then}")
        elif key == "shuffle":
            said.append(f"{arg('shuffle', True)} is given where the run read its data in order" if now else
                        f"the run was shuffled ({arg('shuffle', True)}) and this one is not")
        elif key in ("B", "T"):
            said.append(f"{arg('batch_size' if key == 'B' else 'seq_len', now)} where the run read {then}")
        elif key == "seed":
            said.append(f"{arg('seed', now)} where the run shuffled with {arg('seed', then)}")
        elif key == "world_size":
            said.append(f"{now} rank(s) (--gpus / --procs) where the run had {then}")
        else:
            said.append(f"{key} {now!r} where the run had {then!r}")
    return "; ".join(said)


def check_init_shape(init: str, cfg, given: dict) -> None:
    """--init takes the model's shape from its file: a shape option saying otherwise would be ignored silently (a
    run of another model than the one asked for), so it is a ValueError naming both."""
    for key in SHAPE_OPTIONS:
        want, have, opt, init_ = given.get(key), getattr(cfg, key, None), arg(key), arg("init")
        if want is not None and want != have:
            raise ValueError(f"{init_}: {init} is a model of {key} {have}, but {opt} is {want} (the shape comes from "
                             f"{init_}: leave the option out)" if have is not None else
                             f"{init_}: {opt} does not apply to {init}, a {family_of(cfg).label} model")


SEED_MAX = 2**32 - 1   # seeds are 32 bits: what the device kernels take for stochastic rounding

# the command line's checks of each number, as its option types make them at parse time (commands/options.py):
# (fields, low bound, high bound); the counts and sizes there are capped at INT32_MAX
_POSITIVE = ("batch_size", "seq_len")
_COUNTS = ("steps", "warmup", "val_every", "val_batches", "sample_every", "sample_tokens", "checkpoint_every", "keep",
           "max_bad_steps", "hellaswag_every")
_REALS = ("skip_loss_z", "skip_grad_z", "checkpoint_minutes")  # finite, >= 0 (0 = off)
_FLAGS = ("overfit_batch", "graphs", "prefetch", "shuffle", "resume", "overlap")
_PATHS = ("init", "out", "log", "hellaswag", "tensorboard")  # None or one path


def _product(*values) -> int | None:
    """The product of integers (None when one is not an integer: a damaged state.json's)."""
    if not all(_is_int(v) for v in values):
        return None
    return math.prod(values)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int_arg(name: str, v, lo: int, hi: int, want: str) -> int:
    """`v` as a Python int when it is an integer (numpy's too, never a bool) in [lo, hi], else a TrainError naming
    the field (`want`: what the message says it must be)."""
    if not (_is_int(v) and lo <= v <= hi):
        raise TrainError(f"{name} must be {want} (got {v!r})")
    return int(v)


def _real_arg(name: str, v, lo: float, hi: float | None, want: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, Real) or not (
            math.isfinite(v) and lo <= v and (hi is None or v <= hi)):
        raise TrainError(f"{name} must be {want} (got {v!r})")
    return float(v)


def _path_arg(name: str, v, optional: bool = True, many: bool = False):
    """A path as a str (a PathLike too: a run's state.json records it as text); `many`: a list of them as well."""
    if v is None and optional:
        return None
    if isinstance(v, (str, os.PathLike)) and str(os.fspath(v)):
        return os.fspath(v)
    if many and isinstance(v, (list, tuple)) and v and all(isinstance(x, (str, os.PathLike)) for x in v):
        return [os.fspath(x) for x in v]
    what = "a directory, a glob or a list of shard paths" if many else "a path"
    raise TrainError(f"{name} must be {what}{' or None' if optional else ''} (got {v!r})")


def check_args(a: TrainArgs) -> TrainArgs:
    """Every check the command line makes of its options when it parses them (their types and ranges, and what they
    say together: check_together), made of a Python caller's TrainArgs: one TrainError naming the field as Python
    spells it (the command line names its flags), never a deep error or a value quietly turned into another (1.5
    steps, "no" for a flag, True for a number). Returns the arguments with every value its plain Python type
    (numpy's integers and floats are numbers; paths become str), what the run uses and what its checkpoints
    record."""
    if not isinstance(a, TrainArgs):
        raise TrainError(f"args must be a TrainArgs (got {type(a).__name__})")
    if not isinstance(a.optim, AdamWConfig):
        raise TrainError(f"optim must be an AdamWConfig, e.g. AdamWConfig(lr=1e-3) (got optim={a.optim!r})")
    try:
        optim = a.optim.checked()
    except ValueError as e:
        raise TrainError(str(e)) from None
    new: dict = {"optim": optim}
    new["data"] = _path_arg("data", a.data, optional=False, many=True)
    new["val_data"] = _path_arg("val_data", a.val_data, many=True)
    for name in _PATHS:
        new[name] = _path_arg(name, getattr(a, name))
    if not isinstance(a.model, str):
        raise TrainError(f"model must be a preset name such as 'd12' (got {a.model!r})")
    for name in SHAPE_OPTIONS:  # (worded as a model config's fields are checked: models.base.check_config_fields)
        v = getattr(a, name)
        if v is not None and not (_is_int(v) and 1 <= v <= INT32_MAX):
            raise TrainError(f"{name} must be a positive integer at most {INT32_MAX} or None (the preset's; got "
                             f"{v!r})")
        new[name] = None if v is None else int(v)
    for name in _POSITIVE:
        new[name] = _int_arg(name, getattr(a, name), 1, INT32_MAX, f"positive, an integer at most {INT32_MAX}")
    if a.total_batch_size is not None:
        new["total_batch_size"] = _int_arg("total_batch_size", a.total_batch_size, 1, INT32_MAX,
                                           f"positive, an integer at most {INT32_MAX}, or None (B*T)")
    for name in _COUNTS:
        new[name] = _int_arg(name, getattr(a, name), 0, INT32_MAX, f">= 0, an integer at most {INT32_MAX}")
    new["seed"] = _int_arg("seed", a.seed, 0, SEED_MAX, f"an integer in [0, {SEED_MAX}]")
    new["zero"] = _int_arg("zero", a.zero, 0, 2, "0, 1 or 2")
    new["outlier_window"] = _int_arg("outlier_window", a.outlier_window, 2, INT32_MAX,
                                     f"an integer in [2, {INT32_MAX}]")
    for name in _REALS:
        new[name] = _real_arg(name, getattr(a, name), 0.0, None, "a finite number >= 0 (0 = off)")
    new["lr_decay_frac"] = _real_arg("lr_decay_frac", a.lr_decay_frac, 0.0, 1.0, "a finite number in [0, 1]")
    for name in _FLAGS:
        v = getattr(a, name)
        if not isinstance(v, (bool, np.bool_)):
            raise TrainError(f"{name} must be True or False (got {v!r})")
        new[name] = bool(v)
    try:
        check_recompute(a.recompute)
    except ValueError as e:
        raise TrainError(str(e)) from None
    checked = replace(a, **new)
    check_together(checked)
    return checked


Namer = Callable[..., str]  # (field, value=None) -> how the caller spells it: python_name, or the command's flags


def check_together(a: TrainArgs, ranks: int = 1, name: Namer = arg) -> int:
    """What a run's options say together, refused the same way by the command line (once, before any rank starts)
    and by each rank: zero 2 beside overlap, a micro-batch of more tokens than the kernels index, a total batch
    that is not whole micro-steps of every rank. Returns the tokens per optimizer step."""
    B, T = a.batch_size, a.seq_len
    if a.zero == 2 and a.overlap:
        raise TrainError(f"{name('overlap')}: {name('zero', 2)} already reduces each layer's gradients during the "
                         f"backward pass (into the ranks' shards, on the compute stream); leave {name('overlap')} out")
    if (why := micro_batch_error(B, T, name)) is not None:
        raise TrainError(why)
    micro = B * T * ranks  # one micro-step reads B*T tokens on every rank
    total = a.total_batch_size or micro
    if total % micro:
        what = f"B*T*ranks = {B}*{T}*{ranks}" if ranks > 1 else f"B*T = {B}*{T}"
        raise TrainError(f"{name('total_batch_size', total)} is not a multiple of {what} = {micro}")
    return total


def micro_batch_error(B: int, T: int, name: Namer = arg) -> str | None:
    """Why a micro-batch of B sequences of T tokens is refused (None when it is not): its B*T rows are indexed in
    32 bits by every kernel, and planning memory for more would count chunks past any machine."""
    if B * T > INT32_MAX:
        return (f"{name('batch_size', B)} {name('seq_len', T)}: {B * T:,} tokens a micro-batch, more than the kernels "
                "index (2**31 - 1)")
    return None


def check_seq_len(T: int, cfg) -> None:
    """-t is at most the model's block size (its position table, its rotary cache)."""
    if T > cfg.block_size:
        raise TrainError(f"{arg('seq_len', T)} is longer than the model's block size {cfg.block_size}")
