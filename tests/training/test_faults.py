"""Numerical faults (non-finite steps never applied, outlier skips, abort after K bad steps), bad inputs
answered by one line and exit 2 with nothing touched, and resume exactness on every usable backend."""

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
from llmc_test_support import TINY, rewind_run, run

from llmc_cli.formats import checkpoint as ckpt
from llmc_cli.formats.llmc_bin import write_model
from llmc_cli.formats.evalfile import write_evalfile
from llmc_cli.formats.shards import write_shard
from llmc_cli.registry import create_backend, discover
from llmc_cli.training.guard import OutlierDetector
from llmc_cli.training.args import TrainArgs, TrainDiverged
from llmc_cli.training.trainer import Trainer


def records(log):
    return [json.loads(line) for line in open(log)]


# ---- outlier detector ----------------------------------------------------------------------------------------
def test_outlier_detector_matches_llmc_definition():
    det = OutlierDetector(window=8)
    xs = [1.0, 2.0, 3.0, 2.0, 1.0, 2.0, 3.0, 2.0, 9.0, 2.0]
    zs = [det.update(x) for x in xs]
    assert all(math.isnan(z) for z in zs[:8])  # judges only with a full window
    w = np.array(xs[:8])
    assert zs[8] == pytest.approx((9.0 - w.mean()) / w.std())
    w = np.array(xs[1:9])
    assert zs[9] == pytest.approx((2.0 - w.mean()) / w.std())
    assert math.isnan(det.update(float("nan"))) and len(det.values) == 8  # non-finite never enters the window
    det2 = OutlierDetector(window=8)
    det2.load_state(det.state())
    assert det2.update(5.0) == det.update(5.0)


# ---- numerical faults in the loop ----------------------------------------------------------------------------
def _trainer(shards, **kw):
    a = TrainArgs(data=str(shards / "*train*.bin"), model="d2", n_embd=64, batch_size=2, seq_len=32,
                  steps=kw.pop("steps", 12), val_every=0, sample_every=0, **kw)
    return Trainer(a, create_backend("cpu"), say=lambda s: None)


def _poison(tr, steps, value=float("nan"), what="loss"):
    """Make the device's step loss (or the optimizer's grad norm) be `value` at the given 1-based steps: the
    values are overwritten where the step computes them (loss_sum, global_norm_squared), so the skip verdict
    is the one the device takes before AdamW runs."""
    calls = {"n": 0}
    be = tr.backend
    name = "loss_sum" if what == "loss" else "global_norm_squared"
    orig = getattr(be, name)

    def poisoned(out, *args, **kw):
        orig(out, *args, **kw)
        calls["n"] += 1
        if calls["n"] in steps:
            be.upload(out, np.array([value if what == "loss" else value * value], np.float32))
    setattr(be, name, poisoned)


def test_nonfinite_step_is_skipped_never_applied(shards):
    tr = _trainer(shards, steps=6)
    _poison(tr, {3}, float("nan"))
    _poison(tr, {5}, float("inf"), what="norm")
    snaps = []
    recs = tr.run(on_step=lambda r: snaps.append(tr.model.parameters_host().copy()))
    assert [bool(r.get("skipped")) for r in recs] == [False, False, True, False, True, False]
    assert recs[2]["loss"] is None and "non-finite loss" in recs[2]["reason"]
    assert recs[4]["norm"] is None and "non-finite grad norm" in recs[4]["reason"]
    assert np.array_equal(snaps[1], snaps[2]) and np.array_equal(snaps[3], snaps[4])  # no update applied
    assert not np.array_equal(snaps[2], snaps[3])
    assert tr.opt.step_count == 4 and tr.bad_streak == 0


def test_outlier_spikes_are_skipped(shards):
    tr = _trainer(shards, steps=14, skip_loss_z=3.0, skip_grad_z=3.0, outlier_window=8)
    _poison(tr, {11}, 1e3)               # a loss spike once the window is full
    _poison(tr, {13}, 1e4, what="norm")  # a grad-norm spike
    recs = tr.run()
    skipped = {r["step"]: r["reason"] for r in recs if r.get("skipped")}
    assert set(skipped) == {11, 13}, skipped
    assert "> skip_loss_z 3" in skipped[11] and "> skip_grad_z 3" in skipped[13]
    assert tr.opt.step_count == 12


def test_consecutive_bad_steps_abort(shards, tmp_path):
    tr = _trainer(shards, steps=20, max_bad_steps=3)
    _poison(tr, {4, 5, 6, 7}, float("nan"))
    with pytest.raises(TrainDiverged, match="3 consecutive bad steps"):
        tr.run()
    assert tr.opt.step_count == 3


def test_cli_abort_message_and_jsonl(shards, tmp_path, monkeypatch):
    from llmc_cli.kernels import Backend
    orig = Backend.loss_sum
    calls = {"n": 0}

    def loss_sum(self, out, *a, **kw):
        orig(self, out, *a, **kw)
        calls["n"] += 1
        if calls["n"] >= 3:
            self.upload(out, np.array([np.nan], np.float32))
    monkeypatch.setattr(Backend, "loss_sum", loss_sum)
    log = tmp_path / "l.jsonl"
    r = run(*TINY, "--data", shards / "*train*.bin", "--steps", 10, "--max-bad-steps", 2, "--log", log, ok=False)
    assert r.exit_code == 3, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error:") and "2 consecutive bad steps" in last and "--max-bad-steps" in last
    recs = records(log)
    assert [x.get("skipped", False) for x in recs] == [False, False, True, True]
    assert recs[2]["loss"] is None


def test_resume_keeps_outlier_state_bit_exact(shards, tmp_path):
    """Skips and the outlier windows survive a checkpoint: 8 == 4 + resume + 4 with z-skipping on."""
    common = [*TINY, "--data", shards / "*train*.bin", "--steps", 8, "--skip-loss-z", "1.5", "--skip-grad-z", "1.5"]
    run(*common, "--out", tmp_path / "a", "--log", tmp_path / "a.jsonl")
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--checkpoint-every", 4)
    rewind_run(tmp_path / "b", 4, 8)
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--resume")  # trims the log itself
    a, b = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
    assert [x["loss"] for x in a] == [x["loss"] for x in b] and len(a) == 8


# ---- checkpoint rotation ---------------------------------------------------------------------------------------
def _steps(run_dir):
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_")), \
        (run_dir / "latest").read_text().strip()


def test_keep_rotates_checkpoints(shards, tmp_path):
    rd = tmp_path / "r"
    common = [*TINY, "--data", shards / "*train*.bin", "--checkpoint-every", 1, "--out", rd]
    run(*common, "--steps", 5, "--keep", 2)
    assert _steps(rd) == (["step_00000004", "step_00000005"], "step_00000005")
    run(*common, "--steps", 7, "--keep", 3, "--resume")
    assert _steps(rd) == (["step_00000005", "step_00000006", "step_00000007"], "step_00000007")
    assert not [p for p in rd.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    # resumed from an older step while a newer-named one lingers: the step just written is never rotated away
    shutil.copytree(rd / "step_00000007", rd / "step_00000009")
    (rd / "latest").write_text("step_00000005\n")
    run(*common, "--steps", 6, "--keep", 1, "--resume")
    assert _steps(rd) == (["step_00000006"], "step_00000006")
    assert ckpt.read_run_checkpoint(rd)[3]["step"] == 6


# ---- resume exactness on every usable backend ----------------------------------------------------------------
USABLE = [p.name for p in discover() if p.usable and p.name != "cpu"]  # cpu: tests/commands/test_cli.py


@pytest.mark.parametrize("backend", USABLE)
def test_resume_bit_exact_per_backend(backend, shards, tmp_path):
    """20 steps == 10 + resume + 10, identical losses, on every usable non-CPU backend (CPU: test_cli.py):
    OpenCL on PoCL in CI, CUDA (its default bf16) on the GPU machine."""
    common = [*TINY, "--data", shards / "*train*.bin", "--steps", 20, "--lr", "1e-3", "--warmup", 3,
              "--lr-decay-frac", "0.1", "--weight-decay", "0.1", "--shuffle"]
    common[common.index("cpu")] = backend
    run(*common, "--out", tmp_path / "a", "--log", tmp_path / "a.jsonl")
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--checkpoint-every", 10)
    rewind_run(tmp_path / "b", 10, 20)
    run(*common, "--out", tmp_path / "b", "--log", tmp_path / "b.jsonl", "--resume")
    a = [x["loss"] for x in records(tmp_path / "a.jsonl")]
    b = [x["loss"] for x in records(tmp_path / "b.jsonl")]
    assert len(a) == 20 and a == b


# ---- bad inputs ----------------------------------------------------------------------------------------------
def _tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _header(path, idx, value):
    b = bytearray(path.read_bytes())
    b[4 * idx: 4 * idx + 4] = int(value).to_bytes(4, "little", signed=True)
    path.write_bytes(bytes(b))


CASES = ["shard_version", "model_version", "model_truncated", "init_magic", "state_version", "state_garbage",
         "optimizer_garbage", "optimizer_truncated", "latest_garbage", "resume_n_embd", "cpu_device", "oom",
         "missing_backend_package", "missing_package", "llama_shard_vocab", "eval_magic", "eval_version",
         "eval_truncated", "out_holds_run", "out_is_file", "skip_z_negative"]  # shard magic / truncation / ids >= vocab: tests/commands/test_cli.py


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_line(case, shards, tmp_path, monkeypatch):
    data = shards / "*train*.bin"
    args = [*TINY, "--data", data, "--steps", 1]
    work = tmp_path / "w"
    work.mkdir()
    expect = None
    if case in ("state_version", "state_garbage", "optimizer_garbage", "optimizer_truncated", "latest_garbage",
                "resume_n_embd"):
        run(*args, "--out", work / "r")
        step = work / "r" / "step_00000001"
        if case == "state_version":
            st = json.loads((step / "state.json").read_text())
            st["version"] = 99
            (step / "state.json").write_text(json.dumps(st))
            expect = "state.json: unsupported run state version 99"
        elif case == "state_garbage":
            (step / "state.json").write_text('{"step": "x"')
            expect = "state.json: not valid JSON"
        elif case == "optimizer_garbage":
            (step / "optimizer.npz").write_bytes(b"PK\x03\x04garbage")
            expect = "optimizer.npz: unreadable optimizer state"
        elif case == "optimizer_truncated":
            raw = (step / "optimizer.npz").read_bytes()
            (step / "optimizer.npz").write_bytes(raw[: len(raw) // 2])
            expect = "optimizer.npz"
        elif case == "latest_garbage":
            (work / "r" / "latest").write_bytes(b"../../etc\n")
            shutil.rmtree(step)
            expect = "latest points to '../../etc'"
        else:
            args[args.index("--n-embd") + 1] = "128"
            expect = "--n-embd is 128 but the run"
        args += ["--out", work / "r", "--resume"]
    elif case == "shard_version":
        bad = work / "v.bin"
        shutil.copy(shards / "tiny_train_000001.bin", bad)
        _header(bad, 1, 3)
        args[args.index(data)] = bad
        expect = "unsupported shard version 3"
    elif case in ("model_version", "model_truncated", "init_magic"):
        from llmc_cli.models.gpt2 import GPT2Config, init_parameters
        cfg = GPT2Config(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)
        m = work / "m.bin"
        write_model(m, cfg, init_parameters(cfg, 0))
        if case == "model_version":
            _header(m, 1, 4)
            expect = "unsupported version 4"
        elif case == "init_magic":
            _header(m, 0, 1234)
            expect = "bad magic 1234"
        else:
            m.write_bytes(m.read_bytes()[:-100])
            expect = "truncated"
        args = ["train", "--backend", "cpu", "--init", m, "-b", 2, "-t", 32, "--steps", 1, "--data", data,
                "--val-every", 0, "--sample-every", 0]
    elif case == "cpu_device":
        args[3:3] = ["--device", "gpu0"]
        expect = "--device gpu0"
    elif case == "oom":
        from llmc_cpu import CpuBackend
        orig = CpuBackend.alloc

        def alloc(self, shape, dtype="float32", tag="other"):
            if tag == "optimizer":
                raise MemoryError("Unable to allocate 12.9 MiB")
            return orig(self, shape, dtype, tag)
        monkeypatch.setattr(CpuBackend, "alloc", alloc)
        expect = "out of memory"
    elif case == "missing_backend_package":
        from llmc_cli import registry
        monkeypatch.setattr(registry, "discover", lambda: [registry.PluginInfo(
            "opencl", None, False, "failed to load: ModuleNotFoundError: No module named 'pyopencl'", "llmc-opencl")])
        args[args.index("cpu")] = "opencl"
        expect = "pip install 'pyopencl[pocl]'"
    elif case == "missing_package":
        from llmc_cli.training import trainer as train_mod

        def boom(*a, **k):
            raise ModuleNotFoundError("No module named 'safetensors'", name="safetensors")
        monkeypatch.setattr(train_mod.Trainer, "__init__", boom)
        expect = "pip install safetensors"
    elif case == "llama_shard_vocab":
        bad = work / "llama_train.bin"
        write_shard(bad, np.arange(3000) % 1000, tokenizer="llama3")
        args[args.index(data)] = bad
        expect = "tokenized with the llama3 vocabulary"
    elif case in ("eval_magic", "eval_version", "eval_truncated"):
        ev = work / "hs.bin"
        write_evalfile(ev, [{"label": 0, "ctx_tokens": [1, 2], "ending_tokens": [[3], [4], [5], [6]]}])
        if case == "eval_magic":
            _header(ev, 0, 7)
            expect = "bad magic 7"
        elif case == "eval_version":
            _header(ev, 1, 3)  # (version 2 is llmc's, for tokenizers other than GPT-2)
            expect = "unsupported eval file version 3"
        else:
            ev.write_bytes(ev.read_bytes()[:-4])
            expect = "truncated in example 0"
        args += ["--out", work / "r", "--hellaswag", ev, "--hellaswag-every", 1]
        expect = "--hellaswag: " + str(ev) + ": " + expect
    elif case == "out_holds_run":  # a fresh run (no --resume) must not clobber a run directory's checkpoints
        run(*args, "--out", work / "r", "--log", work / "r" / "log.jsonl")
        args += ["--out", work / "r", "--log", work / "r" / "log.jsonl"]
        expect = f"--out {work / 'r'} already holds a run (checkpoints up to step_00000001); add --resume"
    elif case == "out_is_file":
        (work / "f").write_text("not a directory")
        args += ["--out", work / "f"]
        expect = "is a file; expected a run directory"
    elif case == "skip_z_negative":
        args += ["--skip-loss-z", "-1"]
        expect = "--skip-loss-z must be >= 0"
    before = _tree(tmp_path)
    r = run(*args, ok=False)
    msg = r.output.strip()
    assert r.exit_code == 2, msg
    assert msg.startswith("error:") and "\n" not in msg and "Traceback" not in msg, msg
    assert expect in msg, msg
    assert _tree(tmp_path) == before  # nothing written, moved or lost
    if case == "oom":
        assert "GiB" in msg and "-b/--batch-size" in msg and "--recompute" in msg
