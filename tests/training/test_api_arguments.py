"""The training API given bad arguments (an adversarial pass): each is one TrainError (a ValueError) naming the
argument as the API spells it and the option as the command line does, raised before anything is read or written;
never a deep TypeError / AttributeError / numpy error, a spin of half a minute, or a value quietly turned into another
(1.5 steps, "no" for a flag, True for a learning rate). numpy's integer and float scalars are numbers, bools are
not. Also: eps = 0, a Trainer run after close(), --resume with an option equal to the run's own value, and a backend
whose capabilities say what it cannot do."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llmc_test_support import TINY, cpu_with, one_line_error, run

from llmc_cli.kernels import Backend
from llmc_cli.optim import AdamWConfig
from llmc_cli.registry import create_backend
from llmc_cli.training.args import TrainArgs, TrainError
from llmc_cli.training.trainer import Trainer


def base(shards, **kw) -> dict:
    return dict(data=str(shards / "*train*.bin"), model="d2", n_embd=32, batch_size=2, seq_len=16, steps=1,
                val_every=0, sample_every=0) | kw


def trainer(shards, backend=None, **kw) -> Trainer:
    return Trainer(TrainArgs(**base(shards, **kw)), backend or create_backend("cpu"), say=lambda s: None)


def trained(shards, **kw) -> Trainer:
    """A Trainer that ran to its end and was closed (its run directory's lock released)."""
    t = trainer(shards, **kw)
    try:
        t.run()
    finally:
        t.close()
    return t


BAD = [
    (dict(batch_size=2.5), ["batch_size must be", "(got 2.5"]),
    (dict(batch_size=True), ["batch_size must be", "(got True"]),
    (dict(seq_len=np.float64(16)), ["seq_len must be", "(got "]),
    (dict(steps=1.5), ["steps must be", "(got 1.5"]),
    (dict(total_batch_size=64.0), ["total_batch_size must be", "(got 64.0"]),
    (dict(seed=-1), ["seed must be", "(got -1", "4294967295"]),
    (dict(seed=None), ["seed must be", "(got None"]),
    (dict(seed=2**32), ["seed must be", "(got 4294967296"]),
    (dict(optim=None), ["optim must be an AdamWConfig"]),
    (dict(data=None), ["data must be", "(got None"]),
    (dict(data=5), ["data must be", "(got 5"]),
    (dict(warmup=1.5), ["warmup must be", "(got 1.5"]),
    (dict(max_bad_steps=1.5), ["max_bad_steps must be", "(got 1.5"]),
    (dict(val_batches=float("nan")), ["val_batches must be", "(got nan"]),
    (dict(steps=2**31), ["steps must be", "2147483647"]),
    (dict(overfit_batch="no"), ["overfit_batch must be", "(got 'no'", "True or False"]),
    (dict(resume="yes"), ["resume must be", "(got 'yes'"]),
    (dict(shuffle=1), ["shuffle must be", "(got 1"]),
    (dict(graphs=None), ["graphs must be", "(got None"]),
    (dict(optim=AdamWConfig(lr=True)), ["lr must be", "(got True"]),
    (dict(optim=AdamWConfig(lr="1e-3")), ["lr must be", "(got '1e-3'"]),
    (dict(optim=AdamWConfig(beta2=np.float32(1.0))), ["beta2 must be", "(got "]),
    (dict(optim=AdamWConfig(eps=0.0)), ["eps must be a finite number > 0", "0.0"]),
    (dict(optim=AdamWConfig(eps=-1e-8)), ["eps must be a finite number > 0"]),
    (dict(optim=AdamWConfig(eps=float("inf"))), ["eps must be a finite number > 0"]),
    (dict(checkpoint_minutes=True), ["checkpoint_minutes must be", "(got True"]),
    (dict(skip_loss_z=float("inf")), ["skip_loss_z must be", "(got inf"]),
    (dict(lr_decay_frac=1.5), ["lr_decay_frac must be", "(got 1.5"]),
    (dict(n_layer=2.0), ["n_layer must be a positive integer", "2.0"]),
    (dict(n_head=True), ["n_head must be a positive integer", "True"]),
    (dict(block_size=0), ["block_size must be a positive integer"]),
    (dict(zero=True), ["zero must be", "(got True"]),
    (dict(zero=3), ["zero must be", "(got 3"]),
    (dict(outlier_window=1), ["outlier_window", "got 1"]),
    (dict(model=None), ["model must be", "(got None"]),
    (dict(out=5), ["out must be", "(got 5"]),
    (dict(recompute=None), ["recompute must be one of"]),
]


@pytest.mark.parametrize("kw, needles", BAD, ids=[repr(kw) for kw, _ in BAD])
def test_a_bad_argument_is_one_train_error_naming_it(shards, tmp_path, kw, needles):
    out = tmp_path / "run"
    with pytest.raises(TrainError) as e:
        trainer(shards, **({"out": str(out)} | kw))
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    assert not out.exists()  # refused before the run directory was made


def test_the_backend_say_and_args_themselves_are_checked(shards):
    for make, needle in ((lambda: Trainer(TrainArgs(**base(shards)), None), "backend must be a Backend"),
                         (lambda: Trainer(TrainArgs(**base(shards)), "cpu"), "backend must be a Backend"),
                         (lambda: Trainer(TrainArgs(**base(shards)), create_backend("cpu"), say=None), "say must be"),
                         (lambda: Trainer(base(shards), create_backend("cpu")), "args must be a TrainArgs")):
        with pytest.raises(TrainError, match=needle):
            make()


@pytest.mark.parametrize("B, T", [(2**40, 16), (2**20, 2**12), (2**31 - 1, 2)])
def test_a_micro_batch_past_what_the_kernels_index_is_refused_at_once(shards, B, T, monkeypatch):
    """check_args lacked the command line's B*T <= 2**31 - 1: 2**40 sequences spun over 30 s planning the
    classifier's chunks. The refusal comes with the arguments' checks, before the run is set up."""
    def past_the_checks(self):
        raise AssertionError("the Trainer got past the argument checks")
    monkeypatch.setattr(Trainer, "_setup", past_the_checks)
    with pytest.raises(TrainError) as e:
        trainer(shards, batch_size=B, seq_len=T)
    msg = str(e.value)
    assert ("2147483647" in msg or "2**31 - 1" in msg) and ("batch_size must be" in msg or
                                                            f"batch_size={B} seq_len={T}" in msg), msg


def test_numpy_scalars_are_numbers_and_the_run_records_plain_values(shards, tmp_path):
    out = tmp_path / "run"
    t = trainer(shards, batch_size=np.int64(2), seq_len=np.uint8(16), n_embd=np.int64(32), steps=np.int32(2),
                total_batch_size=np.int16(64), seed=np.uint32(7), lr_decay_frac=np.float32(0.5),
                optim=AdamWConfig(lr=np.float32(1e-3), beta1=np.float64(0.9), grad_clip=np.int64(1)), out=str(out),
                shuffle=np.bool_(False))
    try:
        records = t.run()
    finally:
        t.close()
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert t.grad_accum == 2
    state = json.loads((out / "step_00000002" / "state.json").read_text())
    args = state["args"]
    assert (args["batch_size"], args["seq_len"], args["n_embd"], args["seed"]) == (2, 16, 32, 7)
    assert type(args["batch_size"]) is int and type(args["optim"]["lr"]) is float
    assert args["optim"]["lr"] == pytest.approx(1e-3)


def test_validate_accepts_numpy_floats_and_refuses_bools():
    AdamWConfig(lr=np.float32(1e-3), weight_decay=np.float64(0.1), grad_clip=np.int64(1)).validate()
    assert AdamWConfig(lr=np.float32(0.5)).checked().lr == 0.5 and type(AdamWConfig(lr=np.float32(0.5)).checked().lr) is float
    for kw in (dict(lr=True), dict(grad_clip=False), dict(eps=0.0), dict(beta1=np.bool_(True))):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}"):
            AdamWConfig(**kw).validate()


def test_eps_is_positive_so_updates_are_applied(shards):
    """eps = 0 passed (>= 0) and every update after the first was skipped: its division is 0/0 where a moment is
    zero (the padded vocabulary's rows)."""
    with pytest.raises(TrainError, match="eps must be a finite number > 0"):
        trainer(shards, optim=AdamWConfig(eps=0.0))
    t = trainer(shards, steps=3, optim=AdamWConfig(eps=1e-30))
    try:
        assert not any(r.get("skipped") for r in t.run())
    finally:
        t.close()


def test_run_after_close_is_refused_and_writes_nothing(shards, tmp_path):
    out = tmp_path / "run"
    first = trained(shards, out=str(out), steps=1)
    listing = lambda: sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # noqa: E731
    before = listing()
    second = trainer(shards, out=str(out), steps=2, resume=True)  # holds the directory's lock now
    try:
        with pytest.raises(TrainError, match="closed"):
            first.run()
        with pytest.raises(TrainError, match="closed"):
            first.save(5)
        assert listing() == before
        second.run()
    finally:
        second.close()
    assert (out / "step_00000002").is_dir() and not (out / "step_00000005").exists()


def test_a_second_run_is_refused_and_changes_nothing(shards, tmp_path):
    """run() trains from start_step to --steps once: a second call on the same Trainer went on counting steps and
    data past the run's end, and wrote a checkpoint labelled step 2 holding 4 updates. Refused after a run that
    ended, stopped early or failed alike; a new Trainer (resume=True) continues the run."""
    out = tmp_path / "run"

    def stop_now(rec):
        raise RuntimeError("stopped by on_step")

    for n, first_run in enumerate((lambda t: t.run(), lambda t: t.run(on_step=stop_now))):
        t = trainer(shards, out=str(out / str(n)), steps=2)
        try:
            try:
                first_run(t)
            except RuntimeError:
                pass
            listing = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
            weights, steps = t.model.parameters_host().copy(), t.steps_run
            with pytest.raises(TrainError, match="this Trainer has run already; make a new Trainer") as e:
                t.run()
            assert "\n" not in str(e.value)
            assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == listing
            np.testing.assert_array_equal(t.model.parameters_host(), weights)
            assert t.steps_run == steps
        finally:
            t.close()
    again = trainer(shards, out=str(out / "0"), steps=3, resume=True)
    try:
        assert [r["step"] for r in again.run()] == [3]
    finally:
        again.close()


def test_resume_accepts_options_equal_to_the_runs_own_values(shards, tmp_path):
    """A run trained with the preset's shape recorded n_layer None: resuming it with --n-layer 2 (its value) was
    refused, "--n-layer is 2 but the run ... was trained with None"."""
    out = tmp_path / "run"
    trained(shards, out=str(out), steps=1)
    same = dict(n_layer=2, n_head=2, block_size=1024, vocab_size=50257, total_batch_size=32)
    t = trainer(shards, out=str(out), steps=2, resume=True, **same)
    try:
        assert t.start_step == 1 and [r["step"] for r in t.run()] == [2]
    finally:
        t.close()
    for kw, needle in ((dict(n_layer=3), "^resume=True: n_layer is 3 but the run in .* was trained with 2"),
                       (dict(block_size=512), "block_size is 512 but .* trained with 1024"),
                       (dict(total_batch_size=64), "total_batch_size is 64 but .* trained with 32"),
                       (dict(n_kv_head=1), "n_kv_head does not apply to the run in .*GPT-2")):
        with pytest.raises(TrainError, match=needle):
            trainer(shards, out=str(out), steps=3, resume=True, **kw)


def test_a_run_directory_in_use_is_refused_in_python_words(shards, tmp_path):
    """A second run into one directory tells a Python caller to pass resume=True, not to add --resume."""
    out = tmp_path / "run"
    trained(shards, out=str(out), steps=1)
    with pytest.raises(TrainError, match="already holds a run .*; add resume=True to continue it, or give another out"):
        trainer(shards, out=str(out), steps=2)


def test_resume_on_the_command_line_with_the_runs_own_shape(shards, tmp_path):
    rd = tmp_path / "run"
    run(*TINY, "--data", shards / "*train*.bin", "--steps", 1, "--out", rd)
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 2, "--out", rd, "--resume", "--n-layer", 2,
            "--n-head", 2, "--block-size", 1024, "--total-batch-size", 64)
    assert (rd / "step_00000002").is_dir(), r.output
    one_line_error(run(*TINY, "--data", shards / "*train*.bin", "--steps", 3, "--out", rd, "--resume", "--n-layer", 3,
                       ok=False), "--n-layer is 3", "trained with 2")


# ---- backends whose capabilities say what they cannot do -------------------------------------------------------
@pytest.mark.parametrize("caps", [None, "kv_cache,graphs", ["kv_cache"], {"kv_cache": 1}, frozenset({1})])
def test_capabilities_that_are_not_a_set_of_names_name_the_backend(shards, caps):
    with pytest.raises(TrainError) as e:
        trainer(shards, backend=cpu_with(caps))
    assert "liar backend's capabilities must be a set of names" in str(e.value), str(e.value)


def test_a_capability_announced_without_its_kernel_names_both(shards):
    class NoDecode(Backend):  # the base class's attention_decode: NotImplementedError
        pass
    be_cls = type(create_backend("cpu"))
    liar = type("Liar", (be_cls,), {"name": "liar", "capabilities": frozenset({"kv_cache"}),
                                    "attention_decode": NoDecode.attention_decode})()
    with pytest.raises(TrainError, match="liar backend announces the 'kv_cache' capability but has no "
                                         "attention_decode"):
        trainer(shards, backend=liar)


def test_an_unimplemented_kernel_during_a_run_is_one_train_error(shards):
    """An override that raises NotImplementedError mid-run: a traceback from train before (the command line's
    handler prints TrainError in one line)."""
    from llmc_cli.data.tokenizer import load_tokenizer
    tok = load_tokenizer("gpt2")
    liar = cpu_with(frozenset({"kv_cache"}), lacks=("attention_decode",))
    t = Trainer(TrainArgs(**base(shards, steps=2, sample_every=1, sample_tokens=2)), liar, say=lambda s: None,
                decode=tok.decode, eot=tok.eot)
    try:
        with pytest.raises((TrainError, ValueError)) as e:
            t.run()
    finally:
        t.close()
    msg = str(e.value)
    assert "liar backend's attention_decode is not implemented" in msg and "\n" not in msg, msg
    t = trainer(shards, backend=cpu_with(frozenset(), lacks=("adamw_update",)), steps=1)
    try:
        with pytest.raises(TrainError, match="liar backend's adamw_update is not implemented"):
            t.run()
    finally:
        t.close()


def test_a_sample_whose_logits_overflow_does_not_end_the_run(shards, monkeypatch):
    """The sample during training is a look at the run: logits that overflow end the sample with a note, where
    generate()'s NonFiniteLogits would otherwise stop training that the step guard judges on its own."""
    from llmc_cli.inference import sampling
    from llmc_cli.training import evaluation

    def overflowing(*args, **kw):
        yield 5
        raise sampling.NonFiniteLogits("the model's logits are not finite (3 of 50,257 are NaN or infinite)")

    monkeypatch.setattr(evaluation, "generate", overflowing)
    t = Trainer(TrainArgs(**base(shards)), create_backend("cpu"), say=lambda s: None,
                decode=lambda ids: "".join(f"<{i}>" for i in ids), eot=50256)
    try:
        text = t.sample_text()
    finally:
        t.close()
    assert text.startswith("<5>[no more sample: the model's logits are not finite"), text
