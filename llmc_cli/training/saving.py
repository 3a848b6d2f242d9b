"""What a run's checkpoint records beside its weights and optimizer state: the state.json a resume continues from
(the step, the data position, the RNG, the outlier windows, the options the run was given)."""

from __future__ import annotations

from dataclasses import asdict

from llmc_cli.formats import checkpoint as ckpt


def run_state(tr, step: int, loader_state: dict | None) -> dict:
    """The state of Trainer `tr` after `step` optimizer steps (`loader_state`: the data position then, when a step
    has begun since; else the position after the batches the steps took, however far the data thread read ahead)."""
    state = {"step": step, "config": asdict(tr.cfg), "rng": tr.rng.bit_generator.state,
             "dataloader": loader_state if loader_state is not None else tr.feed.position,
             "dtype": tr.backend.matmul_dtype or tr.backend.dtype, "backend": tr.backend.name,
             "args": {k: v for k, v in asdict(tr.a).items() if k != "optim"} | {"optim": asdict(tr.a.optim)}}
    state |= {"version": ckpt.RUN_STATE_VERSION, "optimizer_steps": tr.opt.step_count,
              "outliers": {"loss": tr.loss_outliers.state(), "norm": tr.norm_outliers.state(),
                           "bad_streak": tr.bad_streak}}
    state |= {"world_size": tr.comm.world_size, "tokens_per_step": tr.tokens_per_step}
    state |= {"family": tr.family.name, "tokenizer": tr.tokenizer, "data_fingerprint": tr.data_fingerprint}
    carried = tr.backend.carried_state()
    if carried:
        state["backend_state"] = carried
    return state
