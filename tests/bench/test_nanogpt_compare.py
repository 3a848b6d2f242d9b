"""bench/nanogpt_compare.py: it trains with the README's Quick start command, feeds nanoGPT the same bytes, and reads
the loss lines both print. (The comparison itself runs for minutes: bench/, never the suite.)"""

from __future__ import annotations

import importlib.util
import pickle
import re
import shlex
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("nanogpt_compare", REPO / "bench" / "nanogpt_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", block)
    return [line.split("#", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def test_it_runs_the_readme_quick_start():
    b = _script()
    commands = _readme_commands()
    assert "llmc tokenize shakespeare --tokenizer bytes" in commands
    assert shlex.split(b.QUICKSTART_TRAIN) in [shlex.split(c) for c in commands]
    cmd = b.llmc_command(Path("/w"))
    assert cmd[cmd.index("--data") + 1] == "/w/datasets/shakespeare" and cmd[cmd.index("--out") + 1] == "/w/run"


def test_it_reads_both_programs_lines():
    b = _script()
    for llmc_step in ("step    12/2000 | loss 3.041230 | 45.2 ms | 16990 tok/s | ETA 0:01:30",  # (80 columns)
                      "step    12/2000 | loss 3.041230 | norm 1.9382 | lr 4.80e-04 | 45.2 ms | 16990 tok/s | 9.22k "
                      "tokens | 0:00:01 elapsed | ETA 0:01:30"):
        assert b._LLMC_STEP.match(llmc_step).groups() == ("12", "3.041230")
    assert b._LLMC_VAL.match("step 250: val loss 2.538189 (20 batches of B=12 T=64)").groups() == ("250", "2.538189")
    assert b._NANO_STEP.match("iter 10: loss 3.9410, time 1758.60ms, mfu 0.00%").groups() == ("10", "3.9410")
    assert b._NANO_VAL.match("step 250: train loss 2.4391, val loss 2.4520").groups() == ("250", "2.4520")
    c = {"train": [(1.0, 1000, 2.1), (2.0, 2000, 1.8)], "val": [(1.5, 1000, 2.0), (2.5, 2000, 1.86)], "seconds": 3.0}
    s = b.summary("llmc", c)
    assert s["tok_per_s"] == 512_000 and s["final_val"] == 1.86 and s["seconds_to_val_below_1.87"] == 2.5


def test_nanogpt_reads_the_same_bytes(tmp_path):
    b = _script()
    (tmp_path / "ng").mkdir()
    (tmp_path / "ng" / "configurator.py").write_text("")
    nano = b.prepare(tmp_path / "w", tmp_path / "ng")
    data = tmp_path / "w" / "datasets" / "shakespeare"
    meta = pickle.loads((nano / "data" / "shakespeare_bytes" / "meta.pkl").read_bytes())
    val = np.fromfile(nano / "data" / "shakespeare_bytes" / "val.bin", np.uint16)
    ours = np.fromfile(next(data.glob("*_val_*.bin")), "<u2", offset=1024)
    assert meta["vocab_size"] == 85 and len(val) == len(ours)
    assert "".join(meta["itos"][i] for i in val[1:40].tolist()) == bytes(ours[1:40].astype(np.uint8)).decode()
    assert (nano / "configurator.py").is_symlink()
