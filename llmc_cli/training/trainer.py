"""The training loop: data -> forward/backward -> clip -> AdamW, with validation, sampling, checkpoints, resume."""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from llmc_cli.data.loader import DataLoader, DataSetupChanged, ValLoader
from llmc_cli.data.prefetch import Feed
from llmc_cli.evals.evaluate import check_shards_tokenizer, eval_batches, evaluate_loss
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.rundir import RunDirError, RunLock, check_out
from llmc_cli.formats.runlog import LogError, check_log, is_runs_own_log, log_lock, open_log, record_line
from llmc_cli.formats.shards import SHARD_VOCAB, has_split
from llmc_cli.formats.tensorboard import EventWriter
from llmc_cli.inference.sampling import NonFiniteLogits, generate
from llmc_cli.kernels import BFLOAT16, CAP_GRAPHS, MAX, Backend, update_applies
from llmc_cli.models.base import STAGED, backend_capabilities, check_backend, unimplemented_kernel
from llmc_cli.models.families import family_for, family_of
from llmc_cli.optim import lr_at
from llmc_cli.parallel.comm import SingleProcess  # data parallel (issue 7)
from llmc_cli.parallel.zero import LayerShardedReduction, OverlappedReduction, make_optimizer, reshard_loader_state
from llmc_cli.training.args import (RESUME_FIXED, SHAPE_OPTIONS, TrainArgs, TrainDiverged, TrainError, _is_int, _product,
                                    check_args, check_init_shape, data_setup_changes, model_config)
from llmc_cli.training.guard import OutlierDetector
from llmc_cli.training.memory import out_of_memory_message
from llmc_cli.training.phases import ENV as PHASES_ENV
from llmc_cli.training.phases import StepPhases


def _append_record(log, path: str, rec: dict) -> None:
    """One record onto the --log file, flushed; a write's OSError names no file (a full disk would say only "No
    space left on device"), so it is raised again naming the log."""
    try:
        log.write(record_line(rec))
        log.flush()
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (writing the --log records)", str(path)) from None


@contextmanager
def _option_named(flag: str):
    """A DataError raised inside, with `flag` in front of its message (unless it names an option already)."""
    try:
        yield
    except DataError as e:
        if str(e).startswith("--"):
            raise
        raise DataError(f"{flag}: {e}") from None


# uncaptured steps before the micro-steps are captured as graphs (CAP_GRAPHS): enough for every scratch buffer to
# reach its size and for a backend's own tuning of its products to settle (the CUDA backend's, d12: by step 5)
GRAPH_AFTER = 6
# data parallel steps this long (seconds, the slowest rank's) also vote on a stop request after each step (_votes):
# its host round trip (0.2 ms) is then under 0.02 % of the step
SLOW_STEP_S = 1.0


class Trainer:
    """One training run. With `out`, rank 0 holds the run directory's lock from here until `close()`."""

    def __init__(self, a: TrainArgs, backend: Backend, say: Callable[[str], None] = print,
                 decode: Callable[[list[int]], str] | None = None, eot: int | None = None, comm=None):
        self.lock = self.log_lock = None
        self.closed = False
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

    def _setup(self) -> None:
        a, backend = self.a, self.backend
        B, T = a.batch_size, a.seq_len
        self.start_step = 0
        resume_state = None
        if a.resume:
            if not a.out:
                raise TrainError("--resume needs --out DIR (the run directory to continue)")
            try:
                cfg, params, opt_state, resume_state = ckpt.read_run_checkpoint(a.out)
            except ckpt.CheckpointError as e:
                raise TrainError(str(e)) from None
            expected = resume_state.get("config")
            if expected and expected != asdict(cfg):
                raise TrainError(f"{a.out}: model file and state.json disagree about the model shape")
            old_args = resume_state["args"]
            self._trim_log = bool(a.log) and is_runs_own_log(a.log, a.out, old_args)
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
                    had = resume_state.get("tokens_per_step") or _product(
                        old_args.get("batch_size"), old_args.get("seq_len"), resume_state.get("world_size", 1))
                opt = "--" + key.replace("_", "-")
                if had is None and key in SHAPE_OPTIONS:
                    raise TrainError(f"--resume: {opt} does not apply to the run in {a.out}, a "
                                     f"{family_of(cfg).label} model (leave it out)")
                if had != val:
                    raise TrainError(f"--resume: {opt} is {val!r} but the run in {a.out} was trained with "
                                     f"{had!r} (give the same options, or start a new --out)")
        elif a.init:
            from llmc_cli.formats.sources import load_model_any
            try:  # llm.c .bin, run directory, llmc Llama file or Hugging Face GPT-2 / Llama directory
                cfg, params, _ = load_model_any(a.init)
                check_init_shape(a.init, cfg, {k: getattr(a, k) for k in SHAPE_OPTIONS})
            except ckpt.CheckpointError as e:
                raise TrainError(f"--init: {e}") from None
            except ValueError as e:
                raise TrainError(str(e)) from None
        else:
            cfg = model_config(a)
            params = family_for(a.model).init_parameters(cfg, a.seed)
        if T > cfg.block_size:
            raise TrainError(f"-t {T} is longer than the model's block size {cfg.block_size}")
        self.cfg = cfg
        self.family = family_of(cfg)
        tokens_per_micro = B * T * self.comm.world_size  # one micro-step reads B*T tokens on every rank
        total = a.total_batch_size or tokens_per_micro
        if total % tokens_per_micro:
            what = "B*T*ranks" if self.comm.world_size > 1 else "B*T"
            raise TrainError(f"--total-batch-size {total} is not a multiple of {what} = {tokens_per_micro}")
        self.grad_accum = total // tokens_per_micro
        self.tokens_per_step = total
        self.steps_run = 0

        if a.zero == 2 and a.overlap:
            raise TrainError("--overlap: --zero 2 already reduces each layer's gradients during the backward pass "
                             "(into the ranks' shards, on the compute stream); leave --overlap out")
        if a.overlap and self.comm.world_size == 1:
            self.say("--overlap: data parallel only, and this run has one rank: nothing to overlap (the same updates)")
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
        where = os.environ.get(PHASES_ENV)
        if where and not callable(getattr(backend.timer(), "marks", None)):
            raise TrainError(f"{PHASES_ENV}: the {backend.name} backend's timer sets no marks (Timer.mark/marks)")
        try:
            self.phases = StepPhases(where, self.comm.rank) if where else None
        except OSError as e:
            raise TrainError(f"{PHASES_ENV}={where}: cannot write the step phases there "
                             f"({f'{e.filename}: ' if e.filename and str(e.filename) != where else ''}"
                             f"{e.strerror or type(e).__name__}); give a directory llmc may create or append to") \
                from None
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
        self.loss_outliers = OutlierDetector(a.outlier_window)
        self.norm_outliers = OutlierDetector(a.outlier_window)
        self.bad_streak = 0
        self.stop_requested: Callable[[], str | None] = lambda: None
        self.stopped: dict | None = None  # set by run() when it returns early on a stop request
        # data parallel: what the last step's vote (_votes) said, and this rank's last step time it sends
        self.voted_stop: str | None = None
        self.voted_due = False
        self.slow_steps = False
        self.last_step_s = 0.0
        self._last_checkpoint = time.monotonic()  # (run() restarts the clock)

        # token ids are checked against the model's vocabulary as each shard is first opened
        # (a missing or damaged shard named with the option that led to it: "data shard x not found" did not say
        # whether --data or --val-data)
        with _option_named("--data"):
            self.train_loader = DataLoader(a.data, B, T, rank=self.comm.rank, world_size=self.comm.world_size,
                                           shuffle=a.shuffle, seed=a.seed, vocab_size=cfg.vocab_size)
        # a directory given as --data serves its train shards; its val shards validate unless --val-data says else
        val_data = a.val_data or (a.data if isinstance(a.data, str) and has_split(a.data, "val") else None)
        with _option_named("--val-data" if a.val_data else "--data"):
            self.val_loader = ValLoader(val_data, B, T, vocab_size=cfg.vocab_size) if val_data else None
        for opt, loader in (("--data", self.train_loader), ("--val-data", self.val_loader)):
            need = SHARD_VOCAB.get(loader.tokenizer) if loader is not None else None
            if need and cfg.vocab_size < need:
                raise TrainError(f"{opt}: the shards were tokenized with the {loader.tokenizer} vocabulary "
                                 f"({need:,} ids) but the model's vocab size is {cfg.vocab_size:,}; use a "
                                 f"{loader.tokenizer} model or re-tokenize the data")
        # the tokenizer is the data's: sample/eval read it from the run directory to decode and encode prompts
        self.tokenizer, self.tokenizer_file = self.train_loader.tokenizer, None
        if resume_state is not None:
            self.tokenizer = resume_state.get("tokenizer", "gpt2")  # runs from before the field: GPT-2 shards
            kept = Path(a.out) / ckpt.TOKENIZER_FILE
            self.tokenizer_file = kept if kept.is_file() else None
        elif a.init and self.tokenizer == "llama3":
            from llmc_cli.formats.sources import tokenizer_for
            try:
                name, self.tokenizer_file = tokenizer_for(a.init)
            except ckpt.CheckpointError:  # without the file the run still trains; sample says what is missing
                name = "llama3"
            if name != "llama3":
                self.tokenizer_file = None
            if self.tokenizer_file is not None:  # copied into the run at its first checkpoint: refused now if bad
                from llmc_cli.data.tokenizer import llama3_ranks
                try:
                    llama3_ranks(self.tokenizer_file)
                except DataError as e:
                    raise TrainError(f"--init: {e}") from None
        # evaluations during the run score the model on ids of its data's tokenizer: val shards or a HellaSwag file
        # of another would be scored without complaint (GPT-2 ids all fit a Llama's vocabulary), so they are refused
        # now, before the first step, rather than at the first validation
        self.model.tokenizer = self.tokenizer if self.tokenizer in SHARD_VOCAB else None
        try:
            if self.val_loader is not None:
                check_shards_tokenizer(self.val_loader, self.model.tokenizer, "the run")
                if a.val_every > 0:  # (a bad id in a later val shard: one line now, not at a validation mid-run)
                    self.val_loader.check_vocab_of_batches(a.val_batches)
        except DataError as e:
            raise TrainError(f"{'--val-data' if a.val_data else '--data'}: {e}") from None
        if a.hellaswag:
            from llmc_cli.evals.evaluate import HELLASWAG_REMEDY, check_tokenizer
            from llmc_cli.formats.evalfile import read_evalfile_header
            try:
                check_tokenizer(a.hellaswag, read_evalfile_header(a.hellaswag).tokenizer, self.model.tokenizer,
                                "the run", HELLASWAG_REMEDY.format(self.model.tokenizer))
            except DataError as e:
                raise TrainError(f"--hellaswag: {e}") from None
        self.sample_prompt: list[int] | None = None  # default [eot]: how GPT-2 documents start
        self.rng = np.random.default_rng(a.seed)
        if resume_state is not None:
            self.opt.load_state(opt_state, resume_state["step"])
            self.opt.step_count = int(resume_state.get("optimizer_steps", resume_state["step"]))
            self.start_step = resume_state["step"]
            if a.steps < self.start_step:  # (equal: the run is complete, and resuming it does nothing)
                raise TrainError(f"--steps {a.steps}: the run in {a.out} is already at step {self.start_step}; give "
                                 f"--steps {self.start_step} or more to continue it")
            old_total = resume_state.get("tokens_per_step")
            if old_total and old_total != self.tokens_per_step:
                raise TrainError(f"--resume: the run in {a.out} took {old_total} tokens per step, now "
                                 f"{self.tokens_per_step} ({self.comm.world_size} rank(s) x B*T); give "
                                 f"--total-batch-size {old_total}")
            try:
                self.train_loader.load_state(reshard_loader_state(resume_state["dataloader"], self.comm.world_size))
            except DataSetupChanged as e:
                raise TrainError(f"--resume {a.out}: {data_setup_changes(e)}; give the run's options, or start a new "
                                 "--out") from None
            except (DataError, ValueError) as e:  # (a position of other ranks, a damaged or foreign state)
                raise TrainError(f"--resume {a.out}: {e}") from None
            try:
                self.backend.load_carried_state(resume_state.get("backend_state", {}))
            except ValueError as e:
                raise TrainError(f"{a.out}: state.json's backend_state is damaged: {e}") from None
            try:
                self.rng.bit_generator.state = resume_state["rng"]
                outl = resume_state.get("outliers", {})
                self.loss_outliers.load_state(outl.get("loss", []))
                self.norm_outliers.load_state(outl.get("norm", []))
                self.bad_streak = int(outl.get("bad_streak", 0))
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                raise TrainError(f"{a.out}: state.json has a damaged RNG / outlier state ({e})") from None
        # the position is final now: the thread starts reading the first batches while the run gets ready
        self.feed = Feed(backend, [self.model.acts["inputs"], self.model.acts["targets"]], self.train_loader,
                         overfit=a.overfit_batch, prefetch=a.prefetch)
        self.feed.start()
        self.sampler = None
        self.updating = False                 # inside the optimizer update of a step (see run's rescue)
        self.saving = False                   # inside save() (a failed save is not retried as a rescue)
        self.saved = self.start_step          # the newest step whose checkpoint is on disk (start_step: none yet)
        self.rescued: Path | None = None      # the checkpoint written after an error stopped the run
        self.rescue_error: str | None = None  # why that checkpoint could not be written

    def data_line(self) -> str:
        """Which shards the run reads: what a directory or a glob resolved to."""
        def part(what: str, loader) -> str:
            f = loader.files
            where = f[0] if len(f) == 1 else f"{f[0]} .. {Path(f[-1]).name}"
            return f"{what} {len(f)} shard(s), {loader.num_tokens:,} tokens ({where})"
        val = part("val", self.val_loader) if self.val_loader is not None else "val: none"
        return f"data: {part('train', self.train_loader)}; {val}"

    def memory_line(self, label: str = "memory") -> str:
        r = self.backend.memory_report()
        parts = [f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(r.by_tag.items())]
        line = f"{label}: {', '.join(parts)}; total {r.allocated / 2**20:.1f} MiB"
        if r.cached:
            line += f"; allocator cache {r.cached / 2**20:.1f} MiB"
        if r.device_total:
            free = f", free {r.device_free / 2**30:.1f} GiB" if r.device_free is not None else ""
            line += f" (device {r.device_total / 2**30:.1f} GiB{free})"
        return line

    def _micro_step(self, i: int, dloss: float) -> None:
        """The kernels of micro-step i over the staged batch (gradients zeroed first at i = 0): all a captured
        graph holds, since nothing here moves data to or from the host."""
        model = self.model
        if i == 0:
            model.zero_grad()
        model.forward(STAGED, STAGED, dloss=dloss)
        model.backward()
        self.backend.loss_sum(self.opt.loss_buf, model.acts["losses"], dloss, accumulate=i > 0)

    def _replays(self, dloss: float) -> list | None:
        """The micro-steps as captured graphs (the first, and one for every later micro-step), captured once
        GRAPH_AFTER steps ran uncaptured (they size every scratch buffer and let the backend tune its kernels);
        None while not (yet) captured. A capture that fails turns graphs off for the run, with one line said."""
        if self.graphs is None and self.steps_run >= GRAPH_AFTER:
            try:
                cap = self.backend.capture
                self.graphs = [cap(lambda i=i: self._micro_step(i, dloss))
                               for i in range(min(self.grad_accum, 2))]
                self.say(f"graphs: each micro-step replays one captured graph from step {self.steps_run + 1} "
                         "(--no-graphs to compare)")
            except Exception as e:  # the step runs uncaptured: nothing a failed capture recorded has run
                self.graphs = False
                self.say(f"graphs: off ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return self.graphs or None

    def train_step(self, step: int) -> dict:
        a, model = self.a, self.model
        timer = self.backend.timer()
        timer.start()
        phases = self.phases
        if phases:
            phases.begin(timer)
        dloss = 1.0 / (a.batch_size * a.seq_len * self.grad_accum)
        # the loss, the norm and the skip verdict stay on the device until the update is queued (AdamW reads them
        # there; data parallel reduces them there too), so the device never idles waiting for the host in a step
        replays = self._replays(dloss)
        waits = self.feed.waits
        self.backend.begin_step()
        for i in range(self.grad_accum):
            self.feed.stage()
            if phases and i == 0:
                phases.mark("stage")
            if replays:
                replays[min(i, 1)]()
            else:
                # (only the last micro-step's backward makes gradients final; ZeRO-2 reduces every micro-step's)
                last = i == self.grad_accum - 1 or getattr(self.reducer, "every_micro_step", False)
                model.on_layer_grads = self.reducer.layer_done if self.reducer is not None and last else None
                self._micro_step(i, dloss)
                model.on_layer_grads = None
            if i + 1 < self.grad_accum or step + 1 < a.steps:  # (the run's last batch has no batch after it)
                self.feed.ahead()  # the next micro-step's batch (or the next step's) is copied while this one computes
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
        stop, votes = self._votes()
        loss, norm, applied = self.opt.guarded_step(lr, a.seed + step, max_loss, max_norm, votes)
        zloss, znorm = self.loss_outliers.update(loss), self.norm_outliers.update(norm)
        self.updating = False
        seen = self.backend.step_observations()  # (FP8's amaxes: every rank carries the ranks' largest)
        if seen is not None and self.comm.world_size > 1:
            self.comm.all_reduce(seen, MAX)
        self.backend.end_step()
        if votes:
            any_stop, due, slowest = self.opt.flags
            self.voted_stop = stop or ("a stop request on another rank" if any_stop > 0 else None)
            self.voted_due = due > 0
            self.slow_steps = slowest >= SLOW_STEP_S
        reason = None
        if not applied:
            if not math.isfinite(lr):
                reason = f"non-finite learning rate {lr}"
            elif not np.isfinite(loss) or not np.isfinite(norm):
                reason = "non-finite loss" if not np.isfinite(loss) else "non-finite grad norm"
            elif not update_applies(loss, 0.0, max_loss, float("inf")):
                reason = f"loss z-score {zloss:.1f} > --skip-loss-z {a.skip_loss_z:g}"
            else:
                reason = f"grad norm z-score {znorm:.1f} > --skip-grad-z {a.skip_grad_z:g}"
        seconds = timer.stop()
        self.last_step_s = seconds
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

    def hellaswag_eval(self) -> dict:
        """HellaSwag acc / acc_norm of the current weights (the eval file is read on first use)."""
        from llmc_cli.evals.evaluate import HellaSwag
        if getattr(self, "hellaswag", None) is None:
            self.hellaswag = HellaSwag(self.a.hellaswag)
        return self.hellaswag.evaluate(self.model).as_dict()

    def sample_text(self) -> str:
        if self.decode is None or self.eot is None:
            return ""
        if self.sampler is None:
            window = min(self.cfg.block_size, max(self.a.seq_len, 64))
            self.sampler = self.family.model_class(self.cfg, self.backend, 1, window, training=False,
                                                   share_params=self.model)
        ids = []
        try:
            for t in generate(self.sampler, self.sample_prompt or [self.eot], self.a.sample_tokens, self.rng,
                              temperature=1.0, stop_token=self.eot):
                ids.append(t)
                # (only rank 0 samples, so no rank waits on this one: a stop request cuts a long --sample-tokens
                # short, where it held the graceful stop, and a scheduler's grace, until the whole sample was done)
                if self.stop_requested():
                    break
        except NonFiniteLogits as e:  # a sample is a look at the run, not a reason to end it (the guard judges steps)
            return f"{self.decode(ids)}[no more sample: {e}]"
        return self.decode(ids)

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
        state = {"step": step, "config": asdict(self.cfg), "rng": self.rng.bit_generator.state,
                 "dataloader": loader_state if loader_state is not None else self.feed.position,
                 "dtype": self.backend.matmul_dtype or self.backend.dtype, "backend": self.backend.name,
                 "args": {k: v for k, v in asdict(self.a).items() if k != "optim"} | {"optim": asdict(self.a.optim)}}
        state |= {"version": ckpt.RUN_STATE_VERSION, "optimizer_steps": self.opt.step_count,
                  "outliers": {"loss": self.loss_outliers.state(), "norm": self.norm_outliers.state(),
                               "bad_streak": self.bad_streak}}
        state |= {"world_size": self.comm.world_size, "tokens_per_step": self.tokens_per_step}
        state |= {"family": self.family.name, "tokenizer": self.tokenizer}
        carried = self.backend.carried_state()
        if carried:
            state["backend_state"] = carried
        path = ckpt.write_run_checkpoint(self.a.out, step, self.cfg, params, bf16=self.backend.dtype == BFLOAT16,
                                         optimizer=opt_state, state=state, keep=self.a.keep,
                                         tokenizer_file=self.tokenizer_file)
        self.saved = step
        return path

    def last_good(self) -> str:
        """'; the last good checkpoint is RUN/step_N' (or '' when this run has none on disk)."""
        if not self.a.out or not self.saved:
            return ""
        return f"; the last good checkpoint is {Path(self.a.out) / ckpt.step_dir_name(self.saved)}"

    def _clock_due(self, ahead: float = 0.0) -> bool:
        """Whether --checkpoint-minutes will have passed `ahead` seconds from now."""
        a = self.a
        return bool(a.out) and a.checkpoint_minutes > 0 and \
            time.monotonic() + ahead - self._last_checkpoint >= a.checkpoint_minutes * 60

    def _evals_before(self, step: int, last: bool) -> tuple[bool, bool, bool]:
        """Whether run()'s iteration `step` validates, evaluates HellaSwag and samples before it trains (rank 0 does
        them; every rank computes the same answer)."""
        a = self.a
        at = lambda every: every > 0 and (step % every == 0 or last)  # noqa: E731
        return self.val_loader is not None and at(a.val_every), bool(a.hellaswag) and at(a.hellaswag_every), \
            step > 0 and at(a.sample_every)

    def _busy_before(self, step: int) -> bool:
        """Whether run()'s iteration `step` validates, evaluates, samples or checkpoints before it trains: the same
        answer on every rank (the options', and for the checkpoint clock the last step's vote)."""
        return any(self._evals_before(step, False)) or (bool(self.a.out) and self._checkpoint_due(step))

    def _checkpoint_due(self, step: int) -> bool:
        """Every --checkpoint-every steps, and whenever --checkpoint-minutes have passed since the last one (or
        the start). Under data parallel rank 0's clock decides for all ranks, as the last step's vote carried it:
        a checkpoint is a collective under ZeRO."""
        a = self.a
        if a.checkpoint_every > 0 and step % a.checkpoint_every == 0:
            return True
        return self.voted_due if self.comm.world_size > 1 else self._clock_due()

    def _votes(self) -> tuple[str | None, tuple[float, ...]]:
        """Data parallel: this rank's stop request, and its votes (that request; rank 0's checkpoint clock; its last
        step's seconds) for the optimizer's step to reduce (max) with its own collectives and return in the step's
        one read. Every rank then stops after the same step and checkpoints at the same one, with no collective
        between steps: one there, a host round trip, left every GPU idle outside any step's time (about 0.2 ms a
        step on two H100s). The host queues a step long before the device runs it, so a request made during the
        step is voted on at the next; where steps take SLOW_STEP_S or more, or the next step waits for a
        validation, a sample or a checkpoint, run() asks again after the step (a scheduler's grace before SIGKILL
        must not be spent on a second long wait). One rank: no votes."""
        if self.comm.world_size == 1:
            return None, ()
        stop = self.stop_requested()
        # (the clock is read as the host queues the step, before the device runs it: asked a step ahead, so that
        # the checkpoint is not one step late)
        return stop, (1.0 if stop else 0.0, 1.0 if self.comm.rank == 0 and self._clock_due(self.last_step_s) else 0.0,
                      self.last_step_s)

    def run(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Trains from `start_step` to `a.steps`. When an error stops it between two updates (a bad shard, a
        full disk), the step before is checkpointed first (`rescued`), so nothing trained is lost."""
        if self.closed:  # its run directory's lock is released: another run may own the directory now
            raise TrainError("this Trainer was closed (close() released its run directory); make a new Trainer to "
                             "train again (with resume=True to continue the run)")
        if on_step is not None and not callable(on_step):
            raise TrainError(f"on_step must be a function taking each step's record, or None (got {on_step!r:.80})")
        a = self.a
        log = None
        lead = self.comm.rank == 0  # only rank 0 logs, validates, samples and writes checkpoints
        records = []
        tb = None
        done, before = self.start_step, None  # steps completed; the data position when a step began
        self._last_checkpoint = time.monotonic()
        try:
            if a.tensorboard and lead:  # a new event file per run (or resumed run), as TensorBoard expects
                try:
                    tb = EventWriter(a.tensorboard)
                except OSError as e:  # (a file where the folder belongs: mkdir says only "File exists")
                    raise TrainError(f"--tensorboard {a.tensorboard}: cannot write event files there "
                                     f"({e.strerror or type(e).__name__}); give a directory llmc may create or "
                                     "write in") from None
            if a.log and lead:  # (checked in __init__) on resume, drop what the dead run logged past its checkpoint
                # (after every other check that can fail here; and only the run's own log: see is_runs_own_log)
                log = open_log(a.log, self.start_step if a.resume and getattr(self, "_trim_log", False) else None)
            for step in range(self.start_step, a.steps + 1):
                done = step
                last = step == a.steps
                rec = None
                validates, evaluates, samples = self._evals_before(step, last)
                if lead and validates:
                    rec = {"step": step, "val_loss": self.validate()}
                    n = eval_batches(self.val_loader, a.val_batches)
                    self.say(f"step {step}: val loss {rec['val_loss']:.6f} ({n} batches of B={a.batch_size} "
                             f"T={a.seq_len})")
                if lead and evaluates:
                    rec = (rec or {"step": step}) | self.hellaswag_eval()
                    self.say(f"step {step}: HellaSwag acc_norm {rec['hellaswag_acc_norm']:.4f} "
                             f"acc {rec['hellaswag_acc']:.4f} ({rec['hellaswag_examples']} examples)")
                if lead and samples:
                    text = self.sample_text()
                    if text:
                        self.say(f"sample at step {step}:\n{text}\n---")
                # a resumed run's first step is on disk already; a fresh run's step 0 is written only as its last
                # (--steps 0 --out: the initial model as a run, which --resume, sample and eval take)
                unsaved = step > self.start_step or (last and not a.resume)
                if a.out and unsaved and (last or self._checkpoint_due(step)):
                    self.say(f"checkpoint: {self.save(step)}")
                    self._last_checkpoint = time.monotonic()
                if rec is not None:
                    records.append(rec)
                    if log:
                        _append_record(log, a.log, rec)
                    if tb:
                        tb.write_record(rec)
                if last:
                    break
                before = self.feed.position  # the data position a checkpoint of `step` records
                rec = self.train_step(step)
                before, done = None, step + 1
                records.append(rec)
                if log:
                    _append_record(log, a.log, rec)
                if tb:
                    tb.write_record(rec)
                if on_step:
                    on_step(rec)
                if rec.get("skipped"):
                    self.bad_streak += 1
                    self.say(f"step {rec['step']}: update skipped ({rec['reason']}); "
                             f"{self.bad_streak} bad step(s) in a row")
                    if a.max_bad_steps and self.bad_streak >= a.max_bad_steps:
                        raise TrainDiverged(
                            f"step {rec['step']}: {self.bad_streak} consecutive bad steps (last: {rec['reason']}), "
                            f"stopping rather than training on garbage{self.last_good()}; lower --lr, raise --warmup "
                            f"or check the data (--max-bad-steps sets the limit)")
                else:
                    self.bad_streak = 0
                # every rank stops after the same step, or none does: data parallel ranks go by the step's vote,
                # and by one more after the step where waiting for the next step's could be long: long steps
                # (every rank knows it from the vote), or a next iteration that validates, evaluates, samples or
                # checkpoints first (the same conditions on every rank)
                if self.comm.world_size == 1:
                    signame = self.stop_requested()
                else:
                    signame = self.voted_stop
                    if signame is None and (self.slow_steps or self._busy_before(step + 1)):
                        local = self.stop_requested()
                        if self.comm.all_reduce_value(1.0 if local else 0.0, MAX) > 0:
                            signame = local or "a stop request on another rank"
                if signame and step + 1 < a.steps:
                    path = None
                    if a.out and self.saved != step + 1:
                        path = self.save(step + 1)
                        self.say(f"checkpoint: {path}")
                    elif a.out:
                        path = Path(a.out) / ckpt.step_dir_name(step + 1)
                    self.stopped = {"signal": signame, "step": step + 1, "checkpoint": path}
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
