"""The training loop: data -> forward/backward -> clip -> AdamW, with validation, sampling, checkpoints, resume."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np

from llmc_cli.data.loader import DataSetupChanged
from llmc_cli.data.prefetch import Feed
from llmc_cli.evals.evaluate import evaluate_loss
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.rundir import RunDirError, RunLock, check_out
from llmc_cli.formats.runlog import LogError, check_log, is_runs_own_log, log_lock, open_log, record_line
from llmc_cli.formats.tensorboard import EventWriter
from llmc_cli.kernels import BFLOAT16, CAP_GRAPHS, MAX, Backend
from llmc_cli.models.base import backend_capabilities, check_backend, check_recompute, unimplemented_kernel
from llmc_cli.models.families import family_for, family_of
from llmc_cli.optim import AdamWConfig, lr_at
from llmc_cli.parallel.comm import SingleProcess  # data parallel (issue 7)
from llmc_cli.parallel.zero import LayerShardedReduction, OverlappedReduction, make_optimizer, reshard_loader_state
from llmc_cli.training.guard import OutlierDetector
from llmc_cli.training.memory import out_of_memory_message
from llmc_cli.training.phases import open_step_phases


def _append_record(log, path: str, rec: dict) -> None:
    """One record onto the --log file, flushed; a write's OSError names no file (a full disk would say only "No
    space left on device"), so it is raised again naming the log."""
    try:
        log.write(record_line(rec))
        log.flush()
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (writing the --log records)", str(path)) from None


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
                               ("vocab_size", a.vocab_size)) if v is not None}
    if "n_kv_head" in over and "n_kv_head" not in {f.name for f in fields(family.config_class)}:
        raise ValueError(f"--n-kv-head applies to Llama models, not {a.model}")
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
            said.append(f"--data gives {now} shard(s) where the run read {then}")
        elif key == "shard_file":
            said.append(f"--data's shard {e.shard} (in the order the run reads them) is {now} where the run's was "
                        f"{then}")
        elif key == "shuffle":
            said.append("--shuffle is given where the run read its data in order" if now else
                        "the run was shuffled (--shuffle) and this one is not")
        elif key in ("B", "T"):
            said.append(f"{'-b' if key == 'B' else '-t'} {now} where the run read {then}")
        elif key == "seed":
            said.append(f"--seed {now} where the run shuffled with --seed {then}")
        elif key == "world_size":
            said.append(f"{now} rank(s) (--gpus / --procs) where the run had {then}")
        else:
            said.append(f"{key} {now!r} where the run had {then!r}")
    return "; ".join(said)


def check_init_shape(init: str, cfg, given: dict) -> None:
    """--init takes the model's shape from its file: a shape option saying otherwise would be ignored silently (a
    run of another model than the one asked for), so it is a ValueError naming both."""
    for key in SHAPE_OPTIONS:
        want, have, opt = given.get(key), getattr(cfg, key, None), "--" + key.replace("_", "-")
        if want is not None and want != have:
            raise ValueError(f"--init: {init} is a model of {key} {have}, but {opt} is {want} (the shape comes from "
                             "--init: leave the option out)" if have is not None else
                             f"--init: {opt} does not apply to {init}, a {family_of(cfg).label} model")


INT32_MAX = 2**31 - 1  # the most tokens, rows or elements the kernels index (the command line's cap on counts)
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int_arg(name: str, v, lo: int, hi: int, want: str, flag: str | None = None) -> int:
    """`v` as a Python int when it is an integer (numpy's too, never a bool) in [lo, hi], else a TrainError naming
    the option and the field (`want`: what the message says it must be)."""
    if not (_is_int(v) and lo <= v <= hi):
        flag = _flag(name) if flag is None else flag
        raise TrainError(f"{flag} must be {want} (got {v!r})" if flag == name else
                         f"{flag} must be {want} (got {name}={v!r})")
    return int(v)


def _real_arg(name: str, v, lo: float, hi: float | None, want: str) -> float:
    from numbers import Real
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, Real) or not (
            math.isfinite(v) and lo <= v and (hi is None or v <= hi)):
        raise TrainError(f"{_flag(name)} must be {want} (got {name}={v!r})")
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
    raise TrainError(f"{_flag(name)} must be {what}{' or None' if optional else ''} (got {name}={v!r})")


def check_args(a: TrainArgs) -> TrainArgs:
    """Every check the command line makes of its options when it parses them (their types and ranges, and that one
    micro-batch of B*T tokens is one the kernels can index), made of a Python caller's TrainArgs: one TrainError
    naming the option (as the command line spells it, and as the field is named), never a deep error or a value
    quietly turned into another (1.5 steps, "no" for a flag, True for a number). Returns the arguments with every
    value its plain Python type (numpy's integers and floats are numbers; paths become str), what the run uses and
    what its checkpoints record."""
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
        raise TrainError(f"--model must be a preset name such as 'd12' (got model={a.model!r})")
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
                                     f"an integer in [2, {INT32_MAX}]", flag="outlier_window")
    for name in _REALS:
        new[name] = _real_arg(name, getattr(a, name), 0.0, None, "a finite number >= 0 (0 = off)")
    new["lr_decay_frac"] = _real_arg("lr_decay_frac", a.lr_decay_frac, 0.0, 1.0, "a finite number in [0, 1]")
    for name in _FLAGS:
        v = getattr(a, name)
        if not isinstance(v, (bool, np.bool_)):
            raise TrainError(f"{_flag(name)} must be True or False (got {name}={v!r})")
        new[name] = bool(v)
    try:
        check_recompute(a.recompute)
    except ValueError as e:
        raise TrainError(str(e)) from None
    B, T = new["batch_size"], new["seq_len"]
    if B * T > INT32_MAX:  # (the command line's check_tokens, in the same words)
        raise TrainError(f"-b {B} -t {T}: {B * T:,} tokens a micro-batch, more than the kernels index (2**31 - 1)")
    return replace(a, **new)


# ---- the Trainer's parts ---------------------------------------------------------------------------------------------
from llmc_cli.formats.sources import load_model_any  # noqa: E402
from llmc_cli.training.evaluation import evaluate_before, sample_text  # noqa: E402
from llmc_cli.training.guard import skip_reason  # noqa: E402
from llmc_cli.training.memory import plan_refusal  # noqa: E402
from llmc_cli.training.report import data_line, memory_line  # noqa: E402
from llmc_cli.training.run_data import (SHARD_VOCAB, check_eval_files, check_shard_vocab, open_loaders,  # noqa: E402
                                        run_tokenizer)
from llmc_cli.training.saving import run_state  # noqa: E402
from llmc_cli.training.steps import forward_backward  # noqa: E402
from llmc_cli.training.votes import RankVotes  # noqa: E402


class Trainer:
    """One training run. With `out`, rank 0 holds the run directory's lock from here until `close()`."""

    def __init__(self, a: TrainArgs, backend: Backend, say: Callable[[str], None] = print,
                 decode: Callable[[list[int]], str] | None = None, eot: int | None = None, comm=None):
        self.lock = self.log_lock = None
        self.closed = self.ran = False
        a = check_args(a)
        try:  # capabilities a set of names: None, or a string ("kv_cache,graphs" holds "graphs" to `in`), is refused
            check_backend(backend)
            backend_capabilities(backend)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if not callable(say):
            raise TrainError(f"say must be a function taking one line, e.g. print (got {say!r:.80})")
        if decode is not None and not callable(decode):
            raise TrainError(f"decode must be a function from token ids to text, or None (got {decode!r:.80})")
        if eot is not None and not _is_int(eot):
            raise TrainError(f"eot must be a token id (an integer) or None (got {eot!r})")
        self.a, self.backend, self.say, self.decode, self.eot = a, backend, say, decode, eot
        self.comm = comm or SingleProcess()  # this process's place among data-parallel ranks (llmc_cli.parallel.comm)
        lead = self.comm.rank == 0
        try:
            if a.out and lead:  # (first: a run directory that cannot be made is --out's failure, not its log's)
                self.lock = RunLock(a.out).acquire()  # before anything reads the directory: one writer at a time
                check_out(a.out, a.resume)
            if a.log and lead:  # one writer of a log: two runs given the same --log would interleave their records
                check_log(a.log)
                self.log_lock = log_lock(a.log).acquire()
            self._setup()
        except (RunDirError, LogError) as e:
            self.close()
            raise TrainError(str(e)) from None
        except NotImplementedError as e:  # a kernel of a capability the backend announces but lacks
            self.close()
            raise TrainError(unimplemented_kernel(backend, e)) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops the data thread and releases the run directory (safe to call twice). The trainer cannot run
        after it: the directory may be another run's by then."""
        self.closed = True
        if getattr(self, "feed", None) is not None:
            self.feed.close()
        if getattr(self, "phases", None) is not None:
            self.phases.close()
            self.phases = None
        # (in the reverse order of __init__'s: the run directory's lock last, so that a directory its acquire made
        # is removed again when the log's lock file inside it has gone)
        if getattr(self, "log_lock", None) is not None:
            self.log_lock.release()
            self.log_lock = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---- setup: the weights, the plan, the model and its optimizer, the data, the state a resume continues ------
    def _setup(self) -> None:
        a = self.a
        self.start_step, self._trim_log = 0, False
        resume_state = opt_state = None
        if a.resume:
            cfg, params, opt_state, resume_state = self._read_resume()
        elif a.init:
            cfg, params = self._read_init()
        else:
            cfg, params = model_config(a), None
        self._plan(cfg)  # (before the weights are initialised: a plan that cannot fit allocates nothing)
        if params is None:
            params = family_for(a.model).init_parameters(cfg, a.seed)
        self._build_model(params)
        self._build_data(resume_state)
        self._start_loop_state()
        if resume_state is not None:
            self._restore(opt_state, resume_state)
        # the position is final now: the thread starts reading the first batches while the run gets ready
        self.feed = Feed(self.backend, [self.model.acts["inputs"], self.model.acts["targets"]], self.train_loader,
                         overfit=a.overfit_batch, prefetch=a.prefetch)
        self.feed.start()

    def _read_resume(self):
        """--resume: the newest checkpoint in --out (config, weights, optimizer state, state.json)."""
        a = self.a
        if not a.out:
            raise TrainError("--resume needs --out DIR (the run directory to continue)")
        try:
            cfg, params, opt_state, state = ckpt.read_run_checkpoint(a.out)
        except ckpt.CheckpointError as e:
            raise TrainError(str(e)) from None
        expected = state.get("config")
        if expected and expected != asdict(cfg):
            raise TrainError(f"{a.out}: model file and state.json disagree about the model shape")
        self._trim_log = bool(a.log) and is_runs_own_log(a.log, a.out, state["args"])
        self._check_resume_options(cfg, state)
        return cfg, params, opt_state, state

    def _check_resume_options(self, cfg, state: dict) -> None:
        """An option given again that fixes the model's shape or the meaning of a step must say what the run had."""
        a, old_args = self.a, state["args"]
        for key in RESUME_FIXED:
            val = getattr(a, key, None)
            if key not in old_args or val is None:  # (not given: the run's own value)
                continue
            # what the run trained with: the option as it recorded it, or where it gave none (the preset's
            # shape, B*T per step) the value that was in effect, which an option given now may repeat
            had = old_args[key]
            if had is None and key in SHAPE_OPTIONS:
                had = getattr(cfg, key, None)
            elif had is None and key == "total_batch_size":  # (runs from before the field: B*T*ranks)
                had = state.get("tokens_per_step") or _product(
                    old_args.get("batch_size"), old_args.get("seq_len"), state.get("world_size", 1))
            opt = "--" + key.replace("_", "-")
            if had is None and key in SHAPE_OPTIONS:
                raise TrainError(f"--resume: {opt} does not apply to the run in {a.out}, a "
                                 f"{family_of(cfg).label} model (leave it out)")
            if had != val:
                raise TrainError(f"--resume: {opt} is {val!r} but the run in {a.out} was trained with "
                                 f"{had!r} (give the same options, or start a new --out)")

    def _read_init(self):
        """--init: weights from a llm.c .bin, a run directory, an llmc Llama file or a Hugging Face directory."""
        try:
            cfg, params, _ = load_model_any(self.a.init)
            check_init_shape(self.a.init, cfg, {k: getattr(self.a, k) for k in SHAPE_OPTIONS})
        except ckpt.CheckpointError as e:
            raise TrainError(f"--init: {e}") from None
        except ValueError as e:
            raise TrainError(str(e)) from None
        return cfg, params

    def _plan(self, cfg) -> None:
        """The sizes of a step, and every refusal that needs only them (the memory the plan needs included)."""
        a, ranks = self.a, self.comm.world_size
        B, T = a.batch_size, a.seq_len
        if T > cfg.block_size:
            raise TrainError(f"-t {T} is longer than the model's block size {cfg.block_size}")
        self.cfg, self.family = cfg, family_of(cfg)
        tokens_per_micro = B * T * ranks  # one micro-step reads B*T tokens on every rank
        total = a.total_batch_size or tokens_per_micro
        if total % tokens_per_micro:
            what = "B*T*ranks" if ranks > 1 else "B*T"
            raise TrainError(f"--total-batch-size {total} is not a multiple of {what} = {tokens_per_micro}")
        self.grad_accum = total // tokens_per_micro
        self.tokens_per_step = total
        self.steps_run = 0
        if a.zero == 2 and a.overlap:
            raise TrainError("--overlap: --zero 2 already reduces each layer's gradients during the backward pass "
                             "(into the ranks' shards, on the compute stream); leave --overlap out")
        if a.overlap and ranks == 1:
            self.say("--overlap: data parallel only, and this run has one rank: nothing to overlap (the same updates)")
        refusal = plan_refusal(self.backend, cfg, B, T, a.recompute, ranks, a.zero, a.overlap)
        if refusal:
            raise TrainError(refusal)

    def _build_model(self, params) -> None:
        """The model holding `params`, its optimizer (sharded under ZeRO), the step phases' marks, and the
        reduction of each layer's gradients over the ranks where it runs during the backward pass."""
        a, backend, cfg, B, T = self.a, self.backend, self.cfg, self.a.batch_size, self.a.seq_len
        try:
            self.model = self.family.model_class(cfg, backend, B, T, recompute=a.recompute, layer_grads=a.zero == 2)
            self.model.load_parameters(params)
            self.opt = make_optimizer(backend, self.model, a.optim, self.comm, a.zero)
        except Exception as e:
            if backend.is_out_of_memory(e):
                raise TrainError(out_of_memory_message(e, backend, cfg, B, T, a.recompute, self.comm.world_size,
                                                       a.zero)) from None
            raise
        self.opt.sync_master_from_params()
        try:
            self.phases = open_step_phases(backend, self.comm.rank)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if self.phases is not None:
            self.opt.mark = self.phases.mark
        # data parallel: each layer's gradients reduced as soon as the backward pass has made them final, on the
        # communicator's own stream where it has one; that reduction is queued from inside the micro-step, so
        # such runs replay no captured graphs. ZeRO-2 reduces each layer's gradients into the shards on every
        # micro-step, in order on the backend's stream
        if a.zero == 2:
            self.reducer = LayerShardedReduction(self.opt, self.model.grads, self.comm)
        else:
            self.reducer = OverlappedReduction(self.opt, self.model.grads, self.comm) \
                if a.overlap and self.comm.world_size > 1 else None
        # None: not captured yet (False: never); the list of replays once captured (see _replays)
        self.graphs = None if a.graphs and CAP_GRAPHS in backend_capabilities(backend) and self.reducer is None else False

    def _build_data(self, resume_state: dict | None) -> None:
        """The loaders, the run's tokenizer, and the checks that the model and the evaluations take its ids."""
        a = self.a
        self.train_loader, self.val_loader = open_loaders(a, self.cfg.vocab_size, self.comm)
        try:
            check_shard_vocab(self.cfg.vocab_size, self.train_loader, self.val_loader)
            self.tokenizer, self.tokenizer_file = run_tokenizer(a, self.train_loader, resume_state)
            self.model.tokenizer = self.tokenizer if self.tokenizer in SHARD_VOCAB else None
            check_eval_files(a, self.val_loader, self.model.tokenizer)
        except DataError as e:
            raise TrainError(str(e)) from None

    def _start_loop_state(self) -> None:
        """What the loop carries from step to step, as a fresh run starts it (a resume then restores it)."""
        a = self.a
        self.loss_outliers = OutlierDetector(a.outlier_window)
        self.norm_outliers = OutlierDetector(a.outlier_window)
        self.bad_streak = 0
        self.stop_requested: Callable[[], str | None] = lambda: None
        self.stopped: dict | None = None  # set by run() when it returns early on a stop request
        self.votes = RankVotes(a, self.comm, validates=self.val_loader is not None)
        self.sample_prompt: list[int] | None = None  # default [eot]: how GPT-2 documents start
        self.rng = np.random.default_rng(a.seed)
        self.sampler = self.hellaswag = None
        self.updating = False                 # inside the optimizer update of a step (see run's rescue)
        self.saving = False                   # inside save() (a failed save is not retried as a rescue)
        self.saved = 0                        # the newest step whose checkpoint is on disk (start_step: none yet)
        self.rescued: Path | None = None      # the checkpoint written after an error stopped the run
        self.rescue_error: str | None = None  # why that checkpoint could not be written

    def _restore(self, opt_state: dict, state: dict) -> None:
        """A resume's optimizer state, step, data position, backend state, RNG and outlier windows."""
        a = self.a
        self.opt.load_state(opt_state, state["step"])
        self.opt.step_count = int(state.get("optimizer_steps", state["step"]))
        self.start_step = self.saved = state["step"]
        if a.steps < self.start_step:  # (equal: the run is complete, and resuming it does nothing)
            raise TrainError(f"--steps {a.steps}: the run in {a.out} is already at step {self.start_step}; give "
                             f"--steps {self.start_step} or more to continue it")
        old_total = state.get("tokens_per_step")
        if old_total and old_total != self.tokens_per_step:
            raise TrainError(f"--resume: the run in {a.out} took {old_total} tokens per step, now "
                             f"{self.tokens_per_step} ({self.comm.world_size} rank(s) x B*T); give "
                             f"--total-batch-size {old_total}")
        try:
            self.train_loader.load_state(reshard_loader_state(state["dataloader"], self.comm.world_size))
        except DataSetupChanged as e:
            raise TrainError(f"--resume {a.out}: {data_setup_changes(e)}; give the run's options, or start a new "
                             "--out") from None
        except (DataError, ValueError) as e:  # (a position of other ranks, a damaged or foreign state)
            raise TrainError(f"--resume {a.out}: {e}") from None
        try:
            self.backend.load_carried_state(state.get("backend_state", {}))
        except ValueError as e:
            raise TrainError(f"{a.out}: state.json's backend_state is damaged: {e}") from None
        try:
            self.rng.bit_generator.state = state["rng"]
            outl = state.get("outliers", {})
            self.loss_outliers.load_state(outl.get("loss", []))
            self.norm_outliers.load_state(outl.get("norm", []))
            self.bad_streak = int(outl.get("bad_streak", 0))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise TrainError(f"{a.out}: state.json has a damaged RNG / outlier state ({e})") from None

    # ---- what the command line prints ------------------------------------------------------------------------------
    def data_line(self) -> str:
        return data_line(self.train_loader, self.val_loader)

    def memory_line(self, label: str = "memory") -> str:
        return memory_line(self.backend, label)

    # ---- one step -----------------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        a, phases = self.a, self.phases
        timer = self.backend.timer()
        timer.start()
        if phases:
            phases.begin(timer)
        waits = self.feed.waits
        forward_backward(self, step)
        self.steps_run += 1
        lr = lr_at(step, a.optim.lr, a.warmup, a.steps, a.lr_decay_frac)
        # llm.c's rule: z-scores against the last 128 steps; a spike skips the update (never a non-finite step).
        # z > Z is taken as value > mean + Z * std, the form the device evaluates too
        max_loss, max_norm = self.loss_outliers.bound(a.skip_loss_z), self.norm_outliers.bound(a.skip_grad_z)
        if not math.isfinite(lr):  # no update can be applied with it (the schedule of finite options never gets here)
            max_loss = -math.inf
        self.updating = True  # from here an error may leave the weights half-updated: no rescue checkpoint
        if phases:
            phases.mark("compute")
        if self.reducer is not None:  # the layers' reductions are queued: the rest, and the wait for them
            self.reducer.finish()
        elif self.comm.world_size > 1:
            self.opt.reduce_grads()
        if phases:
            phases.mark("reduce")
        stop, votes = self.votes.cast(self.stop_requested)
        loss, norm, applied = self.opt.guarded_step(lr, a.seed + step, max_loss, max_norm, votes)
        zloss, znorm = self.loss_outliers.update(loss), self.norm_outliers.update(norm)
        self.updating = False
        seen = self.backend.step_observations()  # (FP8's amaxes: every rank carries the ranks' largest)
        if seen is not None and self.comm.world_size > 1:
            self.comm.all_reduce(seen, MAX)
        self.backend.end_step()
        if votes:
            self.votes.count(stop, self.opt.flags)
        reason = None if applied else skip_reason(a, lr, loss, norm, zloss, znorm, max_loss)
        seconds = self.votes.last_step_s = timer.stop()
        if phases:
            phases.end(step + 1, seconds)
        finite = lambda v: float(v) if np.isfinite(v) else None  # noqa: E731  (JSON has no NaN / inf)
        rec = {"step": step + 1, "loss": finite(loss), "norm": finite(norm), "lr": finite(lr), "ms": seconds * 1e3,
               "tok_per_s": self.tokens_per_step / seconds, "data_waits": self.feed.waits - waits}
        if reason is not None:
            rec |= {"skipped": True, "reason": reason}
        return rec

    def validate(self) -> float:
        return evaluate_loss(self.model, self.val_loader, self.a.val_batches)

    def sample_text(self) -> str:
        return sample_text(self)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save(self, step: int, loader_state: dict | None = None) -> Path:
        """Checkpoint after `step` optimizer steps (`loader_state`: the data position then, when a step has begun
        since; else the position after the batches the steps took, however far the data thread read ahead).
        Refuses non-finite weights or optimizer state: no checkpoint is ever garbage."""
        if self.closed and self.a.out:
            raise TrainError(f"this Trainer was closed (close() released {self.a.out}); it writes no checkpoint there")
        self.saving = True
        try:
            return self._save(step, loader_state)
        finally:
            self.saving = False

    def _save(self, step: int, loader_state: dict | None) -> Path:
        opt_state = self.opt.state_host()  # collective under ZeRO (gathers the whole state to rank 0)
        if self.comm.rank != 0:  # only rank 0 writes
            return Path(self.a.out) / ckpt.step_dir_name(step)
        params = self.model.parameters_host()
        bad = [name for name, arr in (("weights", params), *opt_state.items()) if not np.isfinite(arr).all()]
        if bad:  # (the command line adds where the last good checkpoint is)
            raise TrainError(f"step {step}: the {' and '.join(bad)} hold NaN or inf, so no checkpoint was written")
        path = ckpt.write_run_checkpoint(self.a.out, step, self.cfg, params, bf16=self.backend.dtype == BFLOAT16,
                                         optimizer=opt_state, state=run_state(self, step, loader_state),
                                         keep=self.a.keep, tokenizer_file=self.tokenizer_file)
        self.saved = step
        return path

    def last_good(self) -> str:
        """'; the last good checkpoint is RUN/step_N' (or '' when this run has none on disk)."""
        if not self.a.out or not self.saved:
            return ""
        return f"; the last good checkpoint is {Path(self.a.out) / ckpt.step_dir_name(self.saved)}"

    def _rescue(self, done: int, before: dict | None) -> None:
        """After an error between two updates, write the checkpoint of the `done` completed steps: with the
        data position from before a step that failed midway (`before`), else the steps' own. Not after an
        error inside an update (the weights may be half-updated), and alone only: under data parallel the
        other ranks are not in the collective a checkpoint needs."""
        if not self.a.out or self.comm.world_size > 1 or self.updating or done <= self.saved:
            return
        try:
            self.rescued = self.save(done, loader_state=before)
        except Exception as e:  # noqa: BLE001  (the first error is the one to raise; this one is reported beside it)
            self.rescue_error = str(e).splitlines()[0] if str(e) else type(e).__name__

    # ---- the loop -----------------------------------------------------------------------------------------------
    def run(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Trains from `start_step` to `a.steps`, once. When an error stops it between two updates (a bad shard, a
        full disk), the step before is checkpointed first (`rescued`), so nothing trained is lost."""
        self._check_runnable(on_step)
        self.ran = True
        a, records, log, tb = self.a, [], None, None
        done, before = self.start_step, None  # steps completed; the data position when a step began
        self.votes.restart_clock()
        try:
            tb = self._event_writer()
            if a.log and self.comm.rank == 0:  # (checked in __init__) on resume, drop what the dead run logged past
                # its checkpoint (after every other check that can fail here; only the run's own: is_runs_own_log)
                log = open_log(a.log, self.start_step if a.resume and self._trim_log else None)
            for step in range(self.start_step, a.steps + 1):
                done, last = step, step == a.steps
                self._record(self._between_steps(step, last), records, log, tb)
                if last:
                    break
                before = self.feed.position  # the data position a checkpoint of `step` records
                rec = self.train_step(step)
                before, done = None, step + 1
                self._record(rec, records, log, tb)
                if on_step:
                    on_step(rec)
                self._judge(rec)
                signame = self.votes.stop_after(step, self.stop_requested)  # (every rank stops after the same step)
                if signame and step + 1 < a.steps:
                    self._stop(step + 1, signame)
                    break
        except TrainDiverged:
            raise
        except Exception as e:
            if not self.saving:  # a checkpoint that failed would only fail again
                self._rescue(done, before)
            if isinstance(e, NotImplementedError):  # a kernel of a capability the backend announces but lacks
                raise TrainError(unimplemented_kernel(self.backend, e)) from None
            raise
        finally:
            self.feed.close()  # no thread outlives the run (a later train_step starts one again)
            for f in (log, tb):
                if f:
                    try:
                        f.close()
                    except OSError:  # a full disk: the error that stopped the run is the one to report
                        pass
        return records

    def _check_runnable(self, on_step) -> None:
        if self.closed:  # its run directory's lock is released: another run may own the directory now
            raise TrainError("this Trainer was closed (close() released its run directory); make a new Trainer to "
                             "train again (with resume=True to continue the run)")
        if self.ran:  # its step counts, data position and checkpoints are those of the run it made
            raise TrainError("this Trainer has run already; make a new Trainer to train again (with resume=True to "
                             "continue the run)")
        if on_step is not None and not callable(on_step):
            raise TrainError(f"on_step must be a function taking each step's record, or None (got {on_step!r:.80})")

    def _event_writer(self) -> EventWriter | None:
        """A new TensorBoard event file for this run (or resumed run), as TensorBoard expects; rank 0's only."""
        a = self.a
        if not (a.tensorboard and self.comm.rank == 0):
            return None
        try:
            return EventWriter(a.tensorboard)
        except OSError as e:  # (a file where the folder belongs: mkdir says only "File exists")
            raise TrainError(f"--tensorboard {a.tensorboard}: cannot write event files there "
                             f"({e.strerror or type(e).__name__}); give a directory llmc may create or write in") \
                from None

    def _record(self, rec: dict | None, records: list, log, tb) -> None:
        if rec is not None:
            records.append(rec)
            if log:
                _append_record(log, self.a.log, rec)
            if tb:
                tb.write_record(rec)

    def _between_steps(self, step: int, last: bool) -> dict | None:
        """Before iteration `step` trains: rank 0 validates, evaluates and samples where due (their record), then
        the checkpoint that is due. A resumed run's first step is on disk already; a fresh run's step 0 is written
        only as its last (--steps 0 --out: the initial model as a run, which --resume, sample and eval take)."""
        a, rec = self.a, evaluate_before(self, step, last)
        unsaved = step > self.start_step or (last and not a.resume)
        if a.out and unsaved and (last or self.votes.checkpoint_due(step)):
            self.say(f"checkpoint: {self.save(step)}")
            self.votes.restart_clock()
        return rec

    def _judge(self, rec: dict) -> None:
        """Counts a skipped step; --max-bad-steps in a row stop the run (TrainDiverged)."""
        if not rec.get("skipped"):
            self.bad_streak = 0
            return
        self.bad_streak += 1
        self.say(f"step {rec['step']}: update skipped ({rec['reason']}); {self.bad_streak} bad step(s) in a row")
        if self.a.max_bad_steps and self.bad_streak >= self.a.max_bad_steps:
            raise TrainDiverged(
                f"step {rec['step']}: {self.bad_streak} consecutive bad steps (last: {rec['reason']}), "
                f"stopping rather than training on garbage{self.last_good()}; lower --lr, raise --warmup "
                f"or check the data (--max-bad-steps sets the limit)")

    def _stop(self, step: int, signame: str) -> None:
        """A stop request after `step`: its checkpoint (unless on disk already), and what run() stopped at."""
        a, path = self.a, None
        if a.out and self.saved != step:
            path = self.save(step)
            self.say(f"checkpoint: {path}")
        elif a.out:
            path = Path(a.out) / ckpt.step_dir_name(step)
        self.stopped = {"signal": signame, "step": step, "checkpoint": path}
