"""A resume: the run's newest checkpoint, checked against the options given again and the data read now, then
restored into the Trainer (optimizer, step, data position, backend state, RNG, outlier windows)."""

from __future__ import annotations

from dataclasses import asdict

from llmc_cli.data.loader import DataSetupChanged
from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.files import DataError
from llmc_cli.formats.manifest import data_differences
from llmc_cli.models.families import family_of
from llmc_cli.naming import arg
from llmc_cli.parallel.zero import reshard_loader_state
from llmc_cli.training.args import RESUME_FIXED, SHAPE_OPTIONS, TrainError, _product, data_setup_changes


def read_resume(a):
    """--resume: (config, weights, optimizer state, state.json) of the newest checkpoint in --out, checked against
    the options given again."""
    if not a.out:
        raise TrainError(f"{arg('resume', True)} needs {arg('out')} DIR (the run directory to continue)")
    try:
        cfg, params, opt_state, state = ckpt.read_run_checkpoint(a.out)
    except ckpt.CheckpointError as e:
        raise TrainError(str(e)) from None
    expected = state.get("config")
    if expected and expected != asdict(cfg):
        raise TrainError(f"{a.out}: model file and state.json disagree about the model shape")
    check_resume_options(a, cfg, state)
    return cfg, params, opt_state, state


def _had(key: str, cfg, state: dict):
    """What the run trained with: the option as it recorded it, or where it gave none (the preset's shape, B*T per
    step) the value that was in effect, which an option given now may repeat."""
    old_args, had = state["args"], state["args"][key]
    if had is None and key in SHAPE_OPTIONS:
        return getattr(cfg, key, None)
    if had is None and key == "total_batch_size":  # (runs from before the field: B*T*ranks)
        return state.get("tokens_per_step") or _product(
            old_args.get("batch_size"), old_args.get("seq_len"), state.get("world_size", 1))
    return had


def check_resume_options(a, cfg, state: dict) -> None:
    """An option given again that fixes the model's shape or the meaning of a step must say what the run had."""
    for key in RESUME_FIXED:
        val = getattr(a, key, None)
        if key not in state["args"] or val is None:  # (not given: the run's own value)
            continue
        had, opt, resume = _had(key, cfg, state), arg(key, short=False), arg("resume", True)
        if had is None and key in SHAPE_OPTIONS:
            raise TrainError(f"{resume}: {opt} does not apply to the run in {a.out}, a "
                             f"{family_of(cfg).label} model (leave it out)")
        if had != val:
            raise TrainError(f"{resume}: {opt} is {val!r} but the run in {a.out} was trained with "
                             f"{had!r} (give the same options, or start a new {arg('out')})")


def check_resume_data(a, state: dict, fingerprint: dict, loader) -> None:
    """The shards a run has read are, at its resume, the ones it read: the same names, sizes and sampled contents (a
    corpus tokenized again from other text under the same names is another run's data). Shards it has not reached
    yet may have changed (one mended after it stopped the run)."""
    recorded = state.get("data_fingerprint")
    if not isinstance(recorded, dict) or len(recorded.get("shards", [])) != loader.num_shards:
        diff = data_differences(recorded, fingerprint)  # (nothing recorded, or another number of shards)
    else:
        read = {recorded["shards"][i].get("name") for i in loader.files_read(state["dataloader"])}
        diff = data_differences(_only(recorded, read), _only(fingerprint, read))
    if diff is not None:
        raise TrainError(f"{arg('resume', True)} {a.out}: {arg('data')}: {diff}; give the run's own shards, or start "
                         f"a new {arg('out')}")


def _only(fingerprint: dict, names: set) -> dict:
    return fingerprint | {"shards": [s for s in fingerprint["shards"] if isinstance(s, dict) and s.get("name") in names]}


def restore(tr, opt_state: dict, state: dict) -> None:
    """A resume's optimizer state, step, data position, backend state, RNG and outlier windows, into Trainer
    `tr`."""
    a = tr.a
    tr.opt.load_state(opt_state, state["step"])
    tr.opt.step_count = int(state.get("optimizer_steps", state["step"]))
    tr.start_step = tr.saved = state["step"]
    if a.steps < tr.start_step:  # (equal: the run is complete, and resuming it does nothing)
        raise TrainError(f"{arg('steps', a.steps)}: the run in {a.out} is already at step {tr.start_step}; give "
                         f"{arg('steps', tr.start_step)} or more to continue it")
    old_total = state.get("tokens_per_step")
    if old_total and old_total != tr.tokens_per_step:
        raise TrainError(f"{arg('resume', True)}: the run in {a.out} took {old_total} tokens per step, now "
                         f"{tr.tokens_per_step} ({tr.comm.world_size} rank(s) x B*T); give "
                         f"{arg('total_batch_size', old_total)}")
    _restore_data_position(tr, state)  # (the data's setup first: its message names the option that differs)
    check_resume_data(a, state, tr.data_fingerprint, tr.train_loader)
    try:
        tr.backend.load_carried_state(state.get("backend_state", {}))
    except ValueError as e:
        raise TrainError(f"{a.out}: state.json's backend_state is damaged: {e}") from None
    try:
        tr.rng.bit_generator.state = state["rng"]
        outl = state.get("outliers", {})
        tr.loss_outliers.load_state(outl.get("loss", []))
        tr.norm_outliers.load_state(outl.get("norm", []))
        tr.bad_streak = int(outl.get("bad_streak", 0))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise TrainError(f"{a.out}: state.json has a damaged RNG / outlier state ({e})") from None


def _restore_data_position(tr, state: dict) -> None:
    try:
        tr.train_loader.load_state(reshard_loader_state(state["dataloader"], tr.comm.world_size))
    except DataSetupChanged as e:
        raise TrainError(f"{arg('resume', True)} {tr.a.out}: {data_setup_changes(e)}; give the run's options, or start "
                         f"a new {arg('out')}") from None
    except (DataError, ValueError) as e:  # (a position of other ranks, a damaged or foreign state)
        raise TrainError(f"{arg('resume', True)} {tr.a.out}: {e}") from None
