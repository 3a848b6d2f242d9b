"""The training loop: data -> forward/backward -> clip -> AdamW, with validation, sampling, checkpoints, resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from llmc_cli.data.prefetch import Feed
from llmc_cli.evals.evaluate import evaluate_loss
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.manifest import data_fingerprint
from llmc_cli.formats.rundir import RunDirError, RunLock, check_out
from llmc_cli.formats.runlog import LogError, check_log, is_runs_own_log, log_lock, open_log, record_line
from llmc_cli.formats.shards import SHARD_VOCAB
from llmc_cli.formats.sources import load_model_any
from llmc_cli.formats.tensorboard import EventWriter
from llmc_cli.kernels import BFLOAT16, CAP_GRAPHS, MAX, Backend
from llmc_cli.models.base import backend_capabilities, check_backend, unimplemented_kernel
from llmc_cli.models.families import family_for, family_of
from llmc_cli.naming import arg
from llmc_cli.optim import lr_at
from llmc_cli.parallel.comm import SingleProcess  # data parallel (issue 7)
from llmc_cli.parallel.zero import LayerShardedReduction, OverlappedReduction, make_optimizer
from llmc_cli.training.args import (SHAPE_OPTIONS, TrainArgs, TrainDiverged, TrainError, _is_int, check_args,
                                    check_init_shape, check_seq_len, check_together, model_config)
from llmc_cli.training.evaluation import evaluate_before, sample_text
from llmc_cli.training.guard import OutlierDetector, skip_reason
from llmc_cli.training.memory import out_of_memory_message, plan_refusal
from llmc_cli.training.phases import open_step_phases
from llmc_cli.training.report import data_line, memory_line
from llmc_cli.training.resume import read_resume, restore
from llmc_cli.training.run_data import check_eval_files, check_shard_vocab, open_loaders, run_tokenizer
from llmc_cli.training.saving import run_state
from llmc_cli.training.steps import forward_backward
from llmc_cli.training.votes import RankVotes


def _append_record(log, path: str, rec: dict) -> None:
    """One record onto the --log file, flushed; a write's OSError names no file (a full disk would say only "No
    space left on device"), so it is raised again naming the log."""
    try:
        log.write(record_line(rec))
        log.flush()
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (writing the {arg('log')} records)", str(path)) from None



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
            cfg, params, opt_state, resume_state = read_resume(a)
            self._trim_log = bool(a.log) and is_runs_own_log(a.log, a.out, resume_state["args"])
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
            restore(self, opt_state, resume_state)
        # the position is final now: the thread starts reading the first batches while the run gets ready
        self.feed = Feed(self.backend, [self.model.acts["inputs"], self.model.acts["targets"]], self.train_loader,
                         overfit=a.overfit_batch, prefetch=a.prefetch)
        self.feed.start()

    def _read_init(self):
        """--init: weights from a llm.c .bin, a run directory, an llmc Llama file or a Hugging Face directory."""
        try:
            cfg, params, _ = load_model_any(self.a.init)
            check_init_shape(self.a.init, cfg, {k: getattr(self.a, k) for k in SHAPE_OPTIONS})
        except ckpt.CheckpointError as e:
            raise TrainError(f"{arg('init')}: {e}") from None
        except ValueError as e:
            raise TrainError(str(e)) from None
        return cfg, params

    def _plan(self, cfg) -> None:
        """The sizes of a step, and every refusal that needs only them (the memory the plan needs included)."""
        a, ranks = self.a, self.comm.world_size
        B, T = a.batch_size, a.seq_len
        check_seq_len(T, cfg)
        self.cfg, self.family = cfg, family_of(cfg)
        total = check_together(a, ranks)
        self.grad_accum = total // (B * T * ranks)  # one micro-step reads B*T tokens on every rank
        self.tokens_per_step = total
        self.steps_run = 0
        if a.overlap and ranks == 1:
            self.say(f"{arg('overlap')}: data parallel only, and this run has one rank: nothing to overlap")
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
            # (what checkpoints record and a resume compares: read only by a run that has a run directory)
            self.data_fingerprint = data_fingerprint(self.train_loader.files) if a.out else None
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
                                         keep=self.a.keep, tokenizer_file=self.tokenizer_file,
                                         data_fingerprint=self.data_fingerprint)
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
            raise TrainError(f"{arg('tensorboard', a.tensorboard)}: cannot write event files there "
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
                f"stopping{self.last_good()}; lower {arg('lr')}, raise {arg('warmup')} or check the data "
                f"({arg('max_bad_steps')} sets the limit)")

    def _stop(self, step: int, signame: str) -> None:
        """A stop request after `step`: its checkpoint (unless on disk already), and what run() stopped at."""
        a, path = self.a, None
        if a.out and self.saved != step:
            path = self.save(step)
            self.say(f"checkpoint: {path}")
        elif a.out:
            path = Path(a.out) / ckpt.step_dir_name(step)
        self.stopped = {"signal": signame, "step": step, "checkpoint": path}
